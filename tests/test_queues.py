"""Tests for raycl.methods.queues (the support-set FeatureQueue, incl. a 2-process gloo run) and
raycl.models.momentum (EMA copies and their schedule)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fake_world import run_fake_world
from torch import Tensor, nn

from raycl.methods.queues import FeatureQueue, KnnBackend, cosine_topk, queue_buffer_names


def random_rows(rows: int, dim: int, seed: int) -> Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


def arange_index(start: int, count: int) -> Tensor:
    return torch.arange(start, start + count, dtype=torch.long)


# ---------------------------------------------------------------- cosine_topk


@pytest.mark.parametrize("k", [1, 5])
def test_cosine_topk_torch_and_faiss_agree_with_brute_force(k: int) -> None:
    queries = random_rows(7, 16, seed=0)
    keys = F.normalize(random_rows(60, 16, seed=1), dim=1)
    expected = (F.normalize(queries, dim=1) @ keys.T).sort(dim=1, descending=True)
    backends: tuple[KnnBackend, ...] = ("torch", "faiss")
    results = {backend: cosine_topk(queries, keys, k, backend) for backend in backends}
    for backend, (similarities, positions) in results.items():
        assert similarities.shape == positions.shape == (7, k), backend
        assert positions.dtype == torch.int64, backend
        assert torch.equal(positions, expected.indices[:, :k]), backend
        torch.testing.assert_close(similarities, expected.values[:, :k])
    # The default backend gives the same answer.
    default_similarities, default_positions = cosine_topk(queries, keys, k)
    assert torch.equal(default_positions, results["torch"][1])
    torch.testing.assert_close(default_similarities, results["torch"][0])


@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_cosine_topk_normalises_the_queries(backend: KnnBackend) -> None:
    queries = random_rows(4, 8, seed=2)
    keys = F.normalize(random_rows(20, 8, seed=3), dim=1)
    similarities, positions = cosine_topk(queries, keys, 3, backend)
    scaled = queries * torch.tensor([[0.01], [5.0], [120.0], [1.0]])
    scaled_similarities, scaled_positions = cosine_topk(scaled, keys, 3, backend)
    assert torch.equal(positions, scaled_positions)
    torch.testing.assert_close(similarities, scaled_similarities)
    # Similarities are cosines: the query's own direction (a key equal to it) scores 1.
    own_keys = torch.cat([keys, F.normalize(queries[:1], dim=1)])
    top_similarity, top_position = cosine_topk(100 * queries[:1], own_keys, 1, backend)
    assert top_position.item() == 20
    assert top_similarity.item() == pytest.approx(1.0, abs=1e-5)


def test_cosine_topk_validates_arguments() -> None:
    queries, keys = random_rows(2, 4, seed=0), F.normalize(random_rows(5, 4, seed=1), dim=1)
    for k in (0, 6):
        with pytest.raises(ValueError, match="k must be"):
            cosine_topk(queries, keys, k)
    with pytest.raises(ValueError, match="share D"):
        cosine_topk(queries[:, :3], keys, 1)
    with pytest.raises(ValueError, match="share D"):
        cosine_topk(queries[0], keys, 1)
    with pytest.raises(ValueError, match="backend"):
        cosine_topk(queries, keys, 1, "annoy")  # type: ignore[arg-type]


# ---------------------------------------------------------------- FeatureQueue


def test_queue_starts_as_unit_noise_with_no_samples() -> None:
    queue = FeatureQueue(size=10, dim=3)
    assert queue.size == 10
    assert queue.embeddings.shape == (10, 3) and queue.embeddings.dtype == torch.float32
    torch.testing.assert_close(queue.embeddings.norm(dim=1), torch.ones(10))
    assert torch.equal(queue.sample_index, torch.full((10,), -1))
    assert queue.pointer.item() == 0 and queue.fill().item() == 0.0
    for size, dim in ((0, 3), (3, 0)):
        with pytest.raises(ValueError, match=">= 1"):
            FeatureQueue(size, dim)


def test_queue_is_fifo_and_wraps_when_size_is_not_a_multiple_of_the_batch() -> None:
    queue = FeatureQueue(size=10, dim=3)
    batches = [random_rows(4, 3, seed=step) for step in range(3)]
    unit = [F.normalize(batch, dim=1) for batch in batches]

    queue.enqueue(batches[0], arange_index(0, 4))
    assert queue.pointer.item() == 4
    assert queue.sample_index.tolist() == [0, 1, 2, 3, -1, -1, -1, -1, -1, -1]
    torch.testing.assert_close(queue.embeddings[:4], unit[0])
    assert queue.fill().item() == pytest.approx(0.4)

    queue.enqueue(batches[1], arange_index(4, 4))
    assert queue.pointer.item() == 8
    assert queue.sample_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, -1, -1]
    torch.testing.assert_close(queue.embeddings[4:8], unit[1])
    assert queue.fill().item() == pytest.approx(0.8)

    # The third batch fills rows 8, 9 and wraps around onto rows 0, 1 (the oldest entries).
    queue.enqueue(batches[2], arange_index(8, 4))
    assert queue.pointer.item() == 2
    assert queue.sample_index.tolist() == [10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    torch.testing.assert_close(queue.embeddings[8:], unit[2][:2])
    torch.testing.assert_close(queue.embeddings[:2], unit[2][2:])
    torch.testing.assert_close(queue.embeddings[2:4], unit[0][2:])
    torch.testing.assert_close(queue.embeddings[4:8], unit[1])
    assert queue.fill().item() == 1.0


def test_queue_keeps_the_last_rows_of_a_batch_larger_than_itself() -> None:
    queue = FeatureQueue(size=4, dim=3)
    batch = random_rows(6, 3, seed=5)
    queue.enqueue(batch, arange_index(0, 6))
    assert queue.sample_index.tolist() == [2, 3, 4, 5] and queue.pointer.item() == 0
    torch.testing.assert_close(queue.embeddings, F.normalize(batch[2:], dim=1))

    # From a pointer in the middle: the newest 4 rows go in order from the pointer, wrapping.
    queue = FeatureQueue(size=4, dim=3)
    queue.enqueue(random_rows(1, 3, seed=6), arange_index(100, 1))
    queue.enqueue(batch, arange_index(0, 6))
    assert queue.sample_index.tolist() == [5, 2, 3, 4] and queue.pointer.item() == 1
    torch.testing.assert_close(queue.embeddings[1:], F.normalize(batch[2:5], dim=1))
    torch.testing.assert_close(queue.embeddings[0], F.normalize(batch[5], dim=0))


def test_queue_rejects_mismatched_index() -> None:
    queue = FeatureQueue(size=4, dim=3)
    with pytest.raises(ValueError, match="sample indices"):
        queue.enqueue(random_rows(3, 3, seed=0), arange_index(0, 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_queue_stores_unit_float32_rows_for_half_precision_input(dtype: torch.dtype) -> None:
    queue = FeatureQueue(size=5, dim=8)
    batch = (10 * random_rows(3, 8, seed=7)).to(dtype)
    queue.enqueue(batch, arange_index(0, 3))
    assert queue.embeddings.dtype == torch.float32
    torch.testing.assert_close(queue.embeddings.norm(dim=1), torch.ones(5))
    torch.testing.assert_close(queue.embeddings[:3], F.normalize(batch.float(), dim=1))


@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_queue_nearest_returns_the_most_similar_entries_nearest_first(
    backend: KnnBackend,
) -> None:
    queue = FeatureQueue(size=30, dim=6, backend=backend)
    for step in range(3):
        queue.enqueue(random_rows(10, 6, seed=10 + step), arange_index(1000 + 10 * step, 10))
    queries = 3 * random_rows(4, 6, seed=20)
    neighbours, sample_index = queue.nearest(queries, k=4)
    assert neighbours.shape == (4, 4, 6) and sample_index.shape == (4, 4)

    for q in range(4):
        cosines = [float(F.normalize(queries[q], dim=0) @ row) for row in queue.embeddings]
        ranked = sorted(range(30), key=lambda position: -cosines[position])[:4]
        assert sample_index[q].tolist() == [queue.sample_index[p].item() for p in ranked]
        torch.testing.assert_close(neighbours[q], queue.embeddings[ranked])
        returned = [float(F.normalize(queries[q], dim=0) @ row) for row in neighbours[q]]
        assert returned == sorted(returned, reverse=True)
    # Entries are the stored unit rows (no gradient), and an entry equal to a query comes first.
    assert not neighbours.requires_grad
    _, own = queue.nearest(queue.embeddings[7:8] * 2, k=1)
    assert own.item() == queue.sample_index[7].item()


def test_queue_checkpoint_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = FeatureQueue(size=10, dim=3)
    for step in range(3):  # pointer ends at 2 after wrapping
        original.enqueue(random_rows(4, 3, seed=step), arange_index(4 * step, 4))
    torch.save(original.state_dict(), tmp_path / "queue.pt")
    assert set(original.state_dict()) == {"embeddings", "sample_index", "pointer"}

    torch.manual_seed(1)
    restored = FeatureQueue(size=10, dim=3)
    assert not torch.equal(restored.embeddings, original.embeddings)
    restored.load_state_dict(torch.load(tmp_path / "queue.pt", weights_only=True))
    assert torch.equal(restored.embeddings, original.embeddings)
    assert torch.equal(restored.sample_index, original.sample_index)
    assert restored.pointer.item() == original.pointer.item() == 2

    following = random_rows(3, 3, seed=9)
    for queue in (original, restored):
        queue.enqueue(following, arange_index(50, 3))
    assert restored.sample_index.tolist() == [10, 11, 50, 51, 52, 5, 6, 7, 8, 9]
    assert torch.equal(restored.embeddings, original.embeddings)
    assert torch.equal(restored.sample_index, original.sample_index)
    assert restored.pointer.item() == original.pointer.item() == 5


def test_queue_buffer_names_are_fully_qualified_state_dict_keys() -> None:
    class Method(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.projector = nn.Linear(3, 3)
            self.support = nn.ModuleDict({"queue": FeatureQueue(size=4, dim=3)})

    root = nn.Module()
    root.method = Method()
    root.norm = nn.BatchNorm1d(3)
    names = queue_buffer_names(root)
    assert names == ["method.support.queue.embeddings", "method.support.queue.sample_index",
                     "method.support.queue.pointer"]
    assert set(names) <= set(root.state_dict())
    assert "norm.running_mean" not in names
    assert queue_buffer_names(FeatureQueue(size=2, dim=2)) == [
        "embeddings", "sample_index", "pointer"]
    assert queue_buffer_names(nn.Linear(2, 2)) == []


# ---------------------------------------------------------------- FeatureQueue under DDP

WORLD_SIZE = 2
QUEUE_SIZE, QUEUE_DIM, LOCAL_BATCH, STEPS = 11, 3, 2, 4  # global batch 4: wraps at step 3


def _queue_worker(
    rank: int, init_method: str, batches: Tensor, indices: Tensor, out_dir: str
) -> None:
    """One rank: a seeded queue fed this rank's (different) shards, step by step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    try:
        torch.manual_seed(0)
        queue = FeatureQueue(QUEUE_SIZE, QUEUE_DIM)
        for step in range(STEPS):
            queue.enqueue(batches[step, rank], indices[step, rank])
        torch.save(queue.state_dict(), Path(out_dir) / f"queue{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_distributed_queue_is_global_and_identical_on_every_rank(tmp_path: Path) -> None:
    """On a fake world of 2 gloo processes each rank's queue equals a single-process queue fed
    the global batches (rank 0's rows, then rank 1's) at every step."""
    generator = torch.Generator().manual_seed(0)
    batches = torch.randn(STEPS, WORLD_SIZE, LOCAL_BATCH, QUEUE_DIM, generator=generator)
    indices = torch.arange(STEPS * WORLD_SIZE * LOCAL_BATCH).view(STEPS, WORLD_SIZE, LOCAL_BATCH)

    run_fake_world(_queue_worker, (f"file://{tmp_path / 'rendezvous'}", batches, indices,
                                   str(tmp_path)), WORLD_SIZE)
    per_rank = [torch.load(tmp_path / f"queue{r}.pt", weights_only=True)
                for r in range(WORLD_SIZE)]

    torch.manual_seed(0)
    single = FeatureQueue(QUEUE_SIZE, QUEUE_DIM)
    for step in range(STEPS):
        single.enqueue(batches[step].reshape(-1, QUEUE_DIM), indices[step].reshape(-1))
    # 16 global rows into 11 entries: the last 11 samples, the newest (12..15) wrapped to 1..4.
    assert single.sample_index.tolist() == [11, 12, 13, 14, 15, 5, 6, 7, 8, 9, 10]
    assert single.pointer.item() == 5
    for r, state in enumerate(per_rank):
        assert torch.equal(state["sample_index"], single.sample_index), r
        assert torch.equal(state["pointer"], single.pointer), r
        torch.testing.assert_close(state["embeddings"], single.embeddings, rtol=0, atol=1e-7)
    assert torch.equal(per_rank[0]["embeddings"], per_rank[1]["embeddings"])


# ---------------------------------------------------------------- momentum
# raycl.models.momentum is imported inside the tests: importing raycl.models loads torchvision
# (the backbones), which would slow down every spawned queue worker, as they import this file.


def test_momentum_coefficient_follows_a_half_cosine() -> None:
    from raycl.models.momentum import momentum_coefficient

    start, end, total = 0.99, 1.0, 100
    assert momentum_coefficient(0, total, start, end) == pytest.approx(start, abs=1e-15)
    assert momentum_coefficient(total, total, start, end) == pytest.approx(end, abs=1e-15)
    assert momentum_coefficient(total // 2, total, start, end) == pytest.approx((start + end) / 2)
    # A quarter of the way: end - (end - start) * (cos(pi / 4) + 1) / 2.
    quarter = end - (end - start) * (math.cos(math.pi / 4) + 1) / 2
    assert momentum_coefficient(25, total, start, end) == pytest.approx(quarter, abs=1e-15)
    values = [momentum_coefficient(step, total, 0.9, 0.996) for step in range(total + 1)]
    assert all(a < b for a, b in itertools.pairwise(values))
    # Outside [0, total] the schedule is clamped; start == end is a constant.
    assert momentum_coefficient(250, total, start, end) == pytest.approx(end, abs=1e-15)
    assert momentum_coefficient(-5, total, start, end) == pytest.approx(start, abs=1e-15)
    assert momentum_coefficient(40, total, 0.5, 0.5) == 0.5


@pytest.mark.parametrize(("start", "end"), [(-0.1, 0.5), (0.9, 0.8), (0.5, 1.1)])
def test_momentum_coefficient_rejects_bad_bounds(start: float, end: float) -> None:
    from raycl.models.momentum import momentum_coefficient

    with pytest.raises(ValueError, match="start"):
        momentum_coefficient(0, 10, start, end)


def test_ema_update_blends_parameters_exactly_and_leaves_buffers() -> None:
    from raycl.models.momentum import ema_update, momentum_copy

    online = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    target = momentum_copy(online)
    with torch.no_grad():  # dyadic values: c * t + (1 - c) * o is exact in float32
        online[0].weight.copy_(torch.tensor([[1.0, 2.0], [-4.0, 0.5]]))
        online[0].bias.copy_(torch.tensor([8.0, -2.0]))
        target[0].weight.copy_(torch.tensor([[5.0, -2.0], [0.0, 0.25]]))
        target[0].bias.copy_(torch.tensor([0.0, 6.0]))
        online[1].running_mean.fill_(3.0)
    ema_update(online, target, 0.75)
    assert torch.equal(target[0].weight, torch.tensor([[4.0, -1.0], [-1.0, 0.3125]]))
    assert torch.equal(target[0].bias, torch.tensor([2.0, 4.0]))
    # BatchNorm's affine parameters are averaged too (1 and 0 on both sides stay 1 and 0) ...
    assert torch.equal(target[1].weight, torch.ones(2))
    # ... but its statistics are not.
    assert torch.equal(target[1].running_mean, torch.zeros(2))
    # c = 1 freezes the target, c = 0 copies the online network.
    before = target[0].weight.clone()
    ema_update(online, target, 1.0)
    assert torch.equal(target[0].weight, before)
    ema_update(online, target, 0.0)
    assert torch.equal(target[0].weight, online[0].weight)


def test_ema_update_matches_formula_on_random_weights() -> None:
    from raycl.models.momentum import ema_update

    torch.manual_seed(0)
    online, target = nn.Linear(4, 3), nn.Linear(4, 3)
    expected = [0.9 * t.detach() + 0.1 * o.detach()
                for o, t in zip(online.parameters(), target.parameters(), strict=True)]
    ema_update(online, target, 0.9)
    for parameter, value in zip(target.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter, value)


def test_momentum_update_steps_every_pair_at_the_scheduled_coefficient() -> None:
    """The one EMA step MoCo's key encoder and All4One's momentum branch take."""
    from raycl.models.momentum import momentum_coefficient, momentum_copy, momentum_update

    torch.manual_seed(0)
    pairs = [(online, momentum_copy(online)) for online in (nn.Linear(4, 3), nn.Linear(3, 2))]
    for online, _ in pairs:
        with torch.no_grad():
            online.weight.add_(1.0)
    expected = momentum_coefficient(3, 10, 0.9, 1.0)
    before = [target.weight.clone() for _, target in pairs]
    assert momentum_update(pairs, 3, 10, 0.9, 1.0) == expected
    for (online, target), old in zip(pairs, before, strict=True):
        torch.testing.assert_close(target.weight, expected * old + (1 - expected) * online.weight)


def test_momentum_copy_is_a_frozen_independent_copy() -> None:
    from raycl.models.momentum import momentum_copy

    online = nn.Linear(3, 2)
    target = momentum_copy(online)
    assert all(not parameter.requires_grad for parameter in target.parameters())
    assert all(parameter.requires_grad for parameter in online.parameters())
    assert torch.equal(target.weight, online.weight)
    assert target.weight.data_ptr() != online.weight.data_ptr()
    with torch.no_grad():
        online.weight.add_(1.0)
    assert not torch.equal(target.weight, online.weight)
    # Training the online network leaves the copy without gradients.
    online(torch.ones(1, 3)).sum().backward()
    assert online.weight.grad is not None and target.weight.grad is None


def test_filled_is_a_host_counted_slice_equal_to_the_mask_selection() -> None:
    """``filled()`` (FGVR's bank, read every step) equals the rows whose index is >= 0, before
    the queue is full, when it wraps and after a state-dict load, as a slice by a host-side
    count: a view of the storage (a boolean mask would copy, and on CUDA sync every step)."""
    queue = FeatureQueue(size=10, dim=3, normalize=False)
    restored = FeatureQueue(size=10, dim=3, normalize=False)
    assert queue.filled().shape == (0, 3)
    for step in range(4):  # 4, 8, then wrapping: full
        queue.enqueue(random_rows(4, 3, seed=step), arange_index(4 * step, 4))
        bank = queue.filled()
        assert torch.equal(bank, queue.embeddings[queue.sample_index >= 0])
        assert bank.data_ptr() == queue.embeddings.data_ptr()  # a view, no masked copy
        if step == 0:
            restored.load_state_dict(queue.state_dict())
            assert torch.equal(restored.filled(), bank)  # counted once from the indices
            restored.enqueue(random_rows(4, 3, seed=1), arange_index(4, 4))
    queue.load_state_dict(queue.state_dict())
    assert queue.filled().shape == (10, 3)
    assert torch.equal(restored.filled(), restored.embeddings[restored.sample_index >= 0])
    assert restored.filled().shape == (8, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_filled_does_not_sync_on_cuda() -> None:
    queue = FeatureQueue(size=64, dim=8, normalize=False).cuda()
    queue.enqueue(torch.randn(16, 8, device="cuda"), torch.arange(16, device="cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert queue.filled().shape == (16, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
