"""Stream mode's loader (``data.loader: stream``): batches decoded by Ray Data tasks, epoch by
epoch, for training sets larger than memory.

Image files (:class:`~raycl.data.stream.files.FileRows`) are read in the order the memory-mode
samplers draw (:func:`raycl.worker.loader.batch_sampler`): a global shuffle per epoch seeded by
(seed, stage, epoch), each rank its share of every global batch, MCL's batches within one
pseudo label. Each epoch the rank's batches become a Ray Dataset of file lists that Ray Data
tasks decode, a batch per task, in order (``preserve_order``), at most about
:data:`BUFFERED_BATCHES` ahead; the rank gets exactly the batches the sampler drew, so a
resumed epoch replays them.

Shards (:class:`~raycl.data.stream.shards.ShardRows`) are read in sequence: per epoch the shards are
permuted (seeded by seed, stage, epoch), each rank takes every world-th, and Ray Data tasks
decode them into a seeded shuffle buffer (``data.shuffle_buffer``). Every rank yields exactly
``len(loader)`` batches (a rank whose shards run short reads them again), so no rank enters a
collective alone.

Why not Ray Train's ``get_dataset_shard``: a dataset handed to the trainer is fixed when the
trainer is built, split with ``equal=True`` (rows dropped to even the shares) and shuffled by
Ray's execution count, which restarts with a restored trial; the epoch's order has to be chosen
by the loop for reproducible epochs, exact resumption and MCL's pseudo-label batches.

Decoding tasks run in the trial's placement group when it reserved CPUs for them
(``data.stream_cpus``; :func:`raycl.launch.placement.trial_bundles`), so concurrent trials never
take each other's decoders and a sweep never waits on CPUs it already holds.

An image that cannot be decoded is replaced by another image of its batch (a file) or skipped
(a shard sample), counted (``data/skipped``) and named in a warning; never a crash.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from raycl.config.schema import CoreConfig
from raycl.data.stream.files import FileRows, decode_paths
from raycl.data.stream.shards import Shard, ShardRows, shard_chunks_as_columns
from raycl.worker.batches import TrainBatch
from raycl.worker.samplers import StageSampler, grouping_metrics, reshuffle
from raycl.worker.stage_integration import StageInputs

logger = logging.getLogger(__name__)

# Batches the iterator fetches ahead of the one being trained on (per rank), and the decoded
# batches Ray Data may hold in the object store at once (it runs a little over the limit).
PREFETCH_BATCHES = 4
BUFFERED_BATCHES = 16


def _decode_file_batch(batch: dict[str, np.ndarray], resolution: int) -> dict[str, np.ndarray]:
    """Ray Data task: one training batch's files decoded (an undecodable one replaced by another
    image of the batch, so the batch keeps its size and its pseudo-label group). The skipped
    files travel with the batch: the trial's worker names them (:meth:`FileStreamLoader._skip`)."""
    paths = [str(path) for path in batch["paths"][0]]
    decoded = decode_paths(paths, resolution, threads=1, fill="copy")
    skips = [(name, reason or name) for name, reason in zip(decoded.skipped, decoded.reasons,
                                                            strict=True)]
    return {"images": decoded.images[None],
            "index": np.asarray(batch["index"][0], dtype=np.int64)[None],
            "skipped": np.array([len(skips)], dtype=np.int64),
            "skips": np.array([json.dumps(skips)], dtype=object)}


def _decode_shards(
    batch: dict[str, np.ndarray], fmt: str, resolution: int, need_captions: bool
) -> Iterator[dict[str, np.ndarray]]:
    """Ray Data task: the samples of some shards, decoded, in chunks."""
    for path, count, offset in zip(batch["path"], batch["count"], batch["offset"], strict=True):
        shard = Shard(str(path), int(count), int(offset))
        yield from shard_chunks_as_columns(shard, fmt, resolution, need_captions)


def _scheduling(placement_group: str | None, cpus: float) -> dict[str, Any]:
    """``map_batches`` arguments of the decoding tasks: one CPU each (or what the reservation
    holds, when less), in the trial's data bundles when it reserved them."""
    args: dict[str, Any] = {"num_cpus": min(1.0, cpus) if cpus > 0 else 1.0}
    if placement_group:
        from ray.util.placement_group import PlacementGroup
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = PlacementGroup(_placement_group_id(placement_group))
        # Bundle -1: any bundle with room; the trial process's own bundle is full.
        strategy = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=-1, placement_group_capture_child_tasks=False)
        args["scheduling_strategy"] = strategy
    return args


def _map_batches(dataset: Any, fn: Any, **kwargs: Any) -> Any:
    """``dataset.map_batches(fn, **kwargs)``, one task per batch. Ray 2.60 deprecates passing a
    ``scheduling_strategy`` through ``map_batches`` (to be removed in Ray 2.64) but names no
    replacement for placing a dataset's tasks in a placement group, which the decoders'
    reservation needs; its warning is silenced here, the one place that passes one."""
    import warnings

    from ray.util.annotations import RayDeprecationWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RayDeprecationWarning)
        return dataset.map_batches(fn, batch_size=1, batch_format="numpy", **kwargs)


def _placement_group_id(hex_id: str) -> Any:
    from ray import PlacementGroupID

    return PlacementGroupID.from_hex(hex_id)


def _data_context(preserve_order: bool, batch_bytes: int) -> None:
    """This process's Ray Data settings: order kept (file batches), no progress bars, and at most
    :data:`BUFFERED_BATCHES` decoded batches of ``batch_bytes`` in the object store: without a
    limit Ray Data decodes as far ahead as its share of the object store allows (a whole epoch
    of a small set), holding node memory the trial does not need."""
    from ray.data import DataContext, ExecutionResources

    context = DataContext.get_current()
    context.execution_options.preserve_order = preserve_order
    context.execution_options.resource_limits = ExecutionResources.for_limits(
        object_store_memory=max(64 * 2**20, BUFFERED_BATCHES * batch_bytes))
    context.enable_progress_bars = False
    context.print_on_execution_start = False


class StreamLoader:
    """What both stream kinds share (see the module docstring): where the decoding tasks run, the
    epoch that seeds the order, and the count of undecodable samples.

    Args:
        config: the trial's config (batch size, seed, ``data.*``).
        resolution: side of the decoded images, in pixels.
        inputs: the stage (its index seeds the order; its pseudo labels group MCL's batches).
        rank, world: this rank and the number of ranks.
        placement_group: hex id of the trial's placement group holding the decoders' CPUs, or
            None (decoders take free CPUs).
    """

    def __init__(self, config: CoreConfig, resolution: int, inputs: StageInputs, rank: int,
                 world: int, placement_group: str | None = None) -> None:
        self.rank, self.world = rank, world
        self.seed, self.stage = config.seed, inputs.stage
        self.per_rank = config.train.batch_size // world
        self.resolution = resolution
        self.remote_args = _scheduling(placement_group, config.data.stream_cpus)
        self.epoch = 0  # within the stage: set_epoch sets it
        self.skipped = 0  # in the epoch being read (data/skipped)

    def set_epoch(self, stage_epoch: int) -> None:
        """Seed the order of ``stage_epoch`` (the epoch within the stage)."""
        self.epoch = stage_epoch

    def pop_metrics(self) -> dict[str, float]:
        """``data/skipped``: the undecodable samples this rank skipped in the epoch just read;
        the count starts again for the next one."""
        skipped, self.skipped = self.skipped, 0
        return {"data/skipped": float(skipped)}

    def _batch_bytes(self) -> int:
        """Bytes of one decoded batch of this rank."""
        return self.per_rank * 3 * self.resolution ** 2


class FileStreamLoader(StreamLoader):
    """Image files, decoded a batch per Ray Data task in the order ``sampler`` draws (see the
    module docstring); an undecodable file is replaced by another image of its batch.

    Args:
        images: the training images' files.
        sampler: the stage's batch sampler (:func:`raycl.worker.loader.batch_sampler`), whose
            batches are decoded in its order.
        config, inputs, rank, world, placement_group: as :class:`StreamLoader`'s.
    """

    def __init__(self, config: CoreConfig, images: FileRows, inputs: StageInputs, rank: int,
                 world: int, sampler: StageSampler, placement_group: str | None = None) -> None:
        super().__init__(config, images.resolution, inputs, rank, world, placement_group)
        self.images = images
        self.batch_sampler = sampler
        self._named: set[str] = set()  # undecodable files already named in a warning

    def __len__(self) -> int:
        # The sampler's count, which MCL's pseudo-label sampler may change per epoch.
        return len(self.batch_sampler)

    def set_epoch(self, stage_epoch: int) -> None:
        super().set_epoch(stage_epoch)
        reshuffle(self.batch_sampler, stage_epoch)

    def pop_metrics(self) -> dict[str, float]:
        return {**super().pop_metrics(), **grouping_metrics(self.batch_sampler)}

    def _skip(self, skips: list[list[str]]) -> None:
        """Count a file batch's undecodable files (data/skipped, every epoch) and name each in a
        warning the first time this trial meets it."""
        self.skipped += len(skips)
        for name, reason in skips:
            if name not in self._named:
                self._named.add(name)
                logger.warning("data: skipped an undecodable image (replaced by another of its "
                               "batch, counted in data/skipped every epoch): %s", reason)

    def __iter__(self) -> Iterator[TrainBatch]:
        import ray.data

        _data_context(preserve_order=True, batch_bytes=self._batch_bytes())
        paths = self.images.paths
        rows = [{"index": np.asarray(batch, dtype=np.int64),
                 "paths": [str(path) for path in paths[np.asarray(batch, dtype=np.int64)]]}
                for batch in self.batch_sampler]
        dataset = _map_batches(ray.data.from_items(rows, override_num_blocks=max(1, len(rows))),
                               _decode_file_batch,
                               fn_kwargs={"resolution": self.resolution},
                               **self.remote_args)
        for batch in dataset.iter_batches(batch_size=1, batch_format="numpy",
                                          prefetch_batches=PREFETCH_BATCHES):
            self._skip(json.loads(str(batch["skips"][0])))
            # A copy: Ray hands out read-only views of its object store.
            yield TrainBatch(torch.from_numpy(np.array(batch["images"][0])),
                             torch.from_numpy(np.array(batch["index"][0], dtype=np.int64)))


class ShardStreamLoader(StreamLoader):
    """Shards, read in sequence through a seeded shuffle buffer (see the module docstring); an
    undecodable sample is skipped. Every rank yields exactly ``len(loader)`` batches.

    Args:
        images: the training images' shards.
        need_captions: skip samples without a caption, and hand each batch its captions
            (image-text methods).
        config, inputs, rank, world, placement_group: as :class:`StreamLoader`'s.
    """

    def __init__(self, config: CoreConfig, images: ShardRows, inputs: StageInputs, rank: int,
                 world: int, placement_group: str | None = None,
                 need_captions: bool = False) -> None:
        super().__init__(config, images.resolution, inputs, rank, world, placement_group)
        self.images = images
        self.shuffle_buffer = config.data.shuffle_buffer
        self.need_captions = need_captions
        self.steps = len(images) // world // self.per_rank

    def __len__(self) -> int:
        return self.steps

    def _epoch_shards(self, cycle: int) -> list[Shard]:
        """This rank's shards for the epoch (and for the ``cycle``-th re-read of them)."""
        state = np.random.SeedSequence([self.seed, self.stage, self.epoch, cycle]).generate_state(1)
        order = np.random.default_rng(int(state[0])).permutation(len(self.images.shards))
        mine = order[self.rank::self.world] if len(order) >= self.world else order
        return [self.images.shards[int(i)] for i in mine]

    def _shard_pass(self, cycle: int) -> Iterator[TrainBatch]:
        import ray.data

        _data_context(preserve_order=False, batch_bytes=self._batch_bytes())
        rows = [{"path": shard.path, "count": shard.count, "offset": shard.offset}
                for shard in self._epoch_shards(cycle)]
        dataset = _map_batches(ray.data.from_items(rows, override_num_blocks=max(1, len(rows))),
                               _decode_shards,
                               fn_kwargs={"fmt": self.images.fmt, "resolution": self.resolution,
                                          "need_captions": self.need_captions},
                               **self.remote_args)
        seed = int(np.random.SeedSequence([self.seed, self.stage, self.epoch, cycle, self.rank])
                   .generate_state(1)[0])
        # Not drop_last: a short last batch is read for its skip counts, then dropped here.
        for batch in dataset.iter_batches(
                batch_size=self.per_rank, batch_format="numpy", drop_last=False,
                prefetch_batches=PREFETCH_BATCHES,
                local_shuffle_buffer_size=self.shuffle_buffer or None,
                local_shuffle_seed=seed if self.shuffle_buffer else None):
            # Counted only: the decoding task named them (raycl.data.stream.shards' skip log).
            self.skipped += int(np.asarray(batch["skipped"]).sum())
            if len(batch["index"]) < self.per_rank:
                continue
            # The columns carry captions exactly when the decoders were asked for them.
            yield TrainBatch(torch.from_numpy(np.array(batch["images"])),  # writable (above)
                             torch.from_numpy(np.array(batch["index"], dtype=np.int64)),
                             [str(text) for text in batch["caption"]]
                             if self.need_captions else None)

    def __iter__(self) -> Iterator[TrainBatch]:
        """Exactly ``len(self)`` batches: a rank whose shards run short reads them again."""
        yielded, cycle = 0, 0
        while yielded < self.steps:
            before = yielded
            for batch in self._shard_pass(cycle):
                yield batch
                yielded += 1
                if yielded == self.steps:
                    return
            if yielded == before:
                raise RuntimeError(f"rank {self.rank}: not one full batch of "
                                   f"{self.per_rank} decodable samples in its shards")
            cycle += 1


__all__ = ["BUFFERED_BATCHES", "PREFETCH_BATCHES", "FileStreamLoader", "ShardStreamLoader",
           "StreamLoader"]
