"""One training epoch: the optimizer steps over the loader, with the NaN/inf check of the loss.

The loop knows nothing about a particular method: it calls ``method(batch)`` for the loss and
``method.on_train_step_end`` for EMA/queue updates. A loss that turns NaN/inf ends the trial at
the next check (every :data:`FINITE_CHECK_EVERY` steps and at the epoch's end) with
:class:`NonFiniteLossError` on every rank, naming the step and the value.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from raycl.data.augment import BatchAugment, to_float
from raycl.distributed import any_rank
from raycl.methods.base import Batch, Method, Phase
from raycl.worker.faults import maybe_inject_fault
from raycl.worker.optim import Autocast, LrSchedule
from raycl.worker.outcome import NonFiniteLossError
from raycl.worker.perf import Clock
from raycl.worker.stream_loader import StreamLoader

# Losses are checked for NaN/inf every this many steps (and at each epoch's end): one device
# sync per check, so a GPU is not stalled every step, and a diverged trial still stops at once.
FINITE_CHECK_EVERY = 20


@dataclass
class StepParts:
    """What every training step of one stage uses, built once per stage.

    Attributes:
        stage: index of the stage being trained.
        method: the stage's method (unwrapped: its hooks are called directly).
        loader: ``(uint8 images, index)`` batches of this rank (streamed shards add the
            batch's captions).
        augment: the batched, on-device augmentation that makes the views.
        pseudo_labels: MCL group code per training sample, on the device (None: none used).
        tokens: every caption tokenised once, on the device (None: no captions).
        autocast: the forward pass's autocast region.
        scaler: the loss scaler (a no-op unless fp16 on CUDA).
        device: this rank's device.
        clock: the start-up clock (the first step stops it).
        fault_hook: tests only: ``fault`` (:mod:`raycl.worker.faults`) and ``in_process``.
    """

    stage: int
    method: Method
    loader: DataLoader | StreamLoader
    augment: BatchAugment
    pseudo_labels: Tensor | None
    tokens: Tensor | None
    autocast: Autocast
    scaler: torch.amp.GradScaler
    device: torch.device
    clock: Clock
    fault_hook: dict[str, Any] = field(default_factory=dict)


@dataclass
class EpochStats:
    """What one epoch's steps leave: per-output sums (tensors: no sync per step), the samples
    this rank saw, and the epoch's seconds."""

    sums: dict[str, Tensor]
    seen: int
    seconds: float


def seed_epoch(seed: int, stage: int, stage_epoch: int, rank: int,
               device: torch.device) -> torch.Generator:
    """The augmentation generator of (stage, epoch, rank), and the global torch seed: both
    seeded so a resumed epoch replays exactly."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + stage * 10_007 + stage_epoch * 101 + rank)
    torch.manual_seed(seed * 7 + stage * 10_007 + stage_epoch * 101 + rank)
    return generator


def run_epoch(
    parts: StepParts,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: LrSchedule,
    phase: Phase,
    epoch: int,
    generator: torch.Generator,
) -> EpochStats:
    """Train ``model`` (the method, DDP-wrapped with several ranks) for epoch ``epoch`` of
    ``phase``: one optimizer step per batch, the learning rate set per step."""
    steps_per_epoch = len(parts.loader)
    model.train()
    sums: dict[str, Tensor] = {}
    unchecked: list[Tensor] = []
    started = time.perf_counter()
    seen = 0
    for step_in_epoch, loaded in enumerate(parts.loader):
        step = epoch * steps_per_epoch + step_in_epoch
        schedule.apply(optimizer, step)
        # (images, index), or stream mode's shards: (images, index, captions)
        batch_images, index = loaded[0], loaded[1]
        captions = loaded[2] if len(loaded) > 2 else None
        batch = _batch(parts, batch_images, index, phase.augment, generator, captions)
        with parts.autocast():
            outputs = model(batch)
        optimizer.zero_grad(set_to_none=True)
        parts.scaler.scale(outputs["loss"]).backward()
        parts.scaler.step(optimizer)
        parts.scaler.update()
        parts.method.on_train_step_end(step + 1, schedule.total_steps)
        parts.clock.first_step_done()
        for key, value in outputs.items():
            # Summed as tensors: converting every step would sync the GPU every step.
            sums[key] = sums.get(key, 0.0) + value.detach().float()
        unchecked.append(outputs["loss"].detach())
        if len(unchecked) == FINITE_CHECK_EVERY or step_in_epoch == steps_per_epoch - 1:
            check_finite(unchecked, step - len(unchecked) + 1, parts.stage, epoch, parts.device)
            unchecked = []
        seen += len(index)
        if step_in_epoch == steps_per_epoch // 2:  # tests: a worker killed mid-epoch
            maybe_inject_fault(parts.fault_hook, parts.stage, epoch,
                               bool(parts.fault_hook.get("in_process")), mid_epoch=True)
    return EpochStats(sums, seen, time.perf_counter() - started)


def _batch(
    parts: StepParts, images: Tensor, index: Tensor, augment: bool, generator: torch.Generator,
    captions: list[str] | None = None,
) -> Batch:
    """The method's batch: the images on the device, two augmented views when the phase wants
    them, and the batch's rows of the pseudo labels and caption tokens (streamed shards: the
    batch's ``captions``, tokenised here)."""
    images = images.to(parts.device, non_blocking=True)
    index = index.to(parts.device, non_blocking=True)
    views = [parts.augment(images, generator), parts.augment(images, generator)] if augment else []
    return Batch(
        images=to_float(images),
        views=views,
        index=index,
        pseudo_labels=parts.pseudo_labels[index] if parts.pseudo_labels is not None else None,
        texts=(parts.tokens[index] if parts.tokens is not None
               else parts.method.tokenize(captions).to(parts.device) if captions is not None
               else None),
    )


def check_finite(
    losses: list[Tensor], first_step: int, stage: int, epoch: int, device: torch.device
) -> None:
    """Raise :class:`NonFiniteLossError` (on every rank) when any of ``losses`` is NaN/inf."""
    values = torch.stack(losses).float()
    bad = ~torch.isfinite(values)
    if not any_rank(bool(bad.any()), device):
        return
    if bool(bad.any()):
        offset = int(bad.nonzero()[0, 0])
        where, value = f"step {first_step + offset}", f"{values[offset].item()}"
    else:
        where, value = f"steps {first_step}-{first_step + len(losses) - 1}", "on another rank"
    raise NonFiniteLossError(
        f"non-finite loss at stage {stage}, epoch {epoch + 1}, {where}: loss={value}; the trial "
        f"diverged (lower train.lr, use train.amp=bf16/off, or revisit the method's knobs, "
        f"e.g. a small simclr.temperature)")


__all__ = ["FINITE_CHECK_EVERY", "EpochStats", "StepParts", "check_finite", "run_epoch",
           "seed_epoch"]
