"""MLflow: one parent run per sweep, one nested child run per trial.

:class:`MLflowSweepCallback` runs in the Tune driver. It creates the runs, logs every reported
metric with ``step = training_iteration``, and closes each child with a status that tells how the
trial ended: FINISHED, KILLED (stopped early by the scheduler, or skipped) or FAILED. Because it
lives in the driver, trials stopped by ASHA or killed by a node failure are still logged.

For a person in the MLflow UI: the experiment is tagged as model training, a child run is named
after what it tried (``t03 K=5 N=2 τ=0.31``, :func:`trial_run_name`), every child logs its
objective also as ``objective``/``objective_test``, and after every trial the parent run gets the
leaderboard (``leaderboard.csv``, ``leaderboard.png`` and its description; docs/tracking.md).

Trials themselves only add artifacts and end-of-trial metrics (plots, AMI) through
:func:`log_to_trial_run`, which finds the child run by its ``raycl.trial_id`` tag.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from ray.tune import Callback

import raycl
from raycl.config import (
    CoreConfig,
    Domain,
    apply_overrides,
    flatten,
    key_symbol,
    reported_test_metric,
    resolve_tracking_uri,
)
from raycl.constraints import JOINT_PREFIX
from raycl.worker.outcome import FAIL_REASON_KEY, FAILED_KEY

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
# Keys without a slash the training loop reports and MLflow logs too (the epoch within the
# stage's phase, the stage); Ray's own bookkeeping keys (training_iteration, time_*, done...) stay
# out.
LOOP_METRICS = ("epoch", "stage")
# Every child logs its objective under these names too, so trials of sweeps with different
# objectives (methods, metrics) line up in MLflow's compare view; the tag names the metric.
OBJECTIVE_ALIAS = "objective"
OBJECTIVE_TEST_ALIAS = "objective_test"
OBJECTIVE_TAG = "raycl.objective"
# The trial's number in the sweep, as Ray numbers it (its run name's ``t03``).
TRIAL_INDEX_TAG = "raycl.trial_index"
# MLflow 3's UI tells GenAI experiments (traces) from model-training ones (runs) by this tag;
# custom_model_development is the "Machine learning" kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# MLflow's primary metric of an experiment (mlflow.utils.mlflow_tags): the UI's first chart.
PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"
GREATER_IS_BETTER_TAG = "mlflow.experiment.primaryMetric.greaterIsBetter"
NOTE_TAG = "mlflow.note.content"  # a run's description, shown on its page
# A saved view of the UI's runs table ("Share" writes these): the leaderboard's link opens it.
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
LEADERBOARD_VIEW = "raycl-leaderboard"
# MLflow stores a run name in 250 characters.
_MAX_RUN_NAME_LENGTH = 250
# MLflow rejects a param value longer than this (6000 in MLflow 3).
_MAX_PARAM_LENGTH = 6000


# `ray job submit --working-dir` uploads no `.git`: the submitter passes the commit through the
# job's runtime environment instead (docs/clusters.md).
COMMIT_ENV = "RAYCL_GIT_COMMIT"


def git_commit() -> str | None:
    """The commit raycl runs from: ``$RAYCL_GIT_COMMIT`` when set, else the checkout's HEAD."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        if re.fullmatch(r"[0-9a-f]{7,40}", given):
            return given
        logger.warning("$%s=%r is not a git commit hash; ignored", COMMIT_ENV, given)
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


def mark_training_experiment(client: MlflowClient, experiment_id: str, mode: str) -> None:
    """Tag the experiment as model training (``mlflow.experimentKind``) with ``objective`` as
    its primary metric, new or re-used, unless someone chose otherwise.

    A kind already set to a definite value is left alone: MLflow's UI writes the tag when a
    person picks the experiment's kind, and a sweep logging into an experiment of theirs should
    not undo that choice. Unset, empty or one of the UI's guesses (``*_inferred``,
    ``no_inferred_type``) is replaced. Likewise a primary metric someone set is kept.

    MLflow 3.17's UI decides which page an experiment opens on from its own workflow switch
    (GenAI by default; ``?workflowType=machine_learning`` in the link, or the sidebar's switch,
    selects the runs); the tag is what the experiment says it is, read where the UI (and other
    MLflow 3 versions) ask for the kind.
    """
    tags = client.get_experiment(experiment_id).tags
    kind = tags.get(EXPERIMENT_KIND_TAG, "")
    if not kind or kind.endswith("_inferred") or kind == "no_inferred_type":
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    if PRIMARY_METRIC_TAG not in tags:
        client.set_experiment_tag(experiment_id, PRIMARY_METRIC_TAG, OBJECTIVE_ALIAS)
        client.set_experiment_tag(experiment_id, GREATER_IS_BETTER_TAG, str(mode == "max"))


def write_leaderboard_view(client: MlflowClient, experiment_id: str, config: CoreConfig) -> None:
    """Save the experiment's leaderboard view of the UI's runs table: the objective, its test
    counterpart and the sweep's searched params as columns, best first.

    MLflow 3.17's runs table shows no metric column until one is picked through "Columns". Its
    "Share" button saves the table's state as a JSON object in the experiment tag
    ``mlflow.sharedViewState.<key>`` and opens it from a link with ``viewStateShareKey=<key>``;
    raycl writes that tag in the same form (``python -m raycl.leaderboard`` prints the link).
    The latest sweep in an experiment sets its columns.
    """
    searched = [key for key in config.tune.search_space if not key.startswith(JOINT_PREFIX)]
    state = {"orderByKey": f"metrics.`{OBJECTIVE_ALIAS}`",
             "orderByAsc": config.tune.mode == "min",
             "selectedColumns": [f"metrics.`{OBJECTIVE_ALIAS}`",
                                 f"metrics.`{OBJECTIVE_TEST_ALIAS}`",
                                 *(f"params.`{key}`" for key in searched)]}
    client.set_experiment_tag(experiment_id, VIEW_TAG_PREFIX + LEADERBOARD_VIEW,
                              json.dumps(state))


def trial_index(trial: Trial) -> int | None:
    """The trial's number in its sweep, as Ray gives it, None when it cannot be read.

    Ray's searcher-driven trials (``SearchGenerator``: raycl's Optuna searchers) get a random
    8-hex id and the experiment tag ``<n>_<values>`` with n = 1, 2, ...; grid/variant trials
    (``BasicVariantGenerator``: the seed repeats of an empty search space) get the id
    ``<5 hex>_<n:05d>`` with n = 0, 1, ... and the same n in their experiment tag. The number is
    the one in the trial's directory name (``run_trial_<id>_<n>_...``).
    """
    match = re.match(r"(\d+)(?:_|$)", str(getattr(trial, "experiment_tag", "") or ""))
    if match is None:
        match = re.search(r"_(\d{5})$", str(trial.trial_id))
    return int(match.group(1)) if match else None


def format_value(value: Any, continuous: bool = False) -> str:
    """A searched value, short: a float drawn from a continuous domain to 2 significant digits
    (0.31, 3e-04: whichever of the plain and the exponent form is shorter), one chosen from a
    list as written (0.1, 0.125); integers plain; anything else as its text."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if not math.isfinite(value) or value == 0.0:
        return f"{value:g}"
    if not continuous:
        return f"{value:g}"
    rounded = float(f"{value:.2g}")
    mantissa, exponent = f"{rounded:.1e}".split("e")
    scientific = f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"
    plain = f"{rounded:.{max(0, 1 - math.floor(math.log10(abs(rounded))))}f}"
    if "." in plain:
        plain = plain.rstrip("0").rstrip(".")
    return scientific if len(scientific) < len(plain) else plain


def trial_run_name(
    index: int | None, values: Mapping[str, Any], space: Mapping[str, Domain]
) -> str:
    """``t03 K=5 N=2 τ=0.31``: the trial's number, then each searched key's symbol and value.

    Keys come in the search space's order, then any other key of the trial's config (``seed``
    for the repeats of an empty space). A symbol is the key's declared one
    (:func:`raycl.config.key_symbol`); two keys with the same symbol (``mocov2.temperature`` and
    ``fgvr.temperature``, both τ) are told apart by their section (``mocov2.τ``). Cut at
    MLflow's 250 characters on a whole ``symbol=value``, with "…".
    """
    keys = [key for key in space if key in values]
    keys += [key for key in values if key not in keys]
    symbols = {key: key_symbol(key) for key in keys}
    repeated = {symbol for symbol in symbols.values()
                if list(symbols.values()).count(symbol) > 1}
    parts = [f"t{index:02d}" if index is not None else "t?"]
    for key in keys:
        symbol = symbols[key]
        if symbol in repeated and "." in key:
            symbol = f"{key.split('.', 1)[0]}.{symbol}"
        domain = space.get(key)
        continuous = domain is not None and domain.kind in ("uniform", "loguniform")
        parts.append(f"{symbol}={format_value(values[key], continuous)}")
    name = parts[0]
    for part in parts[1:]:
        if len(name) + 1 + len(part) > _MAX_RUN_NAME_LENGTH - 2:
            return f"{name} …"
        name = f"{name} {part}"
    return name


def _params(flat: dict[str, Any]) -> dict[str, str]:
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


def objective_aliases(metrics: Mapping[str, float], metric: str) -> dict[str, float]:
    """``objective`` (the sweep's objective) and ``objective_test`` (its test counterpart),
    for those of the two that ``metrics`` holds."""
    aliases = {}
    if metric in metrics:
        aliases[OBJECTIVE_ALIAS] = metrics[metric]
    test = reported_test_metric(metric)
    if test is not None and test in metrics:
        aliases[OBJECTIVE_TEST_ALIAS] = metrics[test]
    return aliases


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
        name = trial_run_name(index, trial.config, self.config.tune.search_space)
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
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
        metrics.update(objective_aliases(metrics, self.config.tune.metric))
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
        self._log_leaderboard()

    def on_trial_error(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        run_id = self._child(trial)
        self._ended.add(trial.trial_id)
        self.client.set_tag(run_id, "raycl.ended", "error")
        if trial.error_file and Path(trial.error_file).is_file():
            self.client.log_artifact(run_id, trial.error_file)
        self.client.set_terminated(run_id, status="FAILED")
        self._log_leaderboard()

    def _log_leaderboard(self) -> None:
        """The parent run's leaderboard, rewritten from MLflow after every trial and at the end:
        ``leaderboard.csv`` (every trial of this sweep, best first), ``leaderboard.png`` and
        the run's description. A failure here is logged, never raised: it must not stop the
        sweep."""
        from raycl.leaderboard import (
            markdown_summary,
            plot_leaderboard,
            trial_runs,
            trial_table,
            write_csv,
        )

        if self.parent_run_id is None or self.experiment_id is None:
            return
        try:
            children = trial_runs(self.client, self.experiment_id, self.parent_run_id)
            table = trial_table(children, self.config.tune.metric, self.config.tune.mode)
            with tempfile.TemporaryDirectory() as directory:
                csv_path = Path(directory, "leaderboard.csv")
                png_path = Path(directory, "leaderboard.png")
                write_csv(table, csv_path)
                plot_leaderboard(table, png_path, self.config.tune.search_space)
                self.client.log_artifact(self.parent_run_id, str(csv_path))
                self.client.log_artifact(self.parent_run_id, str(png_path))
            self.client.set_tag(self.parent_run_id, NOTE_TAG,
                                markdown_summary(table, self.config.name))
        except Exception:  # a leaderboard is never worth a sweep
            logger.warning("could not write the leaderboard to the parent run", exc_info=True)

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
            self._log_leaderboard()
            self.client.set_terminated(self.parent_run_id, status="KILLED")
            return
        self.client.set_tag(self.parent_run_id, "raycl.interrupted", "false")
        best = best_trial(trials, self.config.tune.metric, self.config.tune.mode)
        if best is not None:
            trial, value = best
            # The winner is chosen on validation; its test numbers are reported beside it.
            metrics = {self.config.tune.metric: value}
            metrics.update({key: v for key, v in _numeric_metrics(
                trial.last_result or {}).items() if key.startswith("test/")})
            metrics.update(objective_aliases(metrics, self.config.tune.metric))
            metrics = {f"best/{key}": v for key, v in metrics.items()}
            for key, v in metrics.items():
                self.client.log_metric(self.parent_run_id, key, v)
            self.client.set_tag(self.parent_run_id, "raycl.best_trial", trial.trial_id)
            run_id = self._children.get(trial.trial_id)
            if run_id:
                self.client.set_tag(self.parent_run_id, "raycl.best_run", run_id)
        self.client.log_metric(self.parent_run_id, "sweep/trials", len(trials))
        self._log_leaderboard()
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
    """From inside a trial: add metrics and artifacts to its child run. False when not found.

    Under a sweep this goes through the driver's :mod:`raycl.relay` (the trial's node may not
    reach the store); without one (a trial run by hand) straight to MLflow.
    """
    if trial_id == "local":  # not running under Tune: there is no child run
        return False
    from raycl.relay import find_relay, read_files

    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    relay = find_relay()
    if relay is None:
        return log_to_trial_run_directly(tracking_uri, experiment_name(config), trial_id,
                                         metrics, artifact_dir, timeout_s)
    import ray

    reply = relay.log.remote(tracking_uri, experiment_name(config), trial_id, metrics,
                             read_files(artifact_dir), timeout_s)
    try:
        return bool(ray.get(reply, timeout=timeout_s + 60.0))
    except (ray.exceptions.RayError, TimeoutError) as exc:  # diagnostics never fail a trial
        logger.warning("trial %s: MLflow relay failed (%s); diagnostics not logged",
                       trial_id, exc)
        return False


def log_to_trial_run_directly(
    tracking_uri: str,
    experiment: str,
    trial_id: str,
    metrics: dict[str, float],
    artifact_dir: Path | None = None,
    timeout_s: float = 30.0,
) -> bool:
    """Add metrics and the files under ``artifact_dir`` (as ``diagnostics/``) to the run of
    ``trial_id`` in ``experiment``; False when there is no such run."""
    client = _client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    run_id = None
    deadline = time.monotonic() + timeout_s
    while found is not None and run_id is None and time.monotonic() < deadline:
        # The driver creates the run when the trial starts; it may lag behind the trial a little.
        run_id = find_trial_run(client, found.experiment_id, trial_id)
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
