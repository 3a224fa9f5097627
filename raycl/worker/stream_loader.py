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

Where the decoding tasks run: each Ray Train worker's bundle holds its decoders' CPUs beside its
own (``data.stream_cpus``; :func:`raycl.launch.reservations.worker_resources`), and the worker's
Ray Data tasks are scheduled into that very bundle (the Tune trial process's one bundle when it
trains itself), so they decode on the node of the GPU that trains on their batches and no batch
crosses nodes. The worker's actor holds its whole bundle, so the tasks ask for no CPU of their
own; the reservation is what keeps other trials off those CPUs, and at most ``data.stream_cpus``
tasks (at least one) run at once. Ray Data is told the same (its ``resource_limits``), so its
autoscaler asks for nothing beyond them. With ``data.stream_cpus: 0`` nothing is reserved: the
tasks take a free CPU, on the worker's node when it has one.

An image that cannot be read or decoded is replaced by a spare, another sample of the split
from a neighbouring step (a file), or skipped (a shard sample): never by a copy of another image
of its batch. It is counted (``data/skipped``) and named in a warning; past
``data.max_skipped_share`` of an epoch's samples the trial fails naming the files
(:class:`raycl.data.stream.files.SkipBudget`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from raycl.config.schema import CoreConfig
from raycl.data.stream.decoders import CaptionTokenizer, decode_file_batch, decode_shards
from raycl.data.stream.files import FileRows, SkipBudget, spare_batches
from raycl.data.stream.shards import Shard, ShardRows
from raycl.worker.batches import TrainBatch
from raycl.worker.samplers import StageSampler, grouping_metrics, reshuffle
from raycl.worker.stage_integration import StageInputs

logger = logging.getLogger(__name__)

# Batches the iterator fetches ahead of the one being trained on (per rank), and the decoded
# batches Ray Data may hold in the object store at once (it runs a little over the limit).
PREFETCH_BATCHES = 4
BUFFERED_BATCHES = 16


def _bundle_index(group: Any) -> int | None:
    """The bundle of placement group ``group`` this process runs in.

    Ray 2.60 tells a process its placement group (``get_current_placement_group``) but not its
    bundle; the resources the process holds name it (``bundle_group_<index>_<group id>``, the
    pattern of ``ray._private.utils.PLACEMENT_GROUP_INDEXED_BUNDLED_RESOURCE_PATTERN``), read
    through a private API. Failing that: the first of the group's bundles on this node (the node
    is what matters: the decoders take no CPU of the bundle itself). None: no bundle here.
    """
    import ray

    try:
        from ray._private import worker

        pattern = re.compile(rf"bundle_group_(\d+)_{group.id.hex()}")
        for name in worker.global_worker.core_worker.resource_ids():
            found = pattern.fullmatch(name)
            if found:
                return int(found.group(1))
    except Exception:  # a private API moved: fall back to the node's first bundle
        pass
    try:
        from ray.util import placement_group_table

        node = ray.get_runtime_context().get_node_id()
        here = sorted(int(index) for index, on in
                      placement_group_table(group)["bundles_to_node_id"].items() if on == node)
        return here[0] if here else None
    except Exception:  # no table for it (removed): no bundle
        return None


def decoder_bundle(placement_group: str | None = None) -> tuple[str, int] | None:
    """``(placement group hex id, bundle index)`` where this process's decoders run: its own
    bundle (a Ray Train worker's; the Tune trial process's when it trains itself), or the bundle
    of ``placement_group`` on this node; None outside a placement group (a driver, a test)."""
    import ray

    if not ray.is_initialized():  # get_current_placement_group would start a Ray
        return None
    from ray.util.placement_group import PlacementGroup, get_current_placement_group

    group = (PlacementGroup(_placement_group_id(placement_group)) if placement_group
             else get_current_placement_group())
    if group is None:
        return None
    index = _bundle_index(group)
    return (group.id.hex(), index) if index is not None else None


def decoder_tasks(decoder_cpus: float, bundle: tuple[str, int] | None) -> dict[str, Any]:
    """``map_batches`` arguments of the decoding tasks.

    In ``bundle`` (the decoders' CPUs reserved there, ``decoder_cpus`` > 0): no CPU of their own
    (the worker's actor holds the whole bundle) and at most ``decoder_cpus`` tasks at once (at
    least one). Without a bundle: one CPU each (or the reservation, when less), anywhere; with
    nothing reserved, on this node while it has a free CPU.
    """
    import ray
    from ray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    if bundle is not None and decoder_cpus > 0:
        from ray.data import TaskPoolStrategy
        from ray.util.placement_group import PlacementGroup

        group = PlacementGroup(_placement_group_id(bundle[0]))
        return {"num_cpus": 0, "compute": TaskPoolStrategy(size=max(1, int(decoder_cpus))),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=bundle[1],
                    placement_group_capture_child_tasks=False)}
    args: dict[str, Any] = {"num_cpus": min(1.0, decoder_cpus) if decoder_cpus > 0 else 1.0}
    if decoder_cpus <= 0 and ray.is_initialized():
        args["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=True)
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


def _data_context(preserve_order: bool, batch_bytes: int, reserved_cpus: float | None) -> None:
    """This process's Ray Data settings: order kept (file batches), no progress bars, and its
    resource limits: the ``reserved_cpus`` in the worker's bundle and no GPU (what its resource
    manager and autoscaler plan with; None: the cluster's), and at most :data:`BUFFERED_BATCHES`
    decoded batches of ``batch_bytes`` in the object store: without a limit Ray Data decodes as
    far ahead as its share of the object store allows (a whole epoch of a small set), holding
    node memory the trial does not need."""
    from ray.data import DataContext, ExecutionResources

    context = DataContext.get_current()
    context.execution_options.preserve_order = preserve_order
    context.execution_options.resource_limits = ExecutionResources.for_limits(
        cpu=reserved_cpus, gpu=0 if reserved_cpus is not None else None,
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
        placement_group: hex id of a placement group whose bundle on this node holds the
            decoders' CPUs; None (a trial's workers): the bundle this process runs in
            (:func:`decoder_bundle`).
    """

    def __init__(self, config: CoreConfig, resolution: int, inputs: StageInputs, rank: int,
                 world: int, placement_group: str | None = None) -> None:
        self.rank, self.world = rank, world
        self.seed, self.stage = config.seed, inputs.stage
        self.per_rank = config.train.batch_size // world
        self.resolution = resolution
        cpus = config.data.stream_cpus
        bundle = decoder_bundle(placement_group) if cpus > 0 else None
        self.remote_args = decoder_tasks(cpus, bundle)
        self.reserved_cpus = cpus if bundle is not None else None  # Ray Data's CPU limit
        self.epoch = 0  # within the stage: set_epoch sets it
        self.skipped = 0  # in the epoch being read (data/skipped)
        # Past data.max_skipped_share of an epoch's samples the trial fails, naming the files.
        self.budget = SkipBudget(config.data.max_skipped_share, f" on rank {rank}")

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
    module docstring); an undecodable file is replaced by a spare sample of the split.

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
                logger.warning("data: skipped an undecodable image (replaced by another sample "
                               "of the split, counted in data/skipped every epoch): %s", reason)
        self.budget.add([name for name, _ in skips])

    def __iter__(self) -> Iterator[TrainBatch]:
        import ray.data

        _data_context(True, self._batch_bytes(), self.reserved_cpus)
        paths = self.images.paths
        batches = [np.asarray(batch, dtype=np.int64) for batch in self.batch_sampler]
        self.budget.start(sum(len(batch) for batch in batches))
        # Each batch's spares stand in for its unreadable files (never a copy of another row).
        rows = [{"index": batch, "paths": [str(path) for path in paths[batch]],
                 "spares": json.dumps([[int(row), str(paths[row])] for row in spares])}
                for batch, spares in zip(batches, spare_batches(batches), strict=True)]
        dataset = _map_batches(ray.data.from_items(rows, override_num_blocks=max(1, len(rows))),
                               decode_file_batch,
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
        tokenizer: with ``need_captions``, the method's caption tokenizer, run by the decoders:
            each batch also carries its captions' tokens (none tokenised in training).
        config, inputs, rank, world, placement_group: as :class:`StreamLoader`'s.
    """

    def __init__(self, config: CoreConfig, images: ShardRows, inputs: StageInputs, rank: int,
                 world: int, placement_group: str | None = None,
                 need_captions: bool = False, tokenizer: CaptionTokenizer | None = None) -> None:
        super().__init__(config, images.resolution, inputs, rank, world, placement_group)
        self.images = images
        self.shuffle_buffer = config.data.shuffle_buffer
        self.need_captions = need_captions
        self.tokenizer = tokenizer if need_captions else None
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

        _data_context(False, self._batch_bytes(), self.reserved_cpus)
        rows = [{"path": shard.path, "count": shard.count, "offset": shard.offset}
                for shard in self._epoch_shards(cycle)]
        dataset = _map_batches(ray.data.from_items(rows, override_num_blocks=max(1, len(rows))),
                               decode_shards,
                               fn_kwargs={"fmt": self.images.fmt, "resolution": self.resolution,
                                          "need_captions": self.need_captions,
                                          "tokenizer": self.tokenizer},
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
            self.budget.add([name for names in batch["skip_names"]
                             for name in json.loads(str(names))],
                            int(np.asarray(batch["skipped"]).sum()))
            if len(batch["index"]) < self.per_rank:
                continue
            # The columns carry captions exactly when the decoders were asked for them.
            yield TrainBatch(torch.from_numpy(np.array(batch["images"])),  # writable (above)
                             torch.from_numpy(np.array(batch["index"], dtype=np.int64)),
                             [str(text) for text in batch["caption"]]
                             if self.need_captions else None,
                             torch.from_numpy(np.array(batch["tokens"], dtype=np.int64))
                             if self.tokenizer is not None else None)

    def __iter__(self) -> Iterator[TrainBatch]:
        """Exactly ``len(self)`` batches: a rank whose shards run short reads them again."""
        yielded, cycle = 0, 0
        self.budget.start(self.steps * self.per_rank)
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


def _decode_rows(batch: dict[str, np.ndarray], resolution: int) -> dict[str, np.ndarray]:
    """Ray Data task: one evaluation batch's files decoded, an undecodable one's row blank and
    listed (``bad``, counted from the batch's first row) for the embedding to mark, never
    scored (:func:`raycl.data.stream.files.decode_paths`)."""
    from raycl.data.stream.files import decode_paths

    decoded = decode_paths([str(path) for path in batch["paths"][0]], resolution)
    return {"images": decoded.images[None],
            "bad": np.array([json.dumps([int(row) for row in decoded.rows])], dtype=object)}


def decoded_row_batches(images: FileRows, start: int, stop: int, batch_size: int,
                        decoder_cpus: float) -> Iterator[tuple[np.ndarray, list[int]]]:
    """Rows ``start .. stop - 1`` of stream mode's files, ``batch_size`` at a time and in order,
    decoded by Ray Data tasks where training's run (this process's bundle, ``decoder_cpus`` of
    it: ``data.stream_cpus``), each batch with the rows (counted from its first) that could not
    be decoded and are blank: what :func:`raycl.worker.embed.embed_images` reads through
    ``FileRows.decode``, off the training process (no decoding threads of its own)."""
    import ray.data

    starts = range(max(0, start), min(len(images), stop), batch_size)
    rows = [{"paths": [str(path) for path in images.paths[first:min(stop, first + batch_size)]]}
            for first in starts]
    if not rows:
        return
    bundle = decoder_bundle() if decoder_cpus > 0 else None
    _data_context(True, batch_size * 3 * images.resolution ** 2,
                  decoder_cpus if bundle is not None else None)
    dataset = _map_batches(ray.data.from_items(rows, override_num_blocks=len(rows)),
                           _decode_rows, fn_kwargs={"resolution": images.resolution},
                           **decoder_tasks(decoder_cpus, bundle))
    for batch in dataset.iter_batches(batch_size=1, batch_format="numpy",
                                      prefetch_batches=PREFETCH_BATCHES):
        yield np.array(batch["images"][0]), json.loads(str(batch["bad"][0]))


__all__ = ["BUFFERED_BATCHES", "PREFETCH_BATCHES", "FileStreamLoader", "ShardStreamLoader",
           "StreamLoader", "decoded_row_batches", "decoder_bundle", "decoder_tasks"]
