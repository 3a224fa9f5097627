"""The Ray Train worker loop, shared by every method.

``train_loop_per_worker`` trains one stage of one trial: it builds the data, the method (from the
registry) and the optimizer, resumes from the latest checkpoint when there is one, and every epoch
reports ``train/*`` metrics, evaluations and a checkpoint. Evaluations fit probes on the training
split and score the validation split (``val/linear/*``, ``val/knn/*``: what a sweep selects on);
the last epoch of a stage scores the test split too (``test/...``), once.

The loop knows nothing about a particular method: it calls ``method(batch)`` for the loss,
``method.embed(images)`` for evaluation, ``method.param_groups()`` for the optimizer and
``method.on_train_step_end`` for EMA/queue updates. MCL only adds pseudo labels and the frozen
features of earlier stages (:class:`raycl.stages.StageInputs`), handed over by
:mod:`raycl.pipeline`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from raycl.config import SearchConfig
from raycl.data import DatasetSplits, load_dataset, stratified_subset
from raycl.data.augment import BatchAugment, to_float
from raycl.data.samplers import PseudoLabelBatchSampler
from raycl.eval import evaluate_knn, evaluate_linear_splits
from raycl.methods import build_method
from raycl.methods.base import Batch, Method
from raycl.session import InProcessSession, RayTrainSession, Session
from raycl.stages import (
    FEATURES_FILE,
    METRICS_FILE,
    PROGRESS_FILE,
    STAGE_INPUTS_FILE,
    STATE_FILE,
    Features,
    StageInputs,
)

# ---------------------------------------------------------------------------------------------
# Small helpers


def lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """Linear warmup to 1, then cosine decay to 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(method: Method, config: SearchConfig) -> torch.optim.Optimizer:
    groups = []
    for group in method.param_groups():
        group = dict(group)
        group["lr"] = config.train.lr * float(group.pop("lr_scale", 1.0))
        group["initial_lr"] = group["lr"]
        groups.append(group)
    if config.train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.train.lr, momentum=config.train.momentum,
                               weight_decay=config.train.weight_decay)
    return torch.optim.AdamW(groups, lr=config.train.lr, weight_decay=config.train.weight_decay)


def _autocast(config: SearchConfig, device: torch.device) -> tuple[Any, torch.amp.GradScaler]:
    mode = config.train.amp
    if mode == "auto":
        mode = "fp16" if device.type == "cuda" else "off"
    if mode == "off":
        return nullcontext, torch.amp.GradScaler(device.type, enabled=False)
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16" and device.type == "cuda")
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler


def _batch_sampler(
    config: SearchConfig, inputs: StageInputs, num_samples: int, rank: int, world: int
) -> PseudoLabelBatchSampler | BatchSampler:
    per_rank = config.train.batch_size // world
    use_group_sampler = config.mcl.negatives == "sampler" and inputs.pseudo_labels is not None
    if use_group_sampler:
        return PseudoLabelBatchSampler(inputs.pseudo_labels, config.train.batch_size,
                                       num_replicas=world, rank=rank,
                                       seed=config.seed + 7919 * inputs.stage)
    indices = range(num_samples)
    sampler = (DistributedSampler(indices, num_replicas=world, rank=rank, shuffle=True,
                                  seed=config.seed + 7919 * inputs.stage, drop_last=True)
               if world > 1 else RandomSampler(indices))
    return BatchSampler(sampler, per_rank, drop_last=True)


class _Indexed(torch.utils.data.Dataset):
    """Batched indexing into the in-memory uint8 image tensor (no per-sample Python)."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index], index


# ---------------------------------------------------------------------------------------------
# Features and evaluation


@torch.no_grad()
def embed_images(
    method: Method, images: np.ndarray, session: Session, batch_size: int = 512
) -> np.ndarray:
    """Backbone features of every image, computed across all workers and gathered.

    Each rank embeds a contiguous shard (padded to equal length, as all_gather requires); every
    rank returns the full (N, D) array in dataset order.
    """
    rank, world, device = session.rank, session.world_size, session.device
    total = len(images)
    shard = math.ceil(total / world)
    start, stop = min(total, rank * shard), min(total, (rank + 1) * shard)
    was_training = method.training
    method.eval()
    try:
        chunks = [method.embed(to_float(torch.from_numpy(images[i:min(stop, i + batch_size)])
                                        .to(device))).float()
                  for i in range(start, stop, batch_size)]
        # A rank with an empty shard still needs the width for the padded all_gather.
        dim = chunks[0].shape[1] if chunks else method.embed(
            to_float(torch.from_numpy(images[:1]).to(device))).shape[1]
    finally:
        method.train(was_training)
    local = torch.cat(chunks) if chunks else torch.zeros(0, dim, device=device)
    if world == 1:
        return local.cpu().numpy()
    padded = torch.zeros(shard, dim, device=device)
    padded[: len(local)] = local
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    torch.distributed.all_gather(gathered, padded)
    return torch.cat(gathered)[:total].cpu().numpy()


def evaluate_features(
    config: SearchConfig,
    data: DatasetSplits,
    features: Features,
    prefix: str = "",
    device: torch.device | None = None,
) -> dict[str, float]:
    """Linear probe and kNN per attribute, fit on ``features["train"]`` and scored on every other
    split in ``features``, as ``{prefix}{split}/linear/<attribute>``, ``.../knn/...``.

    ``eval.max_train_samples`` caps the probe's training set with a seeded subset stratified on
    the first attribute (the first rows of a folder dataset would be its first classes).
    """
    train_features = features["train"]
    train_labels = data.train.labels
    cap = config.eval.max_train_samples
    if cap is not None and cap < len(train_features):
        keep = stratified_subset(train_labels[data.attributes[0]], cap, config.seed)
        train_features = train_features[keep]
        train_labels = {name: labels[keep] for name, labels in train_labels.items()}
    eval_sets = {split: (values, data.split(split).labels)
                 for split, values in features.items() if split != "train"}
    backend = config.eval.linear_backend
    if backend == "auto":
        large = len(train_features) > 20_000 or (device is not None and device.type == "cuda")
        backend = "torch" if large else "sklearn"
    linear = evaluate_linear_splits(train_features, train_labels, eval_sets,
                                    max_iter=config.eval.linear_max_iter, seed=config.seed,
                                    backend=backend, device=device)
    metrics: dict[str, float] = {}
    for split, (values, labels) in eval_sets.items():
        knn = evaluate_knn(train_features, train_labels, values, labels, k=config.eval.knn_k)
        metrics.update({f"{prefix}{split}/linear/{name}": v for name, v in linear[split].items()})
        metrics.update({f"{prefix}{split}/knn/{name}": v for name, v in knn.items()})
    return metrics


# ---------------------------------------------------------------------------------------------
# Checkpoints and reports


def _report_finished(checkpoint: ray.train.Checkpoint, session: Session) -> None:
    checkpoint_dir = None
    if session.rank == 0:
        checkpoint_dir = tempfile.mkdtemp(prefix="raycl-ckpt-")
        with checkpoint.as_directory() as directory:
            shutil.copytree(directory, checkpoint_dir, dirs_exist_ok=True)
        metrics = json.loads((Path(checkpoint_dir) / METRICS_FILE).read_text())
        # Training curves were logged when the stage ran; repeat only the evaluation.
        metrics = {key: value for key, value in metrics.items() if "train/" not in key}
    else:
        metrics = {}
    session.report(metrics, checkpoint_dir)


def _write_checkpoint(
    directory: Path,
    method: Method,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    progress: dict[str, Any],
    inputs: StageInputs,
    features: Features | None,
    metrics: dict[str, Any],
) -> None:
    # Tensors, numbers, strings and plain containers only: read back with weights_only=True.
    torch.save({"model": method.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict()}, directory / STATE_FILE)
    inputs.save(directory / STAGE_INPUTS_FILE)
    if features is not None:
        np.savez(directory / FEATURES_FILE, **features)
    (directory / METRICS_FILE).write_text(json.dumps(metrics))
    # Written last: a checkpoint directory with progress.json is complete.
    (directory / PROGRESS_FILE).write_text(json.dumps(progress))


# ---------------------------------------------------------------------------------------------
# The loop


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point: train one stage on this worker (see :func:`run_stage`)."""
    run_stage(loop_config, RayTrainSession())


def run_stage(loop_config: dict[str, Any], session: Session) -> None:
    """Train one stage. ``loop_config``: config (dict), inputs (StageInputs or an ObjectRef to
    one), fault (tests only)."""
    config = SearchConfig.model_validate(loop_config["config"])
    inputs = loop_config["inputs"]
    if isinstance(inputs, ray.ObjectRef):
        inputs = ray.get(inputs)
    rank, world, device = session.rank, session.world_size, session.device
    torch.set_num_threads(max(1, int(config.scaling.cpus_per_worker)))
    torch.manual_seed(config.seed + 1000 * inputs.stage)
    np.random.seed(config.seed + 1000 * inputs.stage + rank)

    data = load_dataset(config.data, config.seed)
    num_train = len(data.train.images)
    if config.train.batch_size > num_train:
        raise ValueError(f"train.batch_size={config.train.batch_size} exceeds the training split "
                         f"({num_train} samples)")
    images = torch.from_numpy(data.train.images)
    feature_aware = inputs.pseudo_labels is not None and config.mcl.negatives != "none"
    pseudo_labels = torch.from_numpy(inputs.pseudo_labels).to(device) if feature_aware else None
    batch_sampler = _batch_sampler(config, inputs, num_train, rank, world)
    loader = DataLoader(_Indexed(images), batch_sampler=batch_sampler, collate_fn=lambda x: x,
                        num_workers=config.train.loader_workers,
                        pin_memory=device.type == "cuda")
    if len(loader) == 0:
        raise ValueError("no full batch per epoch: lower train.batch_size")
    augment = BatchAugment(config.augment)

    method = build_method(config, data.channels).to(device)
    optimizer = build_optimizer(method, config)
    autocast, scaler = _autocast(config, device)
    steps_per_epoch = len(loader)
    total_steps = config.train.epochs * steps_per_epoch
    warmup_steps = int(config.train.warmup_epochs * steps_per_epoch)

    start_epoch = 0
    checkpoint = session.latest_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            progress = json.loads((Path(directory) / PROGRESS_FILE).read_text())
            if progress["stage"] == inputs.stage:
                # weights_only: a checkpoint on shared storage must not be able to run code.
                state = torch.load(Path(directory) / STATE_FILE, map_location=device,
                                   weights_only=True)
                method.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                scaler.load_state_dict(state["scaler"])
                start_epoch = int(progress["epoch"])
    if start_epoch >= config.train.epochs and checkpoint is not None:
        # A restarted trial fast-forwards through stages it already finished: hand the finished
        # checkpoint back so the pipeline reads this stage's features from it.
        _report_finished(checkpoint, session)
        return
    model: nn.Module = ray.train.torch.prepare_model(method) if world > 1 else method

    for epoch in range(start_epoch, config.train.epochs):
        if hasattr(batch_sampler, "set_epoch"):
            batch_sampler.set_epoch(epoch)
        sampler = getattr(batch_sampler, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        # One generator per (stage, epoch, rank): augmentations replay identically after a resume.
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed * 1_000_003 + inputs.stage * 10_007 + epoch * 101 + rank)
        torch.manual_seed(config.seed * 7 + inputs.stage * 10_007 + epoch * 101 + rank)

        model.train()
        sums: dict[str, float] = {}
        started = time.perf_counter()
        seen = 0
        for step_in_epoch, (batch_images, index) in enumerate(loader):
            step = epoch * steps_per_epoch + step_in_epoch
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * lr_factor(step, total_steps, warmup_steps)
            batch_images = batch_images.to(device, non_blocking=True)
            index = index.to(device, non_blocking=True)
            batch = Batch(
                images=to_float(batch_images),
                views=[augment(batch_images, generator), augment(batch_images, generator)],
                index=index,
                pseudo_labels=pseudo_labels[index] if pseudo_labels is not None else None,
            )
            with autocast():
                outputs = model(batch)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(outputs["loss"]).backward()
            scaler.step(optimizer)
            scaler.update()
            method.on_train_step_end(step, total_steps)
            for key, value in outputs.items():
                # Summed as tensors: converting every step would sync the GPU every step.
                sums[key] = sums.get(key, 0.0) + value.detach().float()
            seen += len(index)
        epoch_seconds = time.perf_counter() - started
        completed = epoch + 1
        last = completed == config.train.epochs

        metrics: dict[str, Any] = {f"train/{key}": float(value) / steps_per_epoch
                                   for key, value in sums.items()}
        metrics.update({
            "train/lr": optimizer.param_groups[0]["lr"],
            "train/images_per_second": seen * world / max(epoch_seconds, 1e-9),
            "stage": inputs.stage,
            "epoch": completed,
            "resumed_from_epoch": start_epoch,
        })
        if isinstance(batch_sampler, PseudoLabelBatchSampler):
            # How the pseudo-label groups filled batches: pure vs pooled leftovers vs dropped.
            metrics.update({f"train/sampler_{key}": float(value)
                            for key, value in batch_sampler.stats().items()})
        if config.num_stages > 1:
            metrics = {**metrics, **{f"stage{inputs.stage}/{key}": value
                                     for key, value in metrics.items() if "/" in key}}

        every = config.eval.every_n_epochs
        features = None
        if last or (every and completed % every == 0):
            # The test split is embedded and scored once per stage, after its last epoch.
            splits = ("train", "val", "test") if last else ("train", "val")
            features = {split: embed_images(method, data.split(split).images, session)
                        for split in splits}
            if rank == 0:
                metrics.update(_evaluation_metrics(config, data, inputs, features, device))

        checkpoint_dir = None
        if rank == 0 and (last or completed % config.train.checkpoint_every == 0):
            checkpoint_dir = tempfile.mkdtemp(prefix="raycl-ckpt-")
            progress = {"stage": inputs.stage, "epoch": completed, "stage_complete": last}
            _write_checkpoint(Path(checkpoint_dir), method, optimizer, scaler, progress, inputs,
                              features if last else None, metrics)
        session.report(metrics, checkpoint_dir)
        _maybe_inject_fault(loop_config, inputs.stage, completed,
                            isinstance(session, InProcessSession))


def _maybe_inject_fault(
    loop_config: dict[str, Any], stage: int, completed: int, local_mode: bool
) -> None:
    """Test hook: die once after epoch ``after_epoch`` of stage ``stage`` (default 0); the
    marker file records that we did."""
    fault = loop_config.get("fault")
    if (not fault or stage != fault.get("stage", 0) or completed != fault["after_epoch"]
            or Path(fault["marker"]).exists()):
        return
    Path(fault["marker"]).write_text(str(completed))
    if local_mode:
        raise RuntimeError("injected fault")
    os._exit(1)  # a hard worker crash, not an exception Ray could see coming


def _evaluation_metrics(
    config: SearchConfig,
    data: DatasetSplits,
    inputs: StageInputs,
    features: Features,
    device: torch.device,
) -> dict[str, float]:
    """This stage's encoder alone, and (MCL) integrated with the frozen earlier stages.

    The integrated representation is the trial's result: its test split is scored only after
    the last stage, so every trial scores test exactly once.
    """
    if config.num_stages == 1:
        return evaluate_features(config, data, features, "", device)
    metrics = evaluate_features(config, data, features, f"stage{inputs.stage}/", device)
    integrated = inputs.integrated(features)
    if inputs.stage < config.num_stages - 1:
        integrated.pop("test", None)
    return {**metrics, **evaluate_features(config, data, integrated, "", device)}


__all__ = ["embed_images", "lr_factor", "run_stage", "train_loop_per_worker"]
