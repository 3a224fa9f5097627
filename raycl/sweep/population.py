"""Population-based training (``tune.scheduler.type: pbt | pb2``): what raycl adds to Ray Tune's
PBT (:mod:`raycl.sweep.pbt`) and PB2 (:mod:`raycl.sweep.pb2`), shared by both.

Imports neither scheduler, nor Ray Tune at all: a population trial's process imports
:func:`copy_missing_files` from here, and PB2's scikit-learn and SciPy (~1 s of CPU) are for the
driver that schedules with it only.

Design (docs/searches.md, "Population-based training"):

- The mutable keys are the search space's keys, all of them: ``tune.search_space`` gives each
  trial its first values (drawn at random: Tune's PBT refuses a searcher) and the domain each
  exploration perturbs or resamples within (a choice moves to a neighbour in its list; values are
  clamped into their domain). A key that changes the model's shape, the data or MCL's stage plan
  cannot change mid-training (an exploit copies weights of one shape): :func:`check_pbt` refuses
  it before launch.
- Ray's synchronous PBT (``synch=True``): every trial waits at each perturbation point, so an
  exploit copies a checkpoint of the same epoch and a trial's epochs go on without gaps or
  repeats (each epoch logged once in MLflow). With fewer slots than trials
  (``max_concurrent_trials``) the asynchronous variant pauses trials as often anyway.
- No perturbation at the last epoch: there is nothing left to train with the new values.

Trials train in their Tune process (``scaling.num_workers: 0``) or with Ray Train workers; the
latter's Tune function and its workarounds are :mod:`raycl.trial.population_workers`.

Workarounds (Ray 2.60), in :class:`RayclPopulation`:

- The exploited checkpoint is copied, whole (model, optimizer, queues, momentum encoders, MCL's
  stage inputs and the earlier stages' features it refers to), into the exploiting trial's own
  directory: Ray's ``num_to_keep`` deletes the better trial's checkpoint once it trains on (Ray
  warns about it for ``num_to_keep <= 2``; PBT then finds no checkpoint to resume, as in
  ray-project/ray#9036), and MCL's stage features are found beside a checkpoint.
- The mutated values reach the trial as its new config; the optimizer's hyperparameters in the
  checkpoint would overwrite them (ray-project/ray#62173):
  :func:`raycl.worker.optim.load_optimizer_state` keeps the config's.
- Tune does not save its scheduler: a resumed sweep's PBT counts ``perturbation_interval``
  from 0 again, so it would perturb at its first report; :func:`perturbs_at` keeps every
  perturbation at a multiple of the interval.
- Nor does it save synchronous PBT's clock (the epoch the population meets at next): a
  resumed sweep's trials would wait for one another forever; :meth:`RayclPopulation
  .on_trial_add` sets it from the trials' last results (:func:`next_sync_epoch`).
- Ray draws explorations from the global ``random`` and ``numpy.random``: they are drawn from
  the scheduler's own streams, seeded by ``seed`` (:meth:`RayclPopulation._seeded_draws`); a
  resumed sweep's draw again from the seed's start.

Each exploit is recorded on the exploiting trial's MLflow run: a tag
``raycl.pbt.exploit.epoch<e>`` (from which trial and epoch, old and new values) and every
mutable key as a metric history ``pbt/<key>`` (the value each epoch trained with).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import random
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from raycl.config.schema import CoreConfig, Domain

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

# What a trial's epoch is called in its reports (raycl.worker.stage): PBT's clock.
EPOCH_KEY = "global_epoch"
# Tag of one exploit on the exploiting trial's run, and the metric prefix of the mutable keys.
EXPLOIT_TAG = "raycl.pbt.exploit.epoch"
MUTATION_PREFIX = "pbt/"
# ---------------------------------------------------------------------------------------------
# The population's first values and its mutations


def initial_space(config: CoreConfig) -> dict[str, Any]:
    """Tune's ``param_space`` of a population: each searched key's domain (randint's ``high``
    included, as raycl documents it)."""
    from ray import tune

    space: dict[str, Any] = {}
    for key, domain in config.tune.search_space.items():
        if domain.loguniform is not None:
            space[key] = tune.loguniform(*domain.loguniform)
        elif domain.uniform is not None:
            space[key] = tune.uniform(*domain.uniform)
        elif domain.randint is not None:
            space[key] = tune.randint(domain.randint[0], domain.randint[1] + 1)
        else:
            space[key] = tune.choice(list(domain.choice or []))
    return space


def mutations(config: CoreConfig) -> dict[str, Any]:
    """PBT's ``hyperparam_mutations``: a choice as its list (explore moves to a neighbour),
    any other domain as Tune's (explore multiplies by a perturbation factor or resamples)."""
    space = initial_space(config)
    return {key: list(domain.choice) if domain.choice is not None else space[key]
            for key, domain in config.tune.search_space.items()}


def bounds(config: CoreConfig) -> dict[str, list[float]]:
    """PB2's ``hyperparam_bounds``: ``[low, high]`` of each (continuous) domain."""
    return {key: list(getattr(domain, domain.kind)) for key, domain in
            config.tune.search_space.items()}


class ClampToDomains:
    """PBT's ``custom_explore_fn``: a perturbed value put back inside its domain (Ray leaves
    ``0.5 * 1.2`` outside ``uniform [0, 0.5]``, which the trial's config would refuse). A class,
    not a closure: Tune pickles its scheduler."""

    def __init__(self, space: dict[str, Domain]) -> None:
        self.space = dict(space)

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        for key, domain in self.space.items():
            if key in config and domain.choice is None:
                config[key] = clamp(config[key], domain)
        return config


def clamp(value: Any, domain: Domain) -> Any:
    """``value`` inside ``domain``'s ``[low, high]`` (integers stay integers).

    Args:
        value: an explored value.
        domain: a loguniform, uniform or randint domain.

    Returns:
        The nearest value of the domain.
    """
    low, high = getattr(domain, domain.kind)
    clamped = min(max(value, low), high)
    return round(clamped) if domain.randint is not None else clamped


def exploit_summary(clone_id: str, clone_epoch: int | None, old: dict[str, Any],
                    new: dict[str, Any]) -> str:
    """The exploit tag's text: ``from trial X at epoch 3: train.lr 0.001 -> 0.0012; ...``.

    Args:
        clone_id: the better trial whose checkpoint was copied.
        clone_epoch: that checkpoint's epoch.
        old: the exploiting trial's values of the mutable keys before.
        new: its values after (the better trial's, explored).

    Returns:
        One line.
    """
    changes = "; ".join(f"{key} {_short(old.get(key))} -> {_short(value)}"
                        for key, value in new.items())
    return f"from trial {clone_id} at epoch {clone_epoch}: {changes}"


def perturbs_at(epoch: int, interval: int, last_epoch: int) -> bool:
    """Whether a trial's report of ``epoch`` may be a perturbation point: a multiple of
    ``interval`` (where the objective and a checkpoint of that epoch exist, checked before
    launch) before the last epoch (nothing would train with new values). Ray's PBT counts
    ``interval`` from its last perturbation, which a resumed sweep forgets (Tune does not save
    its scheduler): without this, its first report after a resume would be one.

    Args:
        epoch: the trial's epoch over all its stages (``global_epoch``).
        interval: ``tune.scheduler.perturbation_interval``.
        last_epoch: the trial's last epoch.

    Returns:
        True where Ray's scheduler may perturb.
    """
    return epoch % interval == 0 and epoch < last_epoch


def next_sync_epoch(last_epochs: list[int], interval: int, burn_in: int) -> int:
    """Synchronous PBT's next perturbation epoch, which a resumed sweep's scheduler must be
    told: the population waits there for its last trial. Ray starts it at
    ``max(interval, burn_in)`` and moves it on by ``interval`` at each perturbation, which a
    resumed sweep forgets; its trials, already past that epoch, then wait for one another
    forever (no paused trial is ever behind the clock to run).

    Args:
        last_epochs: each trial's last reported epoch (0: none yet).
        interval: ``tune.scheduler.perturbation_interval``.
        burn_in: ``tune.scheduler.burn_in_period``.

    Returns:
        The first epoch after the furthest-behind trial's at which every trial meets:
        the next multiple of ``interval`` past it, no earlier than the burn-in.
    """
    behind = min(last_epochs, default=0)
    return max(burn_in, interval, (behind // interval + 1) * interval)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class RayclPopulation:
    """What raycl adds to Ray's PBT and PB2 (see the module's docstring): a whole copy of the
    checkpoint per exploit, no perturbation at the last epoch, and the exploits and mutable
    values in MLflow."""

    def __init__(self, *args: Any, raycl: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._config: CoreConfig = raycl["config"]
        self._last_epoch: int = raycl["last_epoch"]
        self._client: MlflowClient | None = None
        self._runs: dict[str, str] = {}
        self._logged_epoch: dict[str, int] = {}
        self._interval: int = self._config.tune.scheduler.perturbation_interval
        self._burn_in: int = self._config.tune.scheduler.burn_in_period
        self._draw_depth = 0
        self._random_state = random.Random(self._config.seed).getstate()
        self._numpy_state = np.random.RandomState(self._config.seed).get_state()

    # Tune pickles the scheduler with the tuner: the client holds a database engine.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        return state

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        epoch = result.get(EPOCH_KEY)
        if isinstance(epoch, (int, float)):
            self._log_values(trial, int(epoch))
            if not perturbs_at(int(epoch), self._interval, self._last_epoch):
                return self.CONTINUE  # type: ignore[attr-defined]
        with self._seeded_draws():
            return super().on_trial_result(tune_controller, trial, result)  # type: ignore[misc]

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        """A trial joins; a resumed sweep's trial brings its last epoch (Tune saved its last
        result, not this scheduler), which synchronous PBT's clock is set from."""
        super().on_trial_add(tune_controller, trial)  # type: ignore[misc]
        last = trial.last_result or {}
        epoch = last.get(EPOCH_KEY)
        if isinstance(epoch, (int, float)) and epoch > 0:
            state = self._trial_state[trial]  # type: ignore[attr-defined]
            state.last_train_time = int(epoch)
            state.last_perturbation_time = int(epoch) - int(epoch) % self._interval
            metric = getattr(self, "_metric", None)
            if isinstance(last.get(metric), (int, float)):  # ranked at the next perturbation
                state.last_result = last
                state.last_score = self._metric_op * last[metric]  # type: ignore[attr-defined]
        self._next_perturbation_sync = next_sync_epoch(
            [state.last_train_time for state in self._trial_state.values()],  # type: ignore
            self._interval, self._burn_in)

    def _get_new_config(self, trial: Any, trial_to_clone: Any) -> tuple[dict, dict]:
        with self._seeded_draws():
            return super()._get_new_config(trial, trial_to_clone)  # type: ignore[misc]

    @contextlib.contextmanager
    def _seeded_draws(self) -> Iterator[None]:
        """Ray's PBT and PB2 draw from the global ``random`` and ``numpy.random`` (the donor,
        resampling, perturbation factors, PB2's GP); inside, both draw from this scheduler's
        own streams, seeded by ``seed``, so a sweep's explorations repeat whatever else drew
        from them in between. Re-entrant (``on_trial_result`` explores inside)."""
        self._draw_depth += 1
        if self._draw_depth > 1:
            try:
                yield
            finally:
                self._draw_depth -= 1
            return
        outside = random.getstate(), np.random.get_state()
        random.setstate(self._random_state)
        np.random.set_state(self._numpy_state)
        try:
            yield
        finally:
            self._random_state, self._numpy_state = random.getstate(), np.random.get_state()
            random.setstate(outside[0])
            np.random.set_state(outside[1])
            self._draw_depth -= 1

    def _exploit(self, tune_controller: Any, trial: Any, trial_to_clone: Any) -> None:
        from ray.train._internal.session import _TrainingResult

        keys = list(self._config.tune.search_space)
        old = {key: trial.config.get(key) for key in keys}
        clone_state = self._trial_state[trial_to_clone]  # type: ignore[attr-defined]
        clone_result = clone_state.last_result or {}
        epoch = clone_result.get(EPOCH_KEY)
        copied = self._copy(clone_state.last_checkpoint, trial, trial_to_clone, epoch)
        super()._exploit(tune_controller, trial, trial_to_clone)  # type: ignore[misc]
        manager = trial.run_metadata.checkpoint_manager
        manager._latest_checkpoint_result = _TrainingResult(checkpoint=copied,
                                                            metrics=clone_result)
        # Tune keeps each trial's run metadata (this checkpoint manager in it) as JSON, cached
        # until an attribute of the metadata itself is set: the pointer set one level down, as
        # Ray's own PBT sets it too, left the cache, so a snapshot taken before the trial's
        # next result (a Ctrl+C right after the exploit) saved the donor's config beside the
        # trial's own checkpoint, and the resumed trial trained on without the donor's weights
        # (no upstream issue yet).
        trial.run_metadata.invalidate_cache()
        new = {key: trial.config.get(key) for key in keys}
        self._record(trial, exploit_summary(trial_to_clone.trial_id, epoch, old, new), epoch)

    def _copy(self, checkpoint: Any, trial: Any, clone: Any, epoch: Any) -> Any:
        """A whole copy of ``checkpoint`` (and the stage features beside it) in ``trial``'s
        own directory of the sweep's storage."""
        from ray.tune import Checkpoint

        source = checkpoint.path.rstrip("/")
        name = f"pbt_epoch{epoch}_from_{clone.trial_id}_{posixpath.basename(source)}"
        filesystem = trial.storage.storage_filesystem
        target_run = trial.storage.trial_fs_path
        copy_run_files(checkpoint.filesystem, posixpath.dirname(source), name_of=source,
                       filesystem=filesystem, target_run=target_run, target_name=name)
        try:  # Ray's checkpoint manager never sees the copies: without this they pile up
            drop_earlier_copies(filesystem, target_run, keep=name)
        except OSError:  # disk space is never worth a sweep
            logger.warning("could not delete trial %s's earlier PBT copies", trial.trial_id,
                           exc_info=True)
        return Checkpoint(posixpath.join(target_run, name), filesystem=filesystem)

    # -- MLflow ---------------------------------------------------------------------------

    def _run_id(self, trial: Any) -> str | None:
        from raycl.config.sweep import resolve_tracking_uri
        from raycl.tracking.runs import experiment_name, find_trial_run, mlflow_client

        if trial.trial_id not in self._runs:
            if self._client is None:
                self._client = mlflow_client(
                    resolve_tracking_uri(self._config.mlflow.tracking_uri))
            experiment = self._client.get_experiment_by_name(experiment_name(self._config))
            run_id = experiment and find_trial_run(self._client, experiment.experiment_id,
                                                   trial.trial_id)
            if not run_id:
                return None
            self._runs[trial.trial_id] = run_id
        return self._runs[trial.trial_id]

    def _log_values(self, trial: Any, epoch: int) -> None:
        """``pbt/<key>``: the value each mutable key had for ``epoch`` (logged once per epoch;
        a resumed driver reads back where MLflow stands). Never raises: a record is not worth
        a sweep."""
        try:
            run_id = self._run_id(trial)
            if run_id is None:
                return
            assert self._client is not None
            keys = list(self._config.tune.search_space)
            if trial.trial_id not in self._logged_epoch:
                history = self._client.get_metric_history(run_id, MUTATION_PREFIX + keys[0])
                self._logged_epoch[trial.trial_id] = max((m.step for m in history), default=0)
            if epoch <= self._logged_epoch[trial.trial_id]:
                return
            self._logged_epoch[trial.trial_id] = epoch
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            values = [Metric(MUTATION_PREFIX + key, float(trial.config[key]), now, epoch)
                      for key in keys if isinstance(trial.config.get(key), (int, float))]
            self._client.log_batch(run_id, metrics=values)
        except Exception:
            logger.warning("could not log the PBT values of trial %s", trial.trial_id,
                           exc_info=True)

    def _record(self, trial: Any, summary: str, epoch: Any) -> None:
        """The exploit's tag on ``trial``'s run; never raises."""
        logger.info("PBT exploit of trial %s: %s", trial.trial_id, summary)
        try:
            run_id = self._run_id(trial)
            if run_id is not None:
                assert self._client is not None
                self._client.set_tag(run_id, f"{EXPLOIT_TAG}{epoch}", summary[:5000])
        except Exception:
            logger.warning("could not record the PBT exploit of trial %s", trial.trial_id,
                           exc_info=True)


def copy_run_files(source_fs: Any, source_run: str, name_of: str, filesystem: Any,
                   target_run: str, target_name: str) -> None:
    """Copy the checkpoint directory ``name_of`` (in ``source_run``) to
    ``target_run/target_name``, and ``source_run``'s stage features (content-addressed, what
    an MCL checkpoint refers to) into ``target_run``'s.

    Args:
        source_fs: the source's pyarrow filesystem.
        source_run: the directory holding the checkpoint and ``stage_features/``.
        name_of: the checkpoint directory's path.
        filesystem: the target's pyarrow filesystem.
        target_run: the directory to copy into.
        target_name: the copy's directory name.
    """
    import pyarrow.fs

    from raycl.worker.stage_integration import STAGE_FEATURES_DIR

    target = posixpath.join(target_run, target_name)
    filesystem.create_dir(target, recursive=True)  # pyarrow copies files into existing ones
    selector = pyarrow.fs.FileSelector(name_of.rstrip("/"), recursive=True)
    for info in source_fs.get_file_info(selector):
        if info.type == pyarrow.fs.FileType.File:
            copy_file(source_fs, info.path, filesystem, posixpath.join(
                target, posixpath.relpath(info.path, name_of.rstrip("/"))), info.size)
    copy_missing_files(source_fs, posixpath.join(source_run, STAGE_FEATURES_DIR), filesystem,
                       posixpath.join(target_run, STAGE_FEATURES_DIR))


# S3's CopyObject, which pyarrow uses for a copy within one S3 filesystem, refuses objects above
# 5 GiB (a final ImageNet checkpoint can hold more): those are streamed, as a multipart upload.
SINGLE_COPY_LIMIT = 5 * 2**30


def copy_file(source_fs: Any, path: str, target_fs: Any, target: str, size: int | None,
              single_copy_limit: int = SINGLE_COPY_LIMIT) -> None:
    """Copy one file, server-side where the store allows it for its size.

    Args:
        source_fs: the source's pyarrow filesystem.
        path: the file's path on it.
        target_fs: the target's pyarrow filesystem.
        target: the copy's path (its directory is created).
        size: the file's size in bytes (None: unknown, copied as pyarrow does).
        single_copy_limit: the largest object copied in one server-side request.
    """
    import pyarrow.fs

    target_fs.create_dir(posixpath.dirname(target), recursive=True)
    if not (size is not None and size > single_copy_limit
            and source_fs.type_name == "s3" and source_fs.equals(target_fs)):
        pyarrow.fs.copy_files(path, target, source_filesystem=source_fs,
                              destination_filesystem=target_fs)
        return
    with source_fs.open_input_stream(path) as reader, \
            target_fs.open_output_stream(target) as writer:
        while chunk := reader.read(64 * 2**20):
            writer.write(chunk)


def drop_earlier_copies(filesystem: Any, trial_run: str, keep: str) -> list[str]:
    """Delete a trial's earlier PBT copies (``pbt_epoch<E>_from_<trial>_<checkpoint>``): each
    exploit replaces the trial's weights with the newest copy, and Ray's checkpoint manager,
    which prunes the trial's own checkpoints, never knew of them.

    Args:
        filesystem: the sweep storage's pyarrow filesystem.
        trial_run: the trial's directory in it.
        keep: the newest copy's name, kept.

    Returns:
        The names deleted.
    """
    import pyarrow.fs

    selector = pyarrow.fs.FileSelector(trial_run, allow_not_found=True)
    dropped = sorted(info.base_name for info in filesystem.get_file_info(selector)
                     if info.type == pyarrow.fs.FileType.Directory and info.base_name != keep
                     and info.base_name.startswith("pbt_epoch") and "_from_" in info.base_name)
    for name in dropped:
        filesystem.delete_dir(posixpath.join(trial_run, name))
    return dropped


def copy_missing_files(source_fs: Any, source_dir: str, target_fs: Any,
                       target_dir: str) -> list[str]:
    """Copy the files of ``source_dir`` that ``target_dir`` lacks (content-addressed stage
    features: a file of the same name is the same file).

    Args:
        source_fs: the source's pyarrow filesystem.
        source_dir: a directory (a missing one copies nothing).
        target_fs: the target's pyarrow filesystem.
        target_dir: the directory to copy into (created when needed).

    Returns:
        The names copied.
    """
    import pyarrow.fs

    def names(filesystem: Any, directory: str) -> set[str]:
        selector = pyarrow.fs.FileSelector(directory, allow_not_found=True)
        return {info.base_name for info in filesystem.get_file_info(selector)
                if info.type == pyarrow.fs.FileType.File}

    missing = sorted(names(source_fs, source_dir) - names(target_fs, target_dir))
    if missing:
        target_fs.create_dir(target_dir, recursive=True)
    sizes = {info.base_name: info.size for info in source_fs.get_file_info(
        [posixpath.join(source_dir, name) for name in missing])}
    for name in missing:
        copy_file(source_fs, posixpath.join(source_dir, name), target_fs,
                  posixpath.join(target_dir, name), sizes.get(name))
    return missing
