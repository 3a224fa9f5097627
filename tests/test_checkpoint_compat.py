"""Checkpoints written by an older raycl resume with this one: the checkpoint format is a promise.

The fixtures in ``tests/fixtures/old_checkpoints`` were written by raycl at commit 6822cf3 (the
worker loop was ``raycl/train.py``; ``generate.py`` beside them says how), together with every
report of the uninterrupted trial. Each is resumed here through ``run_trial_loop``: the trial
must go on where the checkpoint says, train as the uninterrupted old run did, report the same
metric names, and write checkpoints of the same shape.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_reliability import StoredSession  # keeps every checkpoint, resumes from the newest

from raycl.methods import SearchConfig
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "old_checkpoints"
# Measured once per process and reported with whichever epoch comes first: a resumed run
# reports them with another epoch than the uninterrupted one did.
ONCE_PER_PROCESS = {"perf/startup_seconds", "perf/kmeans_seconds"}
# Reported every epoch since the fixtures were written (a new figure, not a changed one).
ADDED_SINCE = {"train/effective_lr", "data/val_size", "data/chance/shape",
               "data/chance/texture", "data/chance/color", "perf/device_hours",
               *(f"{split}/label_free/{name}" for split in ("val", "test")
                 for name in ("rankme", "alpha", "std"))}
# (trial, checkpoint, index of the first report the resumed run repeats, its resumed_from_epoch)
CASES = [
    ("simclr", "checkpoint_000000", 1, 1),  # mid-stage: epoch 1 of 2
    ("mcl", "checkpoint_000001", 2, 0),  # stage 0 complete: stage 1 starts after clustering
    ("mcl", "checkpoint_000002", 3, 1),  # stage 1, epoch 1 of 2: stored pseudo labels
]


def trial(name: str) -> dict[str, Any]:
    """The old run: its config, commit and every report of the uninterrupted trial."""
    return json.loads((FIXTURES / name / "trial.json").read_text())


def stage_inputs(checkpoint: Path) -> dict[str, np.ndarray]:
    with np.load(checkpoint / "stage_inputs.npz") as arrays:
        return {name: arrays[name] for name in arrays.files}


def old_checkpoint_of_stage(name: str, stage: int) -> Path:
    for checkpoint in sorted((FIXTURES / name).glob("checkpoint_*")):
        if json.loads((checkpoint / "progress.json").read_text())["stage"] == stage:
            return checkpoint
    raise AssertionError(f"no {name} fixture of stage {stage}")


@pytest.mark.parametrize(("name", "checkpoint", "first", "resumed_from"), CASES)
def test_old_checkpoint_resumes_where_it_stopped(
    data_cache, tmp_path, one_torch_thread, name: str, checkpoint: str, first: int,
    resumed_from: int,
) -> None:
    old = trial(name)
    progress = json.loads((FIXTURES / name / checkpoint / "progress.json").read_text())
    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(FIXTURES / name / checkpoint, root / "checkpoint_000000")

    session = StoredSession(root)
    run_trial_loop(TrialContext(config=SearchConfig.model_validate(old["config"])), session)

    expected = old["reports"][first:]
    assert len(session.reports) == len(expected)
    stage = progress["stage"] + (1 if progress["stage_complete"] else 0)
    assert session.reports[0]["stage"] == stage
    assert session.reports[0]["resumed_from_epoch"] == resumed_from
    for got, want in zip(session.reports, expected, strict=True):
        # The same metric names, epoch by epoch, and the same training.
        added = {key for key in got if re.sub(r"^stage\d+/", "", key) in ADDED_SINCE}
        assert set(got) - ONCE_PER_PROCESS - added == set(want) - ONCE_PER_PROCESS
        assert "train/effective_lr" in got
        for key in ("stage", "epoch", "global_epoch"):
            assert got[key] == want[key], key
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4)
        for key in [key for key in want if key.startswith("train/sampler_")]:
            assert got[key] == want[key], key  # batches grouped by the same pseudo labels
    final = session.reports[-1]
    for key in ("val/linear/mean", "test/linear/mean", "test/knn/mean"):
        assert final[key] == pytest.approx(old["reports"][-1][key], abs=0.02), key

    # The checkpoints this code writes have the old format: the same files and state entries,
    # and the stage's inputs (MCL: frozen stage-0 features, clustering, pseudo labels) as the
    # old run had them.
    written = sorted(root.glob("checkpoint_*"))[1:]
    assert len(written) == len(expected)
    for new in written:
        new_progress = json.loads((new / "progress.json").read_text())
        reference = old_checkpoint_of_stage(name, new_progress["stage"])
        assert set(new_progress) == set(json.loads((reference / "progress.json").read_text()))
        old_inputs, new_inputs = stage_inputs(reference), stage_inputs(new)
        assert set(new_inputs) == set(old_inputs)
        for key, values in old_inputs.items():
            np.testing.assert_array_equal(new_inputs[key], values, err_msg=key)
        old_state = torch.load(reference / "state.pt", weights_only=True)
        new_state = torch.load(new / "state.pt", weights_only=True)
        # One entry added since: a finished MCL stage's kept encoder (issue 35: concat exports
        # every stage), which the old run's checkpoints could not have.
        kept = {"soup"} if name == "mcl" and new_progress["stage_complete"] else set()
        assert set(old_state) == {"model", "optimizer", "scaler"}
        assert set(new_state) == set(old_state) | kept
        assert {k: v.shape for k, v in new_state["model"].items()} == \
            {k: v.shape for k, v in old_state["model"].items()}
        assert set(new_state["optimizer"]) == set(old_state["optimizer"])
        files = {"metrics.json", "progress.json", "stage_inputs.npz", "state.pt"}
        assert files <= {path.name for path in new.iterdir()}
        # Issue 46: the old run wrote every finished stage's features; only a stage that
        # another follows keeps them now (nothing reads the last stage's), and these are all
        # of the last stage (simclr's only one, MCL's stage 1).
        assert not (new / "features.npz").exists()
    if progress["stage_complete"]:
        # Stage 1 was clustered from the features the old checkpoint stored (and its pseudo
        # labels, compared above, are the ones the old run trained stage 1 with).
        carried = stage_inputs(written[0])
        with np.load(FIXTURES / name / checkpoint / "features.npz") as stored:
            for split in stored.files:
                np.testing.assert_array_equal(carried[f"features_0_{split}"], stored[split])

