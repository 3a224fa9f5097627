"""Features for evaluation: every split embedded across the workers, and the stages integrated.

:func:`embed_images` shards the images over the ranks and gathers the features on rank 0 only;
:func:`embed_splits` embeds what one evaluation scores; :func:`integrate_stages` gives the
trial's representation (MCL: the stages so far, concatenated or as a model soup).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, ImageRows
from raycl.data.augment import to_float
from raycl.data.stream.files import FileRows
from raycl.data.stream.shards import ShardRows
from raycl.distributed import gather_to_rank0
from raycl.eval.features import batch_features
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
# Decodes rows ``start .. stop - 1`` of stream mode's files ``batch_size`` at a time, in order,
# each batch with its undecodable rows (:func:`raycl.worker.stream_loader.decoded_row_batches`:
# in the worker's decoder bundle); None: ``FileRows.decode`` in this process.
FileDecoder = Callable[[FileRows, int, int, int], Iterator[tuple[np.ndarray, list[int]]]]


@dataclass(frozen=True)
class OneProcess:
    """Where an embedding pass runs outside Ray Train: one process, no process group
    (``python -m raycl.evaluate``); what :func:`embed_images` asks of a session."""

    device: torch.device
    rank: int = 0
    world_size: int = 1


@torch.no_grad()
def embed_images(
    method: nn.Module,
    images: EmbeddedImages,
    session: Session | OneProcess,
    batch_size: int = 512,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    autocast: Autocast = nullcontext,
    decode_files: FileDecoder | None = None,
) -> np.ndarray | None:
    """Backbone features of every image, computed across all workers and gathered on rank 0.

    Each rank embeds a contiguous shard, read a batch of rows at a time (a split is a view into
    the memory-mapped set: only the shard's rows are read; in stream mode only its files or
    shards are decoded), and sends each batch's features to rank 0 as soon as they are computed
    (padded to ``batch_size`` rows, as a gather requires): rank 0 copies them into the (N, D)
    host array in dataset order and returns it; every other rank returns None and never holds
    more than one batch of features (at paper scale an (N, D) split on every GPU is what ran out
    of memory). A file stream mode cannot decode is never embedded as a blank image: its row is
    NaN, which the scoring leaves out (:func:`raycl.worker.evaluate.decodable_rows`). ``embed``
    replaces ``method.embed`` (e.g. ``method.project`` for the projection spectrum; a frozen
    encoder that is no :class:`Method` passes itself).
    ``autocast``: the forward's precision (:func:`raycl.worker.optim.inference_autocast`: the
    trial's on CUDA, none on CPU); the features are float32 either way. ``decode_files``: where
    stream mode's files are decoded (:data:`FileDecoder`).
    """
    rank, world, device = session.rank, session.world_size, session.device
    embed = embed or method.embed
    total = len(images)
    shard = math.ceil(total / world)
    start, stop = min(total, rank * shard), min(total, (rank + 1) * shard)
    batches = (decode_files(images, start, stop, batch_size)
               if decode_files is not None and isinstance(images, FileRows)
               else _row_batches(images, start, stop, batch_size))
    gathered: np.ndarray | None = None  # rank 0's (N, D), allocated at the first block
    dim: int | None = None
    was_training = method.training
    method.eval()
    try:
        # One precision region for the whole pass, as a bare loop holds it: leaving autocast
        # drops its cached low-precision weight copies (a region per batch casts every weight
        # again). On an H200 the pass is bound by its per-batch host copy (docs/benchmarks.md).
        with autocast():
            # Every rank takes part in the same number of gathers (a shorter shard sends padding).
            for step in range(math.ceil(shard / batch_size)):
                rows, bad = next(batches, (None, []))
                if rows is None:  # this rank's shard is done: it still sends a padded block
                    dim = dim or batch_features(
                        embed, to_float(torch.from_numpy(images[:1]).to(device))).shape[1]
                    local = torch.zeros(0, dim, device=device)
                else:
                    local = _mark_undecodable(batch_features(
                        embed, to_float(torch.from_numpy(rows).to(device))), bad)
                    dim = local.shape[1]
                block = gather_to_rank0(_padded(local, batch_size))
                if block is not None:  # rank 0 (or a single process)
                    if gathered is None:
                        gathered = np.empty((total, block.shape[1]), dtype=np.float32)
                    _place(gathered, block.cpu().numpy(), step * batch_size, shard, batch_size)
    finally:
        method.train(was_training)
    if rank != 0:
        return None
    return gathered if gathered is not None else np.zeros((0, dim or 0), dtype=np.float32)


def _padded(local: torch.Tensor, rows: int) -> torch.Tensor:
    """``local`` (n <= ``rows``, D) padded with zero rows to ``rows``."""
    if len(local) == rows:
        return local
    padded = torch.zeros(rows, local.shape[1], device=local.device, dtype=local.dtype)
    padded[: len(local)] = local
    return padded


def _place(
    gathered: np.ndarray, block: np.ndarray, offset: int, shard: int, batch_size: int
) -> None:
    """Copies one gathered block (``batch_size`` padded rows per rank, in rank order) into
    ``gathered``: rank r's rows start at ``r * shard + offset`` and stop at its shard's end."""
    total = len(gathered)
    for r in range(len(block) // batch_size):
        first = min(total, r * shard + offset)
        last = min(total, (r + 1) * shard, first + batch_size)
        gathered[first:last] = block[r * batch_size: r * batch_size + last - first]


class RowSubset:
    """Some rows of an array-like of images (a reader's lazy array), read only when sliced:
    what an embedding pass reads when an evaluation scores a capped subset of a split."""

    def __init__(self, images: EmbeddedImages, rows: np.ndarray) -> None:
        self.images = images
        self.rows = np.asarray(rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: slice) -> np.ndarray:
        return np.asarray(self.images[self.rows[key]])


def select_images(images: EmbeddedImages, rows: np.ndarray | None) -> EmbeddedImages:
    """Rows ``rows`` of ``images`` (all of them when None), never copied: a view of the array or
    cache, stream mode's files' or shards' subset, or a :class:`RowSubset`."""
    if rows is None:
        return images
    if isinstance(images, FileRows | ShardRows):
        return images.subset(rows)
    if isinstance(images, ImageRows):
        return ImageRows(images.base, images.rows[rows])
    if isinstance(images, np.ndarray):
        return ImageRows(images, rows)
    return RowSubset(images, rows)  # type: ignore[return-value]


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
    if isinstance(images, ShardRows):  # an unreadable sample's row is marked, never scored
        for decoded in images.decode_rows(start, stop, batch_size):
            yield decoded.images, decoded.rows
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
    rows: Mapping[str, np.ndarray | None] | None = None,
    decode_files: FileDecoder | None = None,
) -> Features:
    """The features one evaluation scores, on rank 0 (every other rank embeds its share and
    gets ``{}``): each of ``splits`` (only its ``rows`` where given: a capped split); after a
    stage's ``last`` epoch the transfer sets (``transfer:<name>:train|test``); the MMVP-style
    pairs of the evaluated splits (``mmvp:<split>``), so stages integrate them like splits.
    ``autocast``, ``decode_files``: see :func:`embed_images`."""
    rows = rows or {}

    def embed(images: EmbeddedImages) -> np.ndarray | None:
        return embed_images(model, images, session, autocast=autocast,
                            decode_files=decode_files)

    embedded = {split: embed(select_images(data.split(split).images, rows.get(split)))
                for split in splits}
    for transfer in eval_sets.transfer if last else []:
        embedded[transfer.train_key] = embed(transfer.train.images)
        embedded[transfer.test_key] = embed(transfer.test.images)
    for split, pairs in eval_sets.mmvp.items():
        if split in splits:
            embedded[f"mmvp:{split}"] = embed(pairs.images)
    return {key: values for key, values in embedded.items() if values is not None}


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
    rows: Mapping[str, np.ndarray | None] | None = None,
) -> tuple[Features, Method]:
    """The trial's representation so far and the model that gives it: this stage alone, or (MCL)
    the stages integrated: the concatenated features (rank 0, the only rank holding features;
    ``rows``: the rows of each split ``features`` holds, see :meth:`StageInputs.integrated`),
    or the soup's (embedded by ``embed``: every rank enters it, rank 0 keeps the result)."""
    if config.num_stages == 1:
        return features, method
    if config.mcl.integration == "soup" and inputs.weights:
        soup = soup_method(method, [*inputs.weights, soup_weights(method)])
        return embed(soup), soup
    # concat: the earlier stages' frozen features (their kept encoders serve the export only).
    return inputs.integrated(features, rows), method


__all__ = ["OneProcess", "RowSubset", "embed_images", "embed_splits", "integrate_stages",
           "select_images", "soup_method"]
