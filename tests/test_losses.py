"""Tests for raycl.losses and raycl.distributed (incl. a 2-process gloo run)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fake_world import run_fake_world
from torch import Tensor

from raycl import distributed
from raycl.losses import (
    high_pass_filter,
    hscl_loss,
    info_nce,
    moco_infonce,
    nt_xent,
    redundancy_reduction_loss,
    same_label_mask,
    sinusoidal_positional_encoding,
    spectral_contrastive_loss,
)

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
    torch.testing.assert_close(spectral_contrastive_loss(z1, z2, mu, divide_by_mu=False),
                               loop_spectral(z1, z2, mu))


def test_spectral_known_value_and_rescaling_rule() -> None:
    identity = torch.eye(2, dtype=torch.float64)
    # Perfect alignment, orthogonal pairs: -2 * 1 + 0.
    assert spectral_contrastive_loss(identity, identity.clone()).item() == pytest.approx(-2.0)
    # Rows longer than sqrt(mu) are projected onto the sphere: scaling them up changes nothing.
    assert spectral_contrastive_loss(5 * identity, 3 * identity).item() == pytest.approx(-2.0)
    # Rows inside the ball are left alone: alignment 0.25 each, cross terms 0.
    assert spectral_contrastive_loss(0.5 * identity, 0.5 * identity).item() == pytest.approx(-0.5)
    # mu sets the radius: norm-3 rows become norm-2 rows for mu = 4 -> -2 * 4.
    assert spectral_contrastive_loss(3 * identity, 3 * identity, mu=4.0,
                                     divide_by_mu=False).item() == pytest.approx(-8.0)


def test_spectral_divide_by_mu_follows_the_authors_code() -> None:
    identity = torch.eye(2, dtype=torch.float64)
    # Norm-3 rows become norm-2 rows at mu = 4: the paper's formula gives -2 * 4 = -8, the
    # authors' code (the default) returns that over mu: -2. At mu = 1 the two agree.
    assert spectral_contrastive_loss(3 * identity, 3 * identity, mu=4.0).item() == pytest.approx(
        -2.0)
    z1, z2 = tiny_pair(batch_size=4, dim=3, seed=3)
    torch.testing.assert_close(spectral_contrastive_loss(z1, z2, mu=1.0),
                               spectral_contrastive_loss(z1, z2, mu=1.0, divide_by_mu=False))
    # HSCL divides the same way, so p = 0 stays Spectral CL at any mu.
    for divide in (True, False):
        torch.testing.assert_close(hscl_loss(z1, z2, 0.0, mu=10.0, divide_by_mu=divide),
                                   spectral_contrastive_loss(z1, z2, mu=10.0, divide_by_mu=divide))
    torch.testing.assert_close(hscl_loss(z1, z2, 0.5, mu=10.0) * 10.0,
                               hscl_loss(z1, z2, 0.5, mu=10.0, divide_by_mu=False))


def test_spectral_validates_arguments() -> None:
    z1, z2 = tiny_pair()
    with pytest.raises(ValueError, match="mu"):
        spectral_contrastive_loss(z1, z2, mu=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        spectral_contrastive_loss(z1[:1], z2[:1])
    with pytest.raises(ValueError, match="same shape"):
        spectral_contrastive_loss(z1, z2[:, :2])


def rescaled(z: Tensor, mu: float = 1.0) -> Tensor:
    norms = z.norm(dim=1, keepdim=True)
    return torch.where(norms > math.sqrt(mu), z * math.sqrt(mu) / norms, z)


def loop_hscl(z1: Tensor, z2: Tensor, weight: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Algorithm 1's loss with an explicit filter matrix, by loops; allowed[i, j] restricts the
    pairs i != j (each anchor averages over its allowed partners)."""
    a, b = rescaled(z1), rescaled(z2)
    size = len(a)
    total = torch.zeros((), dtype=a.dtype)
    for i in range(size):
        partners = [j for j in range(size) if j != i and (allowed is None or allowed[i, j])]
        pair_sum = sum(((a[i] @ b[j]) * ((weight @ a[i]) @ (weight @ b[j])) for j in partners),
                       torch.zeros((), dtype=a.dtype))
        total = total - 2 * (a[i] @ b[i]) + pair_sum / max(1, len(partners))
    return total / size


def paper_filter(z1: Tensor, z2: Tensor, p: float) -> Tensor:
    """W = V g(S^{1/2}) V^T for Bmat = sum z z^T + z' z'^T, no floor (well-conditioned inputs)."""
    a, b = rescaled(z1), rescaled(z2)
    eigenvalues, eigenvectors = torch.linalg.eigh(a.T @ a + b.T @ b)
    return eigenvectors @ torch.diag(eigenvalues.sqrt() ** -p) @ eigenvectors.T


def test_hscl_hand_computed_two_pairs() -> None:
    # Rows (0.8, +-0.6): Bmat = diag(4 * 0.64, 4 * 0.36) = diag(2.56, 1.44), so for p = 0.5
    # W^2 = diag(2.56^-0.5, 1.44^-0.5) = diag(0.625, 0.8333..). Positives align perfectly (-2);
    # the two cross pairs: z^T z' = 0.64 - 0.36 = 0.28, z^T W^2 z' = 0.4 - 0.3 = 0.1.
    z = torch.tensor([[0.8, 0.6], [0.8, -0.6]], dtype=torch.float64)
    torch.testing.assert_close(high_pass_filter(z.T @ z * 2, 0.5, 1e-5),
                               torch.diag(torch.tensor([2.56, 1.44], dtype=torch.float64) ** -0.25))
    assert hscl_loss(z, z.clone(), 0.5).item() == pytest.approx(-2 + 0.28 * 0.1)
    assert spectral_contrastive_loss(z, z.clone()).item() == pytest.approx(-2 + 0.28**2)


def test_hscl_with_p_zero_is_spectral_exactly() -> None:
    z1, z2 = tiny_pair(batch_size=6, dim=4, seed=3)
    mask = same_label_mask(torch.tensor([0, 1, 1, 0, 1, 0]), torch.tensor([0, 1, 1, 0, 1, 0]))
    for negative_mask in (None, mask):
        assert torch.equal(hscl_loss(z1, z2, 0.0, mu=2.0, negative_mask=negative_mask),
                           spectral_contrastive_loss(z1, z2, mu=2.0, negative_mask=negative_mask))
    assert torch.equal(high_pass_filter(torch.randn(4, 4).abs(), 0.0, 1e-5), torch.eye(4))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_hscl_matches_algorithm_1_with_w_held_constant(p: float) -> None:
    """Value and gradients equal Algorithm 1's loss with W computed from the batch and then held
    constant; differentiating through the eigendecomposition would give other gradients."""
    z1, z2 = tiny_pair(batch_size=5, dim=3, seed=11)
    z1, z2 = z1.requires_grad_(), z2.requires_grad_()
    loss = hscl_loss(z1, z2, p)
    grads = torch.autograd.grad(loss, (z1, z2))

    constant_weight = paper_filter(z1.detach(), z2.detach(), p)
    reference = loop_hscl(z1, z2, constant_weight)
    reference_grads = torch.autograd.grad(reference, (z1, z2))
    torch.testing.assert_close(loss, reference)
    for ours, theirs in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(ours, theirs)

    through_w = loop_hscl(z1, z2, paper_filter(z1, z2, p))
    through_grads = torch.autograd.grad(through_w, (z1, z2))
    assert not torch.allclose(through_grads[0], grads[0], atol=1e-6)


def test_high_pass_filter_floor_keeps_a_rank_deficient_bmat_finite() -> None:
    # Two samples in R^4: Bmat has rank 2, two eigenvalues are (numerically) zero.
    z = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0]])
    weight = high_pass_filter(z.T @ z, 0.5, 1e-4)
    assert torch.isfinite(weight).all()
    # Unused directions get the largest gain, capped by the floor: (1e-4 * 1)^-0.25 = 10.
    torch.testing.assert_close(torch.linalg.eigvalsh(weight).max(), torch.tensor(10.0))
    assert torch.isfinite(hscl_loss(z, z.clone(), 0.5, eigenvalue_floor=1e-4))
    with pytest.raises(ValueError, match="filter_exponent"):
        hscl_loss(z, z, -0.1)
    with pytest.raises(ValueError, match="eigenvalue_floor"):
        hscl_loss(z, z, 0.5, eigenvalue_floor=0.0)
    with pytest.raises(ValueError, match="square"):
        high_pass_filter(torch.ones(2, 3), 0.5, 1e-5)


def test_masked_hscl_restricts_pairs_but_keeps_the_global_filter() -> None:
    z1, z2 = tiny_pair(batch_size=6, dim=3, seed=5)
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    mask = same_label_mask(labels, labels)
    weight = paper_filter(z1, z2, 0.3)
    torch.testing.assert_close(hscl_loss(z1, z2, 0.3, negative_mask=mask),
                               loop_hscl(z1, z2, weight, allowed=mask))


def test_masked_spectral_equals_size_weighted_group_losses() -> None:
    z1, z2 = tiny_pair(batch_size=7, dim=3, seed=2)
    labels = torch.tensor([0, 1, 1, 0, 1, 0, 2])  # group 2 is a singleton: no pair term
    masked = spectral_contrastive_loss(z1, z2, negative_mask=same_label_mask(labels, labels))
    expected = torch.zeros((), dtype=torch.float64)
    for code in (0, 1):
        members = labels == code
        group_loss = spectral_contrastive_loss(z1[members], z2[members])
        expected = expected + members.sum() / len(labels) * group_loss
    singleton = rescaled(z1[6:]) @ rescaled(z2[6:]).T
    expected = expected + (-2 * singleton.squeeze()) / len(labels)
    torch.testing.assert_close(masked, expected)


def test_spectral_losses_compute_half_precision_in_float32() -> None:
    z1, z2 = (z.to(torch.bfloat16) for z in tiny_pair(batch_size=4, dim=8, seed=1))
    for loss in (spectral_contrastive_loss(z1, z2), hscl_loss(z1, z2, 0.5)):
        assert loss.dtype == torch.float32 and torch.isfinite(loss)


# ---------------------------------------------------------------- All4One: info_nce


def loop_info_nce(queries: Tensor, keys: Tensor, tau: float) -> Tensor:
    """Eq. 1/2 of All4One by loops: -log(exp(q_i.k_i/tau) / sum_n exp(q_i.k_n/tau)), mean over i
    (differentiable)."""
    q = [row / row.norm() for row in queries]
    k = [row / row.norm() for row in keys]
    total = torch.zeros((), dtype=queries.dtype)
    for i in range(len(q)):
        denominator = sum(torch.exp(q[i] @ k[n] / tau) for n in range(len(k)))
        total = total - torch.log(torch.exp(q[i] @ k[i] / tau) / denominator)
    return total / len(q)


def test_info_nce_hand_computed_two_queries() -> None:
    # q = e1, e2; keys (3, 0) and (2, 2) normalise to e1 and (1, 1)/sqrt 2. With tau = 0.5:
    # query 0 sees its positive at cos 1 and the other key at 1/sqrt 2,
    # query 1 its positive at 1/sqrt 2 and the other key at 0.
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    keys = torch.tensor([[3.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    c = 1 / math.sqrt(2)
    loss_0 = -math.log(math.exp(1 / 0.5) / (math.exp(1 / 0.5) + math.exp(c / 0.5)))
    loss_1 = -math.log(math.exp(c / 0.5) / (math.exp(0 / 0.5) + math.exp(c / 0.5)))
    expected = (loss_0 + loss_1) / 2
    assert info_nce(queries, keys, 0.5).item() == pytest.approx(expected, abs=1e-12)
    # One direction only: swapping queries and keys is another loss.
    assert info_nce(keys, queries, 0.5).item() != pytest.approx(expected, abs=1e-6)
    # Identical keys: every candidate ties with the positive -> log B for any temperature.
    same = torch.ones(3, 4, dtype=torch.float64)
    assert info_nce(torch.randn(3, 4, dtype=torch.float64), same, 0.2).item() == pytest.approx(
        math.log(3)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_info_nce_matches_loop_reference_and_gradients(seed: int, tau: float) -> None:
    q, k = tiny_pair(batch_size=5, dim=3, seed=seed)
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    loss = info_nce(qa, ka, tau)
    loss.backward()
    qb, kb = q.clone().requires_grad_(), k.clone().requires_grad_()
    reference = loop_info_nce(qb, kb, tau)
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(qa.grad, qb.grad)
    torch.testing.assert_close(ka.grad, kb.grad)
    # gather=False is the same thing in a single process.
    torch.testing.assert_close(info_nce(q, k, tau, gather=False), reference.detach())


def test_info_nce_normalises_rows_and_computes_half_precision_in_float32() -> None:
    q, k = tiny_pair(batch_size=4, dim=3, seed=3)
    row_scales = torch.tensor([[0.1], [3.0], [7.5], [0.02]], dtype=torch.float64)
    loss = info_nce(q, k, 0.3)
    torch.testing.assert_close(info_nce(q * row_scales, k * row_scales.flip(0), 0.3), loss)
    half = info_nce(q.to(torch.bfloat16), k.to(torch.bfloat16), 0.3)
    assert half.dtype == torch.float32
    assert half.item() == pytest.approx(loss.item(), rel=2e-2)


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), float("inf")])
def test_info_nce_rejects_bad_temperature(temperature: float) -> None:
    q, k = tiny_pair()
    with pytest.raises(ValueError, match="temperature"):
        info_nce(q, k, temperature)


def test_info_nce_rejects_bad_shapes() -> None:
    q, k = tiny_pair(batch_size=3, dim=4)
    with pytest.raises(ValueError, match="same shape"):
        info_nce(q, k[:2], 0.5)
    with pytest.raises(ValueError, match="same shape"):
        info_nce(q, k[:, :3], 0.5)
    with pytest.raises(ValueError, match="2-D"):
        info_nce(q[0], k[0], 0.5)
    with pytest.raises(ValueError, match="at least one"):
        info_nce(q[:0], k[:0], 0.5)


# ---------------------------------------------------------------- All4One: redundancy reduction


def loop_redundancy_parts(
    target1: Tensor, online2: Tensor, target2: Tensor, online1: Tensor
) -> tuple[Tensor, Tensor]:
    """Eq. 3's two square roots by loops over features i, j (targets detached):
    sqrt(1/(2D) sum_i (1 - cc1_ii)^2 + (1 - cc2_ii)^2) and
    sqrt(1/(2D(D-1)) sum_{i != j} cc1_ij^2 + cc2_ij^2)."""
    batch, dim = target1.shape

    def cross_correlation(target: Tensor, online: Tensor, i: int, j: int) -> Tensor:
        t, o = target.detach()[:, i], online[:, j]
        dot = sum(t[b] * o[b] for b in range(batch))
        return dot / (t.norm() * o.norm())

    on = torch.zeros((), dtype=online1.dtype)
    off = torch.zeros((), dtype=online1.dtype)
    for i in range(dim):
        for j in range(dim):
            cc1 = cross_correlation(target1, online2, i, j)
            cc2 = cross_correlation(target2, online1, i, j)
            if i == j:
                on = on + (1 - cc1) ** 2 + (1 - cc2) ** 2
            else:
                off = off + cc1**2 + cc2**2
    return torch.sqrt(on / (2 * dim)), torch.sqrt(off / (2 * dim * (dim - 1)))


def test_redundancy_hand_computed_two_by_two() -> None:
    # Identical views, features (1, 0) and (1, 1)/sqrt 2 over the batch: CC = [[1, c], [c, 1]]
    # with c = 1/sqrt 2 for both branches, so the on-diagonal sum is 0 and the off-diagonal one is
    # 4 * c^2 = 2 over 2D(D-1) = 4 -> L = 0 + lambda * sqrt(1/2). The on-diagonal square root is
    # clamped at 1e-12 inside, i.e. contributes 1e-6 instead of 0.
    z = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    for weight in (0.0, 0.5, 2.0):
        loss = redundancy_reduction_loss(z, z.clone(), z.clone(), z.clone(), weight)
        assert loss.item() == pytest.approx(weight * math.sqrt(0.5), abs=1e-5)
    # Targets e1, e2 (identity columns) against online features (1, 1)/sqrt 2 and (1, -1)/sqrt 2:
    # CC = [[c, c], [c, -c]]; diagonal (1 - c)^2 + (1 + c)^2 = 2 + 2c^2 = 3 per branch -> 6 / 4;
    # off-diagonal 2 * c^2 = 1 per branch -> 2 / 4.
    target = torch.eye(2, dtype=torch.float64)
    online = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    loss = redundancy_reduction_loss(target, online, target.clone(), online.clone(), 0.5)
    assert loss.item() == pytest.approx(math.sqrt(1.5) + 0.5 * math.sqrt(0.5), abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_redundancy_matches_loop_reference_and_gradients(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    t1, o2, t2, o1 = torch.randn(4, 5, 3, generator=generator, dtype=torch.float64)
    o2a, o1a = o2.clone().requires_grad_(), o1.clone().requires_grad_()
    o2b, o1b = o2.clone().requires_grad_(), o1.clone().requires_grad_()
    on, off = loop_redundancy_parts(t1, o2b, t2, o1b)
    weight = 0.5
    loss = redundancy_reduction_loss(t1, o2a, t2, o1a, weight)
    reference = on + weight * off
    torch.testing.assert_close(loss, reference)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(o2a.grad, o2b.grad)
    torch.testing.assert_close(o1a.grad, o1b.grad)
    # lambda scales the off-diagonal square root only: the loss is affine in lambda.
    for other_weight in (0.0, 1.0, 3.0):
        torch.testing.assert_close(
            redundancy_reduction_loss(t1, o2, t2, o1, other_weight, gather=False),
            on.detach() + other_weight * off.detach(),
        )
    # Feature columns are normalised over the batch: rescaling a feature changes nothing.
    column_scales = torch.tensor([0.2, 5.0, 1.7], dtype=torch.float64)
    torch.testing.assert_close(
        redundancy_reduction_loss(t1 * column_scales, o2, t2, o1 * column_scales, weight),
        loss.detach(),
    )


def test_redundancy_sends_no_gradient_into_the_targets() -> None:
    generator = torch.Generator().manual_seed(4)
    t1, o2, t2, o1 = (
        z.requires_grad_() for z in torch.randn(4, 6, 3, generator=generator, dtype=torch.float64)
    )
    redundancy_reduction_loss(t1, o2, t2, o1).backward()
    assert t1.grad is None and t2.grad is None
    assert o1.grad is not None and o2.grad is not None
    assert o1.grad.abs().sum() > 0 and o2.grad.abs().sum() > 0


def test_redundancy_validates_arguments() -> None:
    z, _ = tiny_pair(batch_size=4, dim=3)
    with pytest.raises(ValueError, match="D >= 2"):
        redundancy_reduction_loss(z[:, :1], z[:, :1], z[:, :1], z[:, :1])
    with pytest.raises(ValueError, match="off_diagonal_weight"):
        redundancy_reduction_loss(z, z, z, z, -0.1)
    with pytest.raises(ValueError, match="off_diagonal_weight"):
        redundancy_reduction_loss(z, z, z, z, float("nan"))
    with pytest.raises(ValueError, match="same shape"):
        redundancy_reduction_loss(z, z, z[:3], z)
    with pytest.raises(ValueError, match="same shape"):
        redundancy_reduction_loss(z, z, z, z[:, :2])


# ---------------------------------------------------------------- positional encoding


@pytest.mark.parametrize("dim", [6, 5])
def test_sinusoidal_positional_encoding_entries(dim: int) -> None:
    encoding = sinusoidal_positional_encoding(4, dim)
    assert encoding.shape == (4, dim) and encoding.dtype == torch.float32
    for position in range(4):
        for i in range((dim + 1) // 2):
            angle = position / 10_000 ** (2 * i / dim)
            assert encoding[position, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            if 2 * i + 1 < dim:
                assert encoding[position, 2 * i + 1].item() == pytest.approx(
                    math.cos(angle), abs=1e-6
                )
    # Position 0 is (0, 1, 0, 1, ...), and the first pair of position 1 is (sin 1, cos 1).
    assert encoding[0, 0::2].eq(0).all() and encoding[0, 1::2].eq(1).all()
    assert encoding[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-7)
    assert encoding[1, 1].item() == pytest.approx(math.cos(1.0), abs=1e-7)


def test_sinusoidal_positional_encoding_rejects_empty() -> None:
    assert sinusoidal_positional_encoding(1, 1).tolist() == [[0.0]]
    with pytest.raises(ValueError, match=">= 1"):
        sinusoidal_positional_encoding(0, 4)
    with pytest.raises(ValueError, match=">= 1"):
        sinusoidal_positional_encoding(3, 0)


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
# Every loss that contrasts against the global batch: (z1, z2, negative_mask) -> loss.
GLOBAL_LOSSES: dict[str, Callable[[Tensor, Tensor, Tensor | None], Tensor]] = {
    "nt_xent": lambda z1, z2, mask: nt_xent(z1, z2, TEMPERATURE, mask),
    "spectral": lambda z1, z2, mask: spectral_contrastive_loss(z1, z2, negative_mask=mask),
    "hscl": lambda z1, z2, mask: hscl_loss(z1, z2, 0.5, negative_mask=mask),
    # All4One's losses take no mask; the redundancy loss gets detached copies as its targets.
    "info_nce": lambda z1, z2, mask: info_nce(z1, z2, TEMPERATURE),
    "redundancy": lambda z1, z2, mask: redundancy_reduction_loss(
        z1.detach(), z2, z2.detach(), z1, 0.5
    ),
}
# Losses that take no negative mask run once ("plain") instead of plain and masked.
MASKLESS_LOSSES = frozenset({"info_nce", "redundancy"})
# Losses that return the global-batch loss itself on every rank rather than a local mean.
GLOBAL_VALUE_LOSSES = frozenset({"redundancy"})


def _mask_variants(loss_name: str) -> tuple[tuple[str, bool], ...]:
    return (("plain", False),) if loss_name in MASKLESS_LOSSES else (
        ("plain", False), ("masked", True))


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
        for loss_name, loss_fn in GLOBAL_LOSSES.items():
            for mask_name, use_mask in _mask_variants(loss_name):
                name = f"{loss_name}_{mask_name}"
                x1 = inputs[0, shard].clone().requires_grad_()
                x2 = inputs[1, shard].clone().requires_grad_()
                shared_weight = weight.clone().requires_grad_()
                mask = None
                if use_mask:
                    mask = same_label_mask(labels[shard], distributed.gather_no_grad(labels[shard]))
                loss = loss_fn(x1 @ shared_weight, x2 @ shared_weight, mask)
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
    """NT-Xent, Spectral CL and HSCL (Bmat all-reduced), plain and masked, and All4One's InfoNCE
    and redundancy loss, on a fake world of 2 gloo processes: losses and gradients equal those of
    the global batch in one process."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2, 6, 5, generator=generator, dtype=torch.float64)  # (views, B, D_in)
    weight = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0, 1, 0])  # both ranks hold both labels

    run_fake_world(_ddp_worker, (f"file://{tmp_path / 'rendezvous'}", inputs, weight, labels,
                                 str(tmp_path)), WORLD_SIZE)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]

    local = inputs.shape[1] // WORLD_SIZE
    for r in range(WORLD_SIZE):
        assert torch.equal(per_rank[r]["gathered_labels"], labels)
        assert per_rank[r]["mean_rank"].item() == pytest.approx(0.5)

    global_mask = same_label_mask(labels, labels)
    cases = [(loss_name, f"{loss_name}_{mask_name}", loss_fn, global_mask if use_mask else None)
             for loss_name, loss_fn in GLOBAL_LOSSES.items()
             for mask_name, use_mask in _mask_variants(loss_name)]
    assert len(cases) == 8
    for loss_name, name, loss_fn, mask in cases:
        x1 = inputs[0].clone().requires_grad_()
        x2 = inputs[1].clone().requires_grad_()
        shared_weight = weight.clone().requires_grad_()
        full_loss = loss_fn(x1 @ shared_weight, x2 @ shared_weight, mask)
        full_loss.backward()

        # Per-rank loss = mean over local anchors, so the rank average is the global mean (the
        # redundancy loss holds the global loss itself on every rank, so its average is too).
        rank_mean = sum(result[f"{name}_loss"] for result in per_rank) / WORLD_SIZE
        torch.testing.assert_close(rank_mean, full_loss.detach())
        if loss_name in GLOBAL_VALUE_LOSSES:
            for result in per_rank:
                torch.testing.assert_close(result[f"{name}_loss"], full_loss.detach())
        # gather_with_grad sums every rank's gradient into the shard owner: local input
        # gradients are world_size x the global-mean gradient (for a global-value loss every
        # rank differentiates the whole loss, and the owner receives world_size copies) ...
        for r, result in enumerate(per_rank):
            shard = slice(r * local, (r + 1) * local)
            torch.testing.assert_close(result[f"{name}_grad_x1"], WORLD_SIZE * x1.grad[shard])
            torch.testing.assert_close(result[f"{name}_grad_x2"], WORLD_SIZE * x2.grad[shard])
            # ... which DDP's averaging over ranks cancels for the parameters.
            torch.testing.assert_close(result[f"{name}_grad_weight"], shared_weight.grad)


def test_float32_losses_ignore_autocast() -> None:
    """Under bf16 autocast (fp16 on CUDA alike) the losses that promise float32 compute exactly
    what they compute without it: autocast would otherwise round every matmul to half
    precision (it moved HSCL's loss by 2 % on this case before autocast was switched off)."""
    generator = torch.Generator().manual_seed(0)
    z1, z2, z3, z4 = (torch.randn(8, 6, generator=generator) for _ in range(4))
    losses: dict[str, Callable[[], Tensor]] = {
        "spectral": lambda: spectral_contrastive_loss(z1, z2),
        "hscl": lambda: hscl_loss(z1, z2, 0.5),
        "info_nce": lambda: info_nce(z1, z2, 0.1),
        "redundancy": lambda: redundancy_reduction_loss(z1, z2, z3, z4, 0.5),
        "moco": lambda: moco_infonce(z1, z2, z3, 0.2),
    }
    for name, loss in losses.items():
        reference = loss()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = loss()
        assert under_autocast.dtype == torch.float32, name
        torch.testing.assert_close(under_autocast, reference, rtol=0, atol=0, msg=name)
