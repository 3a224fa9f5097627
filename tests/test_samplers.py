"""Tests for the MCL feature-aware batch sampler (Algorithm 1 + leftover pooling + DDP)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raycl.worker.samplers import PseudoLabelBatchSampler


def _labels(sizes: list[int], seed: int = 0) -> np.ndarray:
    """Pseudo labels with the given group sizes (group g gets label 10*g), shuffled."""
    labels = np.concatenate([np.full(size, 10 * group) for group, size in enumerate(sizes)])
    return np.random.default_rng(seed).permutation(labels).astype(np.int64)


def _epoch(sampler: PseudoLabelBatchSampler) -> list[list[int]]:
    return list(iter(sampler))


# Group sizes chosen so that groups have 3, 1, 0 and 2 full batches of 12 plus leftovers.
SIZES = [41, 17, 5, 30]
BATCH = 12


def test_every_index_once_up_to_dropped() -> None:
    labels = _labels(SIZES)
    sampler = PseudoLabelBatchSampler(labels, batch_size=BATCH, seed=1)
    batches = _epoch(sampler)
    served = [index for batch in batches for index in batch]
    assert len(served) == len(set(served)), "an index was served twice in one epoch"
    stats = sampler.stats()
    # Full batches: 3 + 1 + 0 + 2 = 6; leftovers 5 + 5 + 5 + 6 = 21 -> 1 mixed, 9 dropped.
    assert stats["pure_batches"] == 6
    assert stats["mixed_batches"] == 1
    assert stats["dropped_samples"] == 9
    assert stats["groups"] == 4
    assert len(sampler) == 7 == len(batches)
    assert all(len(batch) == BATCH for batch in batches)
    assert len(labels) - len(served) == stats["dropped_samples"] < BATCH
    # Dropped samples differ between epochs, so nobody is excluded systematically.
    sampler.set_epoch(1)
    served_next = {index for batch in _epoch(sampler) for index in batch}
    assert set(range(len(labels))) - set(served) != set(range(len(labels))) - served_next


def test_pure_batches_then_mixed_tail_round_robin() -> None:
    labels = _labels(SIZES)
    sampler = PseudoLabelBatchSampler(labels, batch_size=BATCH, seed=2)
    batches = _epoch(sampler)
    num_pure = sampler.stats()["pure_batches"]
    batch_labels = [set(labels[batch].tolist()) for batch in batches]
    assert all(len(unique) == 1 for unique in batch_labels[:num_pure])
    # Algorithm 1 round-robin: group j mod C, skipping exhausted ones. Full batches per
    # group (labels 0, 10, 20, 30) are 3, 1, 0, 2 -> 0, 10, 30, 0, 30, 0.
    pure_order = [unique.pop() for unique in batch_labels[:num_pure]]
    assert pure_order == [0, 10, 30, 0, 30, 0]
    # The tail batch pools leftovers of several groups.
    assert len(batch_labels[num_pure]) > 1


def test_masked_loss_view_pure_batches_need_no_mask() -> None:
    """An anchor's negatives are the same-label samples of its global batch.

    In a pure batch every other sample has the anchor's label, so the same-label mask used
    by the masked InfoNCE is all True there (masking changes nothing); in a mixed batch the
    mask is what keeps negatives feature-aware.
    """
    labels = _labels(SIZES)
    sampler = PseudoLabelBatchSampler(labels, batch_size=BATCH, seed=3)
    batches = sampler.global_batches()
    num_pure = sampler.stats()["pure_batches"]
    for position, batch in enumerate(batches):
        batch_labels = torch.as_tensor(labels[batch])
        same_label = batch_labels[:, None] == batch_labels[None, :]
        if position < num_pure:
            assert bool(same_label.all())
        else:
            assert not bool(same_label.all())


def test_single_group_is_plain_shuffled_batching() -> None:
    labels = np.zeros(50, dtype=np.int64)  # stage 0: one group
    sampler = PseudoLabelBatchSampler(labels, batch_size=16, seed=0)
    stats = sampler.stats()
    assert (stats["pure_batches"], stats["mixed_batches"], stats["dropped_samples"]) == (3, 0, 2)
    served = [index for batch in _epoch(sampler) for index in batch]
    assert len(set(served)) == 48
    assert served != sorted(served)  # shuffled


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fake_ddp_ranks_partition_the_global_epoch(world_size: int) -> None:
    labels = _labels(SIZES, seed=world_size)
    batch = 12  # divisible by 2, 3 and 4
    reference = PseudoLabelBatchSampler(labels, batch_size=batch, seed=7)
    samplers = [
        PseudoLabelBatchSampler(
            labels, batch_size=batch, num_replicas=world_size, rank=rank, seed=7
        )
        for rank in range(world_size)
    ]
    for epoch in (0, 1):
        reference.set_epoch(epoch)
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [_epoch(sampler) for sampler in samplers]
        assert len({len(batches) for batches in per_rank}) == 1
        assert all(len(batches) == len(samplers[0]) == len(reference) for batches in per_rank)
        assert all(len(b) == batch // world_size for batches in per_rank for b in batches)
        served = [[index for b in batches for index in b] for batches in per_rank]
        for first in range(world_size):
            for second in range(first + 1, world_size):
                assert not set(served[first]) & set(served[second])
        # Concatenating the ranks' slices in rank order (= all_gather) rebuilds each
        # global batch of the single-process sampler, so purity survives sharding.
        reference_batches = _epoch(reference)
        for step, global_batch in enumerate(reference_batches):
            gathered = [index for rank in range(world_size) for index in per_rank[rank][step]]
            assert gathered == global_batch
        union = {index for indices in served for index in indices}
        assert union == {index for b in reference_batches for index in b}


def test_set_epoch_is_deterministic_and_changes_order() -> None:
    labels = _labels(SIZES)
    first = PseudoLabelBatchSampler(labels, batch_size=BATCH, seed=5)
    second = PseudoLabelBatchSampler(labels, batch_size=BATCH, seed=5)
    epoch0 = _epoch(first)
    assert epoch0 == _epoch(first)  # re-iterating without set_epoch repeats the epoch
    first.set_epoch(1)
    second.set_epoch(1)
    epoch1 = _epoch(first)
    assert epoch1 == _epoch(second)
    assert epoch1 != epoch0
    other_seed = PseudoLabelBatchSampler(labels, batch_size=BATCH, seed=6)
    assert _epoch(other_seed) != epoch0


def test_shuffle_false_is_fixed_and_sorted_within_groups() -> None:
    labels = _labels(SIZES)
    sampler = PseudoLabelBatchSampler(labels, batch_size=BATCH, shuffle=False)
    epoch0 = _epoch(sampler)
    sampler.set_epoch(3)
    assert _epoch(sampler) == epoch0
    assert epoch0[0] == sorted(epoch0[0])


def test_works_as_dataloader_batch_sampler() -> None:
    labels = _labels(SIZES)
    dataset = TensorDataset(torch.arange(len(labels)))
    sampler = PseudoLabelBatchSampler(labels, batch_size=BATCH, num_replicas=2, rank=1)
    loader = DataLoader(dataset, batch_sampler=sampler)
    batches = [indices.tolist() for (indices,) in loader]
    assert len(batches) == len(loader) == len(sampler)
    assert batches == _epoch(sampler)


def test_validation() -> None:
    labels = _labels(SIZES)
    with pytest.raises(ValueError, match="1-D"):
        PseudoLabelBatchSampler(labels[:92].reshape(2, -1), batch_size=BATCH)
    with pytest.raises(ValueError, match="integers"):
        PseudoLabelBatchSampler(labels.astype(float), batch_size=BATCH)
    with pytest.raises(ValueError, match="batch_size"):
        PseudoLabelBatchSampler(labels, batch_size=1)
    with pytest.raises(ValueError, match="divisible"):
        PseudoLabelBatchSampler(labels, batch_size=10, num_replicas=3)
    with pytest.raises(ValueError, match="rank"):
        PseudoLabelBatchSampler(labels, batch_size=BATCH, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="cannot form"):
        PseudoLabelBatchSampler(labels[:5], batch_size=BATCH)


def test_accepts_tensor_labels_and_reports_group_extremes() -> None:
    labels = _labels(SIZES)
    sampler = PseudoLabelBatchSampler(torch.as_tensor(labels), batch_size=BATCH)
    stats = sampler.stats()
    assert (stats["largest_group"], stats["smallest_group"]) == (41, 5)
    counts = Counter(labels[[i for b in _epoch(sampler) for i in b]].tolist())
    assert counts[0] >= 36  # at least group 0's three full batches
