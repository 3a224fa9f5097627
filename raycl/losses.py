"""Contrastive loss functions: small, pure, typed.

Conventions shared by every loss here:
- inputs are projections ``(B_local, D)`` of the local batch; the losses normalise or rescale
  them themselves, so callers pass raw projector outputs;
- losses that contrast against the batch gather the global batch *inside* the loss (with
  :func:`raycl.distributed.gather_with_grad`), so callers never have to think about ranks;
- the returned loss is the mean over the **local** anchors. Averaged over ranks it equals the
  global-batch mean, and with DDP's gradient averaging the parameters receive exactly the
  global-batch gradient (see :mod:`raycl.distributed`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from raycl.distributed import gather_with_grad, rank


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

    if negative_mask is not None:
        if negative_mask.dtype != torch.bool:
            raise ValueError(f"negative_mask must be a bool tensor, got {negative_mask.dtype}")
        if negative_mask.shape != (batch_size, global_size):
            raise ValueError(
                f"negative_mask must have shape (B_local, B_global) = "
                f"{(batch_size, global_size)}, got {tuple(negative_mask.shape)}"
            )

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


def spectral_contrastive_loss(z1: Tensor, z2: Tensor, mu: float = 1.0) -> Tensor:
    """Spectral contrastive loss (HaoChen et al., 2021) on a batch of positive pairs.

    ``L = -2/B sum_i z_i^T z'_i + 1/(B(B-1)) sum_{i != j} (z_i^T z'_j)^2``

    Following the authors' public code (not spelled out in the paper), rows whose norm exceeds
    ``sqrt(mu)`` are first rescaled to norm ``sqrt(mu)``; the rescaling is differentiable. The
    loss uses the local batch only (no gathering).

    Args:
        z1: projections of the first view, (B, D), B >= 2.
        z2: projections of the second view, (B, D); row i pairs with ``z1[i]``.
        mu: squared radius of the ball the embeddings are confined to, > 0.

    Returns:
        Scalar loss.

    Raises:
        ValueError: on mismatched shapes, B < 2, or mu <= 0.
    """
    _check_pair(z1, z2)
    if z1.shape[0] < 2:
        raise ValueError(f"z1 needs at least 2 samples for the uniformity term, got {z1.shape[0]}")
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"mu must be a finite number > 0, got {mu}")
    radius = math.sqrt(mu)
    z1 = _rescale_to_ball(z1, radius)
    z2 = _rescale_to_ball(z2, radius)

    batch_size = z1.shape[0]
    alignment = (z1 * z2).sum(dim=1).mean()
    cross = z1 @ z2.T
    off_diagonal = ~torch.eye(batch_size, dtype=torch.bool, device=z1.device)
    uniformity = cross[off_diagonal].pow(2).mean()  # mean over the B(B-1) pairs i != j
    return -2.0 * alignment + uniformity
