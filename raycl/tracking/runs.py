"""MLflow runs at the bottom of :mod:`raycl.tracking`: the tags raycl writes, the client, the
experiment (created, tagged as model training, given its leaderboard view) and a trial's run.

Everything above (the relay, the leaderboard, the sweep callback) builds on these; this module
imports none of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import raycl
from raycl.config.schema import CoreConfig
from raycl.launch.feasibility import JOINT_PREFIX
from raycl.tracking.retry import retrying_client

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

    from raycl.config.sweep import TuneSection

logger = logging.getLogger(__name__)

TRIAL_TAG = "raycl.trial_id"
ROLE_TAG = "raycl.role"
SEARCHED_TAG = "raycl.searched"  # a trial run's searched values ("key=value, ..."), set last
SWEEP_TAG = "raycl.sweep"
SWEEP_UID_TAG = "raycl.sweep_uid"
COMMIT_TAG = "mlflow.source.git.commit"
PARENT_TAG = "mlflow.parentRunId"
# Every child logs its objective under these names too, so trials of sweeps with different
# objectives (methods, metrics) line up in MLflow's compare view; the tag names the metric.
OBJECTIVE_ALIAS = "objective"
OBJECTIVE_TEST_ALIAS = "objective_test"
OBJECTIVE_TAG = "raycl.objective"
# How a trial ended (completed, stopped_by_scheduler, skipped, error, diverged, interrupted) and,
# for a trial ASHA stopped, the epoch it stopped at (its last logged ``train/epoch``).
ENDED_TAG = "raycl.ended"
STOPPED_AT_METRIC = "stopped_at_epoch"
# The endings whose last metrics a trial is ranked by: it ran to its end, or ASHA stopped it.
COMPLETED, STOPPED_EARLY = "completed", "stopped_by_scheduler"
RANKED_ENDINGS = frozenset({COMPLETED, STOPPED_EARLY})
# The trial's number in the sweep, as Ray numbers it (its run name's ``t03``).
TRIAL_INDEX_TAG = "raycl.trial_index"
# Where the trial's last checkpoint is: a local directory or a bucket URI (raycl.results).
CHECKPOINT_TAG = "raycl.checkpoint"
# MLflow 3's UI tells GenAI experiments (traces) from model-training ones (runs) by this tag;
# custom_model_development is the "Machine learning" kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# MLflow's primary metric of an experiment (mlflow.utils.mlflow_tags): the UI's first chart.
PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"
GREATER_IS_BETTER_TAG = "mlflow.experiment.primaryMetric.greaterIsBetter"
NOTE_TAG = "mlflow.note.content"  # a run's description, shown on its page
# The parent run's search trial whose configuration won seed confirmation: what `--trial best`
# names once confirmation ran (raycl.sweep.confirm_tuner.report_confirmation).
CONFIRMED_RUN_TAG = "raycl.confirmed_run"
# A saved view of the UI's runs table ("Share" writes these): the leaderboard's link opens it.
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
LEADERBOARD_VIEW = "raycl-leaderboard"


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
    """The MLflow experiment a sweep logs to: ``mlflow.experiment``, else the sweep's name."""
    return config.mlflow.experiment or config.name


def mlflow_client(tracking_uri: str) -> MlflowClient:
    """A client of ``tracking_uri`` that waits out a store briefly away (a server restarting,
    a locked sqlite file: :mod:`raycl.tracking.retry`); MLflow is imported there, when used."""
    return retrying_client(tracking_uri)


def get_or_create_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """The id of the experiment ``name``, created (artifacts beside a sqlite store) if new."""
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
    """Save the experiment's leaderboard view of the UI's runs table, best first: the objective,
    the metric it stands for (``val/linear/mean`` beside ``objective``: a column cannot be
    renamed), its test counterpart, the sweep's searched params, how each trial ended
    (``raycl.ended``) and where ASHA stopped it (``stopped_at_epoch``).

    MLflow 3.17's runs table shows no metric column until one is picked through "Columns". Its
    "Share" button saves the table's state as a JSON object in the experiment tag
    ``mlflow.sharedViewState.<key>`` and opens it from a link with ``viewStateShareKey=<key>``;
    raycl writes that tag in the same form (``python -m raycl.leaderboard`` prints the link).
    The latest sweep in an experiment sets its columns.
    """
    searched = [key for key in config.tune.search_space if not key.startswith(JOINT_PREFIX)]
    metric = config.tune.metric
    named = [f"metrics.`{metric}`"] if metric != OBJECTIVE_ALIAS else []
    state = {"orderByKey": f"metrics.`{OBJECTIVE_ALIAS}`",
             "orderByAsc": config.tune.mode == "min",
             "selectedColumns": [f"metrics.`{OBJECTIVE_ALIAS}`", *named,
                                 f"metrics.`{OBJECTIVE_TEST_ALIAS}`",
                                 *(f"params.`{key}`" for key in searched),
                                 f"tags.`{ENDED_TAG}`", f"metrics.`{STOPPED_AT_METRIC}`"]}
    client.set_experiment_tag(experiment_id, VIEW_TAG_PREFIX + LEADERBOARD_VIEW,
                              json.dumps(state))


def mlflow_ui_command(tracking_uri: str) -> str:
    """``mlflow ui`` for ``tracking_uri`` as the user's shell can run it: plain ``mlflow`` when
    that is the script beside this interpreter, else that script's path (``.venv/bin/mlflow``,
    relative when it lies under the working directory: a venv not activated), else this
    interpreter with ``-m mlflow``."""
    script = Path(sys.executable).parent / "mlflow"  # unresolved: a venv's python is a link
    if script.is_file() and os.access(script, os.X_OK):
        on_path = shutil.which("mlflow")
        if on_path and Path(on_path).resolve() == script.resolve():
            program = "mlflow"
        else:
            program = _shell_path(script)
    else:
        program = f"{_shell_path(Path(sys.executable))} -m mlflow"
    return f"{program} ui --backend-store-uri {shlex.quote(tracking_uri)}"


def _shell_path(path: Path) -> str:
    """``path`` for a shell in the working directory: relative when under it, quoted."""
    relative = os.path.relpath(path.absolute())
    if relative.startswith(".."):
        return shlex.quote(str(path.absolute()))
    return shlex.quote(relative if os.sep in relative else f".{os.sep}{relative}")


def checkpoint_location(path: str, storage_path: str) -> str:
    """A checkpoint's path on the sweep's storage filesystem (as Ray reports it) as raycl reads
    it back: a local path as it is; on a bucket, its URI with the scheme and query of
    ``storage_path`` (``s3://bucket/raycl/...?endpoint_override=...``)."""
    scheme, separator, _ = storage_path.partition("://")
    if not separator or scheme == "file":
        return path
    query = storage_path.partition("?")[2]
    return f"{scheme}://{path.lstrip('/')}" + (f"?{query}" if query else "")


def tag_checkpoint(client: MlflowClient, run_id: str, checkpoint: object,
                   tune: TuneSection) -> None:
    """Tag a trial's run with where its latest checkpoint is (``raycl.checkpoint``):
    ``checkpoint`` is Tune's (its ``path``) or the path Ray Train reported, on the storage of
    ``tune`` (the config's ``tune`` section)."""
    path = getattr(checkpoint, "path", checkpoint)
    client.set_tag(run_id, CHECKPOINT_TAG, checkpoint_location(str(path), tune.storage_path))


def rankable(run: Run) -> bool:
    """Whether a trial's run may be ranked (the leaderboard, the Pareto front, ``best``, the
    warm start, seed confirmation's winners): MLflow status FINISHED and ``raycl.ended``
    completed or stopped_by_scheduler.

    A trial that failed, diverged, was skipped, killed or interrupted, or still runs, has last
    metrics from part of its training at part of its cost, and a checkpoint that may predate
    them: it is shown, never ranked. A FINISHED run without ``raycl.ended`` (a sweep logged
    before the tag existed) counts as completed: the callback always tags before it closes a
    run FINISHED.

    Args:
        run: a trial's MLflow run.

    Returns:
        True when its last metrics may rank it.
    """
    return run.info.status == "FINISHED" and run.data.tags.get(ENDED_TAG, COMPLETED) in \
        RANKED_ENDINGS


# Runs fetched per MLflow search page (MLflow's own default; a tracking server may refuse
# more): search_all_runs pages on until the last, so a sweep of any size is read whole.
SEARCH_PAGE_SIZE = 1000


def search_all_runs(client: MlflowClient, experiment_ids: list[str],
                    filter_string: str = "") -> list[Run]:
    """Every run of ``experiment_ids`` matching ``filter_string``, newest first (MLflow's
    default order: start time descending, then run id), read page by page (``page_token``) to
    the last: one ``search_runs`` call stops at its ``max_results``, which once cut a sweep's
    leaderboard and front at 5 000 trials.

    Pages are read oldest first, so a run created while they are read (a sweep still running)
    lands on a later page instead of shifting one run onto two pages; a run seen twice counts
    once.
    """
    runs: list[Run] = []
    seen: set[str] = set()
    token: str | None = None
    while True:
        page = client.search_runs(experiment_ids, filter_string, max_results=SEARCH_PAGE_SIZE,
                                  order_by=["attributes.start_time ASC"], page_token=token)
        for run in page:
            if run.info.run_id not in seen:
                seen.add(run.info.run_id)
                runs.append(run)
        token = page.token
        if not token:
            # MLflow's own order of one search (start_time DESC, then run id), as before.
            return sorted(runs, key=lambda run: (-(run.info.start_time or 0), run.info.run_id))


def find_trial_run(client: MlflowClient, experiment_id: str, trial_id: str) -> str | None:
    """The id of the child run tagged with ``trial_id``, None when there is none (yet)."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{TRIAL_TAG}` = '{trial_id}'",
                              max_results=1)
    return runs[0].info.run_id if runs else None


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
    client = mlflow_client(tracking_uri)
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
