"""Finished trials of a sweep, found from what MLflow recorded: each one's config, metrics and
last checkpoint.

A sweep is an MLflow experiment whose parent run (tag ``raycl.role = sweep``) records the
objective (``raycl.metric``, ``raycl.mode``) and whose child runs are its trials. Each trial's
run holds its resolved config (the ``config.yaml`` artifact: the whole config, where params are
cut at MLflow's length limit) and where its latest checkpoint is (the tag ``raycl.checkpoint``,
written by :class:`raycl.tracking.callback.MLflowSweepCallback`). Runs logged before that tag
existed are matched to their checkpoints in ``tune.storage_path`` by trial id. A trial whose
encoder the sweep logged into its run (the ``encoder/`` artifact, :mod:`raycl.results.run_encoder`)
names it in ``encoder``: what raycl.export and raycl.evaluate read once the checkpoint is gone.

    trials = find_trials("sqlite:///mlflow.db", "quickstart", "best")
    state_dir = local_checkpoint(trials[0], Path("/tmp/best"))   # holds state.pt
"""

from __future__ import annotations

import difflib
import os
import posixpath
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from raycl.config.schema import CoreConfig
from raycl.config.sweep import DEFAULT_TRACKING_URI, resolve_tracking_uri
from raycl.export.run_artifact import ENCODER_TAG
from raycl.tracking.retry import retrying_client
from raycl.tracking.runs import (
    CHECKPOINT_TAG,
    CONFIRMED_RUN_TAG,
    ROLE_TAG,
    TRIAL_TAG,
    checkpoint_location,
    rankable,
)
from raycl.tracking.trial_table import trial_runs, trial_table

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

# A trial's run name starts with its number in the sweep: ``t07 K=5 N=2 τ=0.31``.
_TRIAL_NAME = re.compile(r"^t\d+$")
# MLflow run ids: 32 hex digits.
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
# What every checkpoint directory holds (raycl.worker.stage_integration's model file).
STATE_FILE = "state.pt"
# The artifact each trial run holds its resolved config in (raycl.tracking.callback).
CONFIG_ARTIFACT = "config.yaml"


class TrialLookupError(ValueError):
    """An experiment, trial or checkpoint that cannot be found; its message is one line."""


@dataclass
class FinishedTrial:
    """One trial of a sweep as MLflow recorded it.

    Attributes:
        run_id: the trial's MLflow run.
        run_name: its name (``t07 K=5 ...``).
        experiment: the MLflow experiment (the sweep's).
        config: the trial's resolved config (its searched values applied).
        checkpoint: its last checkpoint: a local directory or a bucket URI.
        metrics: the run's latest metrics.
        tracking_uri: the MLflow store it was found in.
        encoder: the ``runs:/<run_id>/encoder`` URI of the encoder logged into its run, None
            when none was (:mod:`raycl.results.run_encoder`).
    """

    run_id: str
    run_name: str
    experiment: str
    config: CoreConfig
    checkpoint: str
    metrics: dict[str, float] = field(default_factory=dict)
    tracking_uri: str = DEFAULT_TRACKING_URI
    encoder: str | None = None

    @property
    def label(self) -> str:
        """A short name for messages: ``t07`` (the run name's first word)."""
        return (self.run_name or self.run_id[:8]).split(" ")[0]


def find_trials(tracking_uri: str | None, experiment: str, trial: str = "best",
                top: int | None = None) -> list[FinishedTrial]:
    """The trials of ``experiment``'s latest sweep that ``trial`` or ``top`` names.

    Args:
        tracking_uri: the MLflow store (None: :data:`DEFAULT_TRACKING_URI`).
        experiment: the MLflow experiment's name.
        trial: ``best`` (the best by the sweep's validation objective, its ``tune.metric`` and
            ``tune.mode`` as the parent run records them, among the trials that may be ranked:
            :func:`raycl.tracking.runs.rankable`; once seed confirmation ran, the search trial
            of the configuration it confirmed best), a run name's number (``t07``, in the latest
            sweep) or a run id (of any sweep of the experiment).
        top: the ``top`` best trials instead (``trial`` is then ignored); fewer when fewer may
            be ranked.

    Returns:
        The trials, best first for ``best`` and ``top``.

    Raises:
        TrialLookupError: no such experiment, sweep or trial (for ``best`` and ``top``: none
            that may be ranked); a trial without a checkpoint or a readable config.
        ValueError: ``top`` below 1.
    """
    if top is not None and top < 1:
        raise ValueError(f"top must be at least 1, got {top}")
    # One line per problem on stderr: no progress bar per config.yaml read (a setting of the
    # user's is kept).
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = resolve_tracking_uri(tracking_uri or DEFAULT_TRACKING_URI)
    database = uri.removeprefix("sqlite:///")
    if database != uri and not Path(database).is_file():  # MLflow would create an empty one
        raise TrialLookupError(f"no MLflow store at {uri} (no such file); pass --tracking-uri")
    client = retrying_client(uri)
    experiment_id = _experiment_id(client, experiment, uri)
    if top is not None:
        runs = _ranked_trials(client, experiment_id, experiment)[:top]
    elif trial == "best":
        runs = [_best_trial(client, experiment_id, experiment)]
    elif _RUN_ID.match(trial):
        runs = [_run_by_id(client, experiment_id, experiment, trial)]
    elif _TRIAL_NAME.match(trial):
        runs = [_run_by_name(client, experiment_id, experiment, trial)]
    else:
        raise TrialLookupError(f"--trial {trial!r}: expected best, a trial name (t07) or a "
                               "run id (32 hex digits)")
    return [finished_trial(client, run, experiment, uri) for run in runs]


def _experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    """The id of experiment ``name``; else the error names the closest ones."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    names = [item.name for item in client.search_experiments()]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else (
        f"; it has {', '.join(sorted(names)[:5])}" if names else "; it has none")
    raise TrialLookupError(f"no MLflow experiment named {name!r} at {uri}{hint}")


def _latest_sweep(client: MlflowClient, experiment_id: str, experiment: str) -> Run:
    """The experiment's latest parent run (the sweep last started)."""
    parents = client.search_runs([experiment_id], f"tags.`{ROLE_TAG}` = 'sweep'",
                                 order_by=["attributes.start_time DESC"], max_results=1)
    if not parents:
        raise TrialLookupError(f"experiment {experiment!r} has no raycl sweep")
    return parents[0]


def _ranked_trials(client: MlflowClient, experiment_id: str, experiment: str,
                   parent: Run | None = None) -> list[Run]:
    """The latest sweep's trials that may be ranked (:func:`raycl.tracking.runs.rankable`: a
    failed, killed or running trial's last objective came from part of its training) and
    reported its objective, best first (the leaderboard's order,
    :func:`raycl.tracking.trial_table.trial_table`)."""
    parent = parent or _latest_sweep(client, experiment_id, experiment)
    metric = parent.data.tags.get("raycl.metric", "val/linear/mean")
    mode = parent.data.tags.get("raycl.mode", "max")
    table = trial_table(trial_runs(client, experiment_id, parent.info.run_id), metric, mode)
    ranked = [run for run in table.runs if rankable(run) and table.objective(run) is not None]
    if not ranked:
        unranked = sum(not rankable(run) for run in table.runs)
        why = f" ({unranked} failed, killed or still running: never ranked)" if unranked else ""
        raise TrialLookupError(f"no finished trial of experiment {experiment!r}'s latest sweep "
                               f"has reported {metric} yet{why}")
    return ranked


def _best_trial(client: MlflowClient, experiment_id: str, experiment: str) -> Run:
    """``--trial best``: the search trial of the configuration seed confirmation found best
    (said on stderr when it is not the search's own best), else the search's best."""
    parent = _latest_sweep(client, experiment_id, experiment)
    ranked = _ranked_trials(client, experiment_id, experiment, parent)
    confirmed = parent.data.tags.get(CONFIRMED_RUN_TAG)
    winner = next((run for run in ranked if run.info.run_id == confirmed), None)
    if winner is None:
        return ranked[0]
    if winner is not ranked[0]:
        print(f"raycl: --trial best: {winner.info.run_name or confirmed}, the winner of seed "
              f"confirmation (confirm.csv), not the search's best "
              f"{ranked[0].info.run_name or ranked[0].info.run_id}", file=sys.stderr, flush=True)
    return winner


def _run_by_name(client: MlflowClient, experiment_id: str, experiment: str, name: str) -> Run:
    """The latest sweep's trial whose run name starts with ``name`` (``t07``)."""
    parent = _latest_sweep(client, experiment_id, experiment)
    children = trial_runs(client, experiment_id, parent.info.run_id)
    for run in children:
        if (run.info.run_name or "").split(" ")[0] == name:
            return run
    names = sorted((run.info.run_name or "").split(" ")[0] for run in children)
    raise TrialLookupError(f"experiment {experiment!r}'s latest sweep has no trial {name!r} "
                           f"(it has {', '.join(names) or 'none'})")


def _run_by_id(client: MlflowClient, experiment_id: str, experiment: str, run_id: str) -> Run:
    """The trial run ``run_id`` of ``experiment``."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise TrialLookupError(f"no MLflow run {run_id} in experiment {experiment!r}") from None
    if run.info.experiment_id != experiment_id or run.data.tags.get(ROLE_TAG) != "trial":
        raise TrialLookupError(f"run {run_id} is not a trial of experiment {experiment!r}")
    return run


def finished_trial(client: MlflowClient, run: Run, experiment: str, uri: str) -> FinishedTrial:
    """``run`` as a :class:`FinishedTrial`: its config read back, its checkpoint located.

    Args:
        client: a client of the store ``uri``.
        run: the trial's run.
        experiment: its experiment's name (for messages).
        uri: the store.

    Returns:
        The trial.

    Raises:
        TrialLookupError: its config is unreadable, or it has neither a checkpoint nor a
            logged encoder.
    """
    name = (run.info.run_name or run.info.run_id[:8]).split(" ")[0]
    config = _trial_config(client, run, name)
    checkpoint = run.data.tags.get(CHECKPOINT_TAG) or _stored_checkpoint(
        config.tune.storage_path, run.data.tags.get(TRIAL_TAG, "")) or ""
    encoder = run.data.tags.get(ENCODER_TAG)
    if not checkpoint and not encoder:
        raise TrialLookupError(
            f"trial {name} has no checkpoint (its run {run.info.run_id} has no "
            f"{CHECKPOINT_TAG} tag and {config.tune.storage_path} holds none of trial "
            f"{run.data.tags.get(TRIAL_TAG, '?')}; ended: "
            f"{run.data.tags.get('raycl.ended', run.info.status.lower())})")
    return FinishedTrial(run_id=run.info.run_id, run_name=run.info.run_name or "",
                         experiment=experiment, config=config, checkpoint=checkpoint,
                         metrics=dict(run.data.metrics), tracking_uri=uri, encoder=encoder)


def _trial_config(client: MlflowClient, run: Run, name: str) -> CoreConfig:
    """The trial's resolved config, from its run's ``config.yaml`` artifact."""
    import raycl.methods  # noqa: F401  (registers the method sections the schema validates)
    from raycl.config.search_config import search_config_class

    with tempfile.TemporaryDirectory() as directory:
        try:
            path = client.download_artifacts(run.info.run_id, CONFIG_ARTIFACT, directory)
            raw = yaml.safe_load(Path(path).read_text())
        except Exception as exc:  # missing artifact, unreachable artifact store
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise TrialLookupError(f"trial {name}: cannot read its {CONFIG_ARTIFACT} from run "
                                   f"{run.info.run_id}: {why}") from None
    return search_config_class().model_validate(raw)


def _stored_checkpoint(storage_path: str, trial_id: str) -> str | None:
    """The newest ``checkpoint_*`` of trial ``trial_id`` under ``storage_path`` (runs logged
    before the ``raycl.checkpoint`` tag): Tune's ``<sweep>/<trainable>_<trial_id>_*/`` or Ray
    Train's ``<sweep>-train/<sweep>-<trial_id>/`` directories. None when there is none."""
    if not trial_id:
        return None
    from pyarrow import fs

    from raycl.data.bucket_paths import bucket_filesystem, is_remote

    try:
        if is_remote(storage_path):
            filesystem, root = bucket_filesystem(storage_path)
        else:
            filesystem, root = fs.LocalFileSystem(), str(Path(storage_path).expanduser())
        found = []
        for sweep in _listed(filesystem, root):
            for trial_dir in _listed(filesystem, sweep.path):
                if trial_id in trial_dir.base_name:
                    found += [entry.path for entry in _listed(filesystem, trial_dir.path)
                              if entry.base_name.startswith("checkpoint_")]
    except (OSError, ValueError):  # storage gone or unreachable: no checkpoint to offer
        return None
    if not found:
        return None
    # Tune's checkpoint_000007 and Ray Train's checkpoint_<timestamp> both sort by age.
    return checkpoint_location(max(found, key=posixpath.basename), storage_path)


def _listed(filesystem: object, path: str) -> list:
    """The folders directly in ``path`` on ``filesystem`` (none when it is not a folder)."""
    from pyarrow import fs

    assert isinstance(filesystem, fs.FileSystem)
    entries = filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))
    return [entry for entry in entries if entry.type == fs.FileType.Directory]


def local_checkpoint(trial: FinishedTrial, into: Path,
                     files: Sequence[str] | None = None) -> Path:
    """A local directory holding ``trial``'s checkpoint (``state.pt`` and the rest).

    Args:
        trial: a trial from :func:`find_trials`.
        into: where a bucket checkpoint is downloaded to (a folder of that name is made in
            it); a local checkpoint is used where it is and ``into`` stays unused.
        files: download only these files of a bucket checkpoint (those it has), not the
            features and inputs it keeps for resuming; None: all of it.

    Returns:
        The checkpoint directory.

    Raises:
        TrialLookupError: the checkpoint is gone or holds no ``state.pt``.
    """
    from raycl.data.bucket_paths import is_remote

    if not trial.checkpoint:  # only its logged encoder is left (FinishedTrial.encoder)
        raise TrialLookupError(f"trial {trial.label} has no checkpoint (its run records none)")
    if not is_remote(trial.checkpoint):
        directory = Path(trial.checkpoint)
    else:
        directory = Path(into) / posixpath.basename(trial.checkpoint.partition("?")[0])
        try:
            _download(trial.checkpoint, directory, files)
        except (OSError, ValueError) as exc:
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise TrialLookupError(f"trial {trial.label}: cannot download its checkpoint "
                                   f"{trial.checkpoint}: {why}") from None
    if not (directory / STATE_FILE).is_file():
        raise TrialLookupError(f"trial {trial.label} has no checkpoint ({directory} holds no "
                               f"{STATE_FILE}: removed since the sweep?)")
    return directory


def _download(uri: str, directory: Path, files: Sequence[str] | None) -> None:
    """Copy the bucket folder ``uri`` (or only those of ``files`` it holds) to ``directory``."""
    from pyarrow import fs

    from raycl.data.bucket_paths import bucket_filesystem

    filesystem, path = bucket_filesystem(uri)
    local = fs.LocalFileSystem()
    directory.mkdir(parents=True, exist_ok=True)  # pyarrow makes no local parent folder
    if files is None:
        fs.copy_files(path, str(directory), source_filesystem=filesystem,
                      destination_filesystem=local)
        return
    wanted = [posixpath.join(path, name) for name in files]
    for info in filesystem.get_file_info(wanted):
        if info.type == fs.FileType.File:
            fs.copy_files(info.path, str(directory / info.base_name),
                          source_filesystem=filesystem, destination_filesystem=local)
