"""Population-based training of trials that train with Ray Train workers
(``scaling.num_workers >= 1``): the Tune function that fits a ``TorchTrainer`` as PBT needs it.

Ray 2.60's "Tune function fits a TorchTrainer" pattern (``ray.tune.integration.ray_train
.TuneReportCallback``) gives Tune's PBT nothing to exploit, and a restarted trial would train on
from the wrong weights. The workarounds, all here (the scheduler's own are in
:mod:`raycl.sweep.population`):

- **Checkpoints reach Tune.** ``TuneReportCallback`` (in the Train controller) queues the metrics
  and the checkpoint's path only; the trial's Tune session reports them without a checkpoint
  (``ray/train/_internal/session.py``, ``_get_result_from_queues``), so PBT pauses and exploits
  trials that never checkpointed (ray-project/ray#27170). :class:`_ReportRelay` queues the
  metrics and the checkpoint's path to the trial process instead (through one small
  :class:`_Channels` actor per start), which reports them itself with
  ``tune.report(metrics, checkpoint=...)`` (Tune copies the checkpoint into the trial's
  directory; the earlier MCL stages' features it refers to are copied beside it).
- **The exploited checkpoint wins.** A trial's Train run name used to be stable, so a restarted
  trial's ``TorchTrainer`` resumed its *own* Train storage, and an exploit would go on from its
  own weights with the better trial's values (the bug of ray-project/ray#28509). Here every
  start of a trial is a fresh Train run (:func:`generation_run_name`) whose workers resume from
  ``tune.get_checkpoint()`` (:class:`StartingSession`: Train V2 refuses
  ``resume_from_checkpoint``); within the run, a restarted worker group resumes from the run's
  own checkpoints as before. The mutated values win over the checkpoint's optimizer
  hyperparameters (:func:`raycl.worker.optim.load_optimizer_state`).
- **No run-ahead.** The controller waits in :meth:`_ReportRelay.after_report` until Tune has
  taken the report and let the trial go on, so a paused trial's workers train at most the epoch
  they are in (never reported, never logged: each epoch is logged once, from the epoch a
  restarted trial reports).
- **Earlier starts' Train runs go.** Tune copies each reported checkpoint into the trial's
  directory, and a start begins from that copy: the Train run directories of the trial's earlier
  starts are deleted when it starts again (:func:`drop_earlier_runs`), or a long population
  would keep every checkpoint of every start.
- **A paused trial lets go of its workers.** Tune reuses a function trainable's actor
  (``reuse_actors``): the paused trial's thread exits but its ``TorchTrainer`` (controller,
  worker group and their placement group) lives on in the reused process and holds its CPUs,
  so the next trial's workers never start (the hang of ray-project/ray#18808 with a
  function trainable). :func:`reuses_trial_actors` turns reuse off for these sweeps: a paused
  trial's process ends, and its controller and workers (owned by it) with it. Their placement
  group is then removed by Ray Train's cleaner, which needs every worker to know its cluster's
  address when two Rays share a machine (:mod:`raycl.sweep.worker_setup`).
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import re
import threading
import uuid
from typing import Any

import ray
import ray.train
from ray.train.v2.api.callback import UserCallback

from raycl.config.schema import CoreConfig
from raycl.launch.pbt_check import POPULATION_SCHEDULERS
from raycl.sweep.population import copy_missing_files
from raycl.worker.session import RayTrainSession
from raycl.worker.stage_integration import STAGE_FEATURES_DIR

logger = logging.getLogger(__name__)

# The trainer's thread ended: no more reports (an item of the report channel).
_FINISHED = None
# _Channels' two directions: reports to the trial process, its replies to the controller.
_REPORTS, _REPLIES = "reports", "replies"


def trains_population_with_workers(config: CoreConfig) -> bool:
    """Whether ``config``'s trials are a PBT/PB2 population that trains with Ray Train
    workers (this module's path), rather than in the trial process."""
    return (config.tune.scheduler.type in POPULATION_SCHEDULERS
            and config.scaling.num_workers >= 1)


def reuses_trial_actors(config: CoreConfig) -> bool:
    """Tune's ``reuse_actors`` for ``config``'s sweep: off for a population with workers (a
    reused process keeps a paused trial's worker group; see the module's docstring)."""
    return not trains_population_with_workers(config)


def generation_run_name(trial_run_name: str) -> str:
    """The Train run name of one start of a population trial: ``<trial's>-<8 hex>``, new at
    every start, so no start resumes another's Train storage.

    Args:
        trial_run_name: the trial's stable name (``<sweep>-<trial id>``).

    Returns:
        A name no earlier start used.
    """
    return f"{trial_run_name}-{uuid.uuid4().hex[:8]}"


class StartingSession(RayTrainSession):
    """A Ray Train worker's session that resumes from ``start`` (the trial's Tune checkpoint)
    while its run has no checkpoint of its own."""

    def __init__(self, start: ray.train.Checkpoint | None) -> None:
        super().__init__()
        self.start = start

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        return ray.train.get_checkpoint() or self.start


@ray.remote(num_cpus=0)
class _Channels:
    """The two one-way FIFO channels between one start's Train controller and its trial process
    (:data:`_REPORTS`, :data:`_REPLIES`), in one actor, so a start costs one helper process:
    ``get`` waits for an item of its channel (an async actor, so a waiting ``get`` never
    blocks a ``put``)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {_REPORTS: asyncio.Queue(),
                                                  _REPLIES: asyncio.Queue()}

    async def put(self, channel: str, item: Any) -> None:
        self._queues[channel].put_nowait(item)

    async def get(self, channel: str) -> Any:
        return await self._queues[channel].get()


class _ReportRelay(UserCallback):
    """In the Train controller: each report's rank-0 metrics and checkpoint path to the trial
    process, then wait until the trial process says Tune let the trial go on."""

    def __init__(self, channels: Any) -> None:
        self._channels = channels

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]],
                     checkpoint: ray.train.Checkpoint | None) -> None:
        report = (dict(metrics[0]), checkpoint.path if checkpoint else None)
        ray.get(self._channels.put.remote(_REPORTS, report))
        ray.get(self._channels.get.remote(_REPLIES))


def drop_earlier_runs(filesystem: Any, train_root: str, trial_run_name: str,
                      keep: str) -> list[str]:
    """Delete the Train run directories of a population trial's earlier starts.

    Args:
        filesystem: the Train storage's pyarrow filesystem.
        train_root: the Train storage's root path on it.
        trial_run_name: the trial's stable name (``<sweep>-<trial id>``).
        keep: this start's run name (:func:`generation_run_name`), kept.

    Returns:
        The run names deleted (none of another trial: a start's name is the trial's name, a
        dash and 8 hex digits).
    """
    import pyarrow.fs

    start = re.compile(re.escape(trial_run_name) + r"-[0-9a-f]{8}")
    dropped = []
    for info in filesystem.get_file_info(pyarrow.fs.FileSelector(train_root,
                                                                allow_not_found=True)):
        if (info.type == pyarrow.fs.FileType.Directory and info.base_name != keep
                and start.fullmatch(info.base_name)):
            filesystem.delete_dir(info.path)
            dropped.append(info.base_name)
    return dropped


class PopulationStart:
    """One start of a population trial with workers, in the trial's Tune function: the
    checkpoint it starts from, its fresh Train run name, and :meth:`fit`, which relays the
    worker group's reports (with their checkpoints) to Tune."""

    def __init__(self, trial_run_name: str, train_storage_path: str) -> None:
        from ray import tune
        from ray.train._internal.storage import get_fs_and_path

        self.start: ray.train.Checkpoint | None = tune.get_checkpoint()
        self.run_name = generation_run_name(trial_run_name)
        self._trial_run_name = trial_run_name
        self._train_fs, train_root = get_fs_and_path(train_storage_path)
        self._train_root = train_root
        self._train_run_dir = posixpath.join(train_root, self.run_name)
        # Owned by this process: it ends with it, and so does a controller waiting on it.
        self._channels = _Channels.remote()

    def callbacks(self) -> list[UserCallback]:
        return [_ReportRelay(self._channels)]

    def fit(self, trainer: Any) -> Any:
        """``trainer.fit()`` (in a thread) while this thread reports each of its reports to
        Tune; returns its result, raises its error. Tune pausing the trial ends this thread in
        ``tune.report`` (``SystemExit``), and the trial's process with it."""
        self._seed_stage_features()
        try:  # nothing reads them again (this start begins from Tune's copy)
            drop_earlier_runs(self._train_fs, self._train_root, self._trial_run_name,
                              keep=self.run_name)
        except OSError:  # disk space is never worth a trial
            logger.warning("could not delete the earlier Train runs of %s",
                           self._trial_run_name, exc_info=True)
        outcome: dict[str, Any] = {}

        def fit_in_thread() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as exc:  # re-raised in the trial's thread below
                outcome["error"] = exc
            finally:
                ray.get(self._channels.put.remote(_REPORTS, _FINISHED))

        # A daemon: a paused trial's process ends without waiting for its trainer.
        threading.Thread(target=fit_in_thread, name="raycl-pbt-trainer", daemon=True).start()
        while (item := ray.get(self._channels.get.remote(_REPORTS))) is not _FINISHED:
            self._report(*item)
            ray.get(self._channels.put.remote(_REPLIES, True))
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def _report(self, metrics: dict[str, Any], checkpoint_path: str | None) -> None:
        from ray import tune

        checkpoint = None
        if checkpoint_path:
            storage = tune.get_context().get_storage()
            # The stage features the checkpoint refers to, beside Tune's copy of it.
            copy_missing_files(self._train_fs, posixpath.join(
                posixpath.dirname(checkpoint_path.rstrip("/")), STAGE_FEATURES_DIR),
                storage.storage_filesystem,
                posixpath.join(storage.trial_fs_path, STAGE_FEATURES_DIR))
            checkpoint = tune.Checkpoint(checkpoint_path, filesystem=self._train_fs)
        tune.report(metrics, checkpoint=checkpoint)

    def _seed_stage_features(self) -> None:
        """The stage features of the starting checkpoint into the new Train run's directory:
        its checkpoints keep referring to them (written once per run, by content)."""
        if self.start is None:
            return
        copy_missing_files(self.start.filesystem, posixpath.join(
            posixpath.dirname(self.start.path.rstrip("/")), STAGE_FEATURES_DIR),
            self._train_fs, posixpath.join(self._train_run_dir, STAGE_FEATURES_DIR))


__all__ = ["PopulationStart", "StartingSession", "drop_earlier_runs",
           "generation_run_name", "reuses_trial_actors", "trains_population_with_workers"]
