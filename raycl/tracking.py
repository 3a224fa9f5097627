"""MLflow: one parent run per sweep, one nested child run per trial.

:class:`MLflowSweepCallback` runs in the Tune driver. It creates the runs, logs every reported
metric with ``step = training_iteration``, and closes each child with a status that tells how the
trial ended: FINISHED, KILLED (stopped early by the scheduler, or skipped) or FAILED. Because it
lives in the driver, trials stopped by ASHA or killed by a node failure are still logged.

Trials themselves only add artifacts and end-of-trial metrics (plots, AMI) through
:func:`log_to_trial_run`, which finds the child run by its ``raycl.trial_id`` tag.
"""

from __future__ import annotations

import logging
import math
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from ray.tune import Callback

import raycl
from raycl.config import CoreConfig, apply_overrides, flatten, resolve_tracking_uri
from raycl.train import FAIL_REASON_KEY, FAILED_KEY

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from ray.tune.experiment import Trial

logger = logging.getLogger(__name__)

TRIAL_TAG = "raycl.trial_id"
ROLE_TAG = "raycl.role"
SWEEP_TAG = "raycl.sweep"
SWEEP_UID_TAG = "raycl.sweep_uid"
COMMIT_TAG = "mlflow.source.git.commit"
PARENT_TAG = "mlflow.parentRunId"
# Sweep name -> whether its last run in this process was interrupted (set by the callback in the
# driver, read by raycl.tune to choose the exit code).
INTERRUPTED: dict[str, bool] = {}
# The trial's epoch over all its stages, logged at every step: the x axis of every curve.
EPOCH_METRIC = "train/epoch"
# MLflow rejects a param value longer than this (6000 in MLflow 3).
_MAX_PARAM_LENGTH = 6000


def git_commit() -> str | None:
    """The commit of the raycl checkout, when raycl runs from one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(raycl.__file__).parent,
                             capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def experiment_name(config: CoreConfig) -> str:
    return config.mlflow.experiment or config.name


def _client(tracking_uri: str) -> MlflowClient:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def get_or_create_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:///"):
        # Artifacts beside the database, as an absolute path: trial processes have another cwd.
        database = Path(tracking_uri[len("sqlite:///"):])
        artifact_location = (database.parent / "mlartifacts" / name).resolve().as_uri()
    return client.create_experiment(name, artifact_location=artifact_location)


def _params(flat: dict[str, Any]) -> dict[str, str]:
    return {key: str(value)[:_MAX_PARAM_LENGTH] for key, value in flat.items()}


def _numeric_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Our metrics are paths (``train/loss``); Ray's bookkeeping keys have no slash."""
    metrics = {}
    for key, value in result.items():
        if "/" not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            metrics[key] = float(value)
    return metrics


class MLflowSweepCallback(Callback):
    """Tune callback that mirrors a sweep into MLflow (parent run + nested child per trial)."""

    def __init__(self, config: CoreConfig, search_file: str | None = None) -> None:
        self.config = config
        self.tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
        self.search_file = search_file
        # Tune pickles its callbacks with the experiment state: a restored sweep gets this same
        # uid back and so re-attaches to its parent run; a fresh sweep gets a new one.
        self.sweep_uid = uuid.uuid4().hex
        self.parent_run_id: str | None = None
        self.experiment_id: str | None = None
        self._children: dict[str, str] = {}
        # The last epoch (MLflow step) logged per trial; rebuilt from MLflow after a restore.
        self._logged_step: dict[str, int] = {}
        # Trials started and ended (completed or failed) while this driver ran: one the driver
        # was interrupted in the middle of started and never ended (Tune stops it silently).
        self._started: set[str] = set()
        self._ended: set[str] = set()
        self.commit: str | None = None
        self._client_instance: MlflowClient | None = None

    # The client holds a database engine: rebuild it after Tune pickles the callback.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client_instance"] = None
        return state

    @property
    def client(self) -> MlflowClient:
        if self._client_instance is None:
            self._client_instance = _client(self.tracking_uri)
        return self._client_instance

    def setup(self, **info: Any) -> None:
        # Pickled with the experiment state some time ago: MLflow knows better what was logged.
        self._logged_step, self._started, self._ended = {}, set(), set()
        self.commit = git_commit()
        self.experiment_id = get_or_create_experiment(
            self.client, experiment_name(self.config), self.tracking_uri)
        if self.parent_run_id is None:
            self.parent_run_id = self._find_parent() or self._create_parent()
        else:
            self.client.update_run(self.parent_run_id, status="RUNNING")

    def _find_parent(self) -> str | None:
        """A resumed sweep continues its parent run instead of starting another."""
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{SWEEP_UID_TAG}` = '{self.sweep_uid}'",
            max_results=1)
        if runs:
            self.client.update_run(runs[0].info.run_id, status="RUNNING")
            return runs[0].info.run_id
        return None

    def _create_parent(self) -> str:
        tags = {ROLE_TAG: "sweep", SWEEP_TAG: self.config.name, SWEEP_UID_TAG: self.sweep_uid,
                "mlflow.runName": self.config.name,
                "raycl.version": raycl.__version__, "raycl.metric": self.config.tune.metric,
                "raycl.mode": self.config.tune.mode}
        if self.commit:
            tags[COMMIT_TAG] = self.commit
        run = self.client.create_run(self.experiment_id, tags=tags)
        run_id = run.info.run_id
        flat = flatten(self.config.to_dict(used_sections_only=True))
        self._log_params(run_id, flat)
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "search.yaml"
            path.write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
            self.client.log_artifact(run_id, str(path))
            if self.search_file and Path(self.search_file).is_file():
                self.client.log_artifact(run_id, self.search_file, artifact_path="source")
        return run_id

    def _log_params(self, run_id: str, flat: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in _params(flat).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start:start + 100])

    def _child(self, trial: Trial) -> str:
        run_id = self._children.get(trial.trial_id)
        if run_id is not None:
            return run_id
        existing = find_trial_run(self.client, self.experiment_id, trial.trial_id)
        if existing is not None:  # a restored sweep re-attaches to the trial's run
            self._children[trial.trial_id] = existing
            self.client.update_run(existing, status="RUNNING")
            return existing
        tags = {PARENT_TAG: self.parent_run_id, TRIAL_TAG: trial.trial_id, ROLE_TAG: "trial",
                SWEEP_TAG: self.config.name, "raycl.version": raycl.__version__}
        if self.commit:
            tags[COMMIT_TAG] = self.commit
        run = self.client.create_run(self.experiment_id, run_name=str(trial), tags=tags)
        run_id = run.info.run_id
        self._children[trial.trial_id] = run_id
        resolved = apply_overrides(self.config, trial.config)
        flat = flatten(resolved.to_dict(used_sections_only=True))
        flat.pop("tune.search_space", None)
        self._log_params(run_id, flat)
        self.client.set_tag(run_id, "raycl.searched", ", ".join(
            f"{key}={value}" for key, value in trial.config.items()))
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "config.yaml"
            path.write_text(yaml.safe_dump(resolved.to_dict(), sort_keys=False))
            self.client.log_artifact(run_id, str(path))
        return run_id

    def on_trial_start(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        # Also when a resumed sweep restarts an interrupted trial (its run was marked KILLED).
        self.client.update_run(self._child(trial), status="RUNNING")
        self._started.add(trial.trial_id)

    def _last_logged_step(self, trial: Trial, run_id: str) -> int:
        if trial.trial_id not in self._logged_step:
            history = self.client.get_metric_history(run_id, EPOCH_METRIC)
            self._logged_step[trial.trial_id] = max((m.step for m in history), default=0)
        return self._logged_step[trial.trial_id]

    def on_trial_result(
        self, iteration: int, trials: list, trial: Trial, result: dict, **info: Any
    ) -> None:
        from mlflow.entities import Metric

        run_id = self._child(trial)
        last_step = self._last_logged_step(trial, run_id)
        metrics = _numeric_metrics(result)
        if "global_epoch" in result:
            # The step is the epoch of the trial (stage * epochs + epoch), not Tune's report
            # count: a worker that dies right after a report resumes from the checkpoint before
            # it and replays that epoch (identically), which must not be logged twice.
            step = int(result["global_epoch"])
            if step <= last_step:
                logger.info("trial %s replayed epoch %d after a restart; already logged",
                            trial.trial_id, step)
                metrics = {}
            else:
                metrics[EPOCH_METRIC] = float(step)
                self._logged_step[trial.trial_id] = step
        else:  # a report that is not an epoch (a skipped or diverged trial)
            step = last_step or int(result.get("training_iteration", 0))
        now = int(time.time() * 1000)
        entries = [Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(entries), 500):
            self.client.log_batch(run_id, metrics=entries[start:start + 500])
        if "raycl/skip_reason" in result:
            self.client.set_tag(run_id, "raycl.skipped", str(result["raycl/skip_reason"]))
        if FAIL_REASON_KEY in result:
            self.client.set_tag(run_id, "raycl.error", str(result[FAIL_REASON_KEY])[:5000])

    def on_trial_complete(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        run_id = self._child(trial)
        last = trial.last_result or {}
        # Tune marks a trial that ASHA stopped as done too; a trial ran to its end when its last
        # report is the last epoch of its last stage.
        resolved = apply_overrides(self.config, trial.config)
        if last.get("raycl/skipped"):
            status, ended = "KILLED", "skipped"
        elif last.get(FAILED_KEY):
            status, ended = "FAILED", "diverged"
        elif (last.get("stage") == resolved.num_stages - 1
              and last.get("phase", "train") == "train"
              and last.get("epoch") == resolved.train.epochs):
            status, ended = "FINISHED", "completed"
        else:
            status, ended = "KILLED", "stopped_by_scheduler"
        self.client.set_tag(run_id, "raycl.ended", ended)
        self.client.set_terminated(run_id, status=status)
        self._ended.add(trial.trial_id)

    def on_trial_error(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        run_id = self._child(trial)
        self._ended.add(trial.trial_id)
        self.client.set_tag(run_id, "raycl.ended", "error")
        if trial.error_file and Path(trial.error_file).is_file():
            self.client.log_artifact(run_id, trial.error_file)
        self.client.set_terminated(run_id, status="FAILED")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self.parent_run_id is None:
            return
        unfinished = [trial for trial in trials if trial.status == "PENDING" or (
            trial.trial_id in self._started and trial.trial_id not in self._ended)]
        INTERRUPTED[self.config.name] = bool(unfinished)
        if unfinished:
            # Interrupted (Ctrl+C, SIGINT to the driver): Tune saved the sweep, and running the
            # same command again resumes it into these same runs.
            for trial in unfinished:
                run_id = self._children.get(trial.trial_id)
                if run_id:
                    self.client.set_tag(run_id, "raycl.ended", "interrupted")
                    self.client.set_terminated(run_id, status="KILLED")
            self.client.set_tag(self.parent_run_id, "raycl.interrupted", "true")
            self.client.set_terminated(self.parent_run_id, status="KILLED")
            return
        self.client.set_tag(self.parent_run_id, "raycl.interrupted", "false")
        best = best_trial(trials, self.config.tune.metric, self.config.tune.mode)
        if best is not None:
            trial, value = best
            # The winner is chosen on validation; its test numbers are reported beside it.
            metrics = {f"best/{self.config.tune.metric}": value}
            metrics.update({f"best/{key}": v for key, v in _numeric_metrics(
                trial.last_result or {}).items() if key.startswith("test/")})
            for key, v in metrics.items():
                self.client.log_metric(self.parent_run_id, key, v)
            self.client.set_tag(self.parent_run_id, "raycl.best_trial", trial.trial_id)
            run_id = self._children.get(trial.trial_id)
            if run_id:
                self.client.set_tag(self.parent_run_id, "raycl.best_run", run_id)
        self.client.log_metric(self.parent_run_id, "sweep/trials", len(trials))
        self.client.set_terminated(self.parent_run_id, status="FINISHED")


def best_trial(trials: list[Trial], metric: str, mode: str) -> tuple[Trial, float] | None:
    """The trial whose last reported objective is best, with that value (None if no trial
    reported it). Selection uses the objective only: a validation metric."""
    scored = []
    for trial in trials:
        value = trial.metric_analysis.get(metric, {}).get("last")
        if isinstance(value, (int, float)) and math.isfinite(value):
            scored.append((value if mode == "max" else -value, trial, value))
    if not scored:
        return None
    _, trial, value = max(scored, key=lambda item: item[0])
    return trial, value


def find_trial_run(client: MlflowClient, experiment_id: str, trial_id: str) -> str | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{TRIAL_TAG}` = '{trial_id}'",
                              max_results=1)
    return runs[0].info.run_id if runs else None


def log_to_trial_run(
    config: CoreConfig,
    trial_id: str,
    metrics: dict[str, float],
    artifact_dir: Path | None = None,
    timeout_s: float = 30.0,
) -> bool:
    """From inside a trial: add metrics and artifacts to its child run. False when not found."""
    if trial_id == "local":  # not running under Tune: there is no child run
        return False
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    client = _client(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name(config))
    run_id = None
    deadline = time.monotonic() + timeout_s
    while experiment is not None and run_id is None and time.monotonic() < deadline:
        # The driver creates the run when the trial starts; it may lag behind the trial a little.
        run_id = find_trial_run(client, experiment.experiment_id, trial_id)
        if run_id is None:
            time.sleep(1.0)
    if run_id is None:
        logger.warning("no MLflow run for trial %s; diagnostics not logged", trial_id)
        return False
    for key, value in metrics.items():
        client.log_metric(run_id, key, value)
    if artifact_dir is not None:
        client.log_artifacts(run_id, str(artifact_dir), artifact_path="diagnostics")
    return True
