"""Which training images each rank sees, batch by batch: the sampler and the data loader.

Batches index the uint8 training images (no per-sample Python): a view into the node's
memory-mapped cache, read a batch's rows at a time, or (``data.on_device``) one tensor on the
GPU that batches are gathered from there. The training images are ``train`` followed by
``pretrain_extra`` when the dataset has unlabelled pretraining images (STL-10's unlabeled
split). MCL's pseudo labels group a stage's batches with :class:`PseudoLabelBatchSampler`
(``mcl.negatives: sampler``), otherwise a shuffled (distributed) sampler splits the global batch
over the ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, ImageRows
from raycl.data.stream.files import FileRows
from raycl.data.stream.shards import ShardRows
from raycl.methods import method_class
from raycl.worker.resident import training_images
from raycl.worker.samplers import PseudoLabelBatchSampler
from raycl.worker.stage_integration import StageInputs
from raycl.worker.stream_loader import StreamLoader

if TYPE_CHECKING:  # the loader itself needs no Ray
    from raycl.worker.session import Session

# What a loader indexes: host rows (an array or a view into the memory-mapped cache) or one
# tensor on the device.
TrainImages = np.ndarray | ImageRows | torch.Tensor | FileRows | ShardRows


class IndexedImages(torch.utils.data.Dataset):
    """Batched indexing into the uint8 training images (no per-sample Python): a batch reads
    only its rows, from the memory map on the host or from a tensor on the device."""

    def __init__(self, images: TrainImages) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.images, torch.Tensor):
            index = torch.as_tensor(indices, dtype=torch.long, device=self.images.device)
            return self.images[index], index
        rows = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.images[rows])), torch.from_numpy(rows)


def trial_training_images(
    config: CoreConfig, data: DatasetSplits, device: torch.device
) -> TrainImages:
    """The images this trial pretrains on (train, then ``pretrain_extra``), on ``device`` when
    ``data.on_device`` says so (:mod:`raycl.worker.resident`); built once per trial.

    Raises:
        ValueError: the dataset has pretraining-only images and the trial cannot use them:
            stages' pseudo labels (MCL) and captions cover ``train`` only.
    """
    if data.pretrain_extra is not None:
        # Checked before launch too (config.checks.check_pretrain_unlabeled); here for a
        # config that bypassed the checks.
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
    return training_images(data, config.data.on_device, device)


def batch_sampler(
    config: CoreConfig, inputs: StageInputs, num_samples: int, rank: int, world: int
) -> PseudoLabelBatchSampler | BatchSampler:
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


def _as_is(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The collate function: :meth:`IndexedImages.__getitems__` already returns a batch."""
    return batch


def build_loader(
    config: CoreConfig, images: TrainImages, inputs: StageInputs, session: Session,
    placement_group: str | None = None, need_captions: bool = False,
) -> DataLoader | StreamLoader:
    """The loader of one stage over the training ``images`` (:func:`trial_training_images`):
    ``(uint8 images, index)`` batches. Images on the device are gathered there, in the
    training process (no worker processes, nothing to pin). Stream mode's files and shards
    are decoded by Ray Data (:class:`~raycl.worker.stream_loader.StreamLoader`; its decoders in
    ``placement_group`` when the trial reserved CPUs for them; shards yield the batch's
    captions third, samples without one skipped when ``need_captions``).

    Raises:
        ValueError: if no full batch fits in an epoch.
    """
    if isinstance(images, FileRows | ShardRows):
        sampler = (batch_sampler(config, inputs, len(images), session.rank, session.world_size)
                   if isinstance(images, FileRows) else None)
        stream = StreamLoader(config, images, inputs, session.rank, session.world_size,
                              placement_group, need_captions, sampler)
        if len(stream) == 0:
            raise ValueError("no full batch per epoch: lower train.batch_size")
        return stream
    sampler = batch_sampler(config, inputs, len(images), session.rank, session.world_size)
    on_device = isinstance(images, torch.Tensor) and images.device.type != "cpu"
    loader = DataLoader(IndexedImages(images), batch_sampler=sampler, collate_fn=_as_is,
                        num_workers=0 if on_device else config.train.loader_workers,
                        pin_memory=session.device.type == "cuda" and not on_device)
    if len(loader) == 0:
        raise ValueError("no full batch per epoch: lower train.batch_size")
    return loader


def set_sampler_epoch(loader: DataLoader | StreamLoader, stage_epoch: int) -> None:
    """Reshuffle for ``stage_epoch`` (the epoch within the stage, over all its phases)."""
    if isinstance(loader, StreamLoader):
        loader.epoch = stage_epoch  # seeds a shard epoch's order (files: the sampler's below)
    sampler = loader.batch_sampler  # None for shards
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(stage_epoch)
    inner = getattr(sampler, "sampler", None)
    if isinstance(inner, DistributedSampler):
        inner.set_epoch(stage_epoch)


def sampler_metrics(loader: DataLoader | StreamLoader) -> dict[str, float]:
    """How the pseudo-label groups filled the epoch's batches (``train/sampler_*``: pure vs
    pooled leftovers vs dropped; empty without MCL's sampler), and in stream mode the samples
    skipped as undecodable (``data/skipped``)."""
    metrics = loader.pop_metrics() if isinstance(loader, StreamLoader) else {}
    sampler = loader.batch_sampler
    if isinstance(sampler, PseudoLabelBatchSampler):
        metrics.update({f"train/sampler_{key}": float(value)
                        for key, value in sampler.stats().items()})
    return metrics


__all__ = ["IndexedImages", "TrainImages", "batch_sampler", "build_loader", "sampler_metrics",
           "set_sampler_epoch", "trial_training_images"]
