"""Small helpers around ``torch.distributed`` that degrade to no-ops in a single process.

Every helper works the same whether it runs under Ray Train / DDP (process group initialised,
several ranks) or in a plain script or test (no process group): in the latter case the gathers
return their input and ``world_size() == 1``.

All gathers concatenate along dim 0 in rank order and require the tensor to have the **same
shape on every rank** (``torch.distributed.all_gather`` does not pad). Data loaders must
therefore drop the last incomplete batch (or pad it) when training distributed.

Gradient convention of :func:`gather_with_grad`: its backward *sums* the gradients that every
rank computes for a shard into that shard's owner. If each rank minimises the mean over its
local anchors, the gradient on the local inputs is ``world_size`` times the gradient of the
global mean, and DDP's averaging of parameter gradients over ranks divides it back out, so the
parameters receive exactly the gradient of the global-batch mean loss.

Rank-0-only code (scoring, clustering, diagnostics, checkpoint writing) runs inside
:func:`single_rank_section`: there every helper here that enters a collective raises
:class:`CollectiveInSingleRankSection` at once, at any world size, instead of waiting forever
for ranks that never join. Code outside this module enters collectives only through these
helpers, so the guard covers them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.nn.functional import all_gather as _all_gather_with_grad

# What the open single-rank sections are doing, innermost last (process-wide: a worker runs its
# training loop in one thread).
_single_rank_sections: list[str] = []


class CollectiveInSingleRankSection(RuntimeError):
    """A collective entered inside :func:`single_rank_section`: the other ranks never enter
    it, so with two or more workers it would hang."""


@contextmanager
def single_rank_section(what: str) -> Iterator[None]:
    """Marks code that only one rank runs (``what`` names it in the error): any collective of
    this module entered inside raises :class:`CollectiveInSingleRankSection`, even in a single
    process, so a test on one CPU catches what would hang a multi-GPU trial."""
    _single_rank_sections.append(what)
    try:
        yield
    finally:
        _single_rank_sections.pop()


def _entering(collective: str) -> None:
    """Raises when ``collective`` is entered inside a single-rank section."""
    if _single_rank_sections:
        raise CollectiveInSingleRankSection(
            f"{collective} entered inside a rank-0-only section ({_single_rank_sections[-1]}): "
            "the other ranks never enter it, so it would wait forever; compute on this "
            "rank's tensors there (e.g. a loss with gather=False)")


def guard_collective(collective: str) -> None:
    """For a collective a library enters itself (torch's ``nn.SyncBatchNorm`` training
    forward): raises :class:`CollectiveInSingleRankSection` inside a single-rank section, as
    this module's own helpers do, before the library would wait for the other ranks."""
    _entering(collective)


def is_distributed() -> bool:
    """Returns True when a process group is initialised (available and ``init_process_group``
    has been called)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Returns the number of processes in ``group`` (None: the default group), 1 when not
    distributed."""
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    """Returns the rank of this process in ``group`` (None: the default group), 0 when not
    distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def gather_with_grad(t: Tensor) -> Tensor:
    """All-gathers ``t`` from every rank, keeping the autograd graph.

    Gradients that any rank computes for the slice owned by rank ``r`` are summed and flow back
    into rank ``r``'s ``t`` (see the module docstring for the resulting scaling).

    Args:
        t: tensor of identical shape on all ranks, (B_local, ...).

    Returns:
        Tensor (world_size * B_local, ...) with the slices in rank order; ``t`` itself when not
        distributed or when the world size is 1.
    """
    _entering("all_gather (gather_with_grad)")
    if world_size() == 1:
        return t
    return torch.cat(_all_gather_with_grad(t), dim=0)


@torch.no_grad()
def gather_no_grad(t: Tensor) -> Tensor:
    """All-gathers ``t`` from every rank without gradients (labels, indices, queue entries).

    Args:
        t: tensor of identical shape on all ranks, (B_local, ...).

    Returns:
        Tensor (world_size * B_local, ...) in rank order; ``t`` itself when not distributed.
    """
    _entering("all_gather (gather_no_grad)")
    if world_size() == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(shards, t.contiguous())
    return torch.cat(shards, dim=0)


@torch.no_grad()
def gather_to_rank0(t: Tensor) -> Tensor | None:
    """Gathers ``t`` from every rank onto rank 0 only, without gradients (evaluation features:
    the other ranks never hold the whole array).

    Args:
        t: tensor of identical shape on all ranks, (B_local, ...); a caller gathering a large
            array sends it a bounded block at a time, so no rank holds more than a block of
            each rank's rows on its device.

    Returns:
        On rank 0, a tensor (world_size * B_local, ...) in rank order; None on every other rank;
        ``t`` itself when not distributed.
    """
    _entering("gather (gather_to_rank0)")
    if world_size() == 1:
        return t
    t = t.contiguous()
    if rank() != 0:
        dist.gather(t, None, dst=0)
        return None
    shards = [torch.empty_like(t) for _ in range(world_size())]
    dist.gather(t, shards, dst=0)
    return torch.cat(shards, dim=0)


@contextmanager
def barrier_after(timeout: timedelta) -> Iterator[None]:
    """Run the body, then wait until every rank has run it, for up to ``timeout``, in a gloo
    group of its own (created before the body, while the ranks arrive together), so neither the
    default group's timeout (NCCL's 30 minutes under Ray Train) nor its backend applies. A
    single process or a world of one does not wait; a rank whose body raises does not either
    (its error ends the trial).
    """
    _entering("barrier (barrier_after)")
    if world_size() == 1:
        yield
        return
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        yield
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group(group)


@torch.no_grad()
def all_reduce_mean(t: Tensor) -> Tensor:
    """Averages ``t`` over all ranks (e.g. metrics or global batch statistics).

    Args:
        t: tensor of identical shape on all ranks; floating point.

    Returns:
        A new tensor holding the mean over ranks; ``t`` itself when not distributed.
    """
    _entering("all_reduce (all_reduce_mean)")
    if world_size() == 1:
        return t
    reduced = t.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced / world_size()


@torch.no_grad()
def all_reduce_sum(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Sums ``t`` over all ranks (global-batch statistics such as HSCL's ``Bmat``).

    Args:
        t: tensor of identical shape on all ranks; floating point.
        group: the ranks summed over (None: the default group, every rank).

    Returns:
        A new tensor holding the sum over ranks (no gradient); ``t`` itself when not distributed.
    """
    _entering("all_reduce (all_reduce_sum)")
    if world_size(group) == 1:
        return t
    reduced = t.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    return reduced


@torch.no_grad()
def broadcast_from_rank0(t: Tensor) -> Tensor:
    """Rank 0's ``t`` on every rank (e.g. a clustering only rank 0 computed).

    Args:
        t: tensor of identical shape and dtype on all ranks, on the device the process group
            uses (CUDA for NCCL); its content matters on rank 0 only.

    Returns:
        Rank 0's values; ``t`` itself when not distributed.
    """
    _entering("broadcast (broadcast_from_rank0)")
    if world_size() == 1:
        return t
    shared = t.contiguous().clone()
    dist.broadcast(shared, src=0)
    return shared


@torch.no_grad()
def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when ``flag`` is True on at least one (ranks must agree before they
    leave a loop, or the others wait forever in the next collective).

    Args:
        flag: this rank's condition.
        device: where the process group's tensors live (CUDA for NCCL); CPU by default.

    Returns:
        The logical OR of ``flag`` over all ranks; ``flag`` itself when not distributed.
    """
    _entering("all_reduce (any_rank)")
    if world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
