"""tune.collapse: the rule on reports, a really collapsed trial told from a healthy one by the
figures it reports, and what a collapsed trial becomes (stopped, run FINISHED and tagged
collapsed with its reason, pruned for Optuna, never ranked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from test_config import error_of
from test_tracking import StubTrial

import raycl.worker.stage
from raycl.config.collapse import RANKME, STD, CollapseConfig
from raycl.config.schema import CoreConfig
from raycl.methods import SearchConfig
from raycl.sweep.collapse import CollapseStopper, collapse_stopper
from raycl.sweep.searchers import build_searcher
from raycl.tracking import MLflowSweepCallback
from raycl.tracking.runs import ENDED_TAG, NOTE_TAG, rankable
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop
from raycl.worker.outcome import trial_ending
from raycl.worker.session import InProcessSession

TINY = {"data": {"samples_per_combination": 1, "resolution": 16},
        "model": {"width": 8, "projector_hidden_dim": 32, "projector_dim": 16},
        "train": {"epochs": 1, "batch_size": 64}, "scaling": {"num_workers": 0},
        "eval": {"every_n_epochs": 1, "linear_max_iter": 20, "diagnostics": False,
                 "baseline": False}}


def test_the_rule_judges_evaluations_from_its_first_epoch_on() -> None:
    rule = CollapseConfig(std_below=0.1, rankme_below=2.0, from_epoch=2)
    assert rule.reason({"global_epoch": 1, STD: 0.0}) is None  # too early to judge
    assert rule.reason({"global_epoch": 2, STD: 0.5, RANKME: 9.0}) is None  # healthy
    assert rule.reason({"global_epoch": 2, "train/loss": 1.0}) is None  # no evaluation
    assert rule.reason({"global_epoch": 3, STD: 0.05}) == "val/label_free/std 0.05 < 0.1 at epoch 3"
    assert rule.reason({"global_epoch": 2, STD: 0.5, RANKME: 1.2}).startswith(
        "val/label_free/rankme 1.2 < 2")
    stopper = CollapseStopper(rule)
    assert stopper("t", {"global_epoch": 2, STD: 0.01}) and not stopper("t", {"epoch": 2})
    from ray.tune.stopper import FunctionStopper

    assert FunctionStopper.is_valid_function(stopper)  # what RunConfig(stop=...) takes
    with pytest.raises(ValueError, match="std_below, rankme_below"):
        CollapseConfig()


def test_a_collapse_rule_without_the_figures_is_one_line(tmp_path: Path) -> None:
    text = yaml.safe_dump({**TINY, "name": "c", "eval": {**TINY["eval"], "label_free": False},
                           "tune": {"collapse": {"std_below": 0.1}}})
    assert "tune.collapse: judges the label-free figures" in error_of(tmp_path, text)


def trial_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  collapsed: bool) -> list[dict]:
    """A one-epoch SimCLR trial's reports, its backbone made to give every image the same
    features (``collapsed``: the encoder's parameters zeroed and frozen) or left as it is."""
    config = SearchConfig.model_validate({**TINY, "name": "c", "method": "simclr"})
    if collapsed:
        original = raycl.worker.stage.build_method

        def constant_features(config: CoreConfig, channels: int):
            method = original(config, channels)
            with torch.no_grad():
                for parameter in method.backbone.parameters():
                    parameter.zero_()
            # a constant representation, whatever the images: the backbone's output is its
            # last layer's bias, frozen at zero
            method.backbone.requires_grad_(False)
            return method

        monkeypatch.setattr(raycl.worker.stage, "build_method", constant_features)
    session = InProcessSession(torch.device("cpu"))
    reports: list[dict] = []
    session.report = lambda metrics, checkpoint_dir: reports.append(metrics)  # type: ignore
    run_trial_loop(TrialContext(config=config), session)
    return reports


def test_a_collapsed_trial_is_stopped_and_a_healthy_one_trains_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None) -> None:
    """The figures the trial itself reports decide: constant features stop at the first
    evaluation judged, a trained network's do not."""
    stopper = collapse_stopper(SearchConfig.model_validate(
        {**TINY, "name": "c", "tune": {"collapse": {"std_below": 0.1, "rankme_below": 1.5}}}))
    assert stopper is not None
    healthy = trial_reports(tmp_path / "healthy", monkeypatch, collapsed=False)
    assert [stopper("t", report) for report in healthy] == [False]
    assert all(report[STD] > 0.1 and report[RANKME] > 1.5 for report in healthy)
    collapsed = trial_reports(tmp_path / "collapsed", monkeypatch, collapsed=True)
    assert collapsed[0][STD] < 0.01 and stopper("t", collapsed[0])
    assert collapse_stopper(SearchConfig.model_validate({**TINY, "name": "c"})) is None


def test_a_collapsed_trial_ends_finished_tagged_pruned_and_unranked(tmp_path: Path) -> None:
    config = SearchConfig.model_validate({
        "name": "c", "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "tune": {"collapse": {"std_below": 0.1}, "search_space": {
            "train.lr": {"loguniform": [1e-4, 1e-1]}}}})
    last = {"stage": 0, "epoch": 1, "global_epoch": 1, "val/linear/mean": 0.9, STD: 0.02,
            "train/loss": 2.0, "done": True}
    assert trial_ending(last, 1, 2, collapsed=True) == "collapsed"

    callback = MLflowSweepCallback(config)
    callback.setup()
    trial = StubTrial("coll0001", {"seed": 0}, last, status="TERMINATED")
    callback.on_trial_start(0, [trial], trial)
    callback.on_trial_result(0, [trial], trial, last)
    callback.on_trial_complete(0, [trial], trial)
    client = MlflowClient(config.mlflow.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("c").experiment_id],
                                filter_string="tags.`raycl.role` = 'trial'")
    assert run.info.status == "FINISHED" and run.data.tags[ENDED_TAG] == "collapsed"
    assert "val/label_free/std 0.02 < 0.1" in run.data.tags[NOTE_TAG]
    assert not rankable(run)  # its 0.9 is never a result

    searcher = build_searcher(config)
    searcher.set_search_properties(config.tune.metric, config.tune.mode, {})
    for trial_id, result in (("a", last), ("b", {**last, STD: 0.5})):
        searcher.suggest(trial_id)
        searcher.on_trial_complete(trial_id, result)
    states = [trial.state.name for trial in searcher._ot_study.trials]
    assert states == ["PRUNED", "COMPLETE"]
