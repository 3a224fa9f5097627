"""The label-free figures (raycl.eval.label_free): RankMe, α-ReQ and the normalised std on
hand-computed cases, their invariances, their names, and a SimCLR trial on a dataset without
labels that reports them and may select on them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_clip import clip_config
from test_config import error_of
from test_reliability import StoredSession

from raycl.config.sweep import selectable_metric
from raycl.eval.label_free import alpha_req, label_free_scores, normalized_std, rankme
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop


def test_rankme_is_the_exponential_entropy_of_the_singular_values() -> None:
    # σ = (2, 1): shares 2/3 and 1/3
    entropy = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert rankme(np.diag([2.0, 1.0])) == pytest.approx(math.exp(entropy), rel=1e-5)
    assert rankme(np.eye(4)) == pytest.approx(4.0, rel=1e-5)  # a flat spectrum: every direction
    assert rankme(np.outer(np.ones(6), [1.0, 2.0, 3.0])) == pytest.approx(1.0, abs=1e-4)
    assert rankme(np.zeros((3, 2))) == 1.0
    # Not centred, as the paper: the same as the singular values of an SVD, any scale
    rows = np.random.default_rng(0).normal(size=(50, 8)) + 3.0
    sigma = np.linalg.svd(rows, compute_uv=False)
    shares = sigma / sigma.sum() + 1e-7
    assert rankme(rows) == pytest.approx(math.exp(-np.sum(shares * np.log(shares))), rel=1e-9)
    assert rankme(10 * rows) == pytest.approx(rankme(rows), rel=1e-9)


def test_alpha_is_the_power_law_decay_of_the_covariance_spectrum() -> None:
    for alpha in (0.5, 1.0, 2.0):
        # rows ±diag(i^-α/2): a zero-mean cloud whose covariance's eigenvalues are ∝ i^-α
        half = np.diag(np.arange(1, 17, dtype=float) ** (-alpha / 2))
        assert alpha_req(np.vstack([half, -half])) == pytest.approx(alpha, abs=1e-9)
    # a flat spectrum decays not at all; one direction (or none) leaves nothing to fit
    assert alpha_req(np.vstack([np.eye(5), -np.eye(5)])) == pytest.approx(0.0, abs=1e-9)
    assert alpha_req(np.outer(np.arange(6.0), [1.0, 2.0])) == 0.0
    assert alpha_req(np.ones((4, 3))) == 0.0


def test_normalised_std_is_one_when_spread_and_zero_when_collapsed() -> None:
    spread = np.vstack([np.eye(8), -np.eye(8)])  # each dimension: std 1/√8 over the rows
    assert normalized_std(spread) == pytest.approx(1.0, rel=1e-12)
    assert normalized_std(np.ones((5, 3))) == 0.0
    # the direction counts, not the length: rows scaled one by one give the same figure
    rows = np.random.default_rng(1).normal(size=(400, 16))
    scales = np.random.default_rng(2).uniform(0.1, 10.0, size=(400, 1))
    assert normalized_std(rows * scales) == pytest.approx(normalized_std(rows), rel=1e-9)
    assert normalized_std(rows) == pytest.approx(1.0, abs=0.06)  # an isotropic Gaussian


def test_a_collapsed_representation_is_told_from_a_healthy_one() -> None:
    rng = np.random.default_rng(3)
    healthy = rng.normal(size=(2000, 32))
    collapsed = np.ones((2000, 32)) + 1e-3 * rng.normal(size=(2000, 32))  # one point, jittered
    low_rank = rng.normal(size=(2000, 2)) @ rng.normal(size=(2, 32))  # two directions of 32
    assert rankme(healthy) > 28 and rankme(low_rank) < 2.5
    assert normalized_std(healthy) > 0.9 and normalized_std(collapsed) < 0.01


@pytest.mark.parametrize("bad", [np.zeros((1, 4)), np.zeros(4), np.full((3, 2), np.nan)])
def test_figures_refuse_what_is_not_a_feature_matrix(bad: np.ndarray) -> None:
    for figure in (rankme, alpha_req, normalized_std):
        with pytest.raises(ValueError, match="features"):
            figure(bad)


def test_scores_are_named_per_split_and_stage_on_a_fixed_draw_of_rows() -> None:
    rng = np.random.default_rng(4)
    features = {"val": rng.normal(size=(300, 6)), "test": rng.normal(size=(5, 6)),
                "train": rng.normal(size=(50, 6)), "mmvp:val": rng.normal(size=(1, 6))}
    scores = label_free_scores(features, stage=1)
    assert set(scores) == {f"stage1/{split}/label_free/{name}" for split in ("val", "test")
                           for name in ("rankme", "alpha", "std")}
    capped = label_free_scores(features, splits=("val",), max_rows=100, seed=7)
    assert capped == label_free_scores(features, splits=("val",), max_rows=100, seed=7)
    assert capped != label_free_scores(features, splits=("val",))
    assert capped["val/label_free/rankme"] == pytest.approx(rankme(
        features["val"][np.sort(np.random.default_rng(7).choice(300, 100, replace=False))]))
    for name in scores:  # a sweep may select on every val figure
        if "/val/" in name:
            assert selectable_metric(name) == name


def unlabelled_pairs(root: Path) -> dict[str, object]:
    """A caption corpus: images and captions, no class labels."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = ["image,caption"]
    for i in range(40):
        pixels = rng.integers(0, 255, size=(16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i}.png")
        rows.append(f"{i}.png,picture {i}")
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    return {"dataset": "pairs", "root": str(root / "pairs.csv"), "captions": None}


def test_an_image_method_on_unlabelled_data_reports_and_selects_on_label_free_figures(
        tmp_path: Path, one_torch_thread: None) -> None:
    """SimCLR on images that have no labels: refused while nothing could score it; with the
    label-free figures (the default) every evaluation reports them, and the sweep selects on
    RankMe; a labelled objective stays one line naming tune.metric."""
    pairs = unlabelled_pairs(tmp_path)
    sections = {"method": "simclr", "data": pairs, "eval": {"mmvp": None, "every_n_epochs": 1},
                "train": {"epochs": 2, "batch_size": 16}}

    def error(**changes: object) -> str:
        raw = clip_config(**{**sections, **changes}).to_dict()
        return error_of(tmp_path, yaml.safe_dump(raw))

    assert "eval.label_free: true" in error(eval={"mmvp": None, "label_free": False},
                                            tune={"metric": "val/label_free/rankme"})
    assert "tune.metric: pairs has no labels" in error(tune={"metric": "val/linear/mean"})
    session = StoredSession(tmp_path / "run")
    config = clip_config(**sections, tune={"metric": "val/label_free/rankme"})
    run_trial_loop(TrialContext(config=config), session)
    assert [report["epoch"] for report in session.reports] == [1, 2]
    for report in session.reports:
        assert 1.0 <= report["val/label_free/rankme"] <= 40  # at most min(N, D)
        assert report["val/label_free/std"] > 0.0 and report["val/label_free/alpha"] >= 0.0
        assert not any("linear" in key or "knn" in key for key in report)
    assert "test/label_free/rankme" in session.reports[-1]
