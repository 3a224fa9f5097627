"""What users hit when processes die or training diverges, at the level of the worker loop (no Ray
Tune here; the end-to-end versions are in test_end_to_end.py)."""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray.train
import torch
from faults import injected_fault

from raycl.methods import SearchConfig
from raycl.worker.checkpoints import CheckpointError
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop
from raycl.worker.outcome import FAIL_REASON_KEY, FAILED_KEY
from raycl.worker.session import InProcessSession

TINY = {
    "name": "reliability",
    "data": {"samples_per_combination": 1, "resolution": 16},
    "model": {"width": 8, "projector_hidden_dim": 32, "projector_dim": 16},
    "train": {"epochs": 3, "batch_size": 64, "lr": 0.002},
    # No end-of-trial spectrum and plots (their plotting outlasts such a trial's training):
    # only the test of their failure below reads them, and turns them on.
    "eval": {"every_n_epochs": 0, "linear_max_iter": 20, "diagnostics": False},
    "scaling": {"num_workers": 0, "cpus_per_worker": 2},
}


class StoredSession(InProcessSession):
    """An in-process session that keeps every checkpoint as ``root/checkpoint_<n>``, the way
    Tune and Ray Train lay them out, and resumes from the newest."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        stored = sorted(root.glob("checkpoint_*"))
        super().__init__(torch.device("cpu"),
                         ray.train.Checkpoint(str(stored[-1])) if stored else None)
        self.root = root
        self.reports: list[dict[str, Any]] = []

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        self.reports.append(metrics)
        self.last_report = metrics
        if checkpoint_dir:
            count = len(list(self.root.glob("checkpoint_*")))
            shutil.move(checkpoint_dir, self.root / f"checkpoint_{count:06d}")


def config_dict(extra: dict[str, Any] | None = None, **train: Any) -> dict[str, Any]:
    config = SearchConfig.model_validate({**TINY, **(extra or {}),
                                          "train": {**TINY["train"], **train}})
    return config.to_dict()


def run(root: Path, fault: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
        **train: Any) -> StoredSession:
    """The trial in this process, resumed from ``root``'s newest checkpoint; ``fault``: the
    keyword arguments of :func:`faults.injected_fault`, installed while it runs."""
    session = StoredSession(root)
    context = TrialContext(config=SearchConfig.model_validate(config_dict(extra, **train)))
    with injected_fault(**fault) if fault else nullcontext():
        run_trial_loop(context, session)
    return session


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(data_cache, tmp_path) -> None:
    """A truncated state.pt in the newest checkpoint: the trial resumes from the one before it
    and ends with exactly the numbers of an uninterrupted run."""
    reference = run(tmp_path / "reference").reports[-1]

    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected fault"):
        run(root, fault={"after_epoch": 2, "marker": str(tmp_path / "crashed")})
    latest = root / "checkpoint_000001"
    state = (latest / "state.pt").read_bytes()
    (latest / "state.pt").write_bytes(state[: len(state) // 2])

    resumed = run(root)
    assert resumed.reports[0]["resumed_from_epoch"] == 1
    assert [r["epoch"] for r in resumed.reports] == [2, 3]
    final = resumed.reports[-1]
    for key in ("train/loss", "val/linear/mean", "test/linear/mean"):
        assert final[key] == pytest.approx(reference[key], abs=1e-6), key


def test_no_readable_checkpoint_fails_with_one_line(data_cache, tmp_path) -> None:
    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected fault"):
        run(root, fault={"after_epoch": 2, "marker": str(tmp_path / "crashed")})
    for checkpoint in root.glob("checkpoint_*"):
        (checkpoint / "progress.json").unlink()  # as if every write had been cut short
    with pytest.raises(CheckpointError) as error:
        run(root)
    message = str(error.value)
    assert "\n" not in message
    assert "checkpoint_000000" in message and "checkpoint_000001" in message
    assert "progress.json" in message


def test_diverging_loss_ends_the_trial_with_step_and_value(data_cache, tmp_path) -> None:
    """An absurd learning rate overflows the weights: the loop stops at the first check with the
    step and the loss value, and writes no checkpoint after the divergence."""
    session = run(tmp_path / "run", lr=1e30, epochs=2)
    last = session.reports[-1]
    assert last[FAILED_KEY] == 1.0
    reason = last[FAIL_REASON_KEY]
    assert "non-finite loss at stage 0, epoch 1, step " in reason
    assert "loss=nan" in reason or "loss=inf" in reason
    assert len(session.reports) == 1  # not a single epoch was reported as if it had trained
    assert not list((tmp_path / "run").glob("checkpoint_*"))


# A queue larger than three epochs of samples (3 x 640), so a reset would show in its fill.
ALL4ONE = {"method": "all4one",
           "all4one": {"queue_size": 4096, "predictor_hidden_dim": 32, "transformer_heads": 4,
                       "transformer_feedforward": 32}}


def test_resumed_all4one_trial_keeps_its_support_set(data_cache, tmp_path) -> None:
    """Killed after epoch 2 and resumed, an All4One trial continues with the support set it had
    (values, sample indices and write pointer come back from the checkpoint), so it ends with
    exactly the numbers of an uninterrupted run; an emptied queue would change every one."""
    reference = run(tmp_path / "reference", extra=ALL4ONE)

    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected fault"):
        run(root, fault={"after_epoch": 2, "marker": str(tmp_path / "crashed")}, extra=ALL4ONE)
    saved = torch.load(root / "checkpoint_000001" / "state.pt", weights_only=True)["model"]
    filled = int((saved["queue.sample_index"] >= 0).sum())
    assert filled == 2 * 640 and int(saved["queue.pointer"]) == filled  # two epochs of 10 x 64

    resumed = run(root, extra=ALL4ONE)
    assert [r["epoch"] for r in resumed.reports] == [3]
    final = resumed.reports[-1]
    # The epoch's mean fill: 2 x 640 entries kept, then 64 more after each of its 10 steps.
    assert final["train/queue_fill"] == pytest.approx((2 * 640 + 64 * 5.5) / 4096)
    for key in ("train/loss", "train/centroid_loss", "train/redundancy_loss", "val/linear/mean",
                "val/nn_retrieval/mean", "test/nn_retrieval/mean"):
        assert final[key] == pytest.approx(reference.reports[-1][key], abs=1e-6), key


def test_resume_does_not_need_the_pretrained_file_again(data_cache, tmp_path) -> None:
    """A trial that started from model.pretrained resumes from its checkpoint even when the
    weights file has gone since (the checkpoint holds the weights); the start used the file."""
    source = run(tmp_path / "source", epochs=1)
    weights = tmp_path / "weights.pt"
    shutil.copy(tmp_path / "source" / "checkpoint_000000" / "state.pt", weights)
    extra = {"model": {**TINY["model"], "pretrained": str(weights)}}
    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected fault"):
        run(root, fault={"after_epoch": 1, "marker": str(tmp_path / "crashed")}, extra=extra)
    first_epoch = json.loads((root / "checkpoint_000000" / "metrics.json").read_text())
    assert first_epoch["train/loss"] != pytest.approx(source.reports[0]["train/loss"])
    weights.unlink()
    resumed = run(root, extra=extra)
    assert [r["epoch"] for r in resumed.reports] == [2, 3]


def test_failing_diagnostics_do_not_cost_the_trial_its_results(
    data_cache, tmp_path, monkeypatch
) -> None:
    """The end-of-trial diagnostics are extras: when they raise (a LAPACK SVD that does not
    converge did, in a SimSiam sweep), the trial still reports its test metrics and finishes."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr("raycl.worker.evaluate.representation_diagnostics", broken)
    session = run(tmp_path / "run", extra={"eval": {**TINY["eval"], "diagnostics": True}},
                  epochs=1)
    final = session.reports[-1]
    assert "test/linear/mean" in final and not any(key.startswith("diag/") for key in final)


def test_svd_falls_back_to_the_qr_driver(monkeypatch) -> None:
    from raycl.eval import subspaces

    matrix = np.random.default_rng(0).normal(size=(6, 4))
    expected = subspaces._left_singular(matrix)

    def not_converging(*args: Any, **kwargs: Any) -> None:
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(np.linalg, "svd", not_converging)
    left, values = subspaces._left_singular(matrix)
    np.testing.assert_allclose(values, expected[1])
    np.testing.assert_allclose(np.abs(left), np.abs(expected[0]), atol=1e-10)
