"""The Ray Train worker loop, shared by every method: one worker group per trial.

``train_loop_per_worker`` runs a whole trial: it loads the data once, resumes from the newest
readable checkpoint when there is one, and trains every stage (one for most methods, N for MCL).
For each stage it builds the method (from the registry) and the optimizer, and every epoch
reports ``train/*`` metrics, evaluations, ``perf/*`` figures and a checkpoint. Evaluations fit
probes on the training split and score the validation split (``val/linear/*``, ``val/knn/*``:
what a sweep selects on); the last epoch of a stage scores the test split too (``test/...``),
once. Between MCL stages the workers embed their shards, rank 0 clusters and broadcasts the
assignment (:mod:`raycl.stages`), and training goes on with a fresh encoder in the same processes.

The loop knows nothing about a particular method: it calls ``method(batch)`` for the loss,
``method.embed(images)`` for evaluation, ``method.param_groups()`` for the optimizer and
``method.on_train_step_end`` for EMA/queue updates. MCL only adds pseudo labels and the frozen
features of earlier stages (:class:`raycl.stages.StageInputs`).

A loss that turns NaN/inf ends the trial at the next check (every ``FINITE_CHECK_EVERY`` steps)
with a report naming the step and value (``raycl/failed``), which MLflow records as FAILED.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import posixpath
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from raycl.config import CoreConfig, apply_overrides, search_config_class
from raycl.data import DatasetSplits, load_dataset, stratified_subset
from raycl.data.augment import BatchAugment, to_float
from raycl.data.samplers import PseudoLabelBatchSampler
from raycl.distributed import any_rank, broadcast_from_rank0
from raycl.eval import evaluate_knn, evaluate_linear_splits
from raycl.eval.diagnostics import representation_diagnostics
from raycl.eval.image_retrieval import retrieval_scores
from raycl.eval.label_fractions import label_fraction_subset
from raycl.eval.multimodal import EvalSets, image_text_metrics, load_mmvp_sets
from raycl.eval.retrieval import neighbour_retrieval_accuracy
from raycl.eval.transfer import TransferSet, load_transfer_sets
from raycl.methods import build_method, method_class, stage_epochs, stage_phases
from raycl.methods.base import TRAIN_PHASE, Batch, Method, Phase
from raycl.queues import queue_buffer_names
from raycl.session import InProcessSession, RayTrainSession, Session
from raycl.stages import (
    DIAGNOSTICS_FILE,
    FEATURES_FILE,
    METRICS_FILE,
    PROGRESS_FILE,
    STAGE_INPUTS_FILE,
    STATE_FILE,
    Features,
    StageInputs,
    StageWeights,
    average_weights,
    cluster_stage,
    next_stage_inputs,
    soup_weights,
)
from raycl.worker.outcome import FAIL_REASON_KEY, FAILED_KEY, NonFiniteLossError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Small helpers


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



def _autocast(config: CoreConfig, device: torch.device) -> tuple[Any, torch.amp.GradScaler]:
    mode = config.train.amp
    if mode == "auto":
        mode = "fp16" if device.type == "cuda" else "off"
    if mode == "off":
        return nullcontext, torch.amp.GradScaler(device.type, enabled=False)
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16" and device.type == "cuda")
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler


def _batch_sampler(
    config: CoreConfig, inputs: StageInputs, num_samples: int, rank: int, world: int
) -> PseudoLabelBatchSampler | BatchSampler:
    per_rank = config.train.batch_size // world
    use_group_sampler = config.mcl.negatives == "sampler" and inputs.pseudo_labels is not None
    if use_group_sampler:
        return PseudoLabelBatchSampler(inputs.pseudo_labels, config.train.batch_size,
                                       num_replicas=world, rank=rank,
                                       seed=config.seed + 7919 * inputs.stage)
    indices = range(num_samples)
    sampler = (DistributedSampler(indices, num_replicas=world, rank=rank, shuffle=True,
                                  seed=config.seed + 7919 * inputs.stage, drop_last=True)
               if world > 1 else RandomSampler(indices))
    return BatchSampler(sampler, per_rank, drop_last=True)


class _Indexed(torch.utils.data.Dataset):
    """Batched indexing into the in-memory uint8 image tensor (no per-sample Python)."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.images[index], index


# ---------------------------------------------------------------------------------------------
# Features and evaluation


@torch.no_grad()
def embed_images(
    method: Method,
    images: np.ndarray,
    session: Session,
    batch_size: int = 512,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> np.ndarray:
    """Backbone features of every image, computed across all workers and gathered.

    Each rank embeds a contiguous shard (padded to equal length, as all_gather requires); every
    rank returns the full (N, D) array in dataset order. ``embed`` replaces ``method.embed``
    (e.g. ``method.project`` for the projection spectrum).
    """
    rank, world, device = session.rank, session.world_size, session.device
    embed = embed or method.embed
    total = len(images)
    shard = math.ceil(total / world)
    start, stop = min(total, rank * shard), min(total, (rank + 1) * shard)
    was_training = method.training
    method.eval()
    try:
        chunks = [embed(to_float(torch.from_numpy(images[i:min(stop, i + batch_size)])
                                 .to(device))).float()
                  for i in range(start, stop, batch_size)]
        # A rank with an empty shard still needs the width for the padded all_gather.
        dim = chunks[0].shape[1] if chunks else embed(
            to_float(torch.from_numpy(images[:1]).to(device))).shape[1]
    finally:
        method.train(was_training)
    local = torch.cat(chunks) if chunks else torch.zeros(0, dim, device=device)
    if world == 1:
        return local.cpu().numpy()
    padded = torch.zeros(shard, dim, device=device)
    padded[: len(local)] = local
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    torch.distributed.all_gather(gathered, padded)
    return torch.cat(gathered)[:total].cpu().numpy()


def evaluate_features(
    config: CoreConfig,
    data: DatasetSplits,
    features: Features,
    prefix: str = "",
    device: torch.device | None = None,
) -> dict[str, float]:
    """Linear probe and kNN per attribute, fit on ``features["train"]`` and scored on every other
    split in ``features``, as ``{prefix}{split}/linear/<attribute>``, ``.../knn/...``; image
    retrieval within each scored split on the first attribute, ``.../retrieval/rank1``,
    ``rank5`` and ``map`` (every image a query against the rest of its split).

    ``eval.max_train_samples`` caps the probe's training set with a seeded subset stratified on
    the first attribute (the first rows of a folder dataset would be its first classes). Each of
    ``eval.label_fractions`` adds a probe fit on that share of the (capped) training labels,
    ``.../linear_<percent>pct/<attribute>`` (and ``/mean``), on a subset seeded by ``seed``, so
    every evaluation of a trial uses the same one.
    """
    train_features = features["train"]
    train_labels = data.train.labels
    cap = config.eval.max_train_samples
    if cap is not None and cap < len(train_features):
        keep = stratified_subset(train_labels[data.attributes[0]], cap, config.seed)
        train_features = train_features[keep]
        train_labels = {name: labels[keep] for name, labels in train_labels.items()}
    eval_sets = {split: (values, data.split(split).labels)
                 for split, values in features.items() if split in ("val", "test")}
    backend = config.eval.linear_backend
    if backend == "auto":
        large = len(train_features) > 20_000 or (device is not None and device.type == "cuda")
        backend = "torch" if large else "sklearn"
    probe = partial(evaluate_linear_splits, eval_sets=eval_sets,
                    max_iter=config.eval.linear_max_iter, seed=config.seed, backend=backend,
                    device=device)
    # Probe name -> split -> scores; the shares of the labels probe the same splits.
    probes = {"linear": probe(train_features, train_labels)}
    for fraction in config.eval.label_fractions:
        keep = label_fraction_subset(train_labels[data.attributes[0]], fraction, config.seed)
        probes[f"linear_{config.eval.fraction_percent(fraction)}pct"] = probe(
            train_features[keep], {name: labels[keep] for name, labels in train_labels.items()})
    metrics: dict[str, float] = {}
    for split, (values, labels) in eval_sets.items():
        for probe_name, scores in probes.items():
            metrics.update({f"{prefix}{split}/{probe_name}/{name}": value
                            for name, value in scores[split].items()})
        knn = evaluate_knn(train_features, train_labels, values, labels, k=config.eval.knn_k)
        metrics.update({f"{prefix}{split}/knn/{name}": v for name, v in knn.items()})
        retrieval = retrieval_scores(values, labels[data.attributes[0]])
        metrics.update({f"{prefix}{split}/retrieval/{name}": v for name, v in retrieval.items()})
    return metrics


def evaluate_transfer(
    config: CoreConfig,
    transfer_sets: list[TransferSet],
    features: Features,
    prefix: str = "",
    device: torch.device | None = None,
) -> dict[str, float]:
    """Linear probe per transfer set, fit on its probe-training share and scored on its held-out
    share: ``{prefix}transfer/<name>/linear/<attribute>`` (and ``/mean``)."""
    metrics: dict[str, float] = {}
    for transfer in transfer_sets:
        scores = evaluate_linear_splits(
            features[transfer.train_key], transfer.train.labels,
            {"test": (features[transfer.test_key], transfer.test.labels)},
            max_iter=config.eval.linear_max_iter, seed=config.seed,
            backend="torch" if device is not None and device.type == "cuda" else "sklearn",
            device=device)
        metrics.update({f"{prefix}transfer/{transfer.name}/linear/{name}": value
                        for name, value in scores["test"].items()})
    return metrics


# ---------------------------------------------------------------------------------------------
# Checkpoints: written complete or not at all, read back with a fallback

# Losses are checked for NaN/inf every this many steps (and at each epoch's end): one device
# sync per check, so a GPU is not stalled every step, and a diverged trial still stops at once.
FINITE_CHECK_EVERY = 20
# Test images a method's end-of-trial pictures are drawn from (FGVR's reconstruction triples).
DIAGNOSTIC_IMAGES = 8


class CheckpointError(RuntimeError):
    """No checkpoint of the trial could be read back."""


@dataclass
class Restored:
    """Where a checkpoint says the trial stands.

    Attributes:
        directory: a private local copy of the checkpoint.
        progress: ``{"stage", "epoch", "stage_complete"}``.
        inputs: what the checkpointed stage got from the stages before it.
        state: model/optimizer/scaler state of that stage.
        features: the stage's features per split, when the stage is complete.
        metrics: the metrics reported with the checkpoint.
    """

    directory: Path
    progress: dict[str, Any]
    inputs: StageInputs
    state: dict[str, Any]
    features: Features | None
    metrics: dict[str, Any]


def read_checkpoint(directory: Path, device: torch.device) -> Restored:
    """Read every file of a raycl checkpoint; raises if any is missing, truncated or corrupt."""
    progress = json.loads((directory / PROGRESS_FILE).read_text())
    # weights_only: a checkpoint on shared storage must not be able to run code.
    state = torch.load(directory / STATE_FILE, map_location=device, weights_only=True)
    inputs = StageInputs.load(directory / STAGE_INPUTS_FILE)
    features = None
    if progress["stage_complete"]:
        with np.load(directory / FEATURES_FILE) as arrays:
            features = {split: arrays[split] for split in arrays.files}
    metrics = json.loads((directory / METRICS_FILE).read_text())
    if inputs.stage != progress["stage"]:
        raise ValueError(f"stage_inputs is for stage {inputs.stage}, progress for "
                         f"{progress['stage']}")
    return Restored(directory, progress, inputs, state, features, metrics)


def checkpoint_candidates(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """``latest``, then the older checkpoints beside it in the same run, newest first.

    Both Tune (``checkpoint_000007``) and Ray Train (``checkpoint_<timestamp>``) name checkpoint
    directories so that names sort in the order they were written.
    """
    import pyarrow.fs

    path = latest.path.rstrip("/")
    parent, name = posixpath.dirname(path), posixpath.basename(path)
    try:
        entries = latest.filesystem.get_file_info(pyarrow.fs.FileSelector(parent))
    except OSError:
        return [latest]
    older = sorted((entry.base_name for entry in entries
                    if entry.type == pyarrow.fs.FileType.Directory
                    and entry.base_name.startswith("checkpoint_") and entry.base_name < name),
                   reverse=True)
    return [latest, *(ray.train.Checkpoint(posixpath.join(parent, older_name),
                                           filesystem=latest.filesystem)
                      for older_name in older)]


def restore(session: Session) -> Restored | None:
    """The newest readable checkpoint of this trial, None when it has none.

    A corrupt or truncated latest checkpoint (a node died while writing it, a disk filled up)
    is skipped with a warning and the one before it is used: the trial repeats a few epochs
    rather than dying. When checkpoints exist but none can be read, the trial fails with one line
    naming each and why, rather than silently starting over.
    """
    latest = session.latest_checkpoint()
    if latest is None:
        return None
    problems = []
    for candidate in checkpoint_candidates(latest):
        directory = Path(tempfile.mkdtemp(prefix="raycl-restore-"))
        try:
            candidate.to_directory(str(directory))
            restored = read_checkpoint(directory, session.device)
        except Exception as exc:  # any unreadable file disqualifies the whole checkpoint
            shutil.rmtree(directory, ignore_errors=True)
            problem = f"{candidate.path}: {type(exc).__name__}: {exc}"
            logger.warning("checkpoint unreadable, trying an older one: %s", problem)
            problems.append(problem)
            continue
        if problems:
            logger.warning("resuming from %s instead of the latest checkpoint", candidate.path)
        return restored
    raise CheckpointError("no readable checkpoint to resume from: " + "; ".join(problems))


def _write_checkpoint(
    directory: Path,
    method: Method,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    progress: dict[str, Any],
    inputs: StageInputs,
    features: Features | None,
    metrics: dict[str, Any],
    diagnostics: dict[str, np.ndarray] | None = None,
    soup: StageWeights | None = None,
) -> None:
    # Tensors, numbers, strings and plain containers only: read back with weights_only=True.
    state = {"model": method.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict()}
    if soup is not None:  # a finished stage's share of the model soup
        state["soup"] = soup
    torch.save(state, directory / STATE_FILE)
    inputs.save(directory / STAGE_INPUTS_FILE)
    if features is not None:
        np.savez(directory / FEATURES_FILE, **features)
    (directory / METRICS_FILE).write_text(json.dumps(metrics))
    if diagnostics:
        np.savez(directory / DIAGNOSTICS_FILE, **diagnostics)
    # Written last: a checkpoint directory with progress.json is complete.
    (directory / PROGRESS_FILE).write_text(json.dumps(progress))


def _peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


# ---------------------------------------------------------------------------------------------
# The loop


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point: every stage of one trial on this worker (see
    :func:`run_trial_loop`)."""
    run_trial_loop(loop_config, RayTrainSession())


def run_trial_loop(loop_config: dict[str, Any], session: Session) -> None:
    """Train every stage of one trial: one worker group for the whole trial.

    ``loop_config``: ``config`` (dict), ``trial_started_at`` (``time.time()`` when the trial
    began, for the start-up figure), ``fault`` (tests only). The data is loaded once; between MCL
    stages the workers embed their shards and gather them, rank 0 clusters and broadcasts the
    assignment, and every rank goes on with a fresh encoder. A restart resumes from the newest
    readable checkpoint: inside the stage it was written in, or after it when that stage had
    finished.
    """
    config = search_config_class().model_validate(loop_config["config"])
    torch.set_num_threads(max(1, int(config.scaling.cpus_per_worker)))
    data = load_dataset(config.data, config.seed)
    if config.train.batch_size > len(data.train.images):
        raise ValueError(f"train.batch_size={config.train.batch_size} exceeds the training split "
                         f"({len(data.train.images)} samples)")
    # MMVP-style pairs score image-text methods only (a unimodal one has no statements to match).
    eval_sets = EvalSets(load_transfer_sets(config, data.channels),
                         load_mmvp_sets(config) if method_class(config).multimodal else {})
    clock = _Clock(loop_config.get("trial_started_at"))
    last_stage = config.num_stages - 1

    restored = restore(session)
    inputs, resume = StageInputs(), None
    if restored is not None:
        progress = restored.progress
        logger.info("resuming trial at stage %s epoch %s", progress["stage"], progress["epoch"])
        if progress["stage_complete"] and progress["stage"] == last_stage:
            _report_finished(restored, session)  # the trial had finished: nothing to train
            return
        inputs = restored.inputs
        if progress["stage_complete"]:
            assert restored.features is not None
            inputs = _between_stages(config, inputs, restored.features, restored.metrics,
                                     restored.state.get("soup"), session, clock)
            shutil.rmtree(restored.directory, ignore_errors=True)
        else:
            resume = restored
    try:
        while True:
            features, metrics, weights = _train_stage(config, data, eval_sets, inputs, session,
                                                      resume, clock, loop_config)
            resume = None
            if inputs.stage == last_stage:
                return
            inputs = _between_stages(config, inputs, features, metrics, weights, session, clock)
    except NonFiniteLossError as exc:
        # Every rank raised at the same check (the flag is all-reduced), so every rank reports.
        logger.error("%s", exc)
        report = {FAILED_KEY: 1.0, FAIL_REASON_KEY: str(exc)} if session.rank == 0 else {}
        session.report(report, None)


class _Clock:
    """Start-up (trial start to this process's first optimizer step) and between-stage times."""

    def __init__(self, trial_started_at: float | None) -> None:
        self.trial_started_at = trial_started_at or time.time()
        self.stepped = False
        # Measured but not reported yet: each figure goes out once, with the next report.
        self.pending: dict[str, float] = {}

    def first_step_done(self) -> None:
        if not self.stepped:
            self.stepped = True
            self.pending["perf/startup_seconds"] = time.time() - self.trial_started_at

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.pending = self.pending, {}
        return metrics


def _between_stages(
    config: CoreConfig,
    inputs: StageInputs,
    features: Features,
    metrics: dict[str, Any],
    weights: StageWeights | None,
    session: Session,
    clock: _Clock,
) -> StageInputs:
    """Rank 0 clusters stage j's training features; every rank gets the same assignment.
    ``weights``: the stage's soup weights (``mcl.integration: soup``), else None."""
    started = time.perf_counter()
    if session.rank == 0:
        assignment = cluster_stage(config, inputs, features).astype(np.int64)
    else:
        assignment = np.zeros(len(features["train"]), dtype=np.int64)
    assignment = broadcast_from_rank0(torch.from_numpy(assignment).to(session.device))
    clock.pending["perf/kmeans_seconds"] = time.perf_counter() - started
    return next_stage_inputs(config, inputs, features, metrics, assignment.cpu().numpy(),
                             weights)


def _report_finished(restored: Restored, session: Session) -> None:
    """A trial restarted after its last checkpoint: hand that checkpoint back (the trial process
    reads its features) with the evaluation it carried, on rank 0."""
    metrics = {key: value for key, value in restored.metrics.items() if "train/" not in key}
    if session.rank == 0:
        session.report(metrics, str(restored.directory))
    else:
        shutil.rmtree(restored.directory, ignore_errors=True)
        session.report({}, None)


def _check_finite(
    losses: list[torch.Tensor], first_step: int, stage: int, epoch: int, device: torch.device
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


def _train_stage(
    config: CoreConfig,
    data: DatasetSplits,
    eval_sets: EvalSets,
    inputs: StageInputs,
    session: Session,
    resume: Restored | None,
    clock: _Clock,
    loop_config: dict[str, Any],
) -> tuple[Features, dict[str, Any], StageWeights | None]:
    """Train stage ``inputs.stage`` with a fresh encoder (or the resumed one); return its features
    per split (every rank), its final metrics (rank 0) and, for ``mcl.integration: soup``, the
    weights the soup averages."""
    rank, world, device = session.rank, session.world_size, session.device
    torch.manual_seed(config.seed + 1000 * inputs.stage)
    np.random.seed(config.seed + 1000 * inputs.stage + rank)
    num_train = len(data.train.images)
    images = torch.from_numpy(data.train.images)
    feature_aware = inputs.pseudo_labels is not None and config.mcl.negatives != "none"
    pseudo_labels = torch.from_numpy(inputs.pseudo_labels).to(device) if feature_aware else None
    batch_sampler = _batch_sampler(config, inputs, num_train, rank, world)
    loader = DataLoader(_Indexed(images), batch_sampler=batch_sampler, collate_fn=lambda x: x,
                        num_workers=config.train.loader_workers,
                        pin_memory=device.type == "cuda")
    if len(loader) == 0:
        raise ValueError("no full batch per epoch: lower train.batch_size")
    augment = BatchAugment(config.augment)

    # A resumed stage takes its weights from the checkpoint: the model.pretrained file is not
    # read again (it may have moved since the trial started).
    cls = method_class(config)
    weight_files = {key: None for key in ("model.pretrained", *cls.weight_file_keys)}
    built_from = apply_overrides(config, weight_files) if resume is not None else config
    # Model soups average stages that start from the same weights; CLIP tuning always does.
    same_start = cls.stages_share_initial_weights or config.mcl.integration == "soup"
    torch.manual_seed(config.seed if same_start else config.seed + 1000 * inputs.stage)
    method = build_method(built_from, data.channels).to(device)
    # Every caption tokenised once; a batch takes its rows.
    tokens = (method.tokenize(data.train.captions).to(device)
              if cls.multimodal and data.train.captions is not None else None)
    phases = stage_phases(config)
    epochs_per_stage = stage_epochs(config)
    autocast, scaler = _autocast(config, device)
    steps_per_epoch = len(loader)

    first_phase, start_epoch = 0, 0
    if resume is not None:
        method.load_state_dict(resume.state["model"])
        # Checkpoints from before phases existed were all in the single "train" phase.
        first_phase = [phase.name for phase in phases].index(resume.progress.get("phase",
                                                                                 "train"))
        start_epoch = int(resume.progress["epoch"])

    features: Features = {}
    metrics: dict[str, Any] = {}
    soup = config.num_stages > 1 and config.mcl.integration == "soup"
    stage_soup: StageWeights | None = None  # the finished stage's share of the soup
    for phase_index in range(first_phase, len(phases)):
        phase = phases[phase_index]
        # Epochs of the stage before this phase: the augmentation seeds and the MLflow step
        # count through all phases, so no two epochs of a stage share them.
        offset = sum(earlier.epoch_count(config.train.epochs)
                     for earlier in phases[:phase_index])
        method.set_phase(phase.name)
        optimizer = build_optimizer(method, config, phase)
        if resume is not None:
            if start_epoch > 0:  # inside this phase (at 0 the state is the previous phase's)
                optimizer.load_state_dict(resume.state["optimizer"])
                scaler.load_state_dict(resume.state["scaler"])
            shutil.rmtree(resume.directory, ignore_errors=True)
            resume = None
        # Wrapped per phase: DDP registers the parameters that require grad when it is built.
        model: nn.Module = _data_parallel(method) if world > 1 else method
        epochs = phase.epoch_count(config.train.epochs)
        total_steps = epochs * steps_per_epoch
        warmup_steps = (int(config.train.warmup_epochs * steps_per_epoch)
                        if phase.lr is None else 0)
        for epoch in range(start_epoch, epochs):
            stage_epoch = offset + epoch
            if hasattr(batch_sampler, "set_epoch"):
                batch_sampler.set_epoch(stage_epoch)
            sampler = getattr(batch_sampler, "sampler", None)
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(stage_epoch)
            # One generator per (stage, epoch, rank): augmentations replay identically after a
            # resume.
            generator = torch.Generator(device=device)
            generator.manual_seed(config.seed * 1_000_003 + inputs.stage * 10_007
                                  + stage_epoch * 101 + rank)
            torch.manual_seed(config.seed * 7 + inputs.stage * 10_007 + stage_epoch * 101 + rank)

            model.train()
            sums: dict[str, torch.Tensor] = {}
            unchecked: list[torch.Tensor] = []
            started = time.perf_counter()
            seen = 0
            for step_in_epoch, (batch_images, index) in enumerate(loader):
                step = epoch * steps_per_epoch + step_in_epoch
                factor = 1.0 if phase.lr is not None else lr_factor(
                    step, total_steps, warmup_steps, config.train.lr_schedule)
                for group in optimizer.param_groups:
                    group["lr"] = group["initial_lr"] * factor
                batch_images = batch_images.to(device, non_blocking=True)
                index = index.to(device, non_blocking=True)
                views = ([augment(batch_images, generator), augment(batch_images, generator)]
                         if phase.augment else [])
                batch = Batch(
                    images=to_float(batch_images),
                    views=views,
                    index=index,
                    pseudo_labels=pseudo_labels[index] if pseudo_labels is not None else None,
                    texts=tokens[index] if tokens is not None else None,
                )
                with autocast():
                    outputs = model(batch)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(outputs["loss"]).backward()
                scaler.step(optimizer)
                scaler.update()
                method.on_train_step_end(step + 1, total_steps)
                clock.first_step_done()
                for key, value in outputs.items():
                    # Summed as tensors: converting every step would sync the GPU every step.
                    sums[key] = sums.get(key, 0.0) + value.detach().float()
                unchecked.append(outputs["loss"].detach())
                if len(unchecked) == FINITE_CHECK_EVERY or step_in_epoch == steps_per_epoch - 1:
                    _check_finite(unchecked, step - len(unchecked) + 1, inputs.stage, epoch,
                                  device)
                    unchecked = []
                seen += len(index)
            epoch_seconds = time.perf_counter() - started
            completed = epoch + 1
            last = completed == epochs and phase_index == len(phases) - 1

            metrics = {f"train/{key}": float(value) / steps_per_epoch
                       for key, value in sums.items()}
            metrics.update({
                "train/lr": optimizer.param_groups[0]["lr"],
                "train/images_per_second": seen * world / max(epoch_seconds, 1e-9),
                "stage": inputs.stage,
                "epoch": completed,
                # The MLflow step: stable across restarts, so a replayed epoch is logged once.
                "global_epoch": inputs.stage * epochs_per_stage + offset + completed,
                "resumed_from_epoch": start_epoch,
            })
            if len(phases) > 1:
                metrics["phase"] = phase.name
            if isinstance(batch_sampler, PseudoLabelBatchSampler):
                # How the pseudo-label groups filled batches: pure vs pooled leftovers vs dropped.
                metrics.update({f"train/sampler_{key}": float(value)
                                for key, value in batch_sampler.stats().items()})
            if config.num_stages > 1:
                metrics = {**metrics, **{f"stage{inputs.stage}/{key}": value
                                         for key, value in metrics.items() if "/" in key}}

            every = config.eval.every_n_epochs
            features = {}
            diagnostics = None
            if last or (phase.evaluate and every and completed % every == 0):
                features, evaluation, diagnostics = _evaluate(config, data, eval_sets,
                                                              inputs, method, session, last)
                metrics.update(evaluation)
            metrics.update(clock.pop_metrics())
            metrics["perf/peak_rss_mb"] = _peak_rss_mb()

            if last and soup:
                stage_soup = soup_weights(method)
            checkpoint_dir = None
            if rank == 0 and (last or completed == epochs
                              or completed % config.train.checkpoint_every == 0):
                checkpoint_dir = tempfile.mkdtemp(prefix="raycl-ckpt-")
                # A phase's last epoch is checkpointed as the next phase's epoch 0, so a
                # restart there does not redo the phase.
                at = ((phases[phase_index + 1].name, 0)
                      if completed == epochs and not last else (phase.name, completed))
                progress = {"stage": inputs.stage, "phase": at[0], "epoch": at[1],
                            "stage_complete": last}
                _write_checkpoint(Path(checkpoint_dir), method, optimizer, scaler, progress,
                                  inputs, features if last else None, metrics, diagnostics,
                                  stage_soup)
            session.report(metrics, checkpoint_dir)
            _maybe_inject_fault(loop_config, inputs.stage, offset + completed,
                                isinstance(session, InProcessSession))
        start_epoch = 0
    return features, metrics, stage_soup


def _data_parallel(method: Method) -> nn.Module:
    """DDP through Ray Train, minus the per-forward broadcast of queue buffers.

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
    return ray.train.torch.prepare_model(method)


def _evaluate(
    config: CoreConfig,
    data: DatasetSplits,
    eval_sets: EvalSets,
    inputs: StageInputs,
    method: Method,
    session: Session,
    last: bool,
) -> tuple[Features, dict[str, float], dict[str, np.ndarray] | None]:
    """Embed (every rank) and score (rank 0) one evaluation: train and val; after a stage's last
    epoch also test and the transfer sets; at the trial's end the diagnostics. MMVP-style pair
    sets are embedded like splits (``mmvp:val``, ``mmvp:test``), so stages integrate them too.

    Returns:
        The features per split, the metrics (rank 0; timings on every rank), and the diagnostic
        arrays for the plots (rank 0 at the trial's end, else None).
    """
    rank, device = session.rank, session.device
    # The test split (and the transfer sets) are embedded and scored once per stage, after its
    # last epoch.
    splits = ("train", "val", "test") if last else ("train", "val")
    started = time.perf_counter()

    def embed_all(model: Method) -> Features:
        embedded = {split: embed_images(model, data.split(split).images, session)
                    for split in splits}
        for transfer in eval_sets.transfer if last else []:
            embedded[transfer.train_key] = embed_images(model, transfer.train.images, session)
            embedded[transfer.test_key] = embed_images(model, transfer.test.images, session)
        for split, pairs in eval_sets.mmvp.items():
            if split in splits:
                embedded[f"mmvp:{split}"] = embed_images(model, pairs.images, session)
        return embedded

    features = embed_all(method)
    # The trial's representation: the stages so far integrated (MCL), or this stage alone.
    integrated, integrated_method = features, method
    if config.num_stages > 1:
        if config.mcl.integration == "soup" and inputs.weights:
            integrated_method = _soup(method, [*inputs.weights, soup_weights(method)])
            integrated = embed_all(integrated_method)
        else:
            integrated = inputs.integrated(features)
    diagnose = last and inputs.stage == config.num_stages - 1 and config.eval.diagnostics
    projections = None
    if diagnose and type(method).project is not Method.project:
        projections = embed_images(method, data.test.images, session, embed=method.project)
    metrics: dict[str, float] = {"perf/embed_seconds": time.perf_counter() - started}
    diagnostics = None
    if rank == 0:
        started = time.perf_counter()
        metrics.update(_evaluation_metrics(config, data, inputs, features, integrated, device,
                                           eval_sets, method, integrated_method))
        retrieval = neighbour_retrieval_accuracy(method, data, splits[1:], device)
        prefix = f"stage{inputs.stage}/" if config.num_stages > 1 else ""
        metrics.update({prefix + key: value for key, value in retrieval.items()})
        if diagnose and data.attributes:
            try:
                diag_metrics, diagnostics = representation_diagnostics(
                    integrated["test"], data.test.labels[data.attributes[0]], projections)
                diagnostics.update(_method_diagnostics(config, data, method, device))
                metrics.update(diag_metrics)
            except Exception:  # extras: a failure here must not cost the trial its results
                logger.exception("end-of-trial diagnostics failed; the trial's results are kept")
                diagnostics = None
        metrics["perf/eval_seconds"] = time.perf_counter() - started
    return features, metrics, diagnostics


def _soup(method: Method, weights: list[StageWeights]) -> Method:
    """A copy of ``method`` holding the average of the stages' soup weights (model soup)."""
    soup = copy.deepcopy(method)
    soup.load_state_dict(average_weights(weights), strict=False)
    return soup


def _method_diagnostics(
    config: CoreConfig, data: DatasetSplits, method: Method, device: torch.device
) -> dict[str, np.ndarray]:
    """The method's picture arrays (:meth:`Method.diagnostic_arrays`) on the first test images,
    with two augmented views each, the model in eval mode."""
    images = torch.from_numpy(data.test.images[:DIAGNOSTIC_IMAGES]).to(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed)
    augment = BatchAugment(config.augment)
    batch = Batch(images=to_float(images),
                  views=[augment(images, generator), augment(images, generator)],
                  index=torch.arange(len(images), device=device))
    was_training = method.training
    method.eval()
    try:
        return method.diagnostic_arrays(batch)
    finally:
        method.train(was_training)


def _maybe_inject_fault(
    loop_config: dict[str, Any], stage: int, completed: int, local_mode: bool
) -> None:
    """Test hook: die once after epoch ``after_epoch`` of stage ``stage`` (default 0); the
    marker file records that we did. ``settle_seconds`` waits first, so Ray Train's controller
    has polled the epoch's report (without it the crash races the checkpoint's registration)."""
    fault = loop_config.get("fault")
    if (not fault or stage != fault.get("stage", 0) or completed != fault["after_epoch"]
            or Path(fault["marker"]).exists()):
        return
    Path(fault["marker"]).write_text(str(completed))
    if local_mode:
        raise RuntimeError("injected fault")
    time.sleep(float(fault.get("settle_seconds", 0)))
    os._exit(1)  # a hard worker crash, not an exception Ray could see coming


def _evaluation_metrics(
    config: CoreConfig,
    data: DatasetSplits,
    inputs: StageInputs,
    features: Features,
    integrated: Features,
    device: torch.device,
    eval_sets: EvalSets,
    method: Method,
    integrated_method: Method,
) -> dict[str, float]:
    """This stage's encoder alone, and (MCL) the integration of the stages so far
    (concatenated features, or the model soup's).

    The integrated representation is the trial's result: its test split and transfer sets are
    scored only after the last stage, so every trial scores them exactly once.
    """

    def scores(values: Features, prefix: str, model: Method) -> dict[str, float]:
        metrics = evaluate_features(config, data, values, prefix, device) \
            if data.attributes else {}
        if "test" in values:  # a stage's last epoch: the transfer sets were embedded too
            metrics.update(evaluate_transfer(config, eval_sets.transfer, values, prefix,
                                             device))
        if type(model).multimodal:
            metrics.update(image_text_metrics(model, data, values, eval_sets.mmvp, prefix,
                                              device, config.eval.mmvp_direction))
        return metrics

    if config.num_stages == 1:
        return scores(features, "", method)
    metrics = scores(features, f"stage{inputs.stage}/", method)
    if inputs.stage < config.num_stages - 1:
        integrated = {split: values for split, values in integrated.items()
                      if split in ("train", "val", "mmvp:val")}
    return {**metrics, **scores(integrated, "", integrated_method)}


__all__ = ["embed_images", "lr_factor", "restore", "run_trial_loop",
           "train_loop_per_worker"]
