"""The sweep's baseline (eval.baseline, raycl.sweep.baseline): what the parent run gets, the
resumed sweep that does not score it again, and a failed task that costs one warning.

No Ray and no tracking store: Ray's calls and MLflow's client are stand-ins recording what
they were asked (the end-to-end sweep is tests/test_end_to_end.py's quickstart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from raycl.config.schema import CoreConfig
from raycl.sweep.baseline import (
    BASELINE_GPU_SHARE,
    SweepBaseline,
    baseline_report,
    baseline_resources,
    baseline_scope,
    launch_baseline,
    log_baseline,
    score_at_init,
    with_baseline,
)
from raycl.tracking.reference_points import BASELINE_SCOPE_TAG


@dataclass
class FakeClient:
    """MLflow's client, as far as raycl.sweep.baseline uses it: one run's metrics and tags."""

    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    batches: list[list[Any]] = field(default_factory=list)

    def get_run(self, run_id: str) -> Any:
        return SimpleNamespace(data=SimpleNamespace(metrics=dict(self.metrics), tags=self.tags))

    def log_batch(self, run_id: str, metrics: list[Any]) -> None:
        self.batches.append(metrics)
        self.metrics.update({metric.key: metric.value for metric in metrics})

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags[key] = value


def config(**overrides: Any) -> CoreConfig:
    return CoreConfig.model_validate({"name": "b", **overrides})


def test_the_report_renames_val_scores_and_keeps_chance() -> None:
    evaluation = {"val/linear/mean": 0.4, "val/linear/shape": 0.3, "val/knn/mean": 0.35,
                  "stage0/val/linear/mean": 0.4, "perf/embed_seconds": 1.5,
                  "data/chance/shape": 0.1, "data/val_size": 100.0}
    assert baseline_report(evaluation) == {
        "baseline/val/linear/mean": 0.4, "baseline/val/linear/shape": 0.3,
        "baseline/val/knn/mean": 0.35, "data/chance/shape": 0.1, "data/val_size": 100.0}


def test_the_scope_names_searched_model_keys_at_the_base_values() -> None:
    searched = config(model={"width": 32}, tune={"search_space": {
        "model.width": {"choice": [16, 64]}, "train.lr": {"loguniform": [0.001, 0.01]}}})
    assert baseline_scope(searched) == "model.width=32"
    assert baseline_scope(config(tune={"search_space": {
        "train.lr": {"loguniform": [0.001, 0.01]}}})) == ""


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The options of every Ray task launch_baseline starts (ray.remote faked: ``"ref"``)."""
    options_seen: list[dict[str, Any]] = []

    def fake_remote(function: Any) -> Any:
        def options(**resources: Any) -> Any:
            return SimpleNamespace(remote=lambda base: options_seen.append(resources) or "ref")
        return SimpleNamespace(options=options)

    monkeypatch.setattr(ray, "remote", fake_remote)
    return options_seen


def test_a_resumed_sweep_whose_parent_has_the_baseline_does_not_score_it_again(
        launched: list[dict[str, Any]]) -> None:
    scored = FakeClient(metrics={"baseline/val/linear/mean": 0.3, "data/val_size": 100.0})
    assert launch_baseline(config(), scored, "parent") is None
    assert launched == []
    # A parent without it (a fresh sweep, or one interrupted before it was logged): launched,
    # one CPU, a GPU only when the trials use GPUs, never retried.
    assert launch_baseline(config(), FakeClient(), "parent") == "ref"
    assert launch_baseline(config(), scored, None) == "ref"  # no parent known
    assert launched[0] == {"num_cpus": 1, "num_gpus": 0, "max_retries": 0,
                           "name": "raycl-baseline"}
    assert launch_baseline(config(eval={"baseline": False}), FakeClient(), "parent") is None
    assert len(launched) == 2


def test_the_baseline_asks_for_a_share_of_a_gpu_never_more_than_a_trials_worker(
        launched: list[dict[str, Any]]) -> None:
    """One val evaluation (no training) holds no whole GPU, where it would keep a trial
    waiting: at most BASELINE_GPU_SHARE of one, and no more than a trial's worker asks."""
    for scaling in ({"use_gpu": True}, {"use_gpu": True, "num_workers": 4},
                    {"use_gpu": True, "num_workers": 1, "gpus_per_worker": 0.25},
                    {"use_gpu": False}):
        assert launch_baseline(config(scaling=scaling), FakeClient(), "parent") == "ref"
    assert [options["num_gpus"] for options in launched] == [BASELINE_GPU_SHARE,
                                                              BASELINE_GPU_SHARE, 0.25, 0]
    assert 0 < BASELINE_GPU_SHARE < 1
    assert all(options["num_cpus"] == 1 for options in launched)
    assert baseline_resources(config(scaling={"use_gpu": True})) == {
        "num_cpus": 1, "num_gpus": BASELINE_GPU_SHARE}


def test_the_baseline_embeds_the_rows_the_trials_probe_is_capped_to(
        data_cache: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """eval.max_train_samples and eval.max_eval_samples reach the baseline's embedding as they
    reach a trial's every-epoch probe: 100 training and 50 val rows of the quickstart's 3 500
    and 500 are embedded and scored, not the whole splits."""
    from pathlib import Path

    from raycl.launch.load import load_search
    from raycl.worker import evaluate

    embedded: dict[str, int] = {}
    embed_splits = evaluate.embed_splits

    def counting(*args: Any) -> Any:
        features = embed_splits(*args)
        embedded.update({split: len(values) for split, values in features.items()})
        return features

    monkeypatch.setattr(evaluate, "embed_splits", counting)
    search = Path(__file__).resolve().parents[1] / "searches" / "quickstart.yaml"
    base = load_search(search, ["eval.max_train_samples=100", "eval.max_eval_samples=50"])
    report = score_at_init(base.to_dict())
    assert embedded == {"train": 100, "val": 50}
    assert report["data/val_size"] == 50.0 and "baseline/val/linear/mean" in report


def test_the_baseline_callback_comes_before_the_tracker() -> None:
    tracker: Any = SimpleNamespace(client=FakeClient(), parent_run_id=None)
    first, second = with_baseline(config(), tracker)
    assert isinstance(first, SweepBaseline) and second is tracker
    assert with_baseline(config(eval={"baseline": False}), tracker) == [tracker]


def test_the_parent_gets_the_baseline_and_chance_where_it_has_none() -> None:
    client = FakeClient(metrics={"data/val_size": 90.0})
    log_baseline(client, "parent", {"baseline/val/linear/mean": 0.3, "data/val_size": 100.0,
                                    "data/chance/color": 0.1}, "model.width=32")
    (batch,) = client.batches
    assert {metric.key: metric.value for metric in batch} == {
        "baseline/val/linear/mean": 0.3, "data/chance/color": 0.1}
    assert client.tags == {BASELINE_SCOPE_TAG: "model.width=32"}
    log_baseline(client, "parent", {"baseline/val/linear/mean": 0.3}, "")
    assert client.tags == {BASELINE_SCOPE_TAG: "model.width=32"}  # no scope: no tag


def test_a_failed_task_is_one_warning_and_the_sweep_goes_on(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    client = FakeClient()
    tracker = SimpleNamespace(client=client, parent_run_id="parent")
    callback = SweepBaseline(config(), tracker)  # type: ignore[arg-type]

    def failed(ref: Any) -> Any:
        raise RuntimeError("CUDA out of memory\nwhile embedding val")

    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (refs, []))
    monkeypatch.setattr(ray, "get", failed)
    callback._task = "ref"
    assert callback.collect(0.0) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["raycl: warning: the sweep's baseline (eval.baseline) failed: RuntimeError: "
                   "while embedding val; the leaderboard has no at-init row"]
    assert callback.collect(0.0) is False and client.batches == []  # nothing left to wait for
    # Done: logged once, on the parent run.
    monkeypatch.setattr(ray, "get", lambda ref: {"baseline/val/linear/mean": 0.25})
    callback._task = "ref"
    assert callback.collect(0.0) is True
    assert client.metrics == {"baseline/val/linear/mean": 0.25}
    # Still running at a poll: nothing logged, nothing waited for.
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: ([], refs))
    callback._task = "ref"
    assert callback.collect(0.0) is False and callback._task == "ref"


def test_an_interrupted_sweep_does_not_wait_and_the_task_is_cancelled(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    waits: list[float] = []
    cancelled: list[Any] = []
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: waits.append(timeout) or ([], refs))
    monkeypatch.setattr(ray, "cancel", lambda ref, force: cancelled.append(ref))
    tracker = SimpleNamespace(client=FakeClient(), parent_run_id="parent")
    callback = SweepBaseline(config(), tracker)  # type: ignore[arg-type]
    callback._task = "ref"
    callback.on_experiment_end([SimpleNamespace(status="RUNNING")])
    assert waits == [0.0] and cancelled == ["ref"]
    assert capsys.readouterr().err == ""  # the resumed sweep scores it
    callback._task = "ref"
    callback.on_experiment_end([SimpleNamespace(status="TERMINATED")])
    assert waits[-1] > 0 and cancelled == ["ref", "ref"]
    assert "not done 300 s after the sweep's end" in capsys.readouterr().err
