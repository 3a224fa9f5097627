"""The Tune callback on top of :mod:`raycl.tracking`: one parent run per sweep, one nested child
run per trial.

:class:`MLflowSweepCallback` runs in the Tune driver. It creates the runs, logs every reported
metric with ``step = training_iteration``, and closes each child with a status that tells how the
trial ended: FINISHED (ran to its end, or stopped early by ASHA: not a failure; the tag
``raycl.ended`` and the metric ``stopped_at_epoch`` tell which), KILLED (skipped, or interrupted
with the driver) or FAILED. Because it lives in the driver, trials stopped by ASHA or killed by a
node failure are still logged.

For a person in the MLflow UI (docs/tracking.md): a child run is named after what it tried
(``t03 K=5 N=2 τ=0.31``), logs its objective also as ``objective``/``objective_test``; after every
trial the parent gets the leaderboard (``leaderboard.csv``/``.png``, its description). The
parent's params are what every trial shares, the searched keys as ``search_space.<key>``.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from ray.tune import Callback

import raycl
from raycl.config.metric_names import TEST, maybe_metric
from raycl.config.paper import compare_to_paper, comparison_metrics
from raycl.config.schema import CoreConfig, active_values
from raycl.config.search_config import apply_overrides, flatten
from raycl.config.sweep import resolve_tracking_uri, trial_values
from raycl.tracking.importance import log_importance
from raycl.tracking.leaderboard_plot import plot_leaderboard
from raycl.tracking.naming import trial_index, trial_run_name
from raycl.tracking.runs import (
    COMMIT_TAG,
    ENDED_TAG,
    NOTE_TAG,
    OBJECTIVE_TAG,
    PARENT_TAG,
    ROLE_TAG,
    SEARCHED_TAG,
    STOPPED_AT_METRIC,
    SWEEP_TAG,
    SWEEP_UID_TAG,
    TRIAL_INDEX_TAG,
    TRIAL_TAG,
    experiment_name,
    find_trial_run,
    get_or_create_experiment,
    git_commit,
    mark_training_experiment,
    mlflow_client,
    rankable,
    tag_checkpoint,
    write_leaderboard_view,
)
from raycl.tracking.sweep_outputs import log_sweep_outputs
from raycl.tracking.sweep_params import objective_aliases, parent_params
from raycl.tracking.trial_table import markdown_summary, trial_runs, trial_table, write_csv
from raycl.tracking.tune_stop import tune_stop_requested, unfinished_trials
from raycl.worker.outcome import FAIL_REASON_KEY, SKIP_REASON_KEY, trial_ending

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from ray.tune.experiment import Trial

logger = logging.getLogger(__name__)

# Sweep name -> whether its last run in this process was interrupted (set by the callback in the
# driver, read by raycl.tune to choose the exit code).
INTERRUPTED: dict[str, bool] = {}
# The trial's epoch over all its stages, logged at every step: the x axis of every curve.
EPOCH_METRIC = "train/epoch"
# Keys without a slash the training loop reports and MLflow logs too (the epoch within the
# stage's phase, the stage); Ray's own bookkeeping keys (training_iteration, time_*, done...) stay
# out.
LOOP_METRICS = ("epoch", "stage")
# MLflow rejects a param value longer than this (6000 in MLflow 3).
_MAX_PARAM_LENGTH = 6000
# How a trial ended that no resumed sweep runs again (raycl.ended): its run is kept as it is.
_FINAL_ENDINGS = frozenset({"completed", "stopped_by_scheduler", "skipped", "diverged"})
# Tune saves the sweep's state (its trials, their checkpoints) every 10 s or more ("auto"), and
# MLflow is written at once: a driver killed outright (SIGKILL, its node lost) resumed from
# state up to 10 s older than MLflow, so a finished trial ran again and a newly created one was
# lost (its run left beside its replacement's). Saved every second instead, the gap is a
# second; the callback copes with what is left of it (_drop_lost_trial_runs, _closed). Set
# before Tune's controller reads it (in fit), by a callback built or unpickled for the sweep;
# a value the user set is kept.
_TUNE_SAVE_PERIOD = ("TUNE_GLOBAL_CHECKPOINT_S", "1")


def _params(flat: dict[str, Any]) -> dict[str, str]:
    """Flattened config values as MLflow params: text, cut at MLflow's length limit."""
    return {key: str(value)[:_MAX_PARAM_LENGTH] for key, value in flat.items()}


def _numeric_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Our metrics are paths (``train/loss``); Ray's bookkeeping keys have no slash. The training
    loop's ``epoch`` and ``stage`` are ours too (:data:`LOOP_METRICS`)."""
    metrics = {}
    for key, value in result.items():
        if ("/" not in key and key not in LOOP_METRICS) or isinstance(value, bool) \
                or not isinstance(value, (int, float)):
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
        # Whether this driver has deleted the runs of trials Tune lost (on_step_begin).
        self._reconciled = False
        # Trials whose run a previous driver closed for good (_FINAL_ENDINGS): not reopened.
        self._closed: set[str] = set()
        self.commit: str | None = None
        self._client_instance: MlflowClient | None = None
        os.environ.setdefault(*_TUNE_SAVE_PERIOD)

    # The client holds a database engine: rebuild it after Tune pickles the callback.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client_instance"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        os.environ.setdefault(*_TUNE_SAVE_PERIOD)  # a restored sweep: before its fit too

    @property
    def client(self) -> MlflowClient:
        if self._client_instance is None:
            self._client_instance = mlflow_client(self.tracking_uri)
        return self._client_instance

    def setup(self, **info: Any) -> None:
        # Pickled with the experiment state some time ago: MLflow knows better what was logged.
        self._logged_step, self._started, self._ended = {}, set(), set()
        self._reconciled, self._closed = False, set()
        self.commit = git_commit()
        self.experiment_id = get_or_create_experiment(
            self.client, experiment_name(self.config), self.tracking_uri)
        mark_training_experiment(self.client, self.experiment_id, self.config.tune.mode)
        write_leaderboard_view(self.client, self.experiment_id, self.config)
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
                "raycl.mode": self.config.tune.mode,
                # What every trial's `objective` column is, read on the parent's page.
                OBJECTIVE_TAG: f"{self.config.tune.metric}, {self.config.tune.mode}"}
        if self.commit:
            tags[COMMIT_TAG] = self.commit
        run = self.client.create_run(self.experiment_id, tags=tags)
        run_id = run.info.run_id
        self._log_params(run_id, parent_params(self.config))
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
            run = self.client.get_run(existing)
            if SEARCHED_TAG not in run.data.tags:  # its driver died while describing it
                self._describe_trial_run(existing, trial)
            if run.info.status != "RUNNING" and run.data.tags.get(ENDED_TAG) in _FINAL_ENDINGS:
                # Ended before the driver was killed, after Tune's last save: Tune runs it
                # again; MLflow keeps the run as it ended.
                logger.info("trial %s had ended (%s) before the driver stopped; its MLflow run "
                            "is kept as it was", trial.trial_id, run.data.tags[ENDED_TAG])
                self._closed.add(trial.trial_id)
            return existing
        # Ray's number for the trial, else the order trials appeared in (a restored sweep's
        # trials re-attached above and keep their names).
        index = trial_index(trial)
        if index is None:
            index = len(self._children) + 1
        tags = {PARENT_TAG: self.parent_run_id, TRIAL_TAG: trial.trial_id, ROLE_TAG: "trial",
                SWEEP_TAG: self.config.name, "raycl.version": raycl.__version__,
                TRIAL_INDEX_TAG: str(index), OBJECTIVE_TAG: self.config.tune.metric}
        if self.commit:
            tags[COMMIT_TAG] = self.commit
        name = trial_run_name(index, self.trial_values(trial), self.config.tune.search_space)
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        self._children[trial.trial_id] = run.info.run_id
        self._describe_trial_run(run.info.run_id, trial)
        return run.info.run_id

    def trial_values(self, trial: Trial) -> dict[str, Any]:
        """The trial's searched values its own method reads (a confirmation trial's reserved
        case key and the knobs pinned for another method's configuration left out)."""
        return active_values(self.config, trial_values(trial.config))

    def _describe_trial_run(self, run_id: str, trial: Trial) -> None:
        """The trial's params and config.yaml, then ``raycl.searched``: set last, it says the
        run is whole (a driver killed before it leaves a run the next one completes)."""
        values = self.trial_values(trial)
        resolved = apply_overrides(self.config, values)
        flat = flatten(resolved.trial_dict(values))
        flat.pop("tune.search_space", None)
        self._log_params(run_id, flat)  # the same values again: MLflow accepts them
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "config.yaml"
            path.write_text(yaml.safe_dump(resolved.to_dict(), sort_keys=False))
            self.client.log_artifact(run_id, str(path))
        self.client.set_tag(run_id, SEARCHED_TAG, ", ".join(
            f"{key}={value}" for key, value in values.items()))

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        # The first step of a driver: Tune has restored every trial it saved, and this driver
        # has created no run yet.
        if not getattr(self, "_reconciled", True):
            self._reconciled = True
            self._drop_lost_trial_runs({trial.trial_id for trial in trials})

    def _drop_lost_trial_runs(self, known: set[str]) -> None:
        """Delete this sweep's child runs of trials Tune does not know.

        Tune's saved state lags MLflow (saved every second here, see _TUNE_SAVE_PERIOD, then
        copied to the storage path in the background), MLflow is written at once: a driver
        killed outright (SIGKILL, its node lost) can leave the run of a trial created after
        Tune's last copy. The resumed sweep never continues that trial (its searcher suggests
        another in its place), so its run would stand beside the new one forever, half
        trained: one sweep, one child run per trial of its own.
        """
        if self.parent_run_id is None or self.experiment_id is None:
            return
        ours = set(self._children.values())
        for run in trial_runs(self.client, self.experiment_id, self.parent_run_id):
            trial_id = run.data.tags.get(TRIAL_TAG)
            if trial_id in known or run.info.run_id in ours:
                continue
            logger.warning("trial %s was lost with the killed driver (Tune had not saved it "
                           "yet); its MLflow run %s is deleted, its place is taken by a new "
                           "trial", trial_id, run.info.run_id)
            self.client.set_tag(run.info.run_id, ENDED_TAG, "lost")
            self.client.set_terminated(run.info.run_id, status="KILLED")
            self.client.delete_run(run.info.run_id)

    def on_trial_start(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        # Also when a resumed sweep restarts an interrupted trial (its run was marked KILLED).
        run_id = self._child(trial)
        if trial.trial_id not in self._closed:
            self.client.update_run(run_id, status="RUNNING")
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
        if trial.trial_id in self._closed:
            return
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
        metrics.update(objective_aliases(metrics, self.config.tune.metric))
        now = int(time.time() * 1000)
        entries = [Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(entries), 500):
            self.client.log_batch(run_id, metrics=entries[start:start + 500])
        if SKIP_REASON_KEY in result:
            self.client.set_tag(run_id, "raycl.skipped", str(result[SKIP_REASON_KEY]))
        if FAIL_REASON_KEY in result:
            self.client.set_tag(run_id, "raycl.error", str(result[FAIL_REASON_KEY])[:5000])
        if isinstance(path := result.get("checkpoint_path"), str):  # Ray Train's, on storage
            self.on_checkpoint(trial=trial, checkpoint=path)

    def on_checkpoint(self, trial: Trial, checkpoint: Any, **info: Any) -> None:  # Tune's
        tag_checkpoint(self.client, self._child(trial), checkpoint, self.config.tune)

    def on_trial_complete(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        run_id = self._child(trial)
        if trial.trial_id in self._closed:
            self._ended.add(trial.trial_id)
            return
        last = trial.last_result or {}
        # Stopped early is no failure: FINISHED, told apart by its tag and the epoch it stopped
        # at (a column of the leaderboard view).
        resolved = apply_overrides(self.config, self.trial_values(trial))
        rule = resolved.tune.collapse
        collapsed = rule.reason(last) if rule is not None else None
        ended = trial_ending(last, resolved.num_stages, resolved.train.epochs, bool(collapsed))
        status = {"skipped": "KILLED", "diverged": "FAILED"}.get(ended, "FINISHED")
        if collapsed:  # tune.collapse stopped it: why, on the run's page
            self.client.set_tag(run_id, NOTE_TAG, f"Collapsed: {collapsed}; stopped by "
                                                  f"tune.collapse, never ranked.")
        if ended == "stopped_by_scheduler":
            epoch = last.get("global_epoch", self._logged_step.get(trial.trial_id))
            if isinstance(epoch, (int, float)):
                self.client.log_metric(run_id, STOPPED_AT_METRIC, float(epoch), step=int(epoch))
        self.client.set_tag(run_id, ENDED_TAG, ended)
        self.client.set_terminated(run_id, status=status)
        self._ended.add(trial.trial_id)
        self._log_leaderboard()

    def on_trial_error(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        run_id = self._child(trial)
        self._ended.add(trial.trial_id)
        if trial.trial_id in self._closed:  # its run ended well before; this is a re-run's
            logger.warning("trial %s, run again after it had ended, failed: %s", trial.trial_id,
                           trial.error_file)
            return
        self.client.set_tag(run_id, ENDED_TAG, "error")
        if trial.error_file and Path(trial.error_file).is_file():
            self.client.log_artifact(run_id, trial.error_file)
        self.client.set_terminated(run_id, status="FAILED")
        self._log_leaderboard()

    def _log_leaderboard(self) -> None:
        """The parent run's leaderboard (``leaderboard.csv``/``.png``, importance, description,
        Pareto front, warm start) from MLflow after every trial; failures logged, never raised."""
        if self.parent_run_id is None or self.experiment_id is None:
            return
        try:
            children = trial_runs(self.client, self.experiment_id, self.parent_run_id)
            paper, parent = self.config.paper, self.client.get_run(self.parent_run_id)
            table = trial_table(children, self.config.tune.metric, self.config.tune.mode,
                                paper.metric if paper else None, parent)  # its baseline first
            with tempfile.TemporaryDirectory() as directory:
                csv_path = Path(directory, "leaderboard.csv")
                png_path = Path(directory, "leaderboard.png")
                write_csv(table, csv_path)
                plot_leaderboard(table, png_path, self.config.tune.search_space)
                self.client.log_artifact(self.parent_run_id, str(csv_path))
                self.client.log_artifact(self.parent_run_id, str(png_path))
            front = log_sweep_outputs(self.client, self.parent_run_id, children, self.config)
            self.client.set_tag(self.parent_run_id, NOTE_TAG, markdown_summary(
                table, self.config.name, paper=paper) + "\n\n" + log_importance(
                self.client, self.parent_run_id, children, self.config) + front)  # no raise
        except Exception:  # a leaderboard is never worth a sweep
            logger.warning("could not write the leaderboard to the parent run", exc_info=True)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self.parent_run_id is None:
            return
        unfinished = unfinished_trials(trials, self._started, self._ended)
        INTERRUPTED[self.config.name] = tune_stop_requested() or bool(unfinished)
        if INTERRUPTED[self.config.name]:
            # Interrupted (Tune's stop signal, even between two trials, or trials left running):
            # Tune saved the sweep; the same command again resumes it into these same runs.
            for trial in unfinished:
                run_id = self._children.get(trial.trial_id)
                if run_id:
                    self.client.set_tag(run_id, ENDED_TAG, "interrupted")
                    self.client.set_terminated(run_id, status="KILLED")
            self.client.set_tag(self.parent_run_id, "raycl.interrupted", "true")
            self._log_leaderboard()
            self.client.set_terminated(self.parent_run_id, status="KILLED")
            return
        self.client.set_tag(self.parent_run_id, "raycl.interrupted", "false")
        best = best_trial(self._rankable(trials), self.config.tune.metric, self.config.tune.mode)
        if best is not None:
            trial, value = best
            # The winner is chosen on validation; its test numbers are reported beside it.
            metrics = {self.config.tune.metric: value}
            metrics.update({key: v for key, v in _numeric_metrics(trial.last_result or {}).items()
                            if (name := maybe_metric(key)) and name.split == TEST
                            and name.stage is None})
            metrics.update(objective_aliases(metrics, self.config.tune.metric))
            metrics = {f"best/{key}": v for key, v in metrics.items()}
            for key, v in metrics.items():
                self.client.log_metric(self.parent_run_id, key, v)
            self.client.set_tag(self.parent_run_id, "raycl.best_trial", trial.trial_id)
            run_id = self._children.get(trial.trial_id)
            if run_id:
                self.client.set_tag(self.parent_run_id, "raycl.best_run", run_id)
        self._log_paper_comparison(best[0] if best else None)
        self.client.log_metric(self.parent_run_id, "sweep/trials", len(trials))
        self._log_leaderboard()
        self.client.set_terminated(self.parent_run_id, status="FINISHED")

    def _rankable(self, trials: list[Trial]) -> list[Trial]:
        """The ``trials`` whose runs may be ranked (:func:`~raycl.tracking.runs.rankable`), by
        their runs' trial-id tags: a trial that ended in an earlier driver (a resumed sweep)
        counts too."""
        if self.experiment_id is None:
            return []
        ranked = {run.data.tags.get(TRIAL_TAG) for run in trial_runs(
            self.client, self.experiment_id, self.parent_run_id) if rankable(run)}
        return [trial for trial in trials if trial.trial_id in ranked]

    def _log_paper_comparison(self, best: Trial | None) -> None:
        """The parent run's ``paper/value``, ``paper/best_trial_value`` and ``paper/difference``
        (:mod:`raycl.config.paper`): the best trial (chosen on the validation objective) beside
        the ``paper:`` block's number; nothing without one."""
        if self.config.paper is None or self.parent_run_id is None:
            return
        metric = self.config.paper.metric
        reported = None
        if best is not None:
            reported = best.metric_analysis.get(metric, {}).get("last")
            if not isinstance(reported, (int, float)):
                reported = _numeric_metrics(best.last_result or {}).get(metric)
        comparison = compare_to_paper(self.config.paper, reported)
        for key, value in comparison_metrics(comparison).items():
            self.client.log_metric(self.parent_run_id, key, value)


def best_trial(trials: list[Trial], metric: str, mode: str) -> tuple[Trial, float] | None:
    """The trial whose last reported objective is best, with that value (None if no trial
    reported it). Selection uses the objective only: a validation metric. ``trials``: those
    that may be ranked (a failed or killed trial's last value came from part of its training).
    """
    scored = []
    for trial in trials:
        value = trial.metric_analysis.get(metric, {}).get("last")
        if isinstance(value, (int, float)) and math.isfinite(value):
            scored.append((value if mode == "max" else -value, trial, value))
    if not scored:
        return None
    _, trial, value = max(scored, key=lambda item: item[0])
    return trial, value
