"""Contrastive loss functions: small, pure, typed.

Conventions shared by every loss here:
- inputs are projections ``(B_local, D)`` of the local batch; the losses normalise or rescale
  them themselves, so callers pass raw projector outputs;
- losses whose docstring says float32 run with autocast off (:func:`_full_precision`): fourth
  powers, square roots of sums of squares and 65k-way softmaxes are not half-precision work;
- losses that contrast against the batch gather the global batch *inside* the loss (with
  :func:`raycl.distributed.gather_with_grad`), so callers never have to think about ranks;
- the returned loss is the mean over the **local** anchors. Averaged over ranks it equals the
  global-batch mean, and with DDP's gradient averaging the parameters receive exactly the
  global-batch gradient (see :mod:`raycl.distributed`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from raycl.distributed import all_reduce_sum, gather_no_grad, gather_with_grad, rank


def _check_pair(z1: Tensor, z2: Tensor) -> None:
    """Raises ValueError unless z1 and z2 are matching non-empty (B, D) matrices."""
    if z1.dim() != 2:
        raise ValueError(f"z1 must be 2-D (batch, dim), got shape {tuple(z1.shape)}")
    if z1.shape != z2.shape:
        raise ValueError(
            f"z1 and z2 must have the same shape, got {tuple(z1.shape)} and {tuple(z2.shape)}"
        )
    if z1.shape[0] == 0:
        raise ValueError("z1 and z2 must contain at least one sample")


def nt_xent(
    z1: Tensor,
    z2: Tensor,
    temperature: float,
    negative_mask: Tensor | None = None,
    gather: bool = True,
) -> Tensor:
    """SimCLR's normalised-temperature cross entropy (NT-Xent) over two views.

    Each of the 2B anchors (both views of every local sample) has one positive, the other view
    of the same sample, and as negatives both views of every other sample in the (global)
    batch, i.e. 2N-2 candidates for a global batch of N samples. ``negative_mask`` restricts
    the negatives, which is MCL's feature-aware negative sampling in its loss-side form: the
    anchor itself is always excluded and its positive always included, whatever the mask says.

    Under DDP (``gather=True`` and a process group with more than one rank) the local anchors
    are contrasted against both views of the gathered global batch; the positives of rank r's
    samples sit at offset ``r * B_local``. All ranks must hold the same B_local.

    Args:
        z1: projections of the first view, (B_local, D); normalised here.
        z2: projections of the second view, (B_local, D); row i pairs with ``z1[i]``.
        temperature: softmax temperature tau > 0.
        negative_mask: optional bool (B_local, B_global); True where global sample j may serve
            as a negative (both of its views) for local anchor i. ``B_global = B_local`` when not
            gathering. See :func:`same_label_mask`.
        gather: contrast against the batch gathered from all ranks when distributed.

    Returns:
        Scalar loss, the mean over the 2 * B_local local anchors.

    Raises:
        ValueError: on a non-positive temperature, mismatched shapes, or a mask of the wrong
            shape or dtype.

    Example:
        >>> z1, z2 = projector(backbone(view1)), projector(backbone(view2))
        >>> loss = nt_xent(z1, z2, temperature=0.5)
        >>> # MCL: negatives only among samples that share the pseudo label
        >>> mask = same_label_mask(pseudo_labels, gather_no_grad(pseudo_labels))
        >>> loss = nt_xent(z1, z2, temperature=0.5, negative_mask=mask)
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    _check_pair(z1, z2)
    batch_size = z1.shape[0]

    z1 = F.normalize(z1, dim=1)
    z2 = F.normalize(z2, dim=1)
    if gather:
        z1_global, z2_global = gather_with_grad(z1), gather_with_grad(z2)
        offset = rank() * batch_size
    else:
        z1_global, z2_global, offset = z1, z2, 0
    global_size = z1_global.shape[0]

    _check_mask(negative_mask, (batch_size, global_size))

    anchors = torch.cat([z1, z2], dim=0)  # (2B, D)
    candidates = torch.cat([z1_global, z2_global], dim=0)  # (2N, D): all view-1, then view-2
    logits = anchors @ candidates.T / temperature  # cosine similarities / tau, (2B, 2N)

    device = logits.device
    rows = torch.arange(2 * batch_size, device=device)
    own = offset + torch.arange(batch_size, device=device)  # global index of each local sample
    self_cols = torch.cat([own, own + global_size])
    positive_cols = torch.cat([own + global_size, own])

    if negative_mask is None:
        allowed = torch.ones_like(logits, dtype=torch.bool)
    else:
        # A sample allowed as negative contributes both of its views, for both anchor views.
        allowed = negative_mask.to(device).repeat(2, 2)
    allowed[rows, self_cols] = False
    allowed[rows, positive_cols] = True
    # -inf logits drop out of the softmax denominator and receive exactly zero gradient.
    logits = logits.masked_fill(~allowed, float("-inf"))
    return F.cross_entropy(logits, positive_cols)


def same_label_mask(local_labels: Tensor, global_labels: Tensor) -> Tensor:
    """Negative mask for MCL's feature-aware negative sampling.

    An anchor's negatives are only the samples that share its pseudo label (the group code of
    all previous stages' clusterings), so that features already separating the groups cannot
    lower the loss any further.

    Args:
        local_labels: int (B_local,) pseudo labels of this rank's samples.
        global_labels: int (B_global,) pseudo labels of the gathered batch (equal to
            ``local_labels`` when not distributed), e.g. ``gather_no_grad(local_labels)``.

    Returns:
        Bool (B_local, B_global), True where the labels are equal.

    Raises:
        ValueError: if either argument is not 1-D.
    """
    if local_labels.dim() != 1:
        raise ValueError(f"local_labels must be 1-D, got shape {tuple(local_labels.shape)}")
    if global_labels.dim() != 1:
        raise ValueError(f"global_labels must be 1-D, got shape {tuple(global_labels.shape)}")
    return local_labels[:, None] == global_labels[None, :].to(local_labels.device)


def _rescale_to_ball(z: Tensor, radius: float) -> Tensor:
    """Shrinks rows whose L2 norm exceeds ``radius`` onto the sphere of that radius."""
    norms = z.norm(dim=1, keepdim=True)
    # clamp_min keeps the gradient finite for all-zero rows (scale is clamped to 1 there anyway)
    scale = (radius / norms.clamp_min(1e-12)).clamp(max=1.0)
    return z * scale


LossFunction = TypeVar("LossFunction", bound=Callable[..., Tensor])


def _full_precision(loss: LossFunction) -> LossFunction:
    """Runs ``loss`` with autocast off, so the inputs that :func:`_at_least_float32` lifts stay
    float32 through every matmul (autocast would otherwise cast them back to half precision)."""

    @functools.wraps(loss)
    def wrapper(*args: object, **kwargs: object) -> Tensor:
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return loss(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _at_least_float32(z: Tensor) -> Tensor:
    """Half precision (autocast) goes up to float32; float32/float64 stay as they are."""
    return z.float() if z.dtype in (torch.float16, torch.bfloat16) else z


def _check_mask(negative_mask: Tensor | None, shape: tuple[int, int]) -> None:
    if negative_mask is None:
        return
    if negative_mask.dtype != torch.bool:
        raise ValueError(f"negative_mask must be a bool tensor, got {negative_mask.dtype}")
    if tuple(negative_mask.shape) != shape:
        raise ValueError(f"negative_mask must have shape (B_local, B_global) = {shape}, got "
                         f"{tuple(negative_mask.shape)}")


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
    bmat = _at_least_float32(bmat.detach())
    if filter_exponent == 0:
        return torch.eye(bmat.shape[0], dtype=bmat.dtype, device=bmat.device)
    eigenvalues, eigenvectors = torch.linalg.eigh(bmat)
    floor = eigenvalue_floor * eigenvalues.max().clamp_min(torch.finfo(bmat.dtype).tiny)
    scale = eigenvalues.clamp_min(floor).pow(-filter_exponent / 2)
    return (eigenvectors * scale) @ eigenvectors.T


@_full_precision
def _spectral_family_loss(
    z1: Tensor,
    z2: Tensor,
    mu: float,
    negative_mask: Tensor | None,
    gather: bool,
    filter_exponent: float,
    eigenvalue_floor: float,
) -> Tensor:
    """Spectral CL (``filter_exponent == 0``) or HSCL; see the two public functions."""
    _check_pair(z1, z2)
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be a finite number > 0, got {mu}")
    # The pair terms are fourth powers of the embeddings: float32 even under fp16 autocast.
    radius = math.sqrt(mu)
    z1 = _rescale_to_ball(_at_least_float32(z1), radius)
    z2 = _rescale_to_ball(_at_least_float32(z2), radius)
    batch_size = z1.shape[0]
    if gather:
        z2_global, offset = gather_with_grad(z2), rank() * batch_size
    else:
        z2_global, offset = z2, 0
    global_size = z2_global.shape[0]
    if global_size < 2:
        raise ValueError(f"the uniformity term needs at least 2 samples in the (global) batch, "
                         f"got {global_size}")
    _check_mask(negative_mask, (batch_size, global_size))

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
    return (-2.0 * alignment + uniformity).mean()


def spectral_contrastive_loss(
    z1: Tensor,
    z2: Tensor,
    mu: float = 1.0,
    negative_mask: Tensor | None = None,
    gather: bool = True,
) -> Tensor:
    """Spectral contrastive loss (HaoChen et al., 2021) on a batch of positive pairs.

    ``L = -2/N sum_i z_i^T z'_i + 1/(N(N-1)) sum_{i != j} (z_i^T z'_j)^2`` over the global batch
    of N pairs. Following the authors' public code (not spelled out in the paper), rows whose
    norm exceeds ``sqrt(mu)`` are first rescaled to norm ``sqrt(mu)``; the rescaling is
    differentiable.

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

    Returns:
        Scalar loss (at least float32).

    Raises:
        ValueError: on mismatched shapes, a global batch below 2, mu <= 0, or a bad mask.

    Example:
        >>> loss = spectral_contrastive_loss(projector(backbone(view1)),
        ...                                  projector(backbone(view2)), mu=1.0)
    """
    return _spectral_family_loss(z1, z2, mu, negative_mask, gather, 0.0, 0.5)


def hscl_loss(
    z1: Tensor,
    z2: Tensor,
    filter_exponent: float,
    mu: float = 1.0,
    eigenvalue_floor: float = 1e-5,
    negative_mask: Tensor | None = None,
    gather: bool = True,
) -> Tensor:
    """High-pass Spectral CL (HSCL, Algorithm 1 of the paper, appendix B.1).

    ``Bmat = sum_i (z_i z_i^T + z'_i z'_i^T)`` over the global batch, ``Bmat = V S V^T``,
    ``W = V g(S^{1/2}) V^T`` with ``g(x) = x^{-p}`` (:func:`high_pass_filter`), and

    ``L = -2/N sum_i z_i^T z'_i + 1/(N(N-1)) sum_{i != j} (z_i^T z'_j) ((W z_i)^T (W z'_j))``.

    ``p = 0`` is :func:`spectral_contrastive_loss` exactly. The embeddings are rescaled into
    the ball of radius ``sqrt(mu)`` first, as for Spectral CL. ``Bmat`` is the paper's sum, not a
    mean, so the filter's overall scale moves with the batch size as ``N^{-p/2}``. No gradient
    flows through W (see the comment in the code). Gathering, the mask and the returned mean
    follow :func:`spectral_contrastive_loss`; ``Bmat`` is all-reduced over ranks.

    Args:
        z1: projections of the first view, (B_local, D).
        z2: projections of the second view, (B_local, D).
        filter_exponent: p >= 0 of ``g(x) = x^{-p}`` (the paper uses 0.1, 0.3, 0.5).
        mu: squared radius of the ball the embeddings are confined to, > 0.
        eigenvalue_floor: eigenvalues of ``Bmat`` are floored at this fraction of the largest.
        negative_mask: optional bool (B_local, B_global) restricting the pairs ``i != j``.
        gather: use the global batch when distributed.

    Returns:
        Scalar loss (at least float32).

    Raises:
        ValueError: as :func:`spectral_contrastive_loss`, and on p < 0 or a floor outside (0, 1).

    Example:
        >>> loss = hscl_loss(z1, z2, filter_exponent=0.5)
    """
    check_filter_args(filter_exponent, eigenvalue_floor)
    return _spectral_family_loss(z1, z2, mu, negative_mask, gather, filter_exponent,
                                 eigenvalue_floor)


@_full_precision
def info_nce(queries: Tensor, keys: Tensor, temperature: float, gather: bool = True) -> Tensor:
    """One-directional InfoNCE over the batch: query i's positive is key i, the other keys of
    the (global) batch are its negatives.

    ``L_i = -log( exp(q_i . k_i / tau) / sum_n exp(q_i . k_n / tau) )`` on L2-normalised rows.
    It is All4One's neighbour contrast (paper eq. 1, NNCLR: ``q = nn^1``, the support-set
    neighbour, ``k = p^2``, the predictor output of the other view) and centroid contrast (eq. 2:
    ``q = c^1``, ``k = c^2``). Under DDP (``gather=True``) the keys are gathered from every rank
    with gradients and the local queries meet all of them; the positive of rank r's query i sits
    at ``r * B_local + i``.

    Args:
        queries: (B_local, D) queries; a support-set neighbour carries no gradient.
        keys: (B_local, D) keys; row i is query i's positive.
        temperature: tau > 0.
        gather: contrast against the keys of the global batch when distributed.

    Returns:
        Scalar loss, the mean over the local queries (at least float32).

    Raises:
        ValueError: on a non-positive temperature or mismatched shapes.

    Example:
        >>> neighbours, _ = queue.nearest(momentum_z1, k=1)
        >>> loss = info_nce(neighbours[:, 0], predictor(online_z2), temperature=0.1)
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    _check_pair(queries, keys)
    queries = F.normalize(_at_least_float32(queries), dim=1)
    keys = F.normalize(_at_least_float32(keys), dim=1)
    offset = 0
    if gather:
        keys, offset = gather_with_grad(keys), rank() * queries.shape[0]
    logits = queries @ keys.T / temperature
    targets = offset + torch.arange(queries.shape[0], device=logits.device)
    return F.cross_entropy(logits, targets)


@_full_precision
def redundancy_reduction_loss(
    target1: Tensor,
    online2: Tensor,
    target2: Tensor,
    online1: Tensor,
    off_diagonal_weight: float = 0.5,
    gather: bool = True,
) -> Tensor:
    """All4One's feature contrast (paper eq. 3), a square-root form of Barlow Twins' objective.

    Columns (features) are L2-normalised along the batch, ``CC^1 = Z_t1^T Z_o2`` and, with the
    branches swapped, ``CC^2 = Z_t2^T Z_o1`` (D x D), and

    ``L = sqrt( 1/(2D) sum_i (1 - cc^1_ii)^2 + (1 - cc^2_ii)^2 )
    + lambda sqrt( 1/(2D(D-1)) sum_{i != j} (cc^1_ij)^2 + (cc^2_ij)^2 )``.

    The target (momentum) embeddings carry no gradient. Under DDP the normalisation and the
    cross-correlations use the global batch (targets gathered without, online embeddings with
    gradients), so every rank returns the global loss and, after DDP's averaging, parameters get
    its exact gradient (see :mod:`raycl.distributed`).

    Args:
        target1: (B_local, D) momentum projections of view 1 (detached here).
        online2: (B_local, D) online projections of view 2.
        target2: (B_local, D) momentum projections of view 2 (detached here).
        online1: (B_local, D) online projections of view 1.
        off_diagonal_weight: lambda >= 0 (the paper: 0.5).
        gather: use the global batch when distributed.

    Returns:
        Scalar loss (at least float32).

    Raises:
        ValueError: on mismatched shapes, D < 2 or a negative lambda.

    Example:
        >>> loss = redundancy_reduction_loss(zm1, z2, zm2, z1, off_diagonal_weight=0.5)
    """
    for other in (online2, target2, online1):
        _check_pair(target1, other)
    dim = target1.shape[1]
    if dim < 2:
        raise ValueError(f"the redundancy term needs D >= 2 features, got D = {dim}")
    if not (math.isfinite(off_diagonal_weight) and off_diagonal_weight >= 0):
        raise ValueError(f"off_diagonal_weight must be >= 0, got {off_diagonal_weight}")

    def columns(z: Tensor, with_grad: bool) -> Tensor:
        z = _at_least_float32(z)
        if gather:
            z = gather_with_grad(z) if with_grad else gather_no_grad(z)
        return F.normalize(z, dim=0)  # each feature a unit vector over the batch

    cc1 = columns(target1.detach(), False).T @ columns(online2, True)
    cc2 = columns(target2.detach(), False).T @ columns(online1, True)
    diagonal = torch.eye(dim, dtype=torch.bool, device=cc1.device)
    on = ((1 - cc1[diagonal]) ** 2 + (1 - cc2[diagonal]) ** 2).sum() / (2 * dim)
    off = (cc1[~diagonal] ** 2 + cc2[~diagonal] ** 2).sum() / (2 * dim * (dim - 1))
    # clamp: sqrt has an infinite derivative at exactly 0 (perfect correlation)
    return on.clamp_min(1e-12).sqrt() + off_diagonal_weight * off.clamp_min(1e-12).sqrt()


@_full_precision
def moco_infonce(queries: Tensor, keys: Tensor, negatives: Tensor, temperature: float) -> Tensor:
    """MoCo's InfoNCE (He et al., 2020, Algorithm 1; MoCo v2): each query meets its own key as
    the positive and every row of a queue of earlier keys as negatives.

    ``L_i = -log( exp(q_i . k_i / tau) / (exp(q_i . k_i / tau) + sum_j exp(q_i . n_j / tau)) )``
    on L2-normalised rows, i.e. cross entropy of the logits ``[q_i . k_i, q_i . N^T] / tau`` with
    target 0. No batch negatives and no gathering: a query meets its own key and the queue only,
    and the queue is already global (:meth:`raycl.queues.FeatureQueue.enqueue` gathers the keys of
    every rank), so the mean over the local queries, averaged over ranks by DDP, is the
    global-batch loss. Keys and negatives come from the momentum encoder and receive no gradient
    (detached here). The logits are computed in float32 with autocast disabled, so the similarity
    to each of the (up to 65 536) negatives is not rounded to half precision.

    Args:
        queries: (B, D) online projections ``q``; normalised here.
        keys: (B, D) momentum-encoder projections ``k``; row i is query i's positive;
            normalised and detached here.
        negatives: (K, D) the queue's entries (earlier keys), K >= 1; normalised and detached
            here (a :class:`raycl.queues.FeatureQueue` stores them normalised already).
        temperature: tau > 0 (MoCo v2: 0.2).

    Returns:
        Scalar loss, the mean over the B queries (float32, or float64 for float64 inputs).

    Raises:
        ValueError: on a non-positive temperature, mismatched query/key shapes, an empty queue
            or a queue of another width.

    Example:
        >>> q = projector(backbone(view1))
        >>> with torch.no_grad():
        ...     k = key_projector(key_backbone(view2))
        >>> loss = moco_infonce(q, k, queue.embeddings, temperature=0.2)
        >>> queue.enqueue(k, batch.index)  # after the loss: a batch never meets its own keys
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    _check_pair(queries, keys)
    if negatives.dim() != 2 or negatives.shape[1] != queries.shape[1]:
        raise ValueError(f"negatives must be (K, D) with the queries' D = {queries.shape[1]}, "
                         f"got shape {tuple(negatives.shape)}")
    if negatives.shape[0] == 0:
        raise ValueError("negatives must contain at least one row")
    q = F.normalize(_at_least_float32(queries), dim=1)
    k = F.normalize(_at_least_float32(keys.detach()), dim=1).to(q.dtype)
    n = F.normalize(_at_least_float32(negatives.detach()), dim=1).to(q.dtype)
    positive = (q * k).sum(dim=1, keepdim=True)  # (B, 1)
    negative = q @ n.to(q.device).T  # (B, K)
    logits = torch.cat([positive, negative], dim=1) / temperature
    targets = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    return F.cross_entropy(logits, targets)


def simsiam_loss(p1: Tensor, p2: Tensor, z1: Tensor, z2: Tensor) -> Tensor:
    """SimSiam's symmetrised negative cosine similarity (Chen & He, 2021, eq. 2 and Algorithm 1).

    ``L = D(p1, stopgrad(z2)) / 2 + D(p2, stopgrad(z1)) / 2`` with
    ``D(p, z) = -mean_i (p_i / ||p_i||) . (z_i / ||z_i||)``. The stop-gradient is applied here:
    no gradient ever flows through ``z1`` or ``z2`` (the paper's key ingredient against
    collapse); the encoder is reached through ``p1``, ``p2`` only. No negatives, no gathering:
    the mean over the local pairs, averaged over ranks by DDP, is the global-batch loss. Computed
    in float32 under half-precision autocast (no matmul involved).

    Args:
        p1: (B, D) predictor output of view 1.
        p2: (B, D) predictor output of view 2.
        z1: (B, D) projector output of view 1 (the target of ``p2``; detached here).
        z2: (B, D) projector output of view 2 (the target of ``p1``; detached here).

    Returns:
        Scalar loss in [-1, 1]; -1 when every prediction points along its target.

    Raises:
        ValueError: unless the four arguments are matching non-empty (B, D) matrices.

    Example:
        >>> z1, z2 = projector(backbone(view1)), projector(backbone(view2))
        >>> loss = simsiam_loss(predictor(z1), predictor(z2), z1, z2)
    """
    for other in (p2, z1, z2):
        _check_pair(p1, other)

    def negative_cosine(p: Tensor, z: Tensor) -> Tensor:
        p = F.normalize(_at_least_float32(p), dim=1)
        z = F.normalize(_at_least_float32(z.detach()), dim=1)
        return -(p * z).sum(dim=1).mean()

    return negative_cosine(p1, z2) / 2 + negative_cosine(p2, z1) / 2


def sinusoidal_positional_encoding(length: int, dim: int) -> Tensor:
    """Vaswani et al.'s fixed positional encoding: ``PE[pos, 2i] = sin(pos / 10000^(2i/dim))``,
    ``PE[pos, 2i+1] = cos(pos / 10000^(2i/dim))``.

    Args:
        length: sequence length (All4One: the k neighbours), >= 1.
        dim: model width, >= 1 (an odd width drops the last cosine).

    Returns:
        (length, dim) float32 encoding, added to a (B, length, dim) sequence.
    """
    if length < 1 or dim < 1:
        raise ValueError(f"length and dim must be >= 1, got {length} and {dim}")
    position = torch.arange(length, dtype=torch.float64)[:, None]
    frequency = torch.pow(10_000.0, -torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    encoding = torch.zeros(length, dim, dtype=torch.float64)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency)[:, : dim // 2]
    return encoding.float()

