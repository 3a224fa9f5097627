"""The sweep's baseline (``eval.baseline``): its base configuration's backbone at initialisation,
scored once per sweep by the val probes the trials use, on the sweep's parent run.

What a trained trial must beat is the same network untrained (issue 35: a random-init encoder
scored by hand beat a sweep's winner on a transfer set). One Ray task per sweep
(:func:`score_at_init`; one CPU, and when the trials use GPUs a share of one,
:func:`baseline_resources`) builds the base configuration's stage-0 method as trial 0's starts
(the same seed; ``model.pretrained``'s weights when set: "at init") and scores it by the
worker's own val evaluation (:func:`raycl.worker.evaluate.evaluate_epoch`, in a one-process
session), so it embeds the rows the trials' every-epoch probe does: ``eval.max_train_samples``
training rows and ``eval.max_eval_samples`` val rows (:func:`raycl.worker.evaluate.scored_subset`).
The parent run gets ``baseline/val/...``, ``data/chance/<attribute>`` and ``data/val_size``
(:func:`baseline_report`), and ``raycl.baseline_scope`` names the searched ``model.*`` keys' base
values: the leaderboard (:mod:`raycl.tracking.reference_points`) says the row is that network's.

When (:class:`SweepBaseline`, a Tune callback of the sweep's driver): launched at the sweep
loop's first step, never waited for while trials run (polled after each trial report); at the
sweep's end waited for while it still runs, at most :data:`END_WAIT_S` (one evaluation against
the trials' many: it has nearly always finished by then), so the parent's last leaderboard has
its row. An interrupted sweep does not wait: the task is cancelled and the resumed sweep
computes it; a resumed sweep whose parent run already has it does not. A failure is one warning
line; the sweep goes on without the row.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ray.tune import Callback

from raycl.config.metric_names import BASELINE_PREFIX, VAL, baseline_metric, maybe_metric
from raycl.config.schema import CoreConfig
from raycl.tracking.reference_points import BASELINE_SCOPE_TAG, CHANCE_PREFIX, VAL_SIZE_METRIC

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from raycl.tracking.callback import MLflowSweepCallback

# Seconds the driver waits at the sweep's end for a baseline still running (then cancelled).
END_WAIT_S = 300.0
# The most of a GPU the baseline asks for: it embeds and fits the val probes once, no training
# (no gradients, no optimizer state), so a whole GPU held for it would keep a trial waiting.
BASELINE_GPU_SHARE = 0.5
# Trial states of a sweep that ended by itself (any other at the end: it was interrupted).
_ENDED_STATES = ("TERMINATED", "ERROR")


def baseline_report(evaluation: Mapping[str, float]) -> dict[str, float]:
    """What the parent run gets of the untrained backbone's val evaluation: each val score as
    ``baseline/val/...`` (MCL's per-stage copies left out), and chance and the val size as
    reported (``data/chance/<attribute>``, ``data/val_size``).

    Args:
        evaluation: the metrics of one val evaluation (:func:`evaluate_epoch`'s).

    Returns:
        The parent run's metrics.
    """
    report = {baseline_metric(key): float(value) for key, value in evaluation.items()
              if (name := maybe_metric(key)) and name.split == VAL and name.stage is None}
    report.update({key: float(value) for key, value in evaluation.items()
                   if key.startswith(CHANCE_PREFIX) or key == VAL_SIZE_METRIC})
    return report


def has_baseline(metrics: Mapping[str, float]) -> bool:
    """Whether a run's metrics hold a baseline (``baseline/...``)."""
    return any(key.startswith(BASELINE_PREFIX) for key in metrics)


def baseline_scope(config: CoreConfig) -> str:
    """The searched ``model.*`` keys (what changes the network) at the base configuration's
    values, the one the baseline scores: ``model.width=32``; empty when none is searched.

    Args:
        config: the sweep's configuration.
    """
    searched = sorted(key for key in config.tune.search_space if key.startswith("model."))
    flat = config.to_dict()
    values = []
    for key in searched:
        value: Any = flat
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        values.append(f"{key}={value}")
    return ", ".join(values)


def score_at_init(base_config: dict[str, Any]) -> dict[str, float]:
    """The base configuration's stage-0 backbone, built as trial 0's is before its first epoch
    and scored by the trials' val evaluation (the Ray task's body; imports no more of Ray than
    the worker does).

    Args:
        base_config: the sweep's base configuration (``to_dict()``; absolute paths, the loader
            settled), as the trials get it.

    Returns:
        :func:`baseline_report` of the evaluation; ``{}`` for data without attributes (nothing
        to probe).
    """
    from raycl.config.search_config import search_config_class
    from raycl.data import load_dataset
    from raycl.eval.multimodal import EvalSets, load_mmvp_sets
    from raycl.methods import method_class
    from raycl.worker.cuda import configure_cuda_backends
    from raycl.worker.evaluate import evaluate_epoch
    from raycl.worker.session import InProcessSession
    from raycl.worker.stage import build_stage_method
    from raycl.worker.stage_integration import StageInputs

    config = search_config_class().model_validate(base_config)
    use_gpu = config.scaling.use_gpu and torch.cuda.is_available()
    device = torch.device("cuda" if use_gpu else "cpu")
    configure_cuda_backends(device)
    data = load_dataset(config.data, config.data_seed)
    if not data.attributes:
        return {}
    # The val evaluation reads no transfer set (those are scored after a stage's last epoch).
    eval_sets = EvalSets(mmvp=load_mmvp_sets(config) if method_class(config).multimodal else {})
    np.random.seed(config.seed)  # as rank 0 of trial 0's stage 0; the method seeds torch
    method = build_stage_method(config, data.channels, 0, device, None)
    _, evaluation, _ = evaluate_epoch(config, data, eval_sets, StageInputs(), method,
                                      InProcessSession(device), last=False)
    return baseline_report(evaluation)


def baseline_resources(config: CoreConfig) -> dict[str, float]:
    """What the baseline's Ray task reserves: one CPU, and when the trials use GPUs at most
    :data:`BASELINE_GPU_SHARE` of one and never more than a trial's worker
    (``scaling.gpus_per_worker``), so it fits beside the trials' share instead of holding a GPU
    of its own.

    Args:
        config: the sweep's configuration as its trials get it.

    Returns:
        ``num_cpus`` and ``num_gpus`` for ``ray.remote(...).options``.
    """
    gpus = min(BASELINE_GPU_SHARE, config.scaling.gpus_per_worker) if config.scaling.use_gpu \
        else 0
    return {"num_cpus": 1, "num_gpus": gpus}


def _warn(text: str) -> None:
    """One line on the driver's stderr, as raycl's other launch warnings."""
    print(f"raycl: warning: {text}", file=sys.stderr, flush=True)


def launch_baseline(config: CoreConfig, client: MlflowClient, parent_run_id: str | None) -> Any:
    """Start the baseline's Ray task, unless ``eval.baseline`` is off or the parent run already
    has a baseline (a resumed sweep). Never raises: a failure is one warning.

    Args:
        config: the sweep's configuration as its trials get it.
        client: the tracking store's client.
        parent_run_id: the sweep's parent run (None: not known; launched).

    Returns:
        The task's ``ObjectRef``, or None when nothing was launched.
    """
    if not config.eval.baseline:
        return None
    try:
        if parent_run_id is not None and has_baseline(
                client.get_run(parent_run_id).data.metrics):
            return None  # a resumed sweep: scored by the driver before
        import ray

        task = ray.remote(score_at_init).options(
            **baseline_resources(config), max_retries=0, name="raycl-baseline")
        return task.remote(config.to_dict())
    except Exception as exc:  # the baseline is never worth a sweep
        _warn(f"the sweep's baseline (eval.baseline) was not started: {_one_line(exc)}")
        return None


def log_baseline(client: MlflowClient, parent_run_id: str, metrics: Mapping[str, float],
                 scope: str) -> None:
    """The baseline's metrics on the parent run (chance and the val size only where the
    parent has none yet) and, when searched keys change the network, the base values it
    scored (``raycl.baseline_scope``).

    Args:
        client: the tracking store's client.
        parent_run_id: the sweep's parent run.
        metrics: :func:`baseline_report`'s.
        scope: :func:`baseline_scope`'s text (empty: no tag).
    """
    import time

    from mlflow.entities import Metric

    logged = client.get_run(parent_run_id).data.metrics
    stamp = int(time.time() * 1000)
    batch = [Metric(key, value, stamp, 0) for key, value in sorted(metrics.items())
             if key.startswith(BASELINE_PREFIX) or key not in logged]
    if batch:
        client.log_batch(parent_run_id, metrics=batch)
    if scope:
        client.set_tag(parent_run_id, BASELINE_SCOPE_TAG, scope)


def _one_line(exc: BaseException) -> str:
    """An exception (a Ray task's: its cause) as one line."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def interrupted(trials: Sequence[Any]) -> bool:
    """Whether a sweep's loop ended before its trials did (Ctrl+C, a stop signal).

    Args:
        trials: Tune's trials at the sweep's end.
    """
    from raycl.tracking.tune_stop import tune_stop_requested

    return tune_stop_requested() or any(trial.status not in _ENDED_STATES for trial in trials)


class SweepBaseline(Callback):
    """The sweep's baseline in its driver: launched at the loop's first step, logged on the
    parent run once its task is done (polled after each trial report, waited for at the end).

    Put before the sweep's :class:`~raycl.tracking.callback.MLflowSweepCallback` in the
    callbacks: the tracker writes the parent's last leaderboard after this one has logged.
    """

    def __init__(self, config: CoreConfig, tracker: MLflowSweepCallback) -> None:
        self.config = config
        self.tracker = tracker  # its parent run (created or found at its setup) gets the row
        self._task: Any = None
        self._launched = False

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its callbacks: a task belongs to the driver that launched it.
        return {**self.__dict__, "_task": None, "_launched": False}

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        if not self._launched:  # after every setup: the tracker knows the parent run
            self._launched = True
            self._task = launch_baseline(self.config, self.tracker.client,
                                         self.tracker.parent_run_id)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                        **info: Any) -> None:
        self.collect(0.0)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.collect(0.0)  # before the tracker's leaderboard of this trial

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.collect(0.0)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        stopped = interrupted(trials)
        self.collect(0.0 if stopped else END_WAIT_S)
        if self._task is not None:
            import ray

            ray.cancel(self._task, force=True)
            self._task = None
            if not stopped:
                _warn(f"the sweep's baseline (eval.baseline) was not done {END_WAIT_S:g} s "
                      f"after the sweep's end; cancelled, the leaderboard has no at-init row")

    def collect(self, wait_s: float) -> bool:
        """Log the task's result on the parent run once it is done (waiting at most
        ``wait_s``); a failed task is one warning. Returns whether it was logged."""
        if self._task is None:
            return False
        import ray

        ready, _ = ray.wait([self._task], timeout=wait_s)
        if not ready:
            return False
        self._task = None
        parent = self.tracker.parent_run_id
        try:
            metrics = ray.get(ready[0])
            if parent is None or not metrics:
                return False
            log_baseline(self.tracker.client, parent, metrics, baseline_scope(self.config))
        except Exception as exc:  # the baseline is never worth a sweep
            _warn(f"the sweep's baseline (eval.baseline) failed: {_one_line(exc)}; the "
                  f"leaderboard has no at-init row")
            return False
        return True


def with_baseline(config: CoreConfig, tracker: MLflowSweepCallback) -> list[Callback]:
    """The sweep's tracker, preceded by its :class:`SweepBaseline` when ``eval.baseline`` is on.

    Args:
        config: the sweep's configuration as its trials get it.
        tracker: the sweep's MLflow callback (its parent run gets the baseline).

    Returns:
        The callbacks, in the order Tune calls them.
    """
    return [SweepBaseline(config, tracker), tracker] if config.eval.baseline else [tracker]


__all__ = ["BASELINE_GPU_SHARE", "END_WAIT_S", "SweepBaseline", "baseline_report",
           "baseline_resources", "baseline_scope", "has_baseline",
           "interrupted", "launch_baseline", "log_baseline", "score_at_init", "with_baseline"]
