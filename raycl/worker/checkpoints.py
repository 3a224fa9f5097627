"""A trial's checkpoints: written complete or not at all, read back with a fallback.

A checkpoint directory holds (file names in :mod:`raycl.worker.stage_integration`):

- ``state.pt``: ``{"model", "optimizer", "scaler"}`` state dicts, plus ``"soup"`` (a finished
  stage's share of a model soup); tensors and plain containers only (``weights_only`` loads).
- ``stage_inputs.npz`` (+ ``stage_weights.pt``): the stage's :class:`StageInputs`.
- ``features.npz``: the stage's features per split, once the stage is complete.
- ``metrics.json``: the metrics reported with the checkpoint.
- ``diagnostics.npz``: the end-of-trial picture arrays, when there are any.
- ``progress.json``: ``{"stage", "phase", "epoch", "stage_complete"}``, written last, so a
  directory that has it is complete.

Checkpoints reach the run's storage (``tune.storage_path``, e.g. a bucket) and come back through
:mod:`raycl.worker.storage`, which waits out a storage that is unreachable for a while.
"""

from __future__ import annotations

import json
import logging
import posixpath
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch

from raycl.methods.base import Method
from raycl.worker.session import Session
from raycl.worker.stage_integration import (
    DIAGNOSTICS_FILE,
    FEATURES_FILE,
    METRICS_FILE,
    PROGRESS_FILE,
    STAGE_INPUTS_FILE,
    STATE_FILE,
    Features,
    StageInputs,
    StageWeights,
)
from raycl.worker.storage import StorageUnreachable, download

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No checkpoint of the trial could be read back."""


@dataclass
class Restored:
    """Where a checkpoint says the trial stands.

    Attributes:
        directory: a private local copy of the checkpoint.
        progress: ``{"stage", "phase", "epoch", "stage_complete"}`` (no "phase" before phases).
        inputs: what the checkpointed stage got from the stages before it.
        state: model/optimizer/scaler state of that stage, on the CPU; the stage takes each
            entry out (``pop``) as it loads it, so no reference keeps it in memory.
        features: the stage's features per split, when the stage is complete.
        metrics: the metrics reported with the checkpoint.
    """

    directory: Path
    progress: dict[str, Any]
    inputs: StageInputs
    state: dict[str, Any]
    features: Features | None
    metrics: dict[str, Any]


def read_checkpoint(directory: Path) -> Restored:
    """Read every file of a raycl checkpoint; raises if any is missing, truncated or corrupt.

    Every tensor is read to the CPU, whatever device wrote it: ``load_state_dict`` moves model
    and optimizer state to their parameters' device, the soup weights sit beside the earlier
    stages' (also on the CPU), and nothing of the checkpoint stays on an accelerator.
    """
    progress = json.loads((directory / PROGRESS_FILE).read_text())
    # weights_only: a checkpoint on shared storage must not be able to run code.
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    inputs = StageInputs.load(directory / STAGE_INPUTS_FILE)
    features = None
    if progress["stage_complete"]:
        with np.load(directory / FEATURES_FILE) as arrays:
            features = {split: arrays[split] for split in arrays.files}
    metrics = json.loads((directory / METRICS_FILE).read_text())
    if inputs.stage != progress["stage"]:
        raise ValueError(f"stage_inputs is for stage {inputs.stage}, progress for "
                         f"{progress['stage']}")
    return Restored(directory, progress, inputs, state, features, metrics)


def checkpoint_candidates(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """``latest``, then the older checkpoints beside it in the same run, newest first.

    Both Tune (``checkpoint_000007``) and Ray Train (``checkpoint_<timestamp>``) name checkpoint
    directories so that names sort in the order they were written.
    """
    import pyarrow.fs

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


def restore(session: Session) -> Restored | None:
    """The newest readable checkpoint of this trial, None when it has none.

    A corrupt or truncated latest checkpoint (a node died while writing it, a disk filled up)
    is skipped with a warning and the one before it is used: the trial repeats a few epochs
    rather than dying. When checkpoints exist but none can be read, the trial fails with one line
    naming each and why, rather than silently starting over. Storage that stays unreachable
    (:class:`raycl.worker.storage.StorageUnreachable`) is no reason to try an older one.
    """
    latest = session.latest_checkpoint()
    if latest is None:
        return None
    problems = []
    for candidate in checkpoint_candidates(latest):
        directory = Path(tempfile.mkdtemp(prefix="raycl-restore-"))
        try:
            restored = read_checkpoint(download(candidate, directory))
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
        return restored
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
) -> None:
    """Write one checkpoint into ``directory`` (existing, empty); ``progress.json`` goes last."""
    # Tensors, numbers, strings and plain containers only: read back with weights_only=True.
    state = {"model": method.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict()}
    if soup is not None:  # a finished stage's share of the model soup
        state["soup"] = soup
    torch.save(state, directory / STATE_FILE)
    inputs.save(directory / STAGE_INPUTS_FILE)
    if features is not None:
        np.savez(directory / FEATURES_FILE, **features)
    (directory / METRICS_FILE).write_text(json.dumps(metrics))
    if diagnostics:
        np.savez(directory / DIAGNOSTICS_FILE, **diagnostics)
    # Written last: a checkpoint directory with progress.json is complete.
    (directory / PROGRESS_FILE).write_text(json.dumps(progress))


__all__ = ["CheckpointError", "Restored", "checkpoint_candidates", "read_checkpoint", "restore",
           "write_checkpoint"]
