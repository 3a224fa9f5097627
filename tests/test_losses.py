"""Tests for raycl.losses and raycl.distributed (incl. a 2-process gloo run)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor

from raycl import distributed
from raycl.losses import nt_xent, same_label_mask, spectral_contrastive_loss

# ---------------------------------------------------------------- references


def loop_nt_xent(z1: Tensor, z2: Tensor, tau: float, allowed: Tensor | None = None) -> Tensor:
    """NT-Xent with explicit loops over anchors and candidates (differentiable).

    allowed[i, j] (sample level): j may be a negative for anchor sample i.
    """
    batch_size = z1.shape[0]
    views = list(F.normalize(torch.cat([z1, z2]), dim=1))
    total = torch.zeros((), dtype=z1.dtype)
    for anchor in range(2 * batch_size):
        positive = (anchor + batch_size) % (2 * batch_size)
        terms = []
        for candidate in range(2 * batch_size):
            if candidate == anchor:
                continue
            is_allowed = allowed is None or bool(
                allowed[anchor % batch_size, candidate % batch_size]
            )
            if candidate == positive or is_allowed:
                terms.append(views[anchor] @ views[candidate] / tau)
        log_sum_exp = torch.log(sum(torch.exp(term) for term in terms))
        total = total + log_sum_exp - views[anchor] @ views[positive] / tau
    return total / (2 * batch_size)


def lightly_style_nt_xent(z1: Tensor, z2: Tensor, tau: float) -> Tensor:
    """Block formulation: [z1·z2 | z1·z1 without diagonal] rows, cross entropy on the diagonal."""
    batch_size = z1.shape[0]
    z1, z2 = F.normalize(z1, dim=1), F.normalize(z2, dim=1)
    diagonal = torch.eye(batch_size, dtype=torch.bool)
    logits_00 = (z1 @ z1.T / tau)[~diagonal].view(batch_size, -1)
    logits_11 = (z2 @ z2.T / tau)[~diagonal].view(batch_size, -1)
    logits = torch.cat(
        [torch.cat([z1 @ z2.T / tau, logits_00], 1), torch.cat([z2 @ z1.T / tau, logits_11], 1)]
    )
    labels = torch.arange(batch_size).repeat(2)
    return F.cross_entropy(logits, labels)


def solo_style_nt_xent(z1: Tensor, z2: Tensor, tau: float) -> Tensor:
    """Index formulation: exp-similarities summed over positive / negative index masks."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    indexes = torch.arange(z1.shape[0]).repeat(2)[None, :]
    similarity = torch.exp(z @ z.T / tau)
    positive_mask = indexes == indexes.T
    positive_mask.fill_diagonal_(False)
    negative_mask = indexes != indexes.T
    positives = (similarity * positive_mask).sum(1)
    negatives = (similarity * negative_mask).sum(1)
    return -torch.log(positives / (positives + negatives)).mean()


def tiny_pair(batch_size: int = 3, dim: int = 4, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    z1 = torch.randn(batch_size, dim, generator=generator, dtype=torch.float64)
    z2 = torch.randn(batch_size, dim, generator=generator, dtype=torch.float64)
    return z1, z2


# ---------------------------------------------------------------- nt_xent


@pytest.mark.parametrize("tau", [0.1, 0.5, 2.0])
def test_nt_xent_matches_loop_and_library_style_references(tau: float) -> None:
    z1, z2 = tiny_pair()
    loss = nt_xent(z1, z2, tau)
    torch.testing.assert_close(loss, loop_nt_xent(z1, z2, tau))
    torch.testing.assert_close(loss, lightly_style_nt_xent(z1, z2, tau))
    torch.testing.assert_close(loss, solo_style_nt_xent(z1, z2, tau))


def test_nt_xent_hand_computed_two_samples() -> None:
    e1, e2 = torch.eye(2, dtype=torch.float64)
    # Orthogonal samples, identical views: each anchor sees its positive at cos 1 and
    # two negatives at cos 0 -> -log(e^{1/tau} / (e^{1/tau} + 2)).
    z = torch.stack([e1, e2])
    loss = nt_xent(z, z.clone(), temperature=0.5)
    assert loss.item() == pytest.approx(math.log(1 + 2 * math.exp(-2.0)), abs=1e-12)
    # Everything identical: positive and both negatives tie -> log 3 for any temperature.
    same = torch.stack([e1, e1])
    assert nt_xent(same, same.clone(), temperature=0.3).item() == pytest.approx(math.log(3))
    # Scaling the inputs does not matter (cosine similarity).
    assert nt_xent(3 * z, 0.5 * z, temperature=0.5).item() == pytest.approx(loss.item())


def test_nt_xent_all_true_mask_equals_unmasked() -> None:
    z1, z2 = tiny_pair(batch_size=5)
    mask = torch.ones(5, 5, dtype=torch.bool)
    torch.testing.assert_close(nt_xent(z1, z2, 0.5, negative_mask=mask), nt_xent(z1, z2, 0.5))


def test_nt_xent_masked_matches_reference_loss_and_gradients() -> None:
    z1, z2 = tiny_pair(batch_size=4, dim=3, seed=1)
    allowed = torch.tensor(
        [
            [True, False, True, False],
            [False, True, True, True],
            [True, True, True, False],
            [False, True, False, True],
        ]
    )
    z1a, z2a = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    loss = nt_xent(z1a, z2a, 0.5, negative_mask=allowed)
    loss.backward()
    z1b, z2b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    reference = loop_nt_xent(z1b, z2b, 0.5, allowed=allowed)
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(z1a.grad, z1b.grad)
    torch.testing.assert_close(z2a.grad, z2b.grad)
    # ... and the mask really changed something.
    assert not torch.allclose(loss, nt_xent(z1, z2, 0.5))


def test_nt_xent_mask_diagonal_is_ignored() -> None:
    # The anchor itself is always excluded and the positive always kept, whatever the mask says.
    z1, z2 = tiny_pair(batch_size=4)
    mask = torch.rand(4, 4, generator=torch.Generator().manual_seed(3)) > 0.5
    with_diagonal, without_diagonal = mask.clone(), mask.clone()
    with_diagonal.fill_diagonal_(True)
    without_diagonal.fill_diagonal_(False)
    torch.testing.assert_close(
        nt_xent(z1, z2, 0.5, negative_mask=with_diagonal),
        nt_xent(z1, z2, 0.5, negative_mask=without_diagonal),
    )


def test_nt_xent_forbidden_negatives_get_no_gradient() -> None:
    z1, z2 = tiny_pair(batch_size=4, seed=2)
    # Sample 3 is nobody's negative and has no negatives itself: its anchors reduce to
    # log(e^p / e^p) = 0, so nothing in the loss depends on it.
    allowed = torch.ones(4, 4, dtype=torch.bool)
    allowed[3, :] = False
    allowed[:, 3] = False
    z1m, z2m = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    nt_xent(z1m, z2m, 0.5, negative_mask=allowed).backward()
    assert torch.all(z1m.grad[3] == 0) and torch.all(z2m.grad[3] == 0)
    assert torch.all(torch.isfinite(z1m.grad))
    # Unmasked, the same sample does receive gradient, and so the others' gradients differ.
    z1u, z2u = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    nt_xent(z1u, z2u, 0.5).backward()
    assert z1u.grad[3].abs().sum() > 1e-6
    assert not torch.allclose(z1u.grad[:3], z1m.grad[:3])


def test_nt_xent_no_negatives_at_all_is_zero() -> None:
    z1, z2 = tiny_pair(batch_size=3)
    nothing = torch.zeros(3, 3, dtype=torch.bool)
    assert nt_xent(z1, z2, 0.5, negative_mask=nothing).item() == pytest.approx(0.0, abs=1e-12)


def test_nt_xent_permutation_and_view_swap_invariance() -> None:
    z1, z2 = tiny_pair(batch_size=5, seed=4)
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(5)) > 0.4
    permutation = torch.tensor([3, 0, 4, 1, 2])
    loss = nt_xent(z1, z2, 0.2, negative_mask=mask)
    permuted = nt_xent(
        z1[permutation],
        z2[permutation],
        0.2,
        negative_mask=mask[permutation][:, permutation],
    )
    torch.testing.assert_close(loss, permuted)
    torch.testing.assert_close(loss, nt_xent(z2, z1, 0.2, negative_mask=mask))


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), float("inf")])
def test_nt_xent_rejects_bad_temperature(temperature: float) -> None:
    z1, z2 = tiny_pair()
    with pytest.raises(ValueError, match="temperature"):
        nt_xent(z1, z2, temperature)


def test_nt_xent_rejects_bad_shapes_and_masks() -> None:
    z1, z2 = tiny_pair(batch_size=3)
    with pytest.raises(ValueError, match="same shape"):
        nt_xent(z1, z2[:2], 0.5)
    with pytest.raises(ValueError, match="2-D"):
        nt_xent(z1[0], z2[0], 0.5)
    with pytest.raises(ValueError, match=r"negative_mask.*bool"):
        nt_xent(z1, z2, 0.5, negative_mask=torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"negative_mask.*shape"):
        nt_xent(z1, z2, 0.5, negative_mask=torch.ones(3, 6, dtype=torch.bool))


def test_same_label_mask() -> None:
    local = torch.tensor([0, 2])
    global_labels = torch.tensor([0, 2, 2, 1])
    expected = torch.tensor([[True, False, False, False], [False, True, True, False]])
    assert torch.equal(same_label_mask(local, global_labels), expected)
    with pytest.raises(ValueError, match="local_labels"):
        same_label_mask(local[None, :], global_labels)
    with pytest.raises(ValueError, match="global_labels"):
        same_label_mask(local, global_labels[None, :])


def test_masked_loss_equals_loss_over_label_groups() -> None:
    # MCL: the same-label mask on one batch equals the paper's sampler (one group per batch)
    # up to the weighting of groups: per-anchor losses are identical.
    z1, z2 = tiny_pair(batch_size=6, seed=6)
    labels = torch.tensor([0, 1, 0, 1, 1, 0])
    masked = nt_xent(z1, z2, 0.5, negative_mask=same_label_mask(labels, labels))
    per_group = [
        nt_xent(z1[labels == code], z2[labels == code], 0.5) * (labels == code).sum()
        for code in (0, 1)
    ]
    torch.testing.assert_close(masked, sum(per_group) / 6)


# ---------------------------------------------------------------- spectral


def loop_spectral(z1: Tensor, z2: Tensor, mu: float) -> Tensor:
    def rescale(row: Tensor) -> Tensor:
        norm = row.norm()
        return row * math.sqrt(mu) / norm if norm > math.sqrt(mu) else row

    a = [rescale(row) for row in z1]
    b = [rescale(row) for row in z2]
    size = len(a)
    alignment = sum(a[i] @ b[i] for i in range(size)) / size
    uniformity = sum((a[i] @ b[j]) ** 2 for i in range(size) for j in range(size) if i != j) / (
        size * (size - 1)
    )
    return -2 * alignment + uniformity


@pytest.mark.parametrize("mu", [1.0, 4.0])
def test_spectral_matches_loop_reference(mu: float) -> None:
    z1, z2 = tiny_pair(batch_size=4, dim=3, seed=7)
    z1[0] *= 0.1  # one row inside the ball, others (mostly) outside
    torch.testing.assert_close(spectral_contrastive_loss(z1, z2, mu), loop_spectral(z1, z2, mu))


def test_spectral_known_value_and_rescaling_rule() -> None:
    identity = torch.eye(2, dtype=torch.float64)
    # Perfect alignment, orthogonal pairs: -2 * 1 + 0.
    assert spectral_contrastive_loss(identity, identity.clone()).item() == pytest.approx(-2.0)
    # Rows longer than sqrt(mu) are projected onto the sphere: scaling them up changes nothing.
    assert spectral_contrastive_loss(5 * identity, 3 * identity).item() == pytest.approx(-2.0)
    # Rows inside the ball are left alone: alignment 0.25 each, cross terms 0.
    assert spectral_contrastive_loss(0.5 * identity, 0.5 * identity).item() == pytest.approx(-0.5)
    # mu sets the radius: norm-3 rows become norm-2 rows for mu = 4 -> -2 * 4.
    assert spectral_contrastive_loss(3 * identity, 3 * identity, mu=4.0).item() == pytest.approx(
        -8.0
    )


def test_spectral_validates_arguments() -> None:
    z1, z2 = tiny_pair()
    with pytest.raises(ValueError, match="mu"):
        spectral_contrastive_loss(z1, z2, mu=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        spectral_contrastive_loss(z1[:1], z2[:1])
    with pytest.raises(ValueError, match="same shape"):
        spectral_contrastive_loss(z1, z2[:, :2])


# ---------------------------------------------------------------- distributed


def test_helpers_are_identity_without_process_group() -> None:
    assert not distributed.is_distributed()
    assert distributed.world_size() == 1 and distributed.rank() == 0
    t = torch.arange(3.0)
    assert distributed.gather_with_grad(t) is t
    assert distributed.gather_no_grad(t) is t
    assert distributed.all_reduce_mean(t) is t


WORLD_SIZE = 2
TEMPERATURE = 0.5


def _ddp_worker(
    rank: int, init_method: str, inputs: Tensor, weight: Tensor, labels: Tensor, out_dir: str
) -> None:
    """One rank: the loss on its half of the batch through a shared linear 'model'."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    try:
        local = inputs.shape[1] // WORLD_SIZE
        shard = slice(rank * local, (rank + 1) * local)
        results: dict[str, Tensor] = {
            "gathered_labels": distributed.gather_no_grad(labels[shard]),
            "mean_rank": distributed.all_reduce_mean(torch.tensor(float(rank))),
        }
        for name, use_mask in (("plain", False), ("masked", True)):
            x1 = inputs[0, shard].clone().requires_grad_()
            x2 = inputs[1, shard].clone().requires_grad_()
            shared_weight = weight.clone().requires_grad_()
            mask = None
            if use_mask:
                mask = same_label_mask(labels[shard], distributed.gather_no_grad(labels[shard]))
            loss = nt_xent(x1 @ shared_weight, x2 @ shared_weight, TEMPERATURE, mask)
            loss.backward()
            results[f"{name}_loss"] = loss.detach()
            results[f"{name}_grad_x1"] = x1.grad
            results[f"{name}_grad_x2"] = x2.grad
            # What DDP does to parameter gradients: average them over ranks.
            results[f"{name}_grad_weight"] = distributed.all_reduce_mean(shared_weight.grad)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_distributed_loss_and_gradients_match_single_process(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2, 6, 5, generator=generator, dtype=torch.float64)  # (views, B, D_in)
    weight = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0, 1, 0])  # both ranks hold both labels

    context = mp.spawn(
        _ddp_worker,
        args=(f"file://{tmp_path / 'rendezvous'}", inputs, weight, labels, str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=False,
    )
    deadline = time.monotonic() + 60
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("distributed workers did not finish within 60 s")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]

    local = inputs.shape[1] // WORLD_SIZE
    for r in range(WORLD_SIZE):
        assert torch.equal(per_rank[r]["gathered_labels"], labels)
        assert per_rank[r]["mean_rank"].item() == pytest.approx(0.5)

    for name, mask in (("plain", None), ("masked", same_label_mask(labels, labels))):
        x1 = inputs[0].clone().requires_grad_()
        x2 = inputs[1].clone().requires_grad_()
        shared_weight = weight.clone().requires_grad_()
        full_loss = nt_xent(x1 @ shared_weight, x2 @ shared_weight, TEMPERATURE, mask)
        full_loss.backward()

        # Per-rank loss = mean over local anchors, so the rank average is the global mean.
        rank_mean = sum(result[f"{name}_loss"] for result in per_rank) / WORLD_SIZE
        torch.testing.assert_close(rank_mean, full_loss.detach())
        # gather_with_grad sums every rank's gradient into the shard owner: local input
        # gradients are world_size x the global-mean gradient ...
        for r, result in enumerate(per_rank):
            shard = slice(r * local, (r + 1) * local)
            torch.testing.assert_close(result[f"{name}_grad_x1"], WORLD_SIZE * x1.grad[shard])
            torch.testing.assert_close(result[f"{name}_grad_x2"], WORLD_SIZE * x2.grad[shard])
            # ... which DDP's averaging over ranks cancels for the parameters.
            torch.testing.assert_close(result[f"{name}_grad_weight"], shared_weight.grad)
