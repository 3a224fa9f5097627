"""The spectral family: Spectral Contrastive Loss (HaoChen et al.) and HSCL's high-pass filtered
version of it."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from raycl.distributed import all_reduce_sum, gather_with_grad, rank
from raycl.losses.common import at_least_float32, check_mask, check_pair, full_precision


def _rescale_to_ball(z: Tensor, radius: float) -> Tensor:
    """Shrinks rows whose L2 norm exceeds ``radius`` onto the sphere of that radius."""
    norms = z.norm(dim=1, keepdim=True)
    # clamp_min keeps the gradient finite for all-zero rows (scale is clamped to 1 there anyway)
    scale = (radius / norms.clamp_min(1e-12)).clamp(max=1.0)
    return z * scale


def check_filter_args(filter_exponent: float, eigenvalue_floor: float) -> None:
    """Raises ValueError unless p >= 0 (finite) and the relative floor is in (0, 1)."""
    if not (math.isfinite(filter_exponent) and filter_exponent >= 0):
        raise ValueError(f"filter_exponent must be a finite number >= 0, got {filter_exponent}")
    if not 0 < eigenvalue_floor < 1:
        raise ValueError(f"eigenvalue_floor must be in (0, 1), got {eigenvalue_floor}")


def high_pass_filter(bmat: Tensor, filter_exponent: float, eigenvalue_floor: float) -> Tensor:
    """HSCL's filter ``W = V g(S^{1/2}) V^T`` with ``g(x) = x^{-p}``, for ``Bmat = V S V^T``.

    ``g(S^{1/2}) = S^{-p/2}``: directions the batch barely uses are amplified, the dominant ones
    damped (a high-pass filter on the embedding's spectrum). Eigenvalues below
    ``eigenvalue_floor`` times the largest one are raised to it, so ``x^{-p}`` stays finite on a
    rank-deficient ``Bmat`` (relative, so the floor does not depend on the batch size that
    ``Bmat``, a sum, scales with). ``p = 0`` returns the identity exactly.

    On CUDA ``torch.linalg.eigh`` waits for the GPU once per call: it reads cuSOLVER's status on
    the host to raise on failure, and has no flag to skip that check. It stays: an eigh on a
    host copy needs the same wait for the device-to-host copy (and a copy back), and a
    sync-free iterative inverse root (Newton-Schulz) would change the math for ``p != 1``.

    Args:
        bmat: symmetric positive semi-definite (m, m) matrix, ``sum_i z_i z_i^T + z'_i z'_i^T``.
        filter_exponent: p >= 0.
        eigenvalue_floor: relative floor in (0, 1).

    Returns:
        The symmetric (m, m) filter (float32, or float64 for a float64 ``bmat``), without
        gradient.

    Raises:
        ValueError: on p < 0, a floor outside (0, 1), or a non-square ``bmat``.
    """
    check_filter_args(filter_exponent, eigenvalue_floor)
    if bmat.dim() != 2 or bmat.shape[0] != bmat.shape[1]:
        raise ValueError(f"bmat must be square, got shape {tuple(bmat.shape)}")
    bmat = at_least_float32(bmat.detach())
    if filter_exponent == 0:
        return torch.eye(bmat.shape[0], dtype=bmat.dtype, device=bmat.device)
    eigenvalues, eigenvectors = torch.linalg.eigh(bmat)
    floor = eigenvalue_floor * eigenvalues.max().clamp_min(torch.finfo(bmat.dtype).tiny)
    scale = eigenvalues.clamp_min(floor).pow(-filter_exponent / 2)
    return (eigenvectors * scale) @ eigenvectors.T


@full_precision
def _spectral_family_loss(
    z1: Tensor,
    z2: Tensor,
    mu: float,
    negative_mask: Tensor | None,
    gather: bool,
    filter_exponent: float,
    eigenvalue_floor: float,
    divide_by_mu: bool,
) -> Tensor:
    """Spectral CL (``filter_exponent == 0``) or HSCL; see the two public functions."""
    check_pair(z1, z2)
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be a finite number > 0, got {mu}")
    # The pair terms are fourth powers of the embeddings: float32 even under fp16 autocast.
    radius = math.sqrt(mu)
    z1 = _rescale_to_ball(at_least_float32(z1), radius)
    z2 = _rescale_to_ball(at_least_float32(z2), radius)
    batch_size = z1.shape[0]
    if gather:
        z2_global, offset = gather_with_grad(z2), rank() * batch_size
    else:
        z2_global, offset = z2, 0
    global_size = z2_global.shape[0]
    if global_size < 2:
        raise ValueError(f"the uniformity term needs at least 2 samples in the (global) batch, "
                         f"got {global_size}")
    check_mask(negative_mask, (batch_size, global_size))

    cross = z1 @ z2_global.T  # z_i^T z'_j, (B_local, N)
    if filter_exponent == 0:
        pair_terms = cross.square()
    else:
        # Bmat over the global batch. W is a constant of the step (no gradient through the
        # eigendecomposition): Algorithm 1 computes it before the loss, Theorem 3.4 reads it as a
        # fixed filter on A'_sp, and eigh's backward divides by eigenvalue gaps, which the
        # floored, near-degenerate spectra of a collapsing embedding make infinite.
        local_bmat = z1.detach().T @ z1.detach() + z2.detach().T @ z2.detach()
        weight = high_pass_filter(all_reduce_sum(local_bmat) if gather else local_bmat,
                                  filter_exponent, eigenvalue_floor)
        pair_terms = cross * ((z1 @ weight) @ (z2_global @ weight).T)  # W symmetric

    rows = torch.arange(batch_size, device=z1.device)
    allowed = (torch.ones_like(cross, dtype=torch.bool) if negative_mask is None
               else negative_mask.to(z1.device).clone())
    allowed[rows, offset + rows] = False  # i != j: the positive pair is the alignment term
    partners = allowed.sum(dim=1)
    # Each anchor averages over its allowed partners (N - 1 without a mask, which gives the
    # 1/(N(N-1)) sum of the paper); an anchor with none contributes no uniformity term.
    uniformity = pair_terms.masked_fill(~allowed, 0.0).sum(dim=1) / partners.clamp_min(1)
    alignment = (z1 * z2).sum(dim=1)
    loss = (-2.0 * alignment + uniformity).mean()
    # HaoChen et al.'s released code returns the loss over mu: same minimiser, but the gradient
    # (so the effective learning rate) is mu times smaller than the paper's formula's.
    return loss / mu if divide_by_mu else loss


def spectral_contrastive_loss(
    z1: Tensor,
    z2: Tensor,
    mu: float = 1.0,
    negative_mask: Tensor | None = None,
    gather: bool = True,
    divide_by_mu: bool = True,
) -> Tensor:
    """Spectral contrastive loss (HaoChen et al., 2021) on a batch of positive pairs.

    ``L = -2/N sum_i z_i^T z'_i + 1/(N(N-1)) sum_{i != j} (z_i^T z'_j)^2`` over the global batch
    of N pairs. Following the authors' public code (not spelled out in the paper), rows whose
    norm exceeds ``sqrt(mu)`` are first rescaled to norm ``sqrt(mu)``; the rescaling is
    differentiable. With ``divide_by_mu`` (the default) the loss is then divided by ``mu``, as
    the authors' released code does and the paper's formula does not: identical at ``mu = 1``,
    a ``mu`` times smaller loss and gradient otherwise (their ImageNet runs use ``mu = 10``). The
    default follows the code, which produced the reported numbers.

    Under DDP (``gather=True``) each rank's anchors ``z_i`` meet the gathered ``z'_j`` of every
    rank, and the returned loss is the mean over the local anchors, so the rank average is the
    global-batch loss (see the module docstring for the gradients). ``negative_mask`` restricts
    the pairs ``i != j`` of the uniformity term (MCL's feature-aware negatives): each anchor then
    averages over its allowed partners, which makes the masked loss the size-weighted mean of
    the losses of the mask's groups.

    Args:
        z1: projections of the first view, (B_local, D).
        z2: projections of the second view, (B_local, D); row i pairs with ``z1[i]``.
        mu: squared radius of the ball the embeddings are confined to, > 0.
        negative_mask: optional bool (B_local, B_global), True where global sample j may be a
            partner of local anchor i, as for :func:`nt_xent`; the diagonal is ignored.
        gather: pair the local anchors with the batch gathered from all ranks when distributed.
        divide_by_mu: divide the loss by ``mu`` (the authors' code); False: the paper's formula.

    Returns:
        Scalar loss (at least float32).

    Raises:
        ValueError: on mismatched shapes, a global batch below 2, mu <= 0, or a bad mask.

    Example:
        >>> loss = spectral_contrastive_loss(projector(backbone(view1)),
        ...                                  projector(backbone(view2)), mu=1.0)
    """
    return _spectral_family_loss(z1, z2, mu, negative_mask, gather, 0.0, 0.5, divide_by_mu)


def hscl_loss(
    z1: Tensor,
    z2: Tensor,
    filter_exponent: float,
    mu: float = 1.0,
    eigenvalue_floor: float = 1e-5,
    negative_mask: Tensor | None = None,
    gather: bool = True,
    divide_by_mu: bool = True,
) -> Tensor:
    """High-pass Spectral CL (HSCL, Algorithm 1 of the paper, appendix B.1).

    ``Bmat = sum_i (z_i z_i^T + z'_i z'_i^T)`` over the global batch, ``Bmat = V S V^T``,
    ``W = V g(S^{1/2}) V^T`` with ``g(x) = x^{-p}`` (:func:`high_pass_filter`), and

    ``L = -2/N sum_i z_i^T z'_i + 1/(N(N-1)) sum_{i != j} (z_i^T z'_j) ((W z_i)^T (W z'_j))``.

    ``p = 0`` is :func:`spectral_contrastive_loss` exactly. The embeddings are rescaled into
    the ball of radius ``sqrt(mu)`` first and, with ``divide_by_mu``, the loss is divided by
    ``mu``, both as for Spectral CL (HSCL builds on its code), so ``p = 0`` stays Spectral CL.
    ``Bmat`` is the paper's sum, not a mean, so the filter's overall scale moves with the batch
    size as ``N^{-p/2}``. No gradient flows through W (see the comment in the code). Gathering,
    the mask and the returned mean follow :func:`spectral_contrastive_loss`; ``Bmat`` is
    all-reduced over ranks.

    Args:
        z1: projections of the first view, (B_local, D).
        z2: projections of the second view, (B_local, D).
        filter_exponent: p >= 0 of ``g(x) = x^{-p}`` (the paper uses 0.1, 0.3, 0.5).
        mu: squared radius of the ball the embeddings are confined to, > 0.
        eigenvalue_floor: eigenvalues of ``Bmat`` are floored at this fraction of the largest.
        negative_mask: optional bool (B_local, B_global) restricting the pairs ``i != j``.
        gather: use the global batch when distributed.
        divide_by_mu: divide the loss by ``mu``, as :func:`spectral_contrastive_loss`.

    Returns:
        Scalar loss (at least float32).

    Raises:
        ValueError: as :func:`spectral_contrastive_loss`, and on p < 0 or a floor outside (0, 1).

    Example:
        >>> loss = hscl_loss(z1, z2, filter_exponent=0.5)
    """
    check_filter_args(filter_exponent, eigenvalue_floor)
    return _spectral_family_loss(z1, z2, mu, negative_mask, gather, filter_exponent,
                                 eigenvalue_floor, divide_by_mu)
