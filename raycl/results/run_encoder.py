"""Every trial's final encoder in its own MLflow run (issue 35), and read back from there.

When a trial ends with a checkpoint (it ran to its end, or ASHA stopped it early), the driver's
:class:`RunEncoderCallback` logs its trained encoder into the trial's run as the artifact
``encoder/``: the weights as ``python -m raycl.export --format safetensors`` writes them
(an MCL concat trial: every stage's tensors in that one file, under ``stage<j>.``) and
their model card, and tags the run ``raycl.encoder = runs:/<run_id>/encoder``. A run in the
MLflow UI then leads to its model after ``ray_results/`` is gone, and
``raycl.load_encoder("runs:/<run_id>/encoder")`` returns it with its preprocessing.

Why the driver, after the trial: the last checkpoint is known only then (a trial ASHA stops
learns it from no one), only ``state.pt`` (and an MCL trial's stage weights) is read, from local
or bucket storage alike, and the trials' workers do nothing more. The work runs in a background
thread so the sweep's event loop never waits on it; a failure is one warning and the sweep goes
on (the checkpoint tag stays). ``mlflow.log_encoder: false`` turns it off.

``raycl.export`` and ``raycl.evaluate`` fall back on the logged encoder when the trial's
checkpoint is gone (:func:`trial_encoder`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray.tune import Callback

from raycl.config.sweep import resolve_tracking_uri
from raycl.export.run_artifact import (
    ENCODER_ARTIFACT,
    ENCODER_TAG,
    load_run_encoder,
    run_encoder_uri,
)
from raycl.results.trials import (
    FinishedTrial,
    TrialLookupError,
    finished_trial,
    local_checkpoint,
)
from raycl.tracking.retry import retrying_client
from raycl.tracking.runs import ENDED_TAG, RANKED_ENDINGS, experiment_name, find_trial_run

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from torch import nn

    from raycl.config.schema import CoreConfig
    from raycl.export.modules import Preprocessing

logger = logging.getLogger(__name__)

# How a trial ended when its last checkpoint is its final encoder (raycl.ended): the endings
# a trial is ranked by.
ENDINGS_WITH_ENCODER = RANKED_ENDINGS
# What of a checkpoint the encoder is rebuilt from (raycl.export.encoder.trained_encoder):
# not the features and inputs a checkpoint keeps for resuming.
ENCODER_INPUTS = ("state.pt", "stage_weights.pt", "progress.json")
LOGGED_FORMAT = "safetensors"
# How long the sweep's end waits for encoders still being logged.
WAIT_AT_END_S = 300.0


def card_objective(trial: FinishedTrial) -> dict[str, object] | None:
    """The trial's validation objective for its model card, None when it reported none."""
    metric, mode = trial.config.tune.metric, trial.config.tune.mode
    value = trial.metrics.get(metric)
    return None if value is None else {"metric": metric, "mode": mode, "value": value}


def card_test_scores(trial: FinishedTrial) -> dict[str, float]:
    """The trial's test metrics (``test/...``), reported in the model card."""
    return {key: value for key, value in sorted(trial.metrics.items())
            if key.startswith("test/")}


def write_run_encoder(trial: FinishedTrial, checkpoint_dir: Path, out_dir: Path) -> list[Path]:
    """Write ``trial``'s encoder, rebuilt from ``checkpoint_dir``, into ``out_dir`` as the
    ``encoder/`` artifact holds it.

    Args:
        trial: the trial.
        checkpoint_dir: its checkpoint (``state.pt``, and an MCL trial's stage weights).
        out_dir: an existing empty folder.

    Returns:
        The files written, the main file first and the model card last.
    """
    from raycl.export.encoder import checkpoint_channels, read_state, trained_encoder
    from raycl.export.formats import write_encoder
    from raycl.export.modules import base_method_name

    encoder = trained_encoder(checkpoint_dir, trial.config)
    channels = checkpoint_channels(read_state(checkpoint_dir)["model"],
                                   base_method_name(trial.config))
    # One file for every trial (an MCL concat trial's: each stage's tensors under stage<j>.).
    return write_encoder(encoder, trial.config, LOGGED_FORMAT,
                         out_dir / f"encoder.{LOGGED_FORMAT}", channels,
                         objective=card_objective(trial), test_scores=card_test_scores(trial))


def log_run_encoder(client: MlflowClient, trial: FinishedTrial) -> str:
    """Log ``trial``'s encoder into its run as ``encoder/`` and tag the run with its URI.

    Args:
        client: a client of the trial's store.
        trial: the trial, its checkpoint local or in a bucket.

    Returns:
        The ``runs:/<run_id>/encoder`` URI.

    Raises:
        TrialLookupError: the checkpoint is gone; anything writing or logging raises.
    """
    with tempfile.TemporaryDirectory(prefix="raycl-run-encoder-") as scratch:
        checkpoint = local_checkpoint(trial, Path(scratch) / "checkpoint", ENCODER_INPUTS)
        out = Path(scratch) / ENCODER_ARTIFACT
        out.mkdir()
        write_run_encoder(trial, checkpoint, out)
        client.log_artifacts(trial.run_id, str(out), artifact_path=ENCODER_ARTIFACT)
    uri = run_encoder_uri(trial.run_id)
    client.set_tag(trial.run_id, ENCODER_TAG, uri)
    return uri


def log_ended_trial_encoder(tracking_uri: str, experiment: str, trial_id: str) -> str | None:
    """Log the encoder of the trial ``trial_id`` (Tune's id) of ``experiment`` into its run,
    when it ended with a checkpoint and has none logged yet. Never raises: a failure is one
    warning (the sweep goes on; the run keeps its checkpoint tag).

    Args:
        tracking_uri: the sweep's MLflow store.
        experiment: its experiment's name.
        trial_id: the trial's id (the run's ``raycl.trial_id`` tag).

    Returns:
        The encoder's ``runs:/`` URI, None when none was logged.
    """
    # The driver's terminal shows the sweep, not a progress bar per config.yaml read.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        client = retrying_client(tracking_uri)
        found = client.get_experiment_by_name(experiment)
        run_id = found and find_trial_run(client, found.experiment_id, trial_id)
        if not run_id:
            return None
        run = client.get_run(run_id)
        tags = run.data.tags
        if tags.get(ENDED_TAG) not in ENDINGS_WITH_ENCODER or ENCODER_TAG in tags:
            return None
        return log_run_encoder(client, finished_trial(client, run, experiment, tracking_uri))
    except Exception as exc:  # an encoder is never worth a sweep
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        logger.warning("trial %s: its encoder was not logged into its MLflow run (%s); the "
                       "sweep goes on", trial_id, why)
        return None


class RunEncoderCallback(Callback):
    """Tune callback (after :class:`raycl.tracking.callback.MLflowSweepCallback`, which closes
    the trial's run first) logging each ended trial's encoder into its run, in a background
    thread; the sweep's end waits for them (up to :data:`WAIT_AT_END_S`)."""

    def __init__(self, config: CoreConfig) -> None:
        self.tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
        self.experiment = experiment_name(config)
        self.enabled = config.mlflow.log_encoder
        self._pending: list[threading.Thread] = []

    # Tune pickles its callbacks with the sweep's state: threads stay behind.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pending": []}

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if not self.enabled:
            return
        thread = threading.Thread(
            target=log_ended_trial_encoder, args=(self.tracking_uri, self.experiment,
                                                  trial.trial_id),
            name=f"raycl-encoder-{trial.trial_id}", daemon=True)
        thread.start()
        self._pending.append(thread)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.wait(WAIT_AT_END_S)

    def wait(self, timeout_s: float) -> int:
        """Wait for the encoders being logged, at most ``timeout_s`` in all; returns how many
        are still being logged (said in one warning)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._pending:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._pending = [thread for thread in self._pending if thread.is_alive()]
        if self._pending:
            logger.warning("%d trial encoders were still being logged into MLflow after %.0f s; "
                           "left behind", len(self._pending), timeout_s)
        return len(self._pending)


def trial_encoder(trial: FinishedTrial, scratch: Path) -> tuple[nn.Module, Preprocessing, bool]:
    """``trial``'s encoder from its checkpoint, else (the checkpoint gone) from its run's
    logged ``encoder/``.

    Args:
        trial: the trial.
        scratch: where a bucket checkpoint is downloaded (:func:`local_checkpoint`).

    Returns:
        (the module in eval mode on the CPU, its preprocessing, whether it came from the run).

    Raises:
        TrialLookupError: the checkpoint is gone and no encoder was logged (or it cannot be
            read).
    """
    from raycl.export.encoder import checkpoint_channels, read_state, trained_encoder
    from raycl.export.modules import base_method_name, raycl_preprocessing

    try:
        directory = local_checkpoint(trial, scratch, ENCODER_INPUTS)
    except TrialLookupError as gone:
        if not trial.encoder:
            raise
        try:
            loaded = load_run_encoder(trial.encoder, trial.tracking_uri)
        except (OSError, ValueError) as exc:
            raise TrialLookupError(f"{gone}; its logged encoder: {exc}") from None
        assert loaded is not None  # a runs:/ URI
        return loaded[0], loaded[1], True
    encoder = trained_encoder(directory, trial.config)
    channels = checkpoint_channels(read_state(directory)["model"], base_method_name(trial.config))
    return encoder, raycl_preprocessing(trial.config, channels), False


def evaluation_encoder(trial: FinishedTrial, scratch: Path) -> tuple[nn.Module, int]:
    """``trial``'s encoder as raycl's evaluation feeds it (images normalised with mean 0.5 and
    std 0.5: :func:`raycl.data.augment.to_float`) and its image channels, from its checkpoint
    or, that gone, its run's logged encoder.

    Raises:
        TrialLookupError: neither is there, or the logged encoder takes other inputs (a CLIP
            trial's open_clip model, normalised with open_clip's statistics).
    """
    from raycl.export.modules import raycl_preprocessing

    encoder, preprocessing, from_run = trial_encoder(trial, scratch)
    if from_run and preprocessing != raycl_preprocessing(trial.config, preprocessing.channels):
        raise TrialLookupError(f"trial {trial.label}'s checkpoint is gone and its logged encoder "
                               f"({trial.encoder}) takes open_clip's normalisation, not raycl's: "
                               "it is not scored here")
    return encoder, preprocessing.channels


__all__ = ["ENCODER_INPUTS", "ENDINGS_WITH_ENCODER", "RunEncoderCallback", "card_objective",
           "card_test_scores", "evaluation_encoder", "log_ended_trial_encoder",
           "log_run_encoder", "trial_encoder", "write_run_encoder"]
