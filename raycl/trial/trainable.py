"""A trial: one ``TorchTrainer`` (or, with ``scaling.num_workers: 0``, the same loop in the trial
process) that trains every stage of the trial, then the end-of-trial plots (spectrum, principal
angles) and MCL's diagnostics.

The worker loop (:func:`raycl.worker.loop.run_trial_loop`) does all the training, MCL's stages
and the clustering between them included, so a trial pays for one worker group however many
stages it has. Resumption: every checkpoint carries the clusterings of the finished stages and
a reference to their frozen features, written once beside the checkpoints
(``stage_inputs.npz``, :mod:`raycl.worker.checkpoints`). A restarted trial resumes from Tune's
checkpoint (in-process mode) or re-creates its trainer under the same run name, which Ray Train
resumes from storage; a PBT trial's trainer starts a fresh run from Tune's checkpoint at every
start instead (:mod:`raycl.trial.population_workers`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
from ray import tune
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig

import raycl.methods  # noqa: F401  (fills the schema's method sections in a trial process)
from raycl.config.metric_names import MCL, metric_name
from raycl.config.schema import CoreConfig
from raycl.config.search_config import apply_overrides, search_config_class
from raycl.config.sweep import trial_values
from raycl.data import attributes_of, split_sizes_for
from raycl.data.listed_once import listed_once
from raycl.eval.diagnostics import SPECTRUM, plot_diagnostics
from raycl.eval.figures import mcl_figure, method_figures
from raycl.launch.feasibility import trial_problem
from raycl.launch.reservations import worker_resources
from raycl.trial.population_workers import (
    PopulationStart,
    StartingSession,
    trains_population_with_workers,
)
from raycl.trial.torch_trainer import TorchTrainerWithoutDatasets
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop, train_loop_per_worker
from raycl.worker.outcome import FAILED_KEY, SKIP_REASON_KEY, SKIPPED_KEY
from raycl.worker.session import InProcessSession
from raycl.worker.stage_integration import (
    DIAGNOSTICS_FILE,
    MCL_AMI,
    MCL_GROUP_SIZES,
    MCL_STAGE_METRICS,
)
from raycl.worker.storage import download

logger = logging.getLogger(__name__)


def _trial_id() -> str:
    try:
        return tune.get_context().get_trial_id() or "local"
    except Exception:  # not inside Tune (a direct call from a test or a notebook)
        return "local"


def _in_tune() -> bool:
    from ray.tune.trainable.trainable_fn_utils import _in_tune_session

    return _in_tune_session()


def _device(config: CoreConfig) -> torch.device:
    if config.scaling.use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("scaling.use_gpu is true but this process sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass
class TrialOutput:
    """What a trial's training left: its last report and its last checkpoint (a local directory
    the caller removes, with at least the checkpoint's diagnostics; None when the trial ended
    without one, e.g. a diverged loss)."""

    last_report: dict[str, Any]
    checkpoint_dir: Path | None


def fit_trial(
    config: CoreConfig, storage_path: str, trial_started_at: float | None = None
) -> TrialOutput:
    """Train every stage of one trial.

    ``scaling.num_workers >= 1``: one ``TorchTrainer`` whose run name is stable per trial, so a
    restarted trial's trainer resumes from Ray Train's storage (a PBT trial's: from Tune's
    checkpoint, :mod:`raycl.trial.population_workers`). ``0``: the same loop in this
    process (see :class:`raycl.worker.session.InProcessSession`), resuming from Tune's checkpoint.
    """
    # Stream mode's decoders need no placement group named here: each worker's bundle holds
    # them and its loader schedules them there (raycl.worker.stream_loader.decoder_bundle).
    context = TrialContext(config=config, trial_id=_trial_id(),
                           started_at=trial_started_at or time.time())
    if config.scaling.num_workers == 0:
        session = InProcessSession(_device(config), tune.get_checkpoint() if _in_tune() else None)
        run_trial_loop(context, session)
        directory = session.last_checkpoint_dir
        return TrialOutput(last_report=session.last_report,
                           checkpoint_dir=Path(directory) if directory else None)

    run_name, callbacks, population = f"{config.name}-{_trial_id()}", [], None
    if _in_tune() and trains_population_with_workers(config):
        # PBT: every start a fresh Train run from Tune's checkpoint
        # (raycl.trial.population_workers says why)
        population = PopulationStart(run_name, storage_path)
        run_name, callbacks = population.run_name, population.callbacks()
    elif _in_tune():
        from ray.tune.integration.ray_train import TuneReportCallback

        callbacks.append(TuneReportCallback())
    trainer = TorchTrainerWithoutDatasets(
        # The context travels with the function (pickled once per worker): Ray Train's
        # per-worker config argument is a plain dict.
        functools.partial(_train_loop, context, population.start if population else None),
        # The default group's watchdog, named rather than inherited (raycl's single-rank
        # phases wait outside it: raycl.worker.evaluate, raycl.worker.data_barrier).
        torch_config=TorchConfig(timeout_s=config.scaling.collective_timeout_s),
        scaling_config=ScalingConfig(
            num_workers=config.scaling.num_workers,
            use_gpu=config.scaling.use_gpu,
            # CPU (training's, and stream mode's decoders' on the same node), GPU and
            # scaling.resources_per_worker (a node type's resource)
            resources_per_worker=worker_resources(config),
        ),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=config.scaling.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=callbacks,
            # WARNING for a quiet sweep (raycl.sweep.local_ray.init_ray sets it): Ray Train's
            # controller and workers otherwise log every checkpoint at INFO.
            logging_config=LoggingConfig(
                log_level=os.environ.get("RAYCL_TRAIN_LOG_LEVEL", "INFO")),
        ),
    )
    result = population.fit(trainer) if population else trainer.fit()
    directory = None
    if result.checkpoint is not None:
        # The trial process only plots the worker's diagnostics: the final checkpoint's model,
        # optimizer and features stay in storage.
        directory = download(result.checkpoint, Path(tempfile.mkdtemp(prefix="raycl-final-")),
                             only=[DIAGNOSTICS_FILE])
    return TrialOutput(last_report=dict(result.metrics or {}), checkpoint_dir=directory)


def _train_loop(context: TrialContext, start: ray.train.Checkpoint | None = None) -> None:
    """``train_loop_per_worker`` at the sweep's log level: Ray Train 2.60 sets a worker's root
    and ``ray.train`` loggers to INFO whatever ``LoggingConfig`` says ("Reporting training
    result ..." per epoch); ``RAYCL_TRAIN_LOG_LEVEL`` (a quiet sweep, :func:`raycl.tune
    .init_ray`) turns them down to warnings."""
    level = os.environ.get("RAYCL_TRAIN_LOG_LEVEL")
    if level:
        for name in ("", "ray.train"):
            logging.getLogger(name).setLevel(level)
    if start is not None:  # a population trial's start, from Tune's checkpoint
        # (raycl.trial.population_workers)
        run_trial_loop(context, StartingSession(start))
    else:
        train_loop_per_worker(context)


def run_trial(params: dict[str, Any], base_config: dict[str, Any], storage_path: str) -> None:
    """The Tune trainable: apply the sampled ``params`` (dotted keys) and train the trial."""
    with listed_once():  # the trial's checks and (in this process) its data: one listing
        _run_trial(params, base_config, storage_path)


def _run_trial(params: dict[str, Any], base_config: dict[str, Any], storage_path: str) -> None:
    started = time.time()
    config = apply_overrides(search_config_class().model_validate(base_config),
                             trial_values(params))
    # A safety net: the searcher only proposes feasible trials (raycl.launch.feasibility), but a
    # trial that still cannot train is pruned before any training. Optuna records a trial without
    # the metric as PRUNED.
    problem = trial_problem(config, split_sizes_for(config.data)["train"])
    if problem:
        reason = f"{problem[0]}: {problem[1]}"
        logger.warning("skipping trial: %s", reason)
        tune.report({SKIPPED_KEY: 1.0, SKIP_REASON_KEY: reason})
        return

    output = fit_trial(config, storage_path, trial_started_at=started)
    try:
        if output.last_report.get(FAILED_KEY) or output.checkpoint_dir is None:
            return
        log_trial_figures(config, output.checkpoint_dir / DIAGNOSTICS_FILE)
    finally:
        if output.checkpoint_dir is not None:
            shutil.rmtree(output.checkpoint_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Diagnostics


def log_trial_figures(config: CoreConfig, path: Path) -> None:
    """The figures of the worker's end-of-trial diagnostics (``diagnostics.npz`` of the last
    checkpoint), logged to the trial's run: the spectrum and principal angles (their numbers,
    ``diag/*``, came with the last report), the method's pictures, and MCL's summary."""
    if not path.exists():  # no diagnostics, or a trial restored from an older checkpoint
        return
    from raycl.tracking.relay import log_to_trial_run

    with np.load(path) as stored:
        arrays = {key: stored[key] for key in stored.files}
    with tempfile.TemporaryDirectory() as directory:
        title = f"{config.name} {_trial_id()}"
        # No spectrum with eval.diagnostics off: MCL's summary may come alone.
        written = plot_diagnostics(arrays, Path(directory), title) if SPECTRUM in arrays else []
        written += method_figures(arrays, Path(directory), title)
        if written:
            log_to_trial_run(config, _trial_id(), {}, Path(directory))
    if MCL_AMI in arrays:
        log_mcl_diagnostics(config, arrays)


def log_mcl_diagnostics(config: CoreConfig, arrays: dict[str, np.ndarray]) -> None:
    """AMI between stage clusterings, pseudo-label group sizes, per-stage accuracy figure, from
    the summary the worker made after the last stage (:func:`raycl.worker.stage_integration
    .mcl_summary`): nothing is clustered here."""
    from raycl.tracking.relay import log_to_trial_run

    ami, sizes = arrays[MCL_AMI], arrays[MCL_GROUP_SIZES]  # sizes: largest first
    metrics: dict[str, float] = {}
    for i in range(len(ami)):
        for j in range(i + 1, len(ami)):
            metrics[metric_name(MCL, "ami", f"stage{i}_stage{j}")] = float(ami[i, j])
    metrics["mcl/groups"] = float(len(sizes))
    metrics["mcl/group_size_min"] = float(sizes.min())
    metrics["mcl/group_size_max"] = float(sizes.max())

    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory)
        (out / "ami_matrix.json").write_text(json.dumps(ami.round(4).tolist()))
        np.savetxt(out / "group_sizes.txt", sizes, fmt="%d")
        mcl_figure(out, ami, sizes, json.loads(str(arrays[MCL_STAGE_METRICS])),
                   list(attributes_of(config.data) or ()))
        log_to_trial_run(config, _trial_id(), metrics, out)
