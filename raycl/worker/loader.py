"""Which training images each rank sees, batch by batch: the kind of loader a trial reads them
with, its sampler, and each stage's loader.

``data.loader`` arrives settled (the launch resolved ``auto``:
:func:`raycl.sweep.run.settle_loader`); :func:`trial_training_images`, once per trial, turns it into
one of four kinds, each a small record that builds its stage's
:class:`~raycl.worker.batches.TrainLoader`:

- :class:`HostImages` (``memory``): the uint8 training images in host memory, a view into the
  node's memory-mapped cache read a batch's rows at a time in DataLoader workers;
- :class:`DeviceImages` (``memory`` and ``data.on_device``: :mod:`raycl.worker.resident`): one
  tensor on the GPU that batches are gathered from there;
- :class:`StreamedFiles` and :class:`StreamedShards` (``stream``): image files or shards decoded
  batch by batch by Ray Data (:mod:`raycl.worker.stream_loader`).

Every kind yields :class:`~raycl.worker.batches.TrainBatch` records; nothing after the choice
looks at what the images are. The training images are ``train`` followed by ``pretrain_extra``
when the dataset has unlabelled pretraining images (STL-10's unlabeled split). MCL's pseudo
labels group a stage's batches with :class:`PseudoLabelBatchSampler` (``mcl.negatives:
sampler``), otherwise a shuffled (distributed) sampler splits the global batch over the ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, ImageRows
from raycl.data.load import settled_loader
from raycl.data.registry import streamed_only
from raycl.data.stream.files import FileRows
from raycl.data.stream.shards import ShardRows
from raycl.methods import method_class
from raycl.worker.batches import TrainBatch, TrainLoader
from raycl.worker.resident import copy_to_device, keep_on_device, pretraining_images
from raycl.worker.samplers import PseudoLabelBatchSampler, StageSampler, grouping_metrics, reshuffle
from raycl.worker.stage_integration import StageInputs
from raycl.worker.stream_loader import FileStreamLoader, ShardStreamLoader

if TYPE_CHECKING:  # the loader itself needs no Ray
    from raycl.worker.session import Session

_Rows = TypeVar("_Rows", FileRows, ShardRows)


class IndexedImages(torch.utils.data.Dataset):
    """Batched indexing into uint8 images in host memory (no per-sample Python): a batch reads
    only its rows from the memory map (or an array, or stream mode's files when indexed)."""

    def __init__(self, images: np.ndarray | ImageRows) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.images[rows])), torch.from_numpy(rows)


class ResidentImages(torch.utils.data.Dataset):
    """Batched indexing into one uint8 tensor on the device: a batch is gathered there."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = device_index(indices, self.images.device)
        return self.images[index], index


def device_index(indices: list[int], device: torch.device) -> torch.Tensor:
    """The sampler's ``indices`` as an int64 tensor on ``device``, without stalling the host: on
    CUDA they go through pinned memory with a non-blocking copy queued on the current stream
    (``torch.as_tensor(..., device=cuda)`` copies from pageable memory and waits for it, every
    step, so the next batch is never prepared while the GPU still works on this one)."""
    index = torch.tensor(indices, dtype=torch.long)
    if device.type == "cuda":
        index = index.pin_memory()
    return index.to(device, non_blocking=True)


def _as_is(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The collate function: ``__getitems__`` already returns a batch."""
    return batch


class IndexedLoader:
    """The loader of the memory and on-device kinds: the stage's sampler's batches, indexed in
    one go by a DataLoader (``workers`` processes; none on the device, where nothing is pinned).
    """

    def __init__(self, dataset: IndexedImages | ResidentImages, sampler: StageSampler,
                 workers: int, pin: bool) -> None:
        self.batch_sampler = sampler
        self._loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=_as_is,
                                  num_workers=workers, pin_memory=pin)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[TrainBatch]:
        for images, index in self._loader:
            yield TrainBatch(images, index)

    def set_epoch(self, stage_epoch: int) -> None:
        reshuffle(self.batch_sampler, stage_epoch)

    def pop_metrics(self) -> dict[str, float]:
        return grouping_metrics(self.batch_sampler)


def batch_sampler(
    config: CoreConfig, inputs: StageInputs, num_samples: int, rank: int, world: int
) -> StageSampler:
    """This rank's batches of stage ``inputs.stage``: pseudo-label groups (MCL's sampler
    negatives) or a shuffled share of ``train.batch_size // world`` samples, seeded by stage."""
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


@dataclass(frozen=True)
class HostImages:
    """``data.loader: memory``: the training images in host memory (the memory map's rows).

    Every kind's ``loader`` builds a stage's loader from the config, the stage's ``inputs``,
    this rank's ``session``, the trial's ``placement_group`` holding stream mode's decoders (or
    None) and whether an image-text method ``need_captions`` (shards: samples without one are
    skipped, each batch carries its captions); a kind ignores what it has no use for.
    """

    images: np.ndarray | ImageRows

    def loader(self, config: CoreConfig, inputs: StageInputs, session: Session,
               placement_group: str | None, need_captions: bool) -> TrainLoader:
        sampler = batch_sampler(config, inputs, len(self.images), session.rank,
                                session.world_size)
        return IndexedLoader(IndexedImages(self.images), sampler, config.train.loader_workers,
                             pin=session.device.type == "cuda")


@dataclass(frozen=True)
class DeviceImages:
    """``data.loader: memory`` with ``data.on_device``: the training images on the device, in
    the training process (no worker processes, nothing to pin)."""

    images: torch.Tensor

    def loader(self, config: CoreConfig, inputs: StageInputs, session: Session,
               placement_group: str | None, need_captions: bool) -> TrainLoader:
        sampler = batch_sampler(config, inputs, len(self.images), session.rank,
                                session.world_size)
        return IndexedLoader(ResidentImages(self.images), sampler, workers=0, pin=False)


@dataclass(frozen=True)
class StreamedFiles:
    """``data.loader: stream`` over image files, in the order the memory-mode sampler draws."""

    images: FileRows

    def loader(self, config: CoreConfig, inputs: StageInputs, session: Session,
               placement_group: str | None, need_captions: bool) -> TrainLoader:
        sampler = batch_sampler(config, inputs, len(self.images), session.rank,
                                session.world_size)
        return FileStreamLoader(config, self.images, inputs, session.rank, session.world_size,
                                sampler, placement_group)


@dataclass(frozen=True)
class StreamedShards:
    """``data.loader: stream`` over shards (streamed only), read in sequence."""

    images: ShardRows

    def loader(self, config: CoreConfig, inputs: StageInputs, session: Session,
               placement_group: str | None, need_captions: bool) -> TrainLoader:
        # Image-text methods' captions are tokenised by the decoders, not every step here.
        tokenizer = method_class(config).caption_tokenizer(config) if need_captions else None
        return ShardStreamLoader(config, self.images, inputs, session.rank, session.world_size,
                                 placement_group, need_captions, tokenizer)


# What a trial pretrains on, as the kind of loader that reads it.
TrainImages = HostImages | DeviceImages | StreamedFiles | StreamedShards


def trial_training_images(
    config: CoreConfig, data: DatasetSplits, device: torch.device
) -> TrainImages:
    """The images this trial pretrains on (train, then ``pretrain_extra``) as the kind of loader
    that reads them, chosen here once per trial: ``data.loader`` as the launch settled it
    (:func:`raycl.data.load.settled_loader`; the trial's config carries it), the dataset's way
    of streaming, and ``data.on_device`` on ``device`` (:mod:`raycl.worker.resident`).

    Raises:
        ValueError: the dataset has pretraining-only images and the trial cannot use them:
            stages' pseudo labels (MCL) and captions cover ``train`` only.
    """
    _check_pretraining_only(config, data)
    if settled_loader(config.data) == "stream":
        if streamed_only(config.data.dataset):
            return StreamedShards(_loaded_as(data.train.images, ShardRows))
        return StreamedFiles(_streamed_files(data))
    images = pretraining_images(data)
    if keep_on_device(config.data.on_device, int(images.nbytes), device,
                      config.scaling.gpus_per_worker):
        return DeviceImages(copy_to_device(images, device))
    return HostImages(images)


def _check_pretraining_only(config: CoreConfig, data: DatasetSplits) -> None:
    """Refuse pretraining-only images a trial cannot use (see :func:`trial_training_images`)."""
    if data.pretrain_extra is None:
        return
    # Checked before launch too (launch.checks.check_pretrain_unlabeled); here for a config
    # that bypassed the checks.
    if config.num_stages > 1:
        raise ValueError(
            f"data.pretrain_unlabeled: the stages' pseudo labels cover only the labelled "
            f"training images of {data.name}, not its unlabelled pretraining ones; set "
            f"data.pretrain_unlabeled: false")
    if method_class(config).multimodal and data.train.captions is not None:
        raise ValueError(
            f"data.pretrain_unlabeled: the unlabelled pretraining images of {data.name} "
            f"have no captions for method {config.method}; set "
            f"data.pretrain_unlabeled: false")


def _streamed_files(data: DatasetSplits) -> FileRows:
    """Stream mode's training files: train's, then ``pretrain_extra``'s."""
    files = _loaded_as(data.train.images, FileRows)
    if data.pretrain_extra is None:
        return files
    return files.concat(_loaded_as(data.pretrain_extra.images, FileRows))


def _loaded_as(images: object, kind: type[_Rows]) -> _Rows:
    """``images`` as the settled ``data.loader`` had :func:`raycl.data.load_dataset` read them;
    a guard against data loaded under another setting than the trial's."""
    if not isinstance(images, kind):
        raise TypeError(f"data.loader: stream expects the training images as {kind.__name__}, "
                        f"got {type(images).__name__} (data loaded with another data.loader)")
    return images


def build_loader(
    config: CoreConfig, images: TrainImages, inputs: StageInputs, session: Session,
    placement_group: str | None = None, need_captions: bool = False,
) -> TrainLoader:
    """The loader of one stage over the trial's training ``images``
    (:func:`trial_training_images`), of their kind: :class:`~raycl.worker.batches.TrainBatch`
    records. Stream mode's decoders run in ``placement_group`` when the trial reserved CPUs for
    them; shards carry each batch's captions, samples without one skipped, when
    ``need_captions``.

    Raises:
        ValueError: if no full batch fits in an epoch.
    """
    loader = images.loader(config, inputs, session, placement_group, need_captions)
    if len(loader) == 0:
        raise ValueError("no full batch per epoch: lower train.batch_size")
    return loader


__all__ = ["DeviceImages", "HostImages", "IndexedImages", "IndexedLoader", "ResidentImages",
           "StreamedFiles", "StreamedShards", "TrainImages", "batch_sampler", "build_loader",
           "trial_training_images"]
