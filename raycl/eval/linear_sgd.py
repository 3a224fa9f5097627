"""The papers' linear evaluation: linear heads on a frozen backbone, trained by SGD on images.

MoCo's, HSCL's (appendix B.2) and FGVR's (appendix 0.B.3) protocol, as ``eval.linear_sgd``
sets it: the backbone in eval mode (frozen BatchNorm statistics) under ``torch.no_grad``, a
linear head per attribute trained by SGD with momentum and weight decay on randomly resized
crops and flips of the training images (or the whole images), the learning rate multiplied by
0.1 at the milestones; every learning rate of ``lrs`` trains its own heads in the same pass over
the data (one backbone forward per batch, one :class:`~torch.nn.Linear` per learning rate over
every attribute's classes).

Selection: each attribute keeps the learning rate whose head scores best on the validation
split (the papers keep "the best" of their rates; an attribute's head is its own classifier,
so each attribute is selected alone, the first rate of ``lrs`` on a tie). Only then is the test
split read, once (:func:`evaluate_linear_sgd` receives it as a callable), and scored with the
chosen heads alone.

Data parallel: every rank draws the same seeded order of the training rows, takes its share of
each global batch, and the heads' gradients are summed over the ranks
(:func:`raycl.distributed.all_reduce_sum`, each rank's loss divided by the global batch), so
every rank takes the same step as one process on the whole batch. Imports no Ray: a later
"evaluate a checkpoint" command calls :func:`evaluate_linear_sgd` with a loaded model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from raycl.config.evaluation import LinearSGDConfig
from raycl.config.metric_names import (
    DIAG,
    LINEAR_SGD,
    MEAN,
    TEST,
    VAL,
    fraction_percent,
    metric_name,
)
from raycl.config.training import AugmentConfig
from raycl.data.augment import BatchAugment, to_float
from raycl.distributed import all_reduce_sum, rank, world_size
from raycl.eval.features import batch_features
from raycl.eval.label_fractions import label_fraction_subset

# MoCo's lincls.py initialises the head as N(0, 0.01) weights and zero biases.
HEAD_INIT_STD = 0.01
# The papers' training augmentation: random resized crop of (0.08, 1) of the area, and flips.
PAPER_CROP_SCALE = (0.08, 1.0)


class ImageArray(Protocol):
    """uint8 images (N, C, H, W) read by rows: an array, a memory-mapped view, a tensor."""

    def __len__(self) -> int: ...

    def __getitem__(self, rows: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class LabelledImages:
    """One split: its uint8 images and their labels per attribute.

    Attributes:
        images: uint8 (N, C, H, W), a numpy array, a memory-mapped view
            (:class:`raycl.data.ImageRows`) or a tensor on any device; read a batch of rows at
            a time.
        labels: attribute -> int64 (N,) class labels.
    """

    images: ImageArray | Tensor
    labels: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class FrozenEncoder:
    """The backbone the heads are trained on.

    Attributes:
        model: the module holding it: in eval mode during the evaluation (frozen BatchNorm
            statistics), its mode restored after.
        embed: float images (B, C, H, W), normalised as :func:`raycl.data.augment.to_float`,
            -> (B, D) features (e.g. ``method.embed``).
        autocast: the forward's precision context (features are cast to float32 after it).
    """

    model: nn.Module
    embed: Callable[[Tensor], Tensor]
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext


@dataclass(frozen=True)
class LinearSGDResult:
    """The evaluation of one set of heads (all labels, or one label fraction).

    Attributes:
        val_by_lr: learning rate -> attribute -> validation accuracy in [0, 1].
        chosen_lr: attribute -> the learning rate kept (best on validation).
        val: attribute -> the kept head's validation accuracy.
        test: attribute -> the kept head's test accuracy.
    """

    val_by_lr: dict[float, dict[str, float]]
    chosen_lr: dict[str, float]
    val: dict[str, float]
    test: dict[str, float]


class StackedHeads(nn.Module):
    """One linear layer per learning rate over every attribute's classes (their columns side
    by side): one matmul per rate scores all attributes of a batch.

    Args:
        dim: feature dimension D.
        num_classes: attribute -> class count, in column order.
        count: layers (learning rates).
        seed: seeds the initial weights (the same on every rank).
    """

    def __init__(self, dim: int, num_classes: Mapping[str, int], count: int, seed: int) -> None:
        super().__init__()
        if dim < 1 or count < 1 or not num_classes:
            raise ValueError(f"need dim >= 1, count >= 1 and attributes, got dim={dim}, "
                             f"count={count}, num_classes={dict(num_classes)}")
        self.attributes = list(num_classes)
        bounds = np.cumsum([0, *num_classes.values()]).tolist()
        self.columns = {attribute: slice(bounds[i], bounds[i + 1])
                        for i, attribute in enumerate(self.attributes)}
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList()
        for _ in range(count):
            with torch.random.fork_rng(devices=[]):  # nn.Linear's own init: not the trial's RNG
                layer = nn.Linear(dim, bounds[-1])
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator)
                                   * HEAD_INIT_STD)
                layer.bias.zero_()
            self.layers.append(layer)

    def forward(self, features: Tensor) -> Tensor:
        """(B, D) -> logits (count, B, total classes)."""
        return torch.stack([layer(features) for layer in self.layers])

    def loss_sum(self, logits: Tensor, labels: Mapping[str, Tensor]) -> Tensor:
        """Cross-entropy summed over the batch's rows, the layers and the attributes: each
        layer's attribute columns get the gradient of their own head alone."""
        total = logits.new_zeros(())
        for attribute, columns in self.columns.items():
            scores = logits[:, :, columns].flatten(0, 1)
            target = labels[attribute].repeat(len(self.layers))
            total = total + F.cross_entropy(scores, target, reduction="sum")
        return total

    def correct(self, logits: Tensor, labels: Mapping[str, Tensor]) -> Tensor:
        """(count, attributes) right predictions in the batch; a row with a non-finite logit
        (a diverged head) counts as wrong."""
        counts = []
        for attribute, columns in self.columns.items():
            scores = logits[:, :, columns]
            right = (scores.argmax(dim=2) == labels[attribute]) & scores.isfinite().all(dim=2)
            counts.append(right.sum(dim=1))
        return torch.stack(counts, dim=1).to(torch.float64)

    def chosen(self, layer_of: Mapping[str, int]) -> StackedHeads:
        """One layer of the heads ``layer_of`` picks per attribute (layer indices)."""
        first = self.layers[0]
        picked = StackedHeads(first.in_features, {a: c.stop - c.start
                                                  for a, c in self.columns.items()}, 1, 0)
        picked.to(first.weight.device)
        with torch.no_grad():
            for attribute, columns in self.columns.items():
                source = self.layers[layer_of[attribute]]
                picked.layers[0].weight[columns] = source.weight[columns]
                picked.layers[0].bias[columns] = source.bias[columns]
        return picked


def milestone_factor(epoch: int, epochs: int, milestones: Sequence[float]) -> float:
    """The learning rate's factor during ``epoch`` (0-based): 0.1 per milestone passed, a
    milestone ``m`` starting at epoch ``round(m × epochs)`` (HSCL: 60 and 80 of 100 epochs, as
    torch's ``MultiStepLR([60, 80])`` stepped once per epoch).

    Args:
        epoch: the epoch, in [0, epochs).
        epochs: all epochs.
        milestones: increasing fractions of ``epochs`` in (0, 1).

    Returns:
        ``0.1 ** passed``.

    Example:
        >>> milestone_factor(60, 100, [0.6, 0.8])
        0.1
    """
    if not 0 <= epoch < epochs:
        raise ValueError(f"epoch must be in [0, {epochs}), got {epoch}")
    passed = sum(epoch >= round(milestone * epochs) for milestone in milestones)
    return 0.1 ** passed


def paper_augment() -> BatchAugment:
    """Random resized crop of (0.08, 1) of the area and horizontal flips, nothing else."""
    return BatchAugment(AugmentConfig(crop_scale=PAPER_CROP_SCALE, flip=True, color_jitter=0.0,
                                      color_jitter_prob=0.0, grayscale_prob=0.0))


def rank_share(rows: np.ndarray, rank_index: int, ranks: int) -> np.ndarray:
    """This rank's rows of a global batch: contiguous, sorted, as even as the batch allows (a
    rank may get none: it still joins the gradient's sum).

    Example:
        >>> rank_share(np.array([5, 1, 4]), 1, 2).tolist()
        [4]
    """
    return np.sort(np.array_split(rows, ranks)[rank_index])


def read_rows(images: ImageArray | Tensor, rows: np.ndarray, device: torch.device) -> Tensor:
    """uint8 rows of ``images`` on ``device`` (a tensor is indexed where it lives)."""
    if isinstance(images, Tensor):
        return images[torch.from_numpy(rows).to(images.device)].to(device)
    return torch.from_numpy(np.asarray(images[rows])).to(device)


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (BatchNorm uses, never updates, its statistics), its mode
    restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _label_tensors(split: LabelledImages, attributes: Sequence[str], rows: np.ndarray,
                   device: torch.device) -> dict[str, Tensor]:
    return {attribute: torch.from_numpy(np.asarray(split.labels[attribute])[rows]).long()
            .to(device) for attribute in attributes}


def _sum_gradients(heads: StackedHeads, group: ProcessGroup | None = None) -> None:
    """Every rank's gradients replaced by their sum over the ranks, in one all-reduce."""
    parameters = list(heads.parameters())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    summed = all_reduce_sum(torch.cat([grad.reshape(-1) for grad in grads]), group)
    for parameter, chunk in zip(parameters, summed.split([p.numel() for p in parameters]),
                                strict=True):
        parameter.grad = chunk.view_as(parameter).clone()


def _seed(*parts: int) -> int:
    """A 63-bit seed of several integers (a torch generator takes one)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


def train_heads(
    encoder: FrozenEncoder,
    train: LabelledImages,
    rows: np.ndarray,
    num_classes: Mapping[str, int],
    settings: LinearSGDConfig,
    device: torch.device,
    seed: int,
    group: ProcessGroup | None = None,
) -> StackedHeads:
    """Heads per learning rate of ``settings.lrs``, trained on ``train``'s ``rows``.

    Every rank calls this with the same arguments: each takes its share of every global batch
    (:func:`rank_share`) and the gradients are summed across ranks, so the heads are the same
    on every rank and equal to one process's on the whole batches.

    Args:
        encoder: the frozen backbone.
        train: the training split.
        rows: the rows trained on (all, or a label fraction's).
        num_classes: attribute -> class count.
        settings: epochs, batch size, learning rates, momentum, weight decay, milestones and
            whether to augment.
        device: where the heads and batches live.
        seed: seeds the initial heads, the order of the rows and the augmentation.
        group: the ranks sharing each batch (None: the default group).

    Returns:
        The trained heads (one layer per learning rate, in ``settings.lrs`` order).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        raise ValueError("eval.linear_sgd: no training rows")
    with frozen(encoder.model):
        dim = batch_features(encoder.embed, to_float(read_rows(train.images, rows[:1], device)),
                             encoder.autocast).shape[1]
        heads = StackedHeads(dim, num_classes, len(settings.lrs), seed).to(device)
        optimizer = torch.optim.SGD(
            [{"params": layer.parameters(), "lr": lr}
             for layer, lr in zip(heads.layers, settings.lrs, strict=True)],
            lr=settings.lrs[0], momentum=settings.momentum, weight_decay=settings.weight_decay)
        augment = paper_augment() if settings.augment else None
        _train_epochs(encoder, train, rows, heads, optimizer, augment, settings, device, seed,
                      group)
    return heads


def _train_epochs(
    encoder: FrozenEncoder, train: LabelledImages, rows: np.ndarray, heads: StackedHeads,
    optimizer: torch.optim.Optimizer, augment: BatchAugment | None, settings: LinearSGDConfig,
    device: torch.device, seed: int, group: ProcessGroup | None,
) -> None:
    """:func:`train_heads`'s epochs, the encoder frozen."""
    rank_index, ranks = rank(group), world_size(group)
    attributes = list(heads.attributes)
    for epoch in range(settings.epochs):
        factor = milestone_factor(epoch, settings.epochs, settings.lr_milestones)
        for parameters, lr in zip(optimizer.param_groups, settings.lrs, strict=True):
            parameters["lr"] = lr * factor
        order = np.random.default_rng(_seed(seed, epoch)).permutation(rows)
        generator = torch.Generator(device=device).manual_seed(_seed(seed, epoch, rank_index))
        for start in range(0, len(order), settings.batch_size):
            batch = order[start:start + settings.batch_size]
            local = rank_share(batch, rank_index, ranks)
            optimizer.zero_grad(set_to_none=True)
            if local.size:
                images = read_rows(train.images, local, device)
                inputs = augment(images, generator) if augment is not None else to_float(images)
                logits = heads(batch_features(encoder.embed, inputs, encoder.autocast))
                # Divided by the global batch: the sum over ranks is the global mean's gradient.
                loss = heads.loss_sum(logits, _label_tensors(train, attributes, local, device))
                (loss / len(batch)).backward()
            _sum_gradients(heads, group)
            optimizer.step()


@torch.no_grad()
def score_heads(
    encoder: FrozenEncoder, heads: StackedHeads, split: LabelledImages, batch_size: int,
    device: torch.device, group: ProcessGroup | None = None,
) -> np.ndarray:
    """Accuracy of every layer's heads on ``split``, its rows shared among the ranks.

    Returns:
        (layers, attributes) accuracies in [0, 1] (attributes in ``heads.attributes`` order),
        the same on every rank.
    """
    total = len(split.images)
    if total == 0:
        raise ValueError("eval.linear_sgd: an empty split cannot be scored")
    shard = math.ceil(total / world_size(group))
    start, stop = min(total, rank(group) * shard), min(total, (rank(group) + 1) * shard)
    right = torch.zeros(len(heads.layers), len(heads.attributes), dtype=torch.float64,
                        device=device)
    with frozen(encoder.model):
        for begin in range(start, stop, batch_size):
            rows = np.arange(begin, min(stop, begin + batch_size))
            images = to_float(read_rows(split.images, rows, device))
            logits = heads(batch_features(encoder.embed, images, encoder.autocast))
            right += heads.correct(logits, _label_tensors(split, heads.attributes, rows, device))
    return (all_reduce_sum(right, group) / total).cpu().numpy()


def select_by_validation(val_by_lr: Mapping[float, Mapping[str, float]]) -> dict[str, float]:
    """Per attribute, the learning rate whose head scores best on validation (the first one
    listed on a tie).

    Example:
        >>> select_by_validation({1.0: {"shape": 0.4}, 0.1: {"shape": 0.9}})
        {'shape': 0.1}
    """
    lrs = list(val_by_lr)
    if not lrs:
        raise ValueError("no learning rate was scored")
    attributes = list(val_by_lr[lrs[0]])
    return {attribute: max(lrs, key=lambda lr: (val_by_lr[lr][attribute], -lrs.index(lr)))
            for attribute in attributes}


def evaluate_linear_sgd(
    encoder: FrozenEncoder,
    train: LabelledImages,
    val: LabelledImages,
    load_test: Callable[[], LabelledImages],
    num_classes: Mapping[str, int],
    settings: LinearSGDConfig,
    device: torch.device,
    seed: int,
    group: ProcessGroup | None = None,
) -> dict[str | None, LinearSGDResult]:
    """The whole protocol on every label share: train, select on validation, then test once.

    Every rank of a trial's worker group calls this with the same arguments (a single process
    works alike). The encoder is put in eval mode for the evaluation and its mode restored.

    Args:
        encoder: the frozen backbone.
        train: the training split (heads are trained on it).
        val: the validation split (learning rates are chosen on it).
        load_test: returns the test split; called once, after every learning rate is chosen.
        num_classes: attribute -> class count (the attributes evaluated).
        settings: ``eval.linear_sgd``; its label fractions train heads on a seeded subset
            stratified on the first attribute (:func:`label_fraction_subset`).
        device: where heads and batches live.
        seed: seeds the heads, the order, the augmentation and the label subsets.
        group: the ranks that share the work (None: the default group, every rank); every
            rank of it calls this.

    Returns:
        Label share's percent (None: every label; "50": half) -> its result.
    """
    if not num_classes:
        raise ValueError("eval.linear_sgd needs labelled attributes")
    first = np.asarray(train.labels[next(iter(num_classes))])
    subsets: dict[str | None, np.ndarray] = {None: np.arange(len(first), dtype=np.int64)}
    for fraction in settings.label_fractions:
        subsets[fraction_percent(fraction)] = label_fraction_subset(first, fraction, seed)
    with frozen(encoder.model):
        chosen: dict[str | None, tuple[StackedHeads, dict[float, dict[str, float]],
                                       dict[str, float]]] = {}
        for percent, rows in subsets.items():
            heads = train_heads(encoder, train, rows, num_classes, settings, device, seed, group)
            scores = score_heads(encoder, heads, val, settings.batch_size, device, group)
            val_by_lr = {lr: dict(zip(heads.attributes, map(float, scores[i]), strict=True))
                         for i, lr in enumerate(settings.lrs)}
            picked = select_by_validation(val_by_lr)
            chosen[percent] = (heads.chosen({attribute: settings.lrs.index(lr)
                                             for attribute, lr in picked.items()}),
                               val_by_lr, picked)
        test = load_test()  # the first read of the test split: every rate is chosen by now
        results = {}
        for percent, (final, val_by_lr, picked) in chosen.items():
            test_scores = score_heads(encoder, final, test, settings.batch_size, device,
                                      group)[0]
            results[percent] = LinearSGDResult(
                val_by_lr=val_by_lr, chosen_lr=picked,
                val={a: val_by_lr[picked[a]][a] for a in final.attributes},
                test=dict(zip(final.attributes, map(float, test_scores), strict=True)))
        return results


def linear_sgd_metrics(results: Mapping[str | None, LinearSGDResult]) -> dict[str, float]:
    """The reported names of :func:`evaluate_linear_sgd`'s results:
    ``val/linear_sgd/<attribute>`` and ``test/...`` (and ``/mean`` over the attributes),
    ``.../linear_sgd_<percent>pct/...`` per label share, and the learning rate each attribute
    kept as ``diag/linear_sgd_lr/<attribute>`` (``diag/linear_sgd_<percent>pct_lr/...``)."""
    metrics: dict[str, float] = {}
    for percent, result in results.items():
        for split, scores in ((VAL, result.val), (TEST, result.test)):
            for attribute, value in {**scores, MEAN: float(np.mean(list(scores.values())))}.items():
                metrics[metric_name(split, LINEAR_SGD, attribute, percent=percent)] = value
        family = f"{LINEAR_SGD}_{percent}pct_lr" if percent is not None else f"{LINEAR_SGD}_lr"
        for attribute, lr in result.chosen_lr.items():
            metrics[metric_name(DIAG, family, attribute)] = lr
    return metrics


__all__ = ["FrozenEncoder", "LabelledImages", "LinearSGDResult", "StackedHeads",
           "evaluate_linear_sgd", "linear_sgd_metrics", "milestone_factor", "paper_augment",
           "rank_share", "read_rows", "score_heads", "select_by_validation", "train_heads"]
