"""Objectives without negatives: SimSiam's negative cosine and All4One's redundancy reduction,
with the positional encoding All4One's neighbour transformer adds."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from raycl.distributed import gather_no_grad, gather_with_grad
from raycl.losses.common import at_least_float32, check_pair, full_precision


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
        check_pair(p1, other)

    def negative_cosine(p: Tensor, z: Tensor) -> Tensor:
        p = F.normalize(at_least_float32(p), dim=1)
        z = F.normalize(at_least_float32(z.detach()), dim=1)
        return -(p * z).sum(dim=1).mean()

    return negative_cosine(p1, z2) / 2 + negative_cosine(p2, z1) / 2


@full_precision
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
        check_pair(target1, other)
    dim = target1.shape[1]
    if dim < 2:
        raise ValueError(f"the redundancy term needs D >= 2 features, got D = {dim}")
    if not (math.isfinite(off_diagonal_weight) and off_diagonal_weight >= 0):
        raise ValueError(f"off_diagonal_weight must be >= 0, got {off_diagonal_weight}")

    def columns(z: Tensor, with_grad: bool) -> Tensor:
        z = at_least_float32(z)
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
