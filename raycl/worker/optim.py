"""The optimizer of a training phase, its learning-rate schedule, and mixed precision."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from raycl.config.schema import CoreConfig
from raycl.methods.base import TRAIN_PHASE, Method, Phase

# Enters the forward pass's autocast region (or nothing, with train.amp off).
Autocast = Callable[[], AbstractContextManager[Any]]


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str = "cosine") -> float:
    """Linear warmup to 1, then cosine decay to 0 (or 1 throughout: ``schedule="constant"``)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(
    method: Method, config: CoreConfig, phase: Phase = TRAIN_PHASE
) -> torch.optim.Optimizer:
    """The optimizer of one phase over ``method.param_groups()`` (called after ``set_phase``).

    A group's absolute ``"lr"`` (e.g. All4One's transformer) or ``"lr_scale"`` applies to the
    phase's base rate: ``phase.lr`` when the phase sets one, else ``train.lr``.
    """
    base_lr = config.train.lr if phase.lr is None else phase.lr
    groups = []
    for group in method.param_groups():
        group = dict(group)
        group["lr"] = float(group.pop("lr", base_lr)) * float(group.pop("lr_scale", 1.0))
        group["initial_lr"] = group["lr"]
        groups.append(group)
    if (phase.optimizer or config.train.optimizer) == "sgd":
        return torch.optim.SGD(groups, lr=base_lr, momentum=config.train.momentum,
                               weight_decay=config.train.weight_decay)
    return torch.optim.AdamW(groups, lr=base_lr, weight_decay=config.train.weight_decay)


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every step of one phase, as a factor of each group's initial rate.

    Attributes:
        total_steps: the phase's optimizer steps (epochs x steps per epoch).
        warmup_steps: linear warmup steps (``train.warmup_epochs``; none in a constant phase).
        schedule: ``train.lr_schedule`` after the warmup ("cosine" or "constant").
        constant: the phase sets its own ``lr``: factor 1 at every step.
    """

    total_steps: int
    warmup_steps: int
    schedule: str
    constant: bool

    @classmethod
    def for_phase(
        cls, config: CoreConfig, phase: Phase, epochs: int, steps_per_epoch: int
    ) -> LrSchedule:
        """The schedule of ``phase`` over its ``epochs`` of ``steps_per_epoch`` steps."""
        warmup_steps = (int(config.train.warmup_epochs * steps_per_epoch)
                        if phase.lr is None else 0)
        return cls(epochs * steps_per_epoch, warmup_steps, config.train.lr_schedule,
                   phase.lr is not None)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Set every group's rate for ``step`` (counted from the phase's first step)."""
        factor = 1.0 if self.constant else lr_factor(
            step, self.total_steps, self.warmup_steps, self.schedule)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor


def autocast_and_scaler(
    config: CoreConfig, device: torch.device
) -> tuple[Autocast, torch.amp.GradScaler]:
    """The forward pass's autocast region and the loss scaler for ``train.amp``.

    ``auto`` is fp16 on CUDA and off elsewhere; the scaler only scales for fp16 on CUDA (bf16
    needs none), and is a no-op otherwise so the loop calls it the same way in every mode.
    """
    mode = config.train.amp
    if mode == "auto":
        mode = "fp16" if device.type == "cuda" else "off"
    if mode == "off":
        return nullcontext, torch.amp.GradScaler(device.type, enabled=False)
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16" and device.type == "cuda")
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler


__all__ = ["Autocast", "LrSchedule", "autocast_and_scaler", "build_optimizer", "lr_factor"]
