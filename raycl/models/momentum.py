"""Momentum (EMA) copies of networks, as in BYOL, MoCo and All4One."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
from torch import nn


def momentum_copy(module: nn.Module) -> nn.Module:
    """A frozen deep copy of ``module`` to be updated by :func:`ema_update` (no gradients)."""
    target = copy.deepcopy(module)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    return target


def momentum_coefficient(step: int, total_steps: int, start: float, end: float) -> float:
    """BYOL's schedule: the EMA coefficient rises from ``start`` to ``end`` along a half cosine.

    ``tau(step) = end - (end - start) * (cos(pi * step / total_steps) + 1) / 2``.

    Args:
        step: optimizer steps taken so far (0 gives ``start``).
        total_steps: steps of the whole run (``total_steps`` gives ``end``), >= 1.
        start: coefficient at the first step, in [0, 1].
        end: coefficient at the last step, in [start, 1].

    Returns:
        The coefficient for this step.
    """
    if not 0.0 <= start <= end <= 1.0:
        raise ValueError(f"need 0 <= start <= end <= 1, got start={start}, end={end}")
    progress = min(1.0, max(0.0, step / max(1, total_steps)))
    return end - (end - start) * (math.cos(math.pi * progress) + 1.0) / 2.0


@torch.no_grad()
def ema_update(online: nn.Module, target: nn.Module, coefficient: float) -> None:
    """``target = coefficient * target + (1 - coefficient) * online``, for every parameter in one
    multi-tensor call (``torch._foreach_lerp_``: a few fused kernels, not one per parameter; the
    result is the same as a ``lerp_`` per parameter).

    Buffers (BatchNorm statistics) are not averaged: the target's come from its own forwards.
    """
    pairs = list(zip(online.parameters(), target.parameters(), strict=True))
    if not pairs:
        return
    torch._foreach_lerp_([target_param for _, target_param in pairs],
                         [online_param.detach() for online_param, _ in pairs], 1.0 - coefficient)


def momentum_update(
    pairs: Iterable[tuple[nn.Module, nn.Module]], step: int, total_steps: int, start: float,
    end: float,
) -> float:
    """One EMA step of every ``(online, momentum copy)`` pair at the coefficient BYOL's schedule
    gives ``step`` (:func:`momentum_coefficient`, :func:`ema_update`): what MoCo's key encoder
    and All4One's momentum branch do after each optimizer step.

    Returns:
        The coefficient used.
    """
    coefficient = momentum_coefficient(step, total_steps, start, end)
    for online, target in pairs:
        ema_update(online, target, coefficient)
    return coefficient
