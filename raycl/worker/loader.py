"""Which training images each rank sees, batch by batch: the sampler and the data loader.

Batches index the in-memory uint8 images (no per-sample Python); MCL's pseudo labels group a
stage's batches with :class:`PseudoLabelBatchSampler` (``mcl.negatives: sampler``), otherwise
a shuffled (distributed) sampler splits the global batch over the ranks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from raycl.config.schema import CoreConfig
from raycl.data.samplers import PseudoLabelBatchSampler
from raycl.worker.session import Session
from raycl.worker.stages import StageInputs


class IndexedImages(torch.utils.data.Dataset):
    """Batched indexing into the in-memory uint8 image tensor (no per-sample Python)."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index], index


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
    config: CoreConfig, images: np.ndarray, inputs: StageInputs, session: Session
) -> DataLoader:
    """The loader of one stage over the training ``images``: ``(uint8 images, index)`` batches.

    Raises:
        ValueError: if no full batch fits in an epoch.
    """
    sampler = batch_sampler(config, inputs, len(images), session.rank, session.world_size)
    loader = DataLoader(IndexedImages(torch.from_numpy(images)), batch_sampler=sampler,
                        collate_fn=_as_is, num_workers=config.train.loader_workers,
                        pin_memory=session.device.type == "cuda")
    if len(loader) == 0:
        raise ValueError("no full batch per epoch: lower train.batch_size")
    return loader


def set_sampler_epoch(loader: DataLoader, stage_epoch: int) -> None:
    """Reshuffle for ``stage_epoch`` (the epoch within the stage, over all its phases)."""
    sampler = loader.batch_sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(stage_epoch)
    inner = getattr(sampler, "sampler", None)
    if isinstance(inner, DistributedSampler):
        inner.set_epoch(stage_epoch)


def sampler_metrics(loader: DataLoader) -> dict[str, float]:
    """How the pseudo-label groups filled the epoch's batches (``train/sampler_*``: pure vs
    pooled leftovers vs dropped); empty without MCL's sampler."""
    sampler = loader.batch_sampler
    if not isinstance(sampler, PseudoLabelBatchSampler):
        return {}
    return {f"train/sampler_{key}": float(value) for key, value in sampler.stats().items()}


__all__ = ["IndexedImages", "batch_sampler", "build_loader", "sampler_metrics",
           "set_sampler_epoch"]
