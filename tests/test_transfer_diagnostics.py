"""Transfer evaluation and the end-of-trial diagnostics, down to the worker loop (no Tune)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faults import injected_fault
from test_reliability import StoredSession  # keeps every checkpoint, resumes from the newest

from raycl.eval.diagnostics import plot_diagnostics, representation_diagnostics
from raycl.eval.transfer import load_transfer_sets, match_channels
from raycl.methods import SearchConfig
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop
from raycl.worker.stage_integration import DIAGNOSTICS_FILE


def test_match_channels() -> None:
    grey = np.arange(2 * 1 * 2 * 2, dtype=np.uint8).reshape(2, 1, 2, 2)
    rgb = match_channels(grey, 3)
    assert rgb.shape == (2, 3, 2, 2) and all(np.array_equal(rgb[:, c], grey[:, 0])
                                             for c in range(3))
    assert match_channels(rgb, 3) is rgb
    two = np.stack([np.full((2, 2), 10), np.full((2, 2), 21)])[None].astype(np.uint8)
    # Different channel counts go through the grey mean: (10 + 21) / 2 = 15.5 -> 16.
    assert np.all(match_channels(two, 3) == 16) and match_channels(two, 1).shape == (1, 1, 2, 2)
    with pytest.raises(ValueError, match="channels"):
        match_channels(grey, 0)


def test_transfer_sets_take_the_pretraining_resolution_and_channels(data_cache: Path) -> None:
    config = SearchConfig(name="t", data={"resolution": 16},
                          eval={"transfer": [{"dataset": "digits", "test_fraction": 0.25}]})
    (digits,) = load_transfer_sets(config, channels=3)
    assert digits.name == "digits" and digits.train_key == "transfer:digits:train"
    assert digits.train.images.shape[1:] == (3, 16, 16)
    total = len(digits.train.images) + len(digits.test.images)
    assert total == 1797 and len(digits.test.images) == pytest.approx(0.25 * total, abs=10)


def test_diagnostics_see_collapse_and_structure(tmp_path: Path) -> None:
    generator = np.random.default_rng(0)
    labels = np.repeat(np.arange(3), 200)
    # Full-rank features versus features living on 2 directions (a collapsed embedding).
    full = generator.normal(size=(600, 16)) + 4 * np.eye(16)[labels]
    collapsed = generator.normal(size=(600, 2)) @ generator.normal(size=(2, 16))
    full_metrics, arrays = representation_diagnostics(full, labels, projections=collapsed)
    assert full_metrics["diag/effective_rank"] > 10
    assert full_metrics["diag/projection_effective_rank"] < 2.5
    assert full_metrics["diag/shared_directions"] > 0
    assert set(arrays) == {"singular_values", "projection_singular_values", "principal_angles"}
    written = plot_diagnostics(arrays, tmp_path, "test")
    assert [p.name for p in written] == ["spectrum.png", "principal_angles.png"]
    assert all(p.stat().st_size > 1000 for p in written)


MCL_OVER_HSCL = {
    "name": "mcl-hscl",
    "method": "mcl",
    "mcl": {"base": "hscl", "stages": 2, "clusters": 2, "negatives": "mask"},
    "hscl": {"filter_exponent": 0.5},
    "data": {"samples_per_combination": 1, "resolution": 16},
    "model": {"width": 8, "projector_hidden_dim": 32, "projector_dim": 16},
    "train": {"epochs": 2, "batch_size": 64, "lr": 0.002},
    "eval": {"every_n_epochs": 0, "linear_max_iter": 20,
             "transfer": [{"dataset": "digits", "name": "sk-digits"}]},
    "scaling": {"num_workers": 0, "cpus_per_worker": 2},
}


def _run(root: Path, fault: dict[str, Any] | None = None) -> StoredSession:
    session = StoredSession(root)
    context = TrialContext(config=SearchConfig.model_validate(MCL_OVER_HSCL))
    with injected_fault(**fault) if fault else nullcontext():
        run_trial_loop(context, session)
    return session


def test_mcl_over_hscl_reports_transfer_and_diagnostics_and_resumes(
    data_cache: Path, tmp_path: Path
) -> None:
    """MCL with HSCL as its base (masked negatives): every stage and the integration are probed on
    the transfer set once; the trial's end carries diag/ metrics and the arrays for the plots; a
    crash in stage 1 resumes to the same transfer numbers (stage 0's transfer features live in
    the checkpoint)."""
    reference = _run(tmp_path / "reference")
    final = reference.reports[-1]
    every_key = {key: value for report in reference.reports for key, value in report.items()}
    for key in ("stage0/transfer/sk-digits/linear/digit", "stage1/transfer/sk-digits/linear/digit",
                "transfer/sk-digits/linear/digit", "transfer/sk-digits/linear/mean",
                "diag/effective_rank", "diag/projection_effective_rank",
                "diag/shared_directions", "diag/subclass_directions"):
        assert key in every_key, key
        assert np.isfinite(every_key[key])
    # Transfer and test are scored once per stage (stage-alone) and once for the integration.
    integrated = [r for r in reference.reports if "transfer/sk-digits/linear/mean" in r]
    assert len(integrated) == 1 and len([r for r in reference.reports if "diag/effective_rank"
                                         in r]) == 1
    assert 0.2 < final["transfer/sk-digits/linear/digit"] <= 1.0  # 10 classes: chance is 0.1
    last_checkpoint = sorted((tmp_path / "reference").glob("checkpoint_*"))[-1]
    assert (last_checkpoint / DIAGNOSTICS_FILE).exists()

    root = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="injected fault"):
        _run(root, fault={"stage": 1, "after_epoch": 1, "marker": str(tmp_path / "marker")})
    resumed = _run(root).reports[-1]
    for key in ("transfer/sk-digits/linear/digit", "test/linear/mean", "diag/effective_rank"):
        assert resumed[key] == pytest.approx(final[key], abs=1e-6), key
