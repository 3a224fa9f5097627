"""One training epoch: the optimizer steps over the loader, then the epoch's report.

Read top to bottom, :func:`run_epoch` is the whole epoch: per batch, the learning rate of the
step, the method's batch, the forward pass under autocast, the scaled backward pass and the
optimizer step, the method's step hook (EMA, queues), and every
:data:`FINITE_CHECK_EVERY` steps the NaN/inf check of the loss. The loop knows nothing about a
particular method: ``method(batch)`` gives the loss. A loss that turns NaN/inf ends the trial at
the next check (and at the epoch's end) with :class:`NonFiniteLossError` on every rank, naming
the step and the value. :func:`report_epoch` hands the epoch's metrics and checkpoint on.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils import clip_grad_norm_

from raycl.data.augment import BatchAugment, to_float
from raycl.distributed import any_rank
from raycl.methods.base import Batch, Method, Phase
from raycl.worker.batches import TrainBatch, TrainLoader
from raycl.worker.faults import maybe_inject_fault
from raycl.worker.online_probe import OnlineProbe
from raycl.worker.optim import Autocast, LrSchedule
from raycl.worker.outcome import NonFiniteLossError
from raycl.worker.perf import Clock

if TYPE_CHECKING:  # Ray is imported by the session's module; the epoch runs without it (GPU bench)
    from raycl.worker.session import Session

# Losses are checked for NaN/inf every this many steps (and at each epoch's end): one device
# sync per check, so a GPU is not stalled every step, and a diverged trial still stops at once.
FINITE_CHECK_EVERY = 20


@dataclass(frozen=True)
class StepParts:
    """What every training step of one stage uses, built once per stage.

    Attributes:
        stage: index of the stage being trained.
        session: this rank's runtime (its device; where the epoch is reported).
        method: the stage's method (unwrapped: its hooks are called directly).
        loader: this rank's batches (:class:`~raycl.worker.batches.TrainBatch`), of the kind
            the trial reads its images with (:func:`raycl.worker.loader.trial_training_images`).
        augment: the batched, on-device augmentation that makes the views.
        pseudo_labels: MCL group code per training sample, on the device (None: none used).
        tokens: every caption tokenised once, on the device (None: no captions).
        autocast: the forward pass's autocast region.
        scaler: the loss scaler (a no-op unless fp16 on CUDA).
        clock: the start-up clock (the first step stops it).
        online_probe: the heads trained beside the method on each step's backbone features
            (``eval.online_probe``; None: off).
    """

    stage: int
    session: Session
    method: Method
    loader: TrainLoader
    augment: BatchAugment
    pseudo_labels: Tensor | None
    tokens: Tensor | None
    autocast: Autocast
    scaler: torch.amp.GradScaler
    clock: Clock
    online_probe: OnlineProbe | None = None

    @property
    def device(self) -> torch.device:
        return self.session.device


@dataclass(frozen=True)
class PhaseRun:
    """One phase of a stage in training: where it sits in the stage, and what its steps update.

    Attributes:
        index: the phase's position in the stage's phases.
        phase: the phase (its name, epochs, whether its batches are augmented).
        offset: epochs of the stage before this phase (seeds and MLflow steps count on).
        epochs: the phase's epochs.
        start_epoch: the epoch the phase (re)starts at: a resumed one's checkpointed epoch.
        model: the method, wrapped for data parallelism with several ranks.
        optimizer: the phase's optimizer.
        schedule: the phase's learning rate per step.
        clip_norm: the global gradient norm each step is clipped to (``train.grad_clip_norm``;
            None: not clipped).
    """

    index: int
    phase: Phase
    offset: int
    epochs: int
    start_epoch: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LrSchedule
    clip_norm: float | None = None


@dataclass(frozen=True)
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
    parts: StepParts, run: PhaseRun, epoch: int, generator: torch.Generator
) -> EpochStats:
    """Train ``run.model`` for epoch ``epoch`` of ``run.phase``: one optimizer step per batch,
    the learning rate set per step, the views drawn from ``generator``."""
    model, optimizer, schedule = run.model, run.optimizer, run.schedule
    probe = parts.online_probe
    steps_per_epoch = len(parts.loader)
    model.train()
    sums: dict[str, Tensor] = {}
    unchecked: list[Tensor] = []  # losses not yet checked for NaN/inf
    seen = 0
    started = time.perf_counter()
    for step_in_epoch, loaded in enumerate(parts.loader):
        step = epoch * steps_per_epoch + step_in_epoch
        schedule.apply(optimizer, step)
        batch = _batch(parts, loaded, run.phase.augment, generator)

        with parts.autocast(), probe.capturing() if probe is not None else nullcontext():
            outputs = model(batch)
        optimizer.zero_grad(set_to_none=True)
        parts.scaler.scale(outputs["loss"]).backward()
        if run.clip_norm is not None:  # on true gradients: fp16's scale taken out first
            parts.scaler.unscale_(optimizer)
            clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]],
                            run.clip_norm)
        parts.scaler.step(optimizer)
        parts.scaler.update()
        if probe is not None:  # its heads' own step, on the features the forward captured
            probe.step(batch.index)
        parts.method.on_train_step_end(step + 1, schedule.total_steps)
        parts.clock.first_step_done()

        for key, value in outputs.items():
            # Summed as tensors: converting every step would sync the GPU every step.
            sums[key] = sums.get(key, 0.0) + value.detach().float()
        seen += len(loaded.index)
        unchecked.append(outputs["loss"].detach())
        if len(unchecked) == FINITE_CHECK_EVERY or step_in_epoch == steps_per_epoch - 1:
            check_finite(unchecked, step - len(unchecked) + 1, parts.stage, epoch, parts.device)
            unchecked = []
        if step_in_epoch == steps_per_epoch // 2:  # tests: a worker killed mid-epoch
            maybe_inject_fault(parts.session, parts.stage, run.offset + epoch, mid_epoch=True)
    return EpochStats(sums=sums, seen=seen, seconds=time.perf_counter() - started)


def report_epoch(
    parts: StepParts, metrics: dict[str, Any], checkpoint_dir: str | None, completed: int
) -> None:
    """Report the epoch's ``metrics`` (and its checkpoint, when it wrote one) to the session,
    after ``completed`` epochs of the stage; then the tests' fault point
    (:mod:`raycl.worker.faults`): right after the report that registers the checkpoint."""
    parts.session.report(metrics, checkpoint_dir)
    maybe_inject_fault(parts.session, parts.stage, completed)


def _batch(
    parts: StepParts, loaded: TrainBatch, augment: bool, generator: torch.Generator
) -> Batch:
    """The method's batch of the ``loaded`` one: the images on the device, two augmented views
    when the phase wants them, and the batch's rows of the pseudo labels and caption tokens
    (streamed shards: the tokens the decoders made of the batch's captions, or its captions
    tokenised here)."""
    images = loaded.images.to(parts.device, non_blocking=True)
    index = loaded.index.to(parts.device, non_blocking=True)
    captions = loaded.captions
    views = ([parts.augment(images, generator, view=0),
              parts.augment(images, generator, view=1)] if augment else [])
    return Batch(
        images=to_float(images),
        views=views,
        index=index,
        pseudo_labels=parts.pseudo_labels[index] if parts.pseudo_labels is not None else None,
        texts=(parts.tokens[index] if parts.tokens is not None
               else loaded.tokens.to(parts.device, non_blocking=True)
               if loaded.tokens is not None
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


__all__ = ["FINITE_CHECK_EVERY", "EpochStats", "PhaseRun", "StepParts", "check_finite",
           "report_epoch", "run_epoch", "seed_epoch"]
