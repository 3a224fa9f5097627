"""What the loss functions share: input checks and float32 for precision-sensitive losses."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor


def check_pair(z1: Tensor, z2: Tensor) -> None:
    """Raises ValueError unless z1 and z2 are matching non-empty (B, D) matrices."""
    if z1.dim() != 2:
        raise ValueError(f"z1 must be 2-D (batch, dim), got shape {tuple(z1.shape)}")
    if z1.shape != z2.shape:
        raise ValueError(
            f"z1 and z2 must have the same shape, got {tuple(z1.shape)} and {tuple(z2.shape)}"
        )
    if z1.shape[0] == 0:
        raise ValueError("z1 and z2 must contain at least one sample")


LossFunction = TypeVar("LossFunction", bound=Callable[..., Tensor])


def full_precision(loss: LossFunction) -> LossFunction:
    """Runs ``loss`` with autocast off, so the inputs that :func:`at_least_float32` lifts stay
    float32 through every matmul (autocast would otherwise cast them back to half precision)."""

    @functools.wraps(loss)
    def wrapper(*args: object, **kwargs: object) -> Tensor:
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return loss(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def at_least_float32(z: Tensor) -> Tensor:
    """Half precision (autocast) goes up to float32; float32/float64 stay as they are."""
    return z.float() if z.dtype in (torch.float16, torch.bfloat16) else z


def check_mask(negative_mask: Tensor | None, shape: tuple[int, int]) -> None:
    if negative_mask is None:
        return
    if negative_mask.dtype != torch.bool:
        raise ValueError(f"negative_mask must be a bool tensor, got {negative_mask.dtype}")
    if tuple(negative_mask.shape) != shape:
        raise ValueError(f"negative_mask must have shape (B_local, B_global) = {shape}, got "
                         f"{tuple(negative_mask.shape)}")
