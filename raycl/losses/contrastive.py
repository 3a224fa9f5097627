"""InfoNCE-family losses: NT-Xent (SimCLR, MCL's masked negatives), InfoNCE against a gathered
batch (NNCLR, All4One) or a queue (MoCo v2), and the same-pseudo-label mask."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from raycl.distributed import gather_with_grad, rank
from raycl.losses.common import at_least_float32, check_mask, check_pair, full_precision


@full_precision
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
        Scalar loss, the mean over the 2 * B_local local anchors (at least float32: the logits
        are computed with autocast off, as the other InfoNCE losses', so a bf16 cosine is not
        rounded before it is divided by a small temperature).

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
    check_pair(z1, z2)
    batch_size = z1.shape[0]

    z1 = F.normalize(at_least_float32(z1), dim=1)
    z2 = F.normalize(at_least_float32(z2), dim=1)
    if gather:
        z1_global, z2_global = gather_with_grad(z1), gather_with_grad(z2)
        offset = rank() * batch_size
    else:
        z1_global, z2_global, offset = z1, z2, 0
    global_size = z1_global.shape[0]

    check_mask(negative_mask, (batch_size, global_size))

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


@full_precision
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
    check_pair(queries, keys)
    queries = F.normalize(at_least_float32(queries), dim=1)
    keys = F.normalize(at_least_float32(keys), dim=1)
    offset = 0
    if gather:
        keys, offset = gather_with_grad(keys), rank() * queries.shape[0]
    logits = queries @ keys.T / temperature
    targets = offset + torch.arange(queries.shape[0], device=logits.device)
    return F.cross_entropy(logits, targets)


@full_precision
def moco_infonce(queries: Tensor, keys: Tensor, negatives: Tensor, temperature: float) -> Tensor:
    """MoCo's InfoNCE (He et al., 2020, Algorithm 1; MoCo v2): each query meets its own key as
    the positive and every row of a queue of earlier keys as negatives.

    ``L_i = -log( exp(q_i . k_i / tau) / (exp(q_i . k_i / tau) + sum_j exp(q_i . n_j / tau)) )``
    on L2-normalised rows, i.e. cross entropy of the logits ``[q_i . k_i, q_i . N^T] / tau`` with
    target 0. No batch negatives and no gathering: a query meets its own key and the queue only,
    and the queue is already global (:meth:`raycl.methods.queues.FeatureQueue.enqueue` gathers the
    keys of every rank), so the mean over the local queries, averaged over ranks by DDP, is the
    global-batch loss. Keys and negatives come from the momentum encoder and receive no gradient
    (detached here). The logits are computed in float32 with autocast disabled, so the similarity
    to each of the (up to 65 536) negatives is not rounded to half precision.

    Args:
        queries: (B, D) online projections ``q``; normalised here.
        keys: (B, D) momentum-encoder projections ``k``; row i is query i's positive;
            normalised and detached here.
        negatives: (K, D) the queue's entries (earlier keys), K >= 1; normalised and detached
            here (a :class:`raycl.methods.queues.FeatureQueue` stores them normalised already).
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
    check_pair(queries, keys)
    if negatives.dim() != 2 or negatives.shape[1] != queries.shape[1]:
        raise ValueError(f"negatives must be (K, D) with the queries' D = {queries.shape[1]}, "
                         f"got shape {tuple(negatives.shape)}")
    if negatives.shape[0] == 0:
        raise ValueError("negatives must contain at least one row")
    q = F.normalize(at_least_float32(queries), dim=1)
    k = F.normalize(at_least_float32(keys.detach()), dim=1).to(q.dtype)
    n = F.normalize(at_least_float32(negatives.detach()), dim=1).to(q.dtype)
    positive = (q * k).sum(dim=1, keepdim=True)  # (B, 1)
    negative = q @ n.to(q.device).T  # (B, K)
    logits = torch.cat([positive, negative], dim=1) / temperature
    targets = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    return F.cross_entropy(logits, targets)
