"""Features for evaluation: every split embedded across the workers, and the stages integrated.

:func:`embed_images` shards the images over the ranks and gathers the features on every rank;
:func:`embed_splits` embeds what one evaluation scores; :func:`integrate_stages` gives the
trial's representation (MCL: the stages so far, concatenated or as a model soup).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import TYPE_CHECKING

import numpy as np
import torch

from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, ImageRows
from raycl.data.augment import to_float
from raycl.data.stream.files import FileRows
from raycl.data.stream.shards import ShardRows
from raycl.distributed import gather_no_grad
from raycl.eval.multimodal import EvalSets
from raycl.methods.base import Method
from raycl.worker.optim import Autocast
from raycl.worker.stage_integration import (
    Features,
    StageInputs,
    StageWeights,
    average_weights,
    soup_weights,
)

if TYPE_CHECKING:  # the embedding pass itself needs no Ray (benchmarks/gpu.py runs it bare)
    from raycl.worker.session import Session

# What an embedding pass reads: an array, a view into the cache, stream mode's files or shards.
EmbeddedImages = np.ndarray | ImageRows | FileRows | ShardRows


@torch.no_grad()
def embed_images(
    method: Method,
    images: EmbeddedImages,
    session: Session,
    batch_size: int = 512,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    autocast: Autocast = nullcontext,
) -> np.ndarray:
    """Backbone features of every image, computed across all workers and gathered.

    Each rank embeds a contiguous shard (padded to equal length, as all_gather requires), read
    a batch of rows at a time (a split is a view into the memory-mapped set: only the shard's
    rows are read; in stream mode only its files or shards are decoded); every rank returns
    the full (N, D) array in dataset order. A file stream mode cannot decode is never embedded
    as a blank image: its row is NaN, which the scoring leaves out
    (:func:`raycl.worker.evaluate.decodable_rows`). ``embed``
    replaces ``method.embed`` (e.g. ``method.project`` for the projection spectrum).
    ``autocast``: the forward's precision (:func:`raycl.worker.optim.inference_autocast`: the
    trial's on CUDA, none on CPU); the features are float32 either way.
    """
    rank, world, device = session.rank, session.world_size, session.device
    embed = embed or method.embed
    total = len(images)
    shard = math.ceil(total / world)
    start, stop = min(total, rank * shard), min(total, (rank + 1) * shard)
    was_training = method.training
    method.eval()
    try:
        with autocast():
            chunks = [_mark_undecodable(embed(to_float(torch.from_numpy(rows).to(device)))
                                        .float(), bad)
                      for rows, bad in _row_batches(images, start, stop, batch_size)]
            # A rank with an empty shard still needs the width for the padded all_gather.
            dim = chunks[0].shape[1] if chunks else embed(
                to_float(torch.from_numpy(images[:1]).to(device))).shape[1]
    finally:
        method.train(was_training)
    local = torch.cat(chunks) if chunks else torch.zeros(0, dim, device=device)
    if world == 1:
        return local.cpu().numpy()
    padded = torch.zeros(shard, dim, device=device)
    padded[: len(local)] = local
    return gather_no_grad(padded)[:total].cpu().numpy()


def _mark_undecodable(features: torch.Tensor, bad: list[int]) -> torch.Tensor:
    """``features`` with the rows ``bad`` (files that could not be decoded) set to NaN."""
    if bad:
        features[bad] = float("nan")
    return features


def _row_batches(
    images: EmbeddedImages, start: int, stop: int, batch_size: int
) -> Iterator[tuple[np.ndarray, list[int]]]:
    """Rows ``start .. stop - 1`` of ``images``, ``batch_size`` at a time, each with the rows of
    the batch whose file could not be decoded (stream mode's files; blank, to be marked):
    slices of an array, a view or stream mode's files; stream mode's shards read in sequence (a
    slice would re-read its shard from the start; they skip what they cannot decode)."""
    if isinstance(images, ShardRows):
        for rows in images.rows(start, stop, batch_size):
            yield rows, []
        return
    for first in range(start, stop, batch_size):
        last = min(stop, first + batch_size)
        if isinstance(images, FileRows):
            decoded = images.decode(first, last)
            yield decoded.images, decoded.rows
        else:
            yield np.asarray(images[first:last]), []


def embed_splits(
    model: Method,
    data: DatasetSplits,
    eval_sets: EvalSets,
    splits: tuple[str, ...],
    session: Session,
    last: bool,
    autocast: Autocast = nullcontext,
) -> Features:
    """The features one evaluation scores: each of ``splits``; after a stage's ``last`` epoch
    the transfer sets (``transfer:<name>:train|test``); the MMVP-style pairs of the evaluated
    splits (``mmvp:<split>``), so stages integrate them like splits. ``autocast``: see
    :func:`embed_images`."""
    def embed(images: EmbeddedImages) -> np.ndarray:
        return embed_images(model, images, session, autocast=autocast)

    embedded = {split: embed(data.split(split).images) for split in splits}
    for transfer in eval_sets.transfer if last else []:
        embedded[transfer.train_key] = embed(transfer.train.images)
        embedded[transfer.test_key] = embed(transfer.test.images)
    for split, pairs in eval_sets.mmvp.items():
        if split in splits:
            embedded[f"mmvp:{split}"] = embed(pairs.images)
    return embedded


def soup_method(method: Method, weights: list[StageWeights]) -> Method:
    """A copy of ``method`` holding the average of the stages' soup weights (model soup),
    averaged on the method's device whatever device each stage's weights are on."""
    soup = copy.deepcopy(method)
    device = next(iter(method.state_dict().values())).device
    soup.load_state_dict(average_weights(weights, device), strict=False)
    return soup


def integrate_stages(
    config: CoreConfig,
    inputs: StageInputs,
    method: Method,
    features: Features,
    embed: Callable[[Method], Features],
) -> tuple[Features, Method]:
    """The trial's representation so far and the model that gives it: this stage alone, or (MCL)
    the stages integrated: the concatenated features, or the soup's (embedded by ``embed``)."""
    if config.num_stages == 1:
        return features, method
    if config.mcl.integration == "soup" and inputs.weights:
        soup = soup_method(method, [*inputs.weights, soup_weights(method)])
        return embed(soup), soup
    return inputs.integrated(features), method


__all__ = ["embed_images", "embed_splits", "integrate_stages", "soup_method"]
