"""MCL feature-aware batch sampler (paper appendix A.1, Algorithm 1), DDP-aware, and what every
loader that draws a stage's batches with a sampler does with it each epoch (:func:`reshuffle`,
:func:`grouping_metrics`).

Only numpy and torch are imported here so that this module has no dependency on the rest of
`raycl.data`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from raycl.config.metric_names import TRAIN, metric_name


class PseudoLabelBatchSampler(Sampler[list[int]]):
    """Batches whose samples share one pseudo label, cycled round-robin over groups.

    Per epoch (the permutation is seeded by `seed + epoch` and is identical on every rank):

    1. Shuffle each pseudo-label group's indices (groups ordered by label value).
    2. Cut every group into full *global* batches of `batch_size`; each such batch is
       "pure": all its samples carry one pseudo label (Algorithm 1, line 8).
    3. Emit the pure batches round-robin over groups: batch j comes from group j mod C,
       skipping exhausted groups (Algorithm 1, lines 3-7).
    4. Pool every group's remainder (fewer than one batch each), shuffle the pool and
       append it as *mixed* global batches. The masked InfoNCE restricts an anchor's
       negatives to same-label samples of its global batch, so these batches stay
       feature-aware and no sample is systematically excluded. Only the last incomplete
       mixed batch (< batch_size samples, different ones each epoch) is dropped.
    5. Rank r yields the contiguous slice [r * b_local, (r + 1) * b_local) of each global
       batch, b_local = batch_size // num_replicas. All ranks therefore yield the same
       number of batches, no index is served twice per epoch across ranks, a pure global
       batch stays pure on every rank, and gathering the ranks' slices in rank order
       (all_gather) rebuilds exactly the global batch.

    This improves on the authors' public DDP sampler, which drops whatever part of a
    cluster does not fill `batch x world` and seeds every rank differently, so ranks can
    serve overlapping samples within an epoch.

    Use as `DataLoader(dataset, batch_sampler=sampler)` and call `set_epoch` every epoch.

    Args:
        pseudo_labels: 1-D integer array (N,) of pseudo-label codes (any values).
        batch_size: GLOBAL batch size (across all replicas), >= 2.
        num_replicas: number of data-parallel ranks; must divide `batch_size`.
        rank: this process's rank in [0, num_replicas).
        seed: base seed shared by all ranks.
        shuffle: shuffle within groups and the leftover pool; False gives a fixed order
            (indices ascending within each group) for debugging.
    """

    def __init__(
        self,
        pseudo_labels: np.ndarray | torch.Tensor,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if isinstance(pseudo_labels, torch.Tensor):
            pseudo_labels = pseudo_labels.detach().cpu().numpy()
        labels = np.asarray(pseudo_labels)
        if labels.ndim != 1:
            raise ValueError(f"pseudo_labels must be 1-D, got shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"pseudo_labels must be integers, got dtype {labels.dtype}")
        if batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 (contrastive batches), got {batch_size}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if batch_size % num_replicas != 0:
            raise ValueError(
                f"global batch_size={batch_size} must be divisible by num_replicas={num_replicas}"
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        if labels.shape[0] < batch_size:
            raise ValueError(
                f"only {labels.shape[0]} samples: cannot form one batch of {batch_size}"
            )

        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.local_batch_size = batch_size // num_replicas
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

        # Stable sort keeps indices ascending within a group (the shuffle=False order).
        order = np.argsort(labels, kind="stable")
        self.group_labels, starts = np.unique(labels[order], return_index=True)
        self.groups: list[np.ndarray] = np.split(order.astype(np.int64), starts[1:])

        group_counts = np.array([len(group) for group in self.groups], dtype=np.int64)
        self._pure_per_group = group_counts // batch_size
        leftover = int((group_counts % batch_size).sum())
        self._num_pure = int(self._pure_per_group.sum())
        self._num_mixed = leftover // batch_size
        self._num_dropped = leftover % batch_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation `__iter__` yields (same on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        """Number of batches per epoch; identical on every rank and every epoch."""
        return self._num_pure + self._num_mixed

    def stats(self) -> dict[str, int]:
        """Counts for logging (identical on every rank and epoch).

        Returns:
            groups: number of pseudo-label groups; pure_batches: single-label global
            batches; mixed_batches: pooled-leftover global batches; dropped_samples:
            samples left out per epoch (< batch_size); largest_group / smallest_group sizes.
        """
        sizes = [len(group) for group in self.groups]
        return {
            "groups": len(self.groups),
            "pure_batches": self._num_pure,
            "mixed_batches": self._num_mixed,
            "dropped_samples": self._num_dropped,
            "largest_group": max(sizes),
            "smallest_group": min(sizes),
        }

    def global_batches(self) -> list[np.ndarray]:
        """All global batches of the current epoch: pure ones round-robin, then mixed ones.

        Returns:
            List of int64 index arrays, each of length `batch_size`.
        """
        rng = np.random.default_rng(self.seed + self.epoch)
        pure_by_group: list[list[np.ndarray]] = []
        leftovers: list[np.ndarray] = []
        for group in self.groups:
            members = rng.permutation(group) if self.shuffle else group
            num_pure = len(members) // self.batch_size
            cut = num_pure * self.batch_size
            pure_by_group.append(np.split(members[:cut], num_pure) if num_pure else [])
            leftovers.append(members[cut:])

        # Algorithm 1: batch j comes from group j mod C; exhausted groups are skipped.
        batches: list[np.ndarray] = []
        for round_index in range(int(self._pure_per_group.max(initial=0))):
            for group_batches in pure_by_group:
                if round_index < len(group_batches):
                    batches.append(group_batches[round_index])

        pool = np.concatenate(leftovers)
        if self.shuffle:
            pool = rng.permutation(pool)
        for batch_index in range(self._num_mixed):
            start = batch_index * self.batch_size
            batches.append(pool[start : start + self.batch_size])
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        start = self.rank * self.local_batch_size
        stop = start + self.local_batch_size
        for batch in self.global_batches():
            yield batch[start:stop].tolist()


# A stage's batch sampler: MCL's pseudo-label groups, or a shuffled share of the global batch
# (a DistributedSampler over several ranks, a RandomSampler over one).
StageSampler = PseudoLabelBatchSampler | BatchSampler


def reshuffle(sampler: StageSampler, stage_epoch: int) -> None:
    """Seed ``sampler``'s order for ``stage_epoch``: the pseudo-label groups and the distributed
    share are seeded by it; one rank's RandomSampler draws from torch's seed, set per epoch
    (:func:`raycl.worker.epoch.seed_epoch`)."""
    if isinstance(sampler, PseudoLabelBatchSampler):
        sampler.set_epoch(stage_epoch)
    elif isinstance(sampler.sampler, DistributedSampler):
        sampler.sampler.set_epoch(stage_epoch)


def grouping_metrics(sampler: StageSampler) -> dict[str, float]:
    """How the pseudo-label groups filled the epoch's batches (``train/sampler_*``: pure vs
    pooled leftovers vs dropped); empty without MCL's sampler."""
    if not isinstance(sampler, PseudoLabelBatchSampler):
        return {}
    return {metric_name(TRAIN, None, f"sampler_{key}"): float(value)
            for key, value in sampler.stats().items()}


__all__ = ["PseudoLabelBatchSampler", "StageSampler", "grouping_metrics", "reshuffle"]
