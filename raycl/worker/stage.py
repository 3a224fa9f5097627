"""Training one stage: a fresh (or resumed) method, its phases, and every epoch's report.

A stage builds its loader and its method once, then runs the method's phases (most methods have
one, ``train``; FGVR pre-trains its decoder first) with an optimizer per phase. After every
epoch it reports ``train/*``, ``perf/*`` and, when due, an evaluation, with a checkpoint every
``train.checkpoint_every`` epochs and at the end of each phase. A resumed stage starts at the
checkpoint's phase and epoch with the checkpoint's model, optimizer and scaler state.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raycl.config.metric_names import (
    TRAIN,
    metric_name,
    staged,
)
from raycl.config.schema import CoreConfig
from raycl.config.search_config import apply_overrides
from raycl.data import DatasetSplits
from raycl.data.augment import BatchAugment
from raycl.distributed import single_rank_section
from raycl.eval.multimodal import EvalSets
from raycl.methods import build_method, method_class, stage_epochs, stage_phases
from raycl.methods.base import Method, Phase
from raycl.methods.queues import queue_buffer_names
from raycl.worker.checkpoints import Restored, write_checkpoint
from raycl.worker.context import TrialContext
from raycl.worker.cuda import prefer_channels_last
from raycl.worker.device_hours import DEVICE_HOURS, trial_devices
from raycl.worker.epoch import (
    EpochStats,
    PhaseRun,
    StepParts,
    report_epoch,
    run_epoch,
    seed_epoch,
)
from raycl.worker.evaluate import evaluate_epoch, scored_subset
from raycl.worker.loader import TrainImages, build_loader
from raycl.worker.online_probe import OnlineProbe
from raycl.worker.optim import (
    LrSchedule,
    autocast_and_scaler,
    build_optimizer,
    effective_lr,
    load_optimizer_state,
    load_scaler_state,
)
from raycl.worker.perf import Clock, peak_rss_mb
from raycl.worker.session import Session
from raycl.worker.stage_integration import (
    Features,
    StageInputs,
    StageWeights,
    checkpointed_features,
    kept_weights,
)


@dataclass
class StageResult:
    """What a stage hands on: its features per split (rank 0 only: every other rank's is
    empty), its final metrics (rank 0) and, for MCL, the weights it keeps
    (:func:`~raycl.worker.stage_integration.kept_weights`: its soup share or its encoder)."""

    features: Features = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    weights: StageWeights | None = None


@dataclass(frozen=True)
class _Stage:
    """One stage in training: the trial's data, the stage's inputs and the parts built for it.

    Attributes:
        config: the trial's config.
        data: the trial's splits (evaluated when due).
        eval_sets: the trial's transfer and MMVP sets.
        inputs: what the previous stages hand this one (its index, pseudo labels).
        parts: what every step of the stage uses (its session, method, loader, ...).
        phases: the stage's phases (most methods: ``train`` alone).
        epochs_per_stage: epochs over all phases: the MLflow step of a stage's first epoch.
    """

    config: CoreConfig
    data: DatasetSplits
    eval_sets: EvalSets
    inputs: StageInputs
    parts: StepParts
    phases: list[Phase]
    epochs_per_stage: int

    @property
    def session(self) -> Session:
        return self.parts.session


def train_stage(
    context: TrialContext,
    data: DatasetSplits,
    train_images: TrainImages,
    eval_sets: EvalSets,
    inputs: StageInputs,
    session: Session,
    resume: Restored | None,
    clock: Clock,
) -> StageResult:
    """Train stage ``inputs.stage`` of ``context``'s trial with a fresh encoder (or the one
    ``resume`` holds), every phase and epoch of it, reporting each epoch. ``train_images``:
    what the trial pretrains on (:func:`~raycl.worker.loader.trial_training_images`, built once
    per trial)."""
    config = context.config
    torch.manual_seed(config.seed + 1000 * inputs.stage)
    np.random.seed(config.seed + 1000 * inputs.stage + session.rank)
    parts = _build_parts(context, data, train_images, inputs, session, resume, clock)
    stage = _Stage(config=config, data=data, eval_sets=eval_sets, inputs=inputs, parts=parts,
                   phases=stage_phases(config), epochs_per_stage=stage_epochs(config))
    first_phase, start_epoch = _resume_position(stage.phases, resume)
    result = StageResult()
    for phase_index in range(first_phase, len(stage.phases)):
        run = _start_phase(stage, phase_index, start_epoch, resume)
        resume, start_epoch = None, 0
        for epoch in range(run.start_epoch, run.epochs):
            stage.parts.loader.set_epoch(run.offset + epoch)
            generator = seed_epoch(config.seed, inputs.stage, run.offset + epoch,
                                   session.rank, session.device)
            stats = run_epoch(stage.parts, run, epoch, generator)
            result = _end_epoch(stage, run, stats, epoch + 1)
    return result


def _build_parts(
    context: TrialContext,
    data: DatasetSplits,
    train_images: TrainImages,
    inputs: StageInputs,
    session: Session,
    resume: Restored | None,
    clock: Clock,
) -> StepParts:
    """The stage's loader (stream mode's decoders run in the trial's
    ``context.data_placement_group``), method (see :func:`build_stage_method`), pseudo labels,
    caption tokens, augmentation and mixed precision."""
    config, device = context.config, session.device
    feature_aware = inputs.pseudo_labels is not None and config.mcl.negatives != "none"
    pseudo_labels = torch.from_numpy(inputs.pseudo_labels).to(device) if feature_aware else None
    multimodal = method_class(config).multimodal
    loader = build_loader(config, train_images, inputs, session,
                          context.data_placement_group, need_captions=multimodal)
    method = build_stage_method(config, data.channels, inputs.stage, device, resume)
    # Every caption tokenised once; a batch takes its rows.
    tokens = (method.tokenize(data.train.captions).to(device)
              if multimodal and data.train.captions is not None else None)
    autocast, scaler = autocast_and_scaler(config, device)
    return StepParts(stage=inputs.stage, session=session, method=method, loader=loader,
                     augment=BatchAugment(config.augment), pseudo_labels=pseudo_labels,
                     tokens=tokens, autocast=autocast, scaler=scaler, clock=clock,
                     online_probe=_online_probe(config, data, method, device, resume))


def _online_probe(config: CoreConfig, data: DatasetSplits, method: Method,
                  device: torch.device, resume: Restored | None) -> OnlineProbe | None:
    """The online probe's heads (``eval.online_probe``), with the checkpoint's when resumed."""
    if not config.eval.online_probe or not data.attributes:
        return None
    probe = OnlineProbe(method.backbone, {name: data.train.labels[name]
                                          for name in data.attributes},
                        data.num_classes, config.eval.online_probe_lr, device)
    if resume is not None:
        probe.load_state_dict(resume.state.pop("online_probe", {}))
    return probe


def build_stage_method(
    config: CoreConfig, channels: int, stage: int, device: torch.device,
    resume: Restored | None,
) -> Method:
    """The stage's method on ``device``: built fresh (seeded by the stage, or alike for every
    stage when stages share their initial weights), then given the checkpoint's weights when
    ``resume`` is set."""
    cls = method_class(config)
    # A resumed stage takes its weights from the checkpoint: the model.pretrained file is not
    # read again (it may have moved since the trial started).
    weight_files = {key: None for key in ("model.pretrained", *cls.weight_file_keys)}
    built_from = apply_overrides(config, weight_files) if resume is not None else config
    # Model soups average stages that start from the same weights; CLIP tuning always does.
    same_start = cls.stages_share_initial_weights or config.mcl.integration == "soup"
    torch.manual_seed(config.seed if same_start else config.seed + 1000 * stage)
    method = prefer_channels_last(build_method(built_from, channels).to(device), device)
    if resume is not None:  # taken out of the checkpoint: once loaded, nothing keeps it
        method.load_state_dict(resume.state.pop("model"))
    return method


def _resume_position(phases: list[Phase], resume: Restored | None) -> tuple[int, int]:
    """The phase index and epoch the stage starts at: 0, 0 unless resumed."""
    if resume is None:
        return 0, 0
    # Checkpoints from before phases existed were all in the single "train" phase.
    phase = [phase.name for phase in phases].index(resume.progress.get("phase", "train"))
    return phase, int(resume.progress["epoch"])


def _start_phase(
    stage: _Stage, index: int, start_epoch: int, resume: Restored | None
) -> PhaseRun:
    """Switch the method to phase ``index``, build its optimizer (with the checkpoint's state
    when resumed inside the phase) and wrap the model for data parallelism."""
    config, method, phase = stage.config, stage.parts.method, stage.phases[index]
    # Epochs of the stage before this phase: the augmentation seeds and the MLflow step
    # count through all phases, so no two epochs of a stage share them.
    offset = sum(earlier.epoch_count(config.train.epochs) for earlier in stage.phases[:index])
    method.set_phase(phase.name)
    optimizer = build_optimizer(method, config, phase)
    if resume is not None:
        # Taken out of the checkpoint: once loaded (or unused), nothing keeps it in memory.
        optimizer_state, scaler_state = resume.state.pop("optimizer"), resume.state.pop("scaler")
        if start_epoch > 0:  # inside this phase (at 0 the state is the previous phase's)
            load_optimizer_state(optimizer, optimizer_state)  # the config's rates win
            load_scaler_state(stage.parts.scaler, scaler_state)
        del optimizer_state, scaler_state
        shutil.rmtree(resume.directory, ignore_errors=True)
    # Wrapped per phase: DDP registers the parameters that require grad when it is built.
    model = (data_parallel(method, stage.session, config.model.sync_batchnorm)
             if stage.session.world_size > 1 else method)
    epochs = phase.epoch_count(config.train.epochs)
    schedule = LrSchedule.for_phase(config, phase, epochs, len(stage.parts.loader))
    return PhaseRun(index=index, phase=phase, offset=offset, epochs=epochs,
                    start_epoch=start_epoch, model=model, optimizer=optimizer, schedule=schedule,
                    clip_norm=config.train.grad_clip_norm)


def data_parallel(method: Method, session: Session, sync_bn: bool = False) -> nn.Module:
    """DDP as the session sets it up (Ray Train's, or plain DDP over a process group set up by
    hand), minus the per-forward broadcast of queue buffers.

    DDP re-broadcasts every buffer from rank 0 at each forward (``broadcast_buffers=True``, which
    BatchNorm statistics need). A support-set queue is identical on every rank by construction
    (each rank writes the same gathered rows), and re-sending a 98k x 256 queue would cost 100 MB
    per step, so its buffers are excluded with DDP's ignore list (a private but long-standing
    PyTorch API; it also skips them in DDP's initial sync, which the identical seeded
    initialisation makes unnecessary).
    """
    ignored = queue_buffer_names(method)
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(method, ignored)
    return session.wrap_model(method, sync_bn)  # sync_bn: model.sync_batchnorm


def _end_epoch(stage: _Stage, run: PhaseRun, stats: EpochStats, completed: int) -> StageResult:
    """After epoch ``completed`` of the phase: its metrics, the evaluation when due, the
    checkpoint when due (rank 0), and the report. (The untrained backbone's scores,
    ``eval.baseline``, are the sweep's, once: :mod:`raycl.sweep.baseline`.)"""
    config, inputs, session = stage.config, stage.inputs, stage.session
    method = stage.parts.method
    last = completed == run.epochs and run.index == len(stage.phases) - 1
    metrics = _epoch_metrics(stage, run, stats, completed)
    every = config.eval.every_n_epochs
    features: Features = {}
    diagnostics = None
    if last or (run.phase.evaluate and every and completed % every == 0):
        features, evaluation, diagnostics = evaluate_epoch(
            config, stage.data, stage.eval_sets, inputs, method, session, last)
        metrics.update(evaluation)  # eval.linear_sgd's too at the trial's end
        metrics.update(_online_probe_scores(stage, features))
    metrics.update(stage.parts.clock.pop_metrics())
    metrics["perf/peak_rss_mb"] = peak_rss_mb()
    metrics[DEVICE_HOURS] = stage.parts.clock.device_hours(trial_devices(config.scaling))
    # The finished stage's kept weights (its soup share or, concat, its encoder): in its last
    # checkpoint, so a trial resumed after the stage still has them.
    soup = kept_weights(config, method) if last else None
    progress = checkpoint_progress(config, stage.phases, run.index, run.epochs, completed,
                                   inputs.stage)
    checkpoint_dir = None
    if session.rank == 0 and progress is not None:
        checkpoint_dir = tempfile.mkdtemp(prefix="raycl-ckpt-")
        # Only the features a trial resumed after this stage reads: none after the last stage.
        kept = checkpointed_features(config, inputs.stage, features) if last else None
        with single_rank_section("rank 0's checkpoint writing"):
            write_checkpoint(Path(checkpoint_dir), method, run.optimizer, stage.parts.scaler,
                             progress, inputs, kept, metrics,
                             diagnostics, soup, run=session.run_storage(),
                             extra=_probe_state(stage.parts.online_probe))
    report_epoch(stage.parts, metrics, checkpoint_dir, run.offset + completed)
    return StageResult(features=features, metrics=metrics, weights=soup)


def _online_probe_scores(stage: _Stage, features: Features) -> dict[str, float]:
    """Rank 0: the online probe's heads on the val (and at the end test) embeddings the
    evaluation computed, at the rows it scored."""
    probe = stage.parts.online_probe
    if probe is None or stage.session.rank != 0:
        return {}
    scores: dict[str, float] = {}
    with single_rank_section("rank 0's online probe scores"):  # local: no collective in here
        for split in ("val", "test"):
            if split in features:
                rows = scored_subset(stage.config, stage.data, split)
                labels = stage.data.split(split).labels
                scores.update(probe.score(split, features[split], {
                    name: values if rows is None else values[rows]
                    for name, values in labels.items()}))
    return scores


def _probe_state(probe: OnlineProbe | None) -> dict[str, Any] | None:
    return None if probe is None else {"online_probe": probe.state_dict()}


def _epoch_metrics(
    stage: _Stage, run: PhaseRun, stats: EpochStats, completed: int
) -> dict[str, Any]:
    """The epoch's ``train/*`` means, throughput and position (stage, epoch, the MLflow step);
    for MCL also under ``stage<j>/``."""
    config, inputs = stage.config, stage.inputs
    steps_per_epoch = len(stage.parts.loader)
    metrics: dict[str, Any] = {metric_name(TRAIN, None, key): float(value) / steps_per_epoch
                               for key, value in stats.sums.items()}
    metrics.update({
        "train/lr": run.optimizer.param_groups[0]["lr"],
        # The phase's peak base rate, after train.lr_scaling (train/lr is the scheduled one).
        "train/effective_lr": effective_lr(config, run.phase),
        "train/images_per_second": (stats.seen * stage.session.world_size
                                    / max(stats.seconds, 1e-9)),
        "stage": inputs.stage,
        "epoch": completed,
        # The MLflow step: stable across restarts, so a replayed epoch is logged once.
        "global_epoch": inputs.stage * stage.epochs_per_stage + run.offset + completed,
        "resumed_from_epoch": run.start_epoch,
    })
    if len(stage.phases) > 1:
        metrics["phase"] = run.phase.name
    metrics.update(stage.parts.loader.pop_metrics())  # train/sampler_*, data/skipped
    if stage.parts.online_probe is not None:  # a collective: every rank, every epoch
        metrics.update(stage.parts.online_probe.pop_metrics())
    if stage.data.skipped:  # left out by data.skip_unreadable: counted beside stream's skips
        metrics["data/skipped"] = metrics.get("data/skipped", 0.0) + len(stage.data.skipped)
    if config.num_stages > 1:
        metrics = {**metrics, **{staged(key, inputs.stage): value
                                 for key, value in metrics.items() if "/" in key}}
    return metrics


def checkpoint_progress(
    config: CoreConfig, phases: list[Phase], phase_index: int, epochs: int, completed: int,
    stage: int,
) -> dict[str, Any] | None:
    """The ``progress.json`` of a checkpoint after epoch ``completed`` of phase ``phase_index``
    (of ``epochs``), or None when that epoch writes none: every ``train.checkpoint_every``
    epochs, at the end of every phase, and at the end of the stage."""
    last_phase = phase_index == len(phases) - 1
    last = completed == epochs and last_phase
    if not (last or completed == epochs or completed % config.train.checkpoint_every == 0):
        return None
    # A phase's last epoch is checkpointed as the next phase's epoch 0, so a restart there does
    # not redo the phase.
    phase, epoch = ((phases[phase_index + 1].name, 0) if completed == epochs and not last
                    else (phases[phase_index].name, completed))
    return {"stage": stage, "phase": phase, "epoch": epoch, "stage_complete": last}


__all__ = ["StageResult", "build_stage_method", "checkpoint_progress", "data_parallel",
           "train_stage"]
