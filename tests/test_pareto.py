"""Several objectives (``tune.objectives``): the Pareto front against brute force, the schema's
and the pre-launch checks' refusals, the searcher's lists, the device-hours cost, and one tiny
two-objective sweep (with a warm-started sweep after it) through Ray Tune and MLflow."""

from __future__ import annotations

import csv
import random
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

from raycl.config.schema import ScalingSection
from raycl.launch.load import load_search
from raycl.sweep.searchers import OptunaSearch, build_searcher
from raycl.tracking.pareto import (
    dominates,
    mark_front,
    objectives_tag,
    pareto_front,
    parse_objectives,
)
from raycl.tune import main
from raycl.worker.device_hours import device_hours, trial_devices
from tests.test_config import BASE  # the smallest valid search, with one searched key

REPO = Path(__file__).resolve().parents[1]


def brute_force_front(points: list[list[float]], modes: list[str]) -> list[int]:
    """Written apart from raycl's: values turned into 'larger is better', then the definition."""
    signed = [[v if m == "max" else -v for v, m in zip(p, modes, strict=True)] for p in points]
    front = []
    for i, p in enumerate(signed):
        beaten = any(all(q[k] >= p[k] for k in range(len(p))) and q != p
                     for j, q in enumerate(signed) if j != i)
        if not beaten:
            front.append(i)
    return front


@pytest.mark.parametrize("seed", range(30))
def test_front_equals_brute_force_on_random_points_with_ties(seed: int) -> None:
    rng = random.Random(seed)
    dims = rng.choice([2, 3])
    modes = [rng.choice(["max", "min"]) for _ in range(dims)]
    # Small integers: many ties and duplicate points.
    points = [[float(rng.randint(0, 4)) for _ in range(dims)] for _ in range(rng.randint(1, 25))]
    assert pareto_front(points, modes) == brute_force_front(points, modes)


def test_front_on_hand_made_cases() -> None:
    # max/max: (1, 3) and (3, 1) trade off; (2, 2) too; (1, 1) is beaten; duplicates both stay.
    points = [[1.0, 3.0], [3.0, 1.0], [2.0, 2.0], [1.0, 1.0], [3.0, 1.0]]
    assert pareto_front(points, ["max", "max"]) == [0, 1, 2, 4]
    # accuracy max, cost min: the cheaper of two equally accurate trials wins.
    assert pareto_front([[0.8, 2.0], [0.8, 1.0], [0.9, 3.0]], ["max", "min"]) == [1, 2]
    assert dominates([1.0, 1.0], [1.0, 2.0], ["max", "min"])
    assert not dominates([1.0, 1.0], [1.0, 1.0], ["max", "min"])
    with pytest.raises(ValueError, match="mode"):
        dominates([1.0], [0.0], ["up"])
    with pytest.raises(ValueError, match="finite"):
        pareto_front([[float("nan"), 1.0]], ["max", "max"])


def test_objectives_tag_round_trips_and_the_table_marks_the_front() -> None:
    objectives = [("val/linear/shape", "max"), ("perf/device_hours", "min")]
    assert parse_objectives(objectives_tag(objectives)) == objectives

    class Run:  # the two attributes mark_front reads
        def __init__(self, run_id: str, metrics: dict[str, float]) -> None:
            self.info = type("Info", (), {"run_id": run_id})()
            self.data = type("Data", (), {"metrics": metrics})()

    runs = [Run("a", {"perf/device_hours": 0.5}), Run("b", {})]
    header = ["#", "trial", "status", "val/linear/shape", "perf/device_hours", "lr"]
    rows = [["1", "t01", "completed", "0.9", "0.5", "0.1"],
            ["2", "t02", "completed", "0.8", "-", "0.2"]]
    new_header, new_rows, _ = mark_front(header, rows, runs, {"a"}, objectives, str)
    assert new_header == ["#", "trial", "status", "val/linear/shape", "pareto",
                          "perf/device_hours", "lr"]
    assert [row[4] for row in new_rows] == ["*", ""]
    assert new_rows[0][5] == "0.5" and new_rows[1][6] == "0.2"


def test_device_hours_is_wall_time_times_devices() -> None:
    assert device_hours(1800.0, 4.0) == pytest.approx(2.0)
    assert device_hours(3600.0, 0.5, before=1.0) == pytest.approx(1.5)  # resumed: cumulative
    with pytest.raises(ValueError):
        device_hours(-1.0, 1.0)
    assert trial_devices(ScalingSection(num_workers=0)) == 1.0
    assert trial_devices(ScalingSection(num_workers=3)) == 3.0
    assert trial_devices(ScalingSection(num_workers=4, use_gpu=True, gpus_per_worker=0.5)) == 2.0


TWO = ("  objectives: [{metric: val/linear/shape, mode: max}, "
       "{metric: perf/device_hours, mode: min}]\n")


@pytest.mark.parametrize(("tune", "key", "why"), [
    ("  objectives: [{metric: val/linear/shape, mode: max}]\n", "tune.objectives",
     "one objective only"),
    ("  objectives: [{metric: val/linear/shape, mode: up}, {metric: val/linear/color, "
     "mode: max}]\n",
     "tune.objectives.0.mode", "'max' or 'min'"),
    ("  objectives: [{metric: val/linear/shape, mode: max}, {metric: val/linear/size, "
     "mode: max}]\n",
     "tune.objectives.1.metric", "no attribute 'size'"),
    ("  objectives: [{metric: val/linear/shape, mode: max}, {metric: perf/kmeans_seconds, "
     "mode: min}]\n", "tune.objectives.1.metric", "not reported every epoch"),
    ("  objectives: [{metric: test/linear/shape, mode: max}, {metric: val/linear/color, "
     "mode: max}]\n", "tune.objectives.0.metric", "test metric"),
    (TWO + "  scheduler: {type: asha}\n", "tune", "compares one number per trial"),
    (TWO + "  metric: val/linear/mean\n", "tune", "not both"),
])
def test_bad_objectives_are_one_line_and_exit_2_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture, tune: str, key: str, why: str
) -> None:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE) + tune)
    assert main([str(path), "--storage", str(tmp_path / "ray"),
                 "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {path}: {key}: ") and why in err
    assert not (tmp_path / "ray").exists()


def test_objectives_run_without_asha_and_the_first_stands_for_tune_metric(tmp_path: Path) -> None:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE) + TWO)
    config = load_search(path)
    assert (config.tune.metric, config.tune.mode) == ("val/linear/shape", "max")
    assert config.tune.scheduler.type == "none"
    searcher = build_searcher(config)
    assert searcher.metric == ["val/linear/shape", "perf/device_hours"]
    assert searcher.mode == ["max", "min"]
    # Optuna's multi-objective study: intermediate reports are skipped, a last report without
    # one objective is recorded as pruned instead of failing the sweep.
    searcher.suggest("a")
    searcher.on_trial_result("a", {"val/linear/shape": 0.5, "training_iteration": 1})
    searcher.on_trial_complete("a", {"val/linear/shape": 0.5})
    searcher.suggest("b")
    searcher.on_trial_complete("b", {"val/linear/shape": 0.6, "perf/device_hours": 0.1})
    states = [t.state.name for t in searcher._ot_study.trials]
    assert states == ["PRUNED", "COMPLETE"]
    assert isinstance(searcher, OptunaSearch)


@pytest.mark.parametrize("name", ["mcl_shape_texture.yaml", "accuracy_vs_cost.yaml"])
def test_shipped_multi_objective_searches(name: str) -> None:
    config = load_search(REPO / "searches" / name)
    assert config.tune.objectives is not None and len(config.tune.objectives) == 2


TINY = [
    "data.samples_per_combination=1", "data.resolution=16", "train.batch_size=64",
    "model.width=8", "model.projector_hidden_dim=32", "model.projector_dim=16",
    "eval.linear_max_iter=50", "eval.every_n_epochs=1", "train.epochs=1",
    "eval.diagnostics=false", "eval.baseline=false", "mlflow.log_encoder=false",
]


def sweep_args(tmp_path: Path, name: str, samples: int, *extra: str) -> list[str]:
    return [str(REPO / "searches" / "accuracy_vs_cost.yaml"),
            *[arg for override in TINY for arg in ("--set", override)],
            "--num-samples", str(samples), "--name", name, "--storage", str(tmp_path / "ray"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", *extra]


def test_two_objective_sweep_ends_with_its_front_and_seeds_a_warm_start(
    ray_session, data_cache, tmp_path, capsys
) -> None:
    objectives = [("val/linear/mean", "max"), ("perf/device_hours", "min")]
    assert main(sweep_args(tmp_path, "e2e-pareto", 3)) == 0
    # The title is wrapped at the terminal's width (xdist's workers have another one).
    printed = " ".join(capsys.readouterr().out.split())
    assert "Pareto front on val/linear/mean (max), perf/device_hours (min)" in printed

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("e2e-pareto")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("raycl.role") == "sweep"]
    children = [r for r in runs if r.data.tags.get("raycl.role") == "trial"]
    assert len(children) == 3 and all(c.info.status == "FINISHED" for c in children)
    for child in children:  # the cost every epoch, growing
        history = client.get_metric_history(child.info.run_id, "perf/device_hours")
        assert len(history) == 1 and history[0].value > 0
    points = [[c.data.metrics[m] for m, _ in objectives] for c in children]
    expected = {children[i].info.run_id for i in brute_force_front(points, ["max", "min"])}
    assert {c.info.run_id for c in children if c.data.tags["raycl.pareto"] == "true"} == expected
    path = client.download_artifacts(parent.info.run_id, "pareto.csv", str(tmp_path))
    with Path(path).open() as handle:
        rows = list(csv.DictReader(handle))
    by_trial = {c.data.tags["raycl.trial_id"]: c.info.run_id for c in children}
    assert {by_trial[row["trial_id"]] for row in rows if row["on_front"] == "1"} == expected
    assert "pareto.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    # The parent's description: the leaderboard, then the front's section with its trials only.
    section = parent.data.tags["mlflow.note.content"].split("**Pareto front** of ")[1]
    assert section.startswith(f"`val/linear/mean` (max), `perf/device_hours` (min): "
                              f"{len(expected)} of 3 trial(s)")
    for child in children:
        assert (f"| {child.info.run_name} |" in section) == (child.info.run_id in expected)

    # Warm start: the next sweep's first trial is the earlier sweep's best configuration (by
    # its first objective), on the keys this search space has.
    best = max(children, key=lambda c: c.data.metrics["val/linear/mean"])
    assert main(sweep_args(tmp_path, "e2e-warm", 1, "--warm-start", "e2e-pareto")) == 0
    warm = client.get_experiment_by_name("e2e-warm")
    runs = client.search_runs([warm.experiment_id])
    (warm_parent,) = [r for r in runs if r.data.tags.get("raycl.role") == "sweep"]
    (first,) = [r for r in runs if r.data.tags.get("raycl.role") == "trial"]
    for key in ("simclr.temperature", "train.lr"):
        assert float(first.data.params[key]) == pytest.approx(float(best.data.params[key]))
    assert warm_parent.data.tags["raycl.warm_start"].startswith(
        f"e2e-pareto: {best.info.run_name.split(' ')[0]} ")
