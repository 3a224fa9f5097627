"""A trial's checkpoints: written complete or not at all, read back with a fallback.

A checkpoint directory holds (file names in :mod:`raycl.worker.stage_integration`):

- ``state.pt``: ``{"model", "optimizer", "scaler"}`` state dicts, plus ``"soup"`` (a finished
  MCL stage's kept weights: its share of a model soup, or, concat, its encoder; the key's name
  is older than concat's); tensors and plain containers only (``weights_only`` loads).
- ``stage_inputs.npz`` (+ ``stage_weights.pt``, the earlier stages' kept weights; absent in
  concat checkpoints of raycl before it kept them): the stage's :class:`StageInputs`: pseudo labels,
  clusterings, metrics and a :class:`FeatureRef` per earlier stage, whose frozen features are
  written once, when the first checkpoint after that stage is, to
  ``stage_features/stage_<j>_<sha256[:16]>.npz`` beside the checkpoints (in the run's storage,
  where Ray's ``num_to_keep`` deletes nothing), so a checkpoint does not grow with the stage
  count. Without run storage (a session outside Ray Train and Tune), and in checkpoints of
  older raycl, the features are inline (``features_<j>_<split>``); both are read.
- ``features.npz``: once an MCL stage that another follows is complete, what of its features
  a trial resumed there reads (:func:`~raycl.worker.stage_integration.checkpointed_features`);
  none after the last stage (a single-stage trial's checkpoints never hold one).
- ``metrics.json``: the metrics reported with the checkpoint.
- ``diagnostics.npz``: the end-of-trial picture arrays, when there are any.
- ``progress.json``: ``{"stage", "phase", "epoch", "stage_complete"}``, written last, so a
  directory that has it is complete.

Checkpoints reach the run's storage (``tune.storage_path``, e.g. a bucket) and come back through
:mod:`raycl.worker.storage`, which waits out a storage that is unreachable for a while. On a
restore rank 0 chooses the checkpoint and reads all of it (features included); the other ranks
read the same one's state, stage inputs and metrics file by file, and no features.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raycl.distributed import broadcast_from_rank0, single_rank_section
from raycl.methods.base import Method
from raycl.worker.session import Session
from raycl.worker.stage_integration import (
    DIAGNOSTICS_FILE,
    FEATURES_FILE,
    METRICS_FILE,
    PROGRESS_FILE,
    STAGE_FEATURES_DIR,
    STAGE_INPUTS_FILE,
    STAGE_WEIGHTS_FILE,
    STATE_FILE,
    FeatureRef,
    Features,
    StageInputs,
    StageWeights,
)
from raycl.worker.storage import StorageUnreachable, StoredDirectory, download

if TYPE_CHECKING:  # a checkpoint to resume comes from Ray; a run without Ray resumes none
    import ray.train

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No checkpoint of the trial could be read back."""


@dataclass
class Restored:
    """Where a checkpoint says the trial stands.

    Attributes:
        directory: a private local directory: rank 0's copy of the checkpoint (which a finished
            trial reports again); empty on other ranks, which read from storage.
        progress: ``{"stage", "phase", "epoch", "stage_complete"}`` (no "phase" before phases).
        inputs: what the checkpointed stage got from the stages before it.
        state: model/optimizer/scaler state of that stage, on the CPU; the stage takes each
            entry out (``pop``) as it loads it, so no reference keeps it in memory.
        features: the stage's features per split, when the stage is complete and its
            checkpoint holds them (rank 0; None when it holds none, as after the last stage;
            empty on other ranks).
        metrics: the metrics reported with the checkpoint.
    """

    directory: Path
    progress: dict[str, Any]
    inputs: StageInputs
    state: dict[str, Any]
    features: Features | None
    metrics: dict[str, Any]


def read_checkpoint(directory: Path, run: StoredDirectory | None = None) -> Restored:
    """Read every file of a local raycl checkpoint, and the earlier stages' features it refers
    to in ``run`` (the directory that holds the run's checkpoints; by default the one that holds
    ``directory``); raises if any is missing, truncated or corrupt.

    Every tensor is read to the CPU, whatever device wrote it: ``load_state_dict`` moves model
    and optimizer state to their parameters' device, the soup weights sit beside the earlier
    stages' (also on the CPU), and nothing of the checkpoint stays on an accelerator.
    """
    restored = _read_files(StoredDirectory.local(directory), directory, features=True)
    run = run or StoredDirectory.local(directory.parent)
    for stage, ref in restored.inputs.feature_refs.items():
        restored.inputs.features[stage] = read_stage_features(run, ref)
    return restored


def read_rank_share(checkpoint: StoredDirectory, directory: Path) -> Restored:
    """What a rank other than 0 needs of a checkpoint, read file by file from storage: the
    state, the stage inputs without features (only those members of the archive), metrics and
    progress; no features file, no diagnostics. ``directory``: its empty private directory."""
    return _read_files(checkpoint, directory, features=False)


def _read_files(files: StoredDirectory, directory: Path, features: bool) -> Restored:
    """A checkpoint's files; ``features``: also the stage's and the inline earlier stages'."""
    progress = json.loads(files.read_bytes(PROGRESS_FILE))
    # weights_only: a checkpoint on shared storage must not be able to run code.
    state = files.read(STATE_FILE, _torch_load)
    weights = (files.read(STAGE_WEIGHTS_FILE, _torch_load) if files.exists(STAGE_WEIGHTS_FILE)
               else [])
    inputs = files.read(STAGE_INPUTS_FILE,
                        lambda file: StageInputs.load(file, weights, features=features))
    stage_features = None
    if progress["stage_complete"] and not features:
        stage_features = {}
    elif progress["stage_complete"] and files.exists(FEATURES_FILE):
        # Absent after the last stage, which nothing follows (older raycl wrote it there too).
        stage_features = files.read(FEATURES_FILE, _load_arrays)
    metrics = json.loads(files.read_bytes(METRICS_FILE))
    if inputs.stage != progress["stage"]:
        raise ValueError(f"stage_inputs is for stage {inputs.stage}, progress for "
                         f"{progress['stage']}")
    return Restored(directory, progress, inputs, state, stage_features, metrics)


def _torch_load(file: Any) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def _load_arrays(file: Any) -> dict[str, np.ndarray]:
    with np.load(file) as arrays:
        return {name: arrays[name] for name in arrays.files}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def store_stage_features(inputs: StageInputs, run: StoredDirectory | None) -> None:
    """Write each earlier stage's features that ``run`` (the directory the run's checkpoints go
    to) does not hold yet into its ``stage_features/``, once, and record the reference in
    ``inputs.feature_refs``: every later checkpoint refers to the file instead of holding the
    arrays. Rank 0, before the checkpoint that first refers to them. No ``run``: nothing is
    written (the checkpoint holds the features inline)."""
    if run is None:
        return
    for stage, features in enumerate(inputs.features):
        if stage in inputs.feature_refs or not features:
            continue
        with tempfile.TemporaryDirectory(prefix="raycl-stage-features-") as scratch:
            local = Path(scratch) / "features.npz"
            np.savez(local, **features)
            digest = _sha256(local)
            # Named by content: a stage trained again after a fallback never overwrites a file
            # that a kept checkpoint refers to.
            name = posixpath.join(STAGE_FEATURES_DIR, f"stage_{stage}_{digest[:16]}.npz")
            run.upload(local, name)
        inputs.feature_refs[stage] = FeatureRef(stage=stage, file=name, sha256=digest,
                                                splits=tuple(sorted(features)))


def read_stage_features(run: StoredDirectory, ref: FeatureRef) -> Features:
    """The features ``ref`` names, from ``run``, checked against its SHA-256."""
    with tempfile.TemporaryDirectory(prefix="raycl-stage-features-") as scratch:
        local = Path(scratch) / "features.npz"
        run.download(ref.file, local)
        digest = _sha256(local)
        if digest != ref.sha256:
            raise ValueError(f"{run.location(ref.file)}: SHA-256 {digest[:16]}..., the "
                             f"checkpoint expects {ref.sha256[:16]}...")
        with np.load(local) as arrays:
            return {split: arrays[split] for split in ref.splits}


def checkpoint_candidates(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """``latest``, then the older checkpoints beside it in the same run, newest first.

    Both Tune (``checkpoint_000007``) and Ray Train (``checkpoint_<timestamp>``) name checkpoint
    directories so that names sort in the order they were written.
    """
    import pyarrow.fs
    import ray.train

    path = latest.path.rstrip("/")
    parent, name = posixpath.dirname(path), posixpath.basename(path)
    try:
        entries = latest.filesystem.get_file_info(pyarrow.fs.FileSelector(parent))
    except OSError:
        return [latest]
    older = sorted((entry.base_name for entry in entries
                    if entry.type == pyarrow.fs.FileType.Directory
                    and entry.base_name.startswith("checkpoint_") and entry.base_name < name),
                   reverse=True)
    return [latest, *(ray.train.Checkpoint(posixpath.join(parent, older_name),
                                           filesystem=latest.filesystem)
                      for older_name in older)]


# What rank 0 tells the other ranks when it resumes from no checkpoint.
_NONE_READABLE, _UNREACHABLE = -1, -2


def restore(session: Session) -> Restored | None:
    """The newest readable checkpoint of this trial, None when it has none.

    A corrupt or truncated latest checkpoint (a node died while writing it, a disk filled up)
    is skipped with a warning and the one before it is used: the trial repeats a few epochs
    rather than dying. When checkpoints exist but none can be read, the trial fails with one line
    naming each and why, rather than silently starting over. Storage that stays unreachable
    (:class:`raycl.worker.storage.StorageUnreachable`) is no reason to try an older one.

    Rank 0 chooses (it reads every file, the features too) and tells the others which one;
    they read only their share of it (:func:`read_rank_share`), so every rank resumes from the
    same checkpoint.
    """
    latest = session.latest_checkpoint()
    if latest is None:
        return None
    candidates = checkpoint_candidates(latest)
    restored, chosen, error = None, _NONE_READABLE, None
    if session.rank == 0:
        try:
            # The others wait in the broadcast below: a collective in here would never return.
            with single_rank_section("rank 0's choice of a checkpoint"):
                chosen, restored = _first_readable(candidates)
        except StorageUnreachable as exc:
            chosen, error = _UNREACHABLE, exc
        except CheckpointError as exc:
            error = exc
    if session.world_size > 1:  # every rank enters this broadcast, rank 0 after its reading
        chosen = int(broadcast_from_rank0(
            torch.tensor([chosen], dtype=torch.int64, device=session.device)).item())
    if error is not None:
        raise error
    if chosen == _UNREACHABLE:
        raise StorageUnreachable("rank 0 could not reach the run's storage to resume")
    if chosen == _NONE_READABLE:
        raise CheckpointError("rank 0 found no readable checkpoint to resume from")
    if restored is not None:
        return restored
    candidate = candidates[chosen]
    return read_rank_share(StoredDirectory(candidate.filesystem, candidate.path),
                           Path(tempfile.mkdtemp(prefix="raycl-restore-")))


def _first_readable(candidates: list[ray.train.Checkpoint]) -> tuple[int, Restored]:
    """The index and contents of the first checkpoint of ``candidates`` that reads whole."""
    problems = []
    for index, candidate in enumerate(candidates):
        directory = Path(tempfile.mkdtemp(prefix="raycl-restore-"))
        run = StoredDirectory(candidate.filesystem, candidate.path).parent()
        try:
            restored = read_checkpoint(download(candidate, directory), run)
        except StorageUnreachable:
            shutil.rmtree(directory, ignore_errors=True)
            raise  # not the checkpoint's fault: an older one is in the same storage
        except Exception as exc:  # any unreadable file disqualifies the whole checkpoint
            shutil.rmtree(directory, ignore_errors=True)
            problem = f"{candidate.path}: {type(exc).__name__}: {exc}"
            logger.warning("checkpoint unreadable, trying an older one: %s", problem)
            problems.append(problem)
            continue
        if problems:
            logger.warning("resuming from %s instead of the latest checkpoint", candidate.path)
        return index, restored
    raise CheckpointError("no readable checkpoint to resume from: " + "; ".join(problems))


def write_checkpoint(
    directory: Path,
    method: Method,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    progress: dict[str, Any],
    inputs: StageInputs,
    features: Features | None,
    metrics: dict[str, Any],
    diagnostics: dict[str, np.ndarray] | None = None,
    soup: StageWeights | None = None,
    run: StoredDirectory | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write one checkpoint into ``directory`` (existing, empty); ``progress.json`` goes last.
    ``run``: the directory of the run's storage the checkpoint will be persisted into (its
    session's :meth:`run_storage`): earlier stages' features are written there once and
    referenced (:func:`store_stage_features`); None: inline. ``extra``: more state for
    ``state.pt`` beside the method's (the online probe's heads, ``"online_probe"``)."""
    # Tensors, numbers, strings and plain containers only: read back with weights_only=True.
    state = {"model": method.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict()}
    if soup is not None:  # a finished stage's kept weights (soup share or concat encoder)
        state["soup"] = soup
    state.update(extra or {})
    torch.save(state, directory / STATE_FILE)
    store_stage_features(inputs, run)
    inputs.save(directory / STAGE_INPUTS_FILE)
    if features is not None:
        np.savez(directory / FEATURES_FILE, **features)
    (directory / METRICS_FILE).write_text(json.dumps(metrics))
    if diagnostics:
        np.savez(directory / DIAGNOSTICS_FILE, **diagnostics)
    # Written last: a checkpoint directory with progress.json is complete.
    (directory / PROGRESS_FILE).write_text(json.dumps(progress))


__all__ = ["CheckpointError", "Restored", "checkpoint_candidates", "read_checkpoint",
           "read_rank_share", "read_stage_features", "restore", "store_stage_features",
           "write_checkpoint"]
