"""Issue 47: what a sweep and its leaderboard show. Every knob on the importance line, and
"indistinguishable" instead of flat numbers; the attribute image retrieval scores named in its
column; the test column kept at 80 columns; readable learning-rate ticks in leaderboard.png;
one ``finished:`` line a trial. No Ray: the display is fed the events a sweep sends."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_progress import FakeTrial

from raycl.config.search_config import search_config_class
from raycl.config.sweep import Domain
from raycl.leaderboard import main as leaderboard_main
from raycl.methods import SearchConfig
from raycl.sweep.display import ProgressDisplay
from raycl.tracking.importance import (
    IMPORTANCE_TAG,
    Importance,
    importance_line,
    log_importance,
    sweep_importance,
)
from raycl.tracking.leaderboard_plot import leaderboard_figure, log_ticks
from raycl.tracking.reference_points import retrieval_attribute
from raycl.tracking.runs import ENDED_TAG, PARENT_TAG, ROLE_TAG, TRIAL_TAG, mlflow_client
from raycl.tracking.terminal_table import format_table
from raycl.tracking.trial_table import build_leaderboard, trial_table

OBJECTIVE = "val/linear/mean"
SPACE_RAW = {"simclr.temperature": {"uniform": [0.1, 0.5]},
             "train.lr": {"loguniform": [0.0005, 0.005]}}


def _config(**tune: Any) -> SearchConfig:
    return search_config_class().model_validate(
        {"name": "demo", "method": "simclr", "seed": 3, "train": {"epochs": 8},
         "tune": {"metric": OBJECTIVE, "num_samples": 4, "search_space": SPACE_RAW,
                  "scheduler": {"type": "asha", "grace_period": 2}, **tune}})


# -- 1. the importance line -----------------------------------------------------------------


def test_importance_line_names_every_knob() -> None:
    result = Importance("fanova", {"train.lr": 0.52, "simclr.temperature": 0.3,
                                   "model.backbone": 0.12, "method": 0.06}, 12, 0)
    line = importance_line(result)
    assert line == ("knobs that mattered (fANOVA over 12 trials): train.lr 0.52, "
                    "simclr.temperature 0.30, model.backbone 0.12, method 0.06")
    assert "…" not in line


def test_flat_importances_are_indistinguishable_not_numbers() -> None:
    flat = Importance("fanova", {"train.lr": 0.5, "method": 0.5}, 4, 1)
    assert importance_line(flat) == (
        "knobs that mattered (fANOVA, 1 stopped early by ASHA, at their last objective): "
        "indistinguishable (4 trials): train.lr, method")
    near = Importance("fanova", {"train.lr": 0.51, "method": 0.49}, 4, 0)
    assert "indistinguishable (4 trials)" in importance_line(near)
    assert "0.5" not in importance_line(near)


def _run(params: dict[str, Any], objective: float) -> Any:
    return SimpleNamespace(data=SimpleNamespace(
        params={key: str(value) for key, value in params.items()},
        tags={ENDED_TAG: "completed"}, metrics={OBJECTIVE: objective}))


class _Client:
    """What log_importance calls on MLflow's client, recorded."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.artifacts: list[str] = []

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.tags[key] = value

    def log_artifact(self, run_id: str, path: str) -> None:
        self.artifacts.append(Path(path).name)


def test_a_forest_that_cannot_split_says_indistinguishable() -> None:
    # Four trials of one configuration (every knob alike), four objectives: no tree can split,
    # fANOVA raised "zero total variance" (the line said "could not be computed").
    same = {"simclr.temperature": 0.3, "train.lr": 0.001}
    runs = [_run(same, value) for value in (0.31, 0.35, 0.33, 0.4)]
    result = sweep_importance(runs, _config())
    assert isinstance(result, Importance)
    client = _Client()
    line = log_importance(client, "parent", runs, _config())  # type: ignore[arg-type]
    assert line == ("knobs that mattered (fANOVA): indistinguishable (4 trials): "
                    "simclr.temperature, train.lr")
    assert client.tags[IMPORTANCE_TAG] == line and client.artifacts == []  # no numbers logged


# -- 2 and 3. the leaderboard: retrieval's attribute, the test column at 80 columns ------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Experiment ``board``: three completed trials of a Trifeature sweep, each with its test
    counterpart, image retrieval and two searched knobs."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('board') / 'mlflow.db'}"
    client = mlflow_client(uri)
    experiment = client.create_experiment("board")
    parent = client.create_run(experiment, tags={ROLE_TAG: "sweep", "raycl.metric": OBJECTIVE,
                                                 "raycl.mode": "max"}).info.run_id
    client.log_param(parent, "data.dataset", "trifeature")
    for i, (temperature, lr, value) in enumerate([(0.2419, 0.002551, 0.61), (0.31, 0.0011, 0.55),
                                                  (0.45, 0.000712, 0.5)], start=1):
        name = f"t{i:02d} τ={temperature:.2g} lr={lr:.2g}"
        run_id = client.create_run(experiment, run_name=name, tags={
            ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: f"id{i}", ENDED_TAG: "completed",
            "raycl.searched": f"simclr.temperature={temperature}, train.lr={lr}"}).info.run_id
        client.log_param(run_id, "data.dataset", "trifeature")
        for key, metric in {OBJECTIVE: value, "test/linear/mean": value - 0.02,
                            "val/retrieval/rank1": 0.3, "val/retrieval/map": 0.2,
                            "diag/effective_rank": 30.5}.items():
            client.log_metric(run_id, key, metric, step=8)
        client.set_terminated(run_id)
    return uri


def test_retrieval_columns_name_the_attribute_they_score(store: str) -> None:
    board = build_leaderboard(store, "board")
    assert "val/retrieval/rank1 (shape)" in board.header
    assert "val/retrieval/map (shape)" in board.header
    assert OBJECTIVE in board.header and "test/linear/mean" in board.header  # others as named
    digits = SimpleNamespace(data=SimpleNamespace(params={"data.dataset": "digits"}))
    assert retrieval_attribute([digits]) == "digit"
    assert retrieval_attribute([SimpleNamespace(data=SimpleNamespace(params={}))]) is None


def test_leaderboard_keeps_the_test_column_at_80_columns(
        store: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert leaderboard_main(["--experiment", "board", "--tracking-uri", store]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  "))
    table = lines[start:start + 5]
    assert all(len(line) <= 80 for line in table)
    assert table[0].split()[:5] == ["#", "trial", "status", OBJECTIVE, "test/linear/mean"]
    column = table[0].index("test/linear/mean")
    assert table[2].startswith("1  t01 τ=0.24") and table[2][column:].startswith("0.59")
    assert "tempe…" in table[0]  # the knob's header was shortened before the name was cut


def test_knob_headers_shorten_before_the_name() -> None:
    header = ["#", "trial", "status", OBJECTIVE, "test/linear/mean", "simclr.temperature",
              "train.lr", "diag/effective_rank"]
    rows = [["1", "t01 τ=0.24 lr=0.0026", "completed", "0.6123", "0.5912", "0.2419",
             "0.002551", "31.5"]]
    keep = ["simclr.temperature", "train.lr"]
    first, _, row, note = format_table(header, rows, width=90, keep=keep).splitlines()
    assert first.split() == ["#", "trial", "status", OBJECTIVE, "test/linear/mean",
                             "temperat…", "train.lr"]
    assert "t01 τ=0.24 lr=0.0026" in row and "0.5912" in row  # the whole name, and test
    assert note.startswith("1 more column(s) in leaderboard.csv and MLflow: diag/")
    # At 80 the knob is down to its values' width before the name is cut; test stays.
    first, _, row, _ = format_table(header, rows, width=80, keep=keep).splitlines()
    assert "test/linear/mean" in first and "tempe…" in first and "0.5912" in row
    assert "t01 τ=0.24 l…" in row and len(row) <= 80
    # Narrower than the kept columns can be: the test column goes, as it did.
    narrow = format_table(header, rows, width=60, keep=keep).splitlines()[0]
    assert "test/linear/mean" not in narrow and "simclr.temperature" in narrow


# -- 4. leaderboard.png's learning-rate ticks -------------------------------------------------


def _plot_run(i: int, lr: float) -> Any:
    return SimpleNamespace(
        info=SimpleNamespace(run_name=f"t{i:02d}", run_id=f"r{i}", status="FINISHED"),
        data=SimpleNamespace(params={}, metrics={OBJECTIVE: 0.3 + 0.01 * i}, tags={
            ENDED_TAG: "completed", "raycl.trial_index": str(i),
            "raycl.searched": f"train.lr={lr}, simclr.temperature={0.1 + 0.05 * i}"}))


@pytest.mark.parametrize("low,high", [(5e-4, 5e-3), (1e-4, 1e-2), (2.1e-3, 2.9e-3)])
def test_lr_tick_labels_do_not_overlap(low: float, high: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    runs = [_plot_run(i, low * (high / low) ** (i / 7)) for i in range(8)]
    space = {"train.lr": Domain(loguniform=(low, high)),
             "simclr.temperature": Domain(uniform=(0.1, 0.5))}
    figure = leaderboard_figure(trial_table(runs, OBJECTIVE, "max"), space)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    axis = figure.axes[0]
    left, right = sorted(axis.get_xlim())
    labels = [label for label in axis.get_xticklabels(which="both")
              if label.get_text() and left <= label.get_position()[0] <= right]
    assert len(labels) >= 2  # readable, and still there
    boxes = sorted((label.get_window_extent(canvas.get_renderer()) for label in labels),
                   key=lambda box: box.x0)
    assert all(a.x1 <= b.x0 for a, b in itertools.pairwise(boxes)), \
        [label.get_text() for label in labels]


def test_log_ticks_are_few_and_round() -> None:
    assert log_ticks(5e-4, 5e-3) == [0.0005, 0.001, 0.002, 0.005]
    assert log_ticks(1e-6, 1.0) == [1e-6, 1e-4, 1e-2, 1.0]
    assert log_ticks(2.1e-3, 2.9e-3) == [0.0021, 0.0025, 0.0029]


# -- 5. one ``finished:`` line a trial --------------------------------------------------------


def _report(trial: FakeTrial, epoch: int, objective: float) -> dict:
    result = {"epoch": epoch, "stage": 0, "global_epoch": epoch, "training_iteration": epoch,
              OBJECTIVE: objective, "time_total_s": 10.0 * epoch}
    trial.last_result = result
    trial.metric_analysis = {OBJECTIVE: {"last": objective}}
    return result


def _run_to_the_end(display: ProgressDisplay, trial: FakeTrial) -> None:
    display.on_trial_start(0, [], trial)
    for epoch in (2, 4, 6, 8):
        display.on_trial_result(0, [], trial, _report(trial, epoch, 0.1 * epoch))
    display.on_trial_complete(0, [], trial)


def test_a_trial_started_again_after_it_finished_prints_no_second_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    display = ProgressDisplay(_config())
    display.setup(total_num_samples=4)
    trial = FakeTrial("id1", {"simclr.temperature": 0.3, "train.lr": 0.001}, "1_x",
                      status="RUNNING")
    _run_to_the_end(display, trial)
    # Tune runs it again: its worker hands its last checkpoint back (the same last report),
    # and Tune completes it again.
    display.on_trial_start(0, [], trial)
    display.on_trial_result(0, [], trial, _report(trial, 8, 0.8))
    display.on_trial_complete(0, [], trial)
    out = capsys.readouterr().out
    assert out.count(": finished:") == 1 and out.count("epoch 8/8") == 1
    assert out.count(": started") == 1


def test_a_restored_sweep_does_not_finish_a_trial_twice(
        capsys: pytest.CaptureFixture[str]) -> None:
    before = ProgressDisplay(_config())
    pickled = pickle.dumps(before)  # as the Tuner keeps it, from before the sweep ran
    before.setup(total_num_samples=4)
    trial = FakeTrial("id1", {"simclr.temperature": 0.3, "train.lr": 0.001}, "1_x",
                      status="RUNNING")
    _run_to_the_end(before, trial)
    # The driver stops before Tune saves the trial's end: the next one restores it RUNNING with
    # its last report, runs it again (its checkpoint handed back) and completes it.
    after = pickle.loads(pickled)
    after.setup(total_num_samples=4)
    after.on_trial_start(0, [], trial)
    after.on_trial_result(0, [], trial, _report(trial, 8, 0.8))
    after.on_trial_complete(0, [], trial)
    out = capsys.readouterr().out
    assert out.count(": finished:") == 1 and out.count("epoch 8/8") == 1
    assert out.splitlines()[-1].endswith(
        "t01 τ=0.3 lr=0.001: had run to its end before the sweep stopped "
        "(val/linear/mean 0.8); resumed only to hand its result back")
    # A trial resumed part-way is started as before, and finishes once.
    other = FakeTrial("id2", {"simclr.temperature": 0.2, "train.lr": 0.002}, "2_x",
                      status="RUNNING")
    _report(other, 4, 0.4)
    after.on_trial_start(0, [], other)
    after.on_trial_result(0, [], other, _report(other, 8, 0.7))
    after.on_trial_complete(0, [], other)
    lines = capsys.readouterr().out.splitlines()
    assert "started (resumed from its checkpoint)" in lines[0] and "finished:" in lines[-1]
