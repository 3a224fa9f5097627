"""A leaderboard that does not mislead: chance, the untrained backbone's row (the parent run's
first, a trial's for older sweeps), a stopped trial
beside the winner at the same epoch, searched keys kept on a narrow terminal, --columns and
--wide, per-attribute columns one flag away, and the val split's resolution.

No Ray: the sweep's MLflow runs are written by hand with the tags and metrics raycl writes
(:mod:`raycl.tracking.callback`, :mod:`raycl.worker.evaluate`).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from raycl.config.metric_names import baseline_metric, maybe_metric
from raycl.config.schema import CoreConfig
from raycl.leaderboard import main as leaderboard_main
from raycl.tracking.pareto import PARETO_TAG, front_run_ids
from raycl.tracking.pareto_log import log_pareto
from raycl.tracking.reference_points import (
    BASELINE_SCOPE_TAG,
    noise_level,
    resolution_line,
    stopped_note,
    value_at_step,
)
from raycl.tracking.runs import (
    CHECKPOINT_TAG,
    ENDED_TAG,
    PARENT_TAG,
    ROLE_TAG,
    STOPPED_AT_METRIC,
    TRIAL_TAG,
    mlflow_client,
    rankable,
)
from raycl.tracking.trial_table import (
    build_leaderboard,
    format_table,
    markdown_summary,
    trial_runs,
    trial_table,
    write_csv,
)
from raycl.worker.evaluate import val_reference_metrics

OBJECTIVE = "val/linear/mean"


@pytest.fixture(scope="module")
def sweep_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An experiment ``honest`` with one sweep: the winner (trained 8 epochs, objective 0.5 at
    epoch 2, 0.6 at 4 and 0.8 at 8), two trials ASHA stopped at epochs 2 (0.45) and 3 (0.44),
    each reporting chance on val (shape 0.5, color 0.25 of 300 images) and the untrained
    backbone's scores; returns the tracking URI (one store for the module: creating one takes
    seconds)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('honest') / 'mlflow.db'}"
    client = mlflow_client(uri)
    experiment = client.create_experiment("honest")
    parent = client.create_run(experiment, tags={ROLE_TAG: "sweep", "raycl.metric": OBJECTIVE,
                                                 "raycl.mode": "max"}).info.run_id
    reference = {"data/val_size": 300.0, "data/chance/shape": 0.5, "data/chance/color": 0.25,
                 baseline_metric(OBJECTIVE): 0.41, baseline_metric("val/linear/shape"): 0.52}

    def trial(name: str, lr: str, ended: str, history: list[tuple[int, float]]) -> str:
        run = client.create_run(experiment, run_name=name, tags={
            ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: name,
            "raycl.searched": f"train.lr={lr}, simclr.temperature=0.2", ENDED_TAG: ended})
        run_id = run.info.run_id
        for step, value in history:
            client.log_metric(run_id, OBJECTIVE, value, step=step)
        last = history[-1][0]
        for key, value in {**reference, "test/linear/mean": history[-1][1] - 0.05,
                           "val/linear/shape": 0.7, "test/linear/shape": 0.65,
                           "val/linear/color": 0.6, "test/linear/color": 0.55,
                           "diag/effective_rank": 31.5}.items():
            client.log_metric(run_id, key, value, step=last)
        if ended == "stopped_by_scheduler":
            client.log_metric(run_id, STOPPED_AT_METRIC, float(last), step=last)
        client.set_terminated(run_id)
        return run_id

    trial("t01 lr=0.1", "0.1", "completed", [(2, 0.5), (4, 0.6), (8, 0.8)])
    trial("t02 lr=0.3", "0.3", "stopped_by_scheduler", [(1, 0.4), (2, 0.45)])
    trial("t03 lr=0.5", "0.5", "stopped_by_scheduler", [(1, 0.4), (2, 0.42), (3, 0.44)])
    return uri


def test_val_reference_metrics_are_majority_share_and_size() -> None:
    labels = {"shape": np.array([0, 0, 0, 1]), "color": np.array([2, 1, 0, 1])}
    assert val_reference_metrics(labels) == {
        "data/val_size": 4.0, "data/chance/shape": 0.75, "data/chance/color": 0.5}
    assert all(maybe_metric(key) for key in val_reference_metrics(labels))  # the contract
    assert val_reference_metrics({"shape": np.array([], dtype=np.int64)}) == {}


def test_chance_and_resolution_lines_on_the_leaderboard_and_the_parent_run(
        sweep_uri: str, tmp_path: Path) -> None:
    uri = sweep_uri
    board = build_leaderboard(uri, "honest")
    # Chance: majority share per attribute, their mean read against val/linear/mean.
    assert ("chance (majority class on val): color 0.25, shape 0.5; mean 0.375"
            in board.notes[0])
    # 2·sqrt(0.8·0.2/300) = 0.0462: the winner's 0.8 resolves differences of about 0.046.
    assert board.notes[1] == ("val has 300 images: differences in val/linear/mean under 0.046 "
                              "are within noise (2 binomial standard errors at 0.8)")
    client = mlflow_client(uri)
    table = trial_table(trial_runs(client, client.get_experiment_by_name("honest")
                                   .experiment_id, None), OBJECTIVE, "max")
    write_csv(table, tmp_path / "leaderboard.csv")
    with (tmp_path / "leaderboard.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["rank"] for row in rows] == ["1", "2", "3", "baseline"]
    assert rows[-1]["trial"] == "at init" and float(rows[-1][OBJECTIVE]) == 0.41
    note = markdown_summary(table, "honest")
    assert "Chance (majority class on val): color 0.25" in note
    assert "Val has 300 images: differences in val/linear/mean under 0.046" in note
    assert "Random init (the same backbone untrained, the same probes): 0.41." in note


def test_noise_level_formula_and_bad_arguments() -> None:
    assert noise_level(0.5, 100) == pytest.approx(0.1)
    assert noise_level(1.0, 10) == 0.0
    assert resolution_line("val/linear/mean", 0.5, 100) == (
        "val has 100 images: differences in val/linear/mean under 0.1 are within noise (2 "
        "binomial standard errors at 0.5)")
    assert resolution_line("train/loss", 3.2, 100) is None  # a loss is no share
    assert resolution_line("val/linear/mean", 0.5, None) is None  # an older trial's runs
    with pytest.raises(ValueError, match="count must be >= 1"):
        noise_level(0.5, 0)
    with pytest.raises(ValueError, match=r"accuracy must be in \[0, 1\]"):
        noise_level(1.5, 10)


def test_baseline_row_under_the_ranked_trials(
        sweep_uri: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    uri = sweep_uri
    board = build_leaderboard(uri, "honest")
    assert [row[1] for row in board.rows] == ["t01 lr=0.1", "t02 lr=0.3", "t03 lr=0.5"]
    assert board.baseline is not None
    by_column = dict(zip(board.header, board.baseline, strict=True))
    assert by_column["trial"] == "at init" and by_column["status"] == "baseline"
    assert by_column[OBJECTIVE] == "0.41" and by_column["val/linear/shape"] == "0.52"
    assert by_column["train.lr"] == "-" and by_column["test/linear/mean"] == "-"
    monkeypatch.setenv("COLUMNS", "200")
    assert leaderboard_main(["--experiment", "honest", "--tracking-uri", uri]) == 0
    printed = capsys.readouterr().out.splitlines()
    (row,) = [line for line in printed if "at init" in line]
    assert row.split()[1:5] == ["at", "init", "baseline", "0.41"]


def test_a_stopped_trial_beside_the_winner_at_the_same_epoch(sweep_uri: str) -> None:
    board = build_leaderboard(sweep_uri, "honest")
    status = {row[1]: row[2] for row in board.rows}
    # Stopped at 3, between the winner's evaluations at 2 and 4: its last one before.
    assert status == {"t01 lr=0.1": "completed", "t02 lr=0.3": "stopped at 2 (winner at 2: 0.5)",
                      "t03 lr=0.5": "stopped at 3 (winner at 3: 0.5)"}


def test_value_at_step_reads_the_last_value_at_or_before() -> None:
    history = [(4, 0.6), (2, 0.5), (8, 0.8)]
    assert value_at_step(history, 2) == 0.5
    assert value_at_step(history, 7) == 0.6
    assert value_at_step(history, 1) is None
    assert value_at_step([(2, math.nan)], 2) is None
    assert stopped_note(2, None) == "stopped at 2"


def test_searched_keys_kept_when_the_terminal_is_narrow() -> None:
    header = ["#", "trial", "status", OBJECTIVE, "test/linear/mean", "diag/effective_rank",
              "simclr.temperature", "train.lr", "val/linear/color"]
    rows = [["1", "t01", "completed", "0.5123", "0.5012", "34.48", "0.2419", "0.002551",
             "0.99"]]
    cut = format_table(header, rows, width=70, keep=["simclr.temperature", "train.lr"])
    first = cut.splitlines()[0].split()
    assert first == ["#", "trial", "status", OBJECTIVE, "simclr.temperature", "train.lr"]
    assert all(len(line) <= 70 for line in cut.splitlines())
    assert cut.splitlines()[-1].startswith("3 more column(s) in leaderboard.csv and MLflow")
    wide = format_table(header, rows, width=200, keep=["train.lr"])
    assert "val/linear/color" in wide.splitlines()[0]  # room for all: nothing left out
    # Without keep, the right-most columns go first, searched or not (the old behaviour).
    assert "train.lr" not in format_table(header, rows, width=70).splitlines()[0]


def test_columns_wide_and_attributes_flags(
        sweep_uri: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    uri = sweep_uri
    base = ["--experiment", "honest", "--tracking-uri", uri]
    monkeypatch.setenv("COLUMNS", "60")
    assert leaderboard_main(base) == 0
    narrow = _header(capsys)
    assert narrow == ["#", "trial", "status", OBJECTIVE, "simclr.temperature", "train.lr"]
    assert leaderboard_main([*base, "--wide"]) == 0
    wide = _header(capsys)
    # --wide: every column but the per-attribute ones, whatever the width.
    assert "diag/effective_rank" in wide and "test/linear/mean" in wide
    assert "val/linear/shape" not in wide and "simclr.temperature" in wide
    assert leaderboard_main([*base, "--wide", "--attributes"]) == 0
    assert {"val/linear/shape", "test/linear/color"} <= set(_header(capsys))
    assert leaderboard_main([*base, "--columns", "diag/effective_rank", "--wide"]) == 0
    assert _header(capsys) == ["#", "trial", "status", OBJECTIVE, "simclr.temperature",
                               "train.lr", "diag/effective_rank"]
    assert leaderboard_main([*base, "--columns", "val/nothing"]) == 2
    assert "--columns: no column 'val/nothing'" in capsys.readouterr().err


def _header(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The printed table's header row, as words."""
    lines = capsys.readouterr().out.splitlines()
    return next(line for line in lines if line.startswith("#  ")).split()


def test_eval_baseline_is_on_by_default_and_says_what_it_costs() -> None:
    config = CoreConfig.model_validate({"name": "x"})
    assert config.eval.baseline is True
    description = type(config.eval).model_fields["baseline"].description or ""
    assert "Once per sweep" in description and "one Ray task per sweep" in description
    assert CoreConfig.model_validate({"name": "x", "eval": {"baseline": False}}).eval.baseline \
        is False


@pytest.fixture(scope="module")
def parent_sweep(sweep_uri: str) -> str:
    """Experiment ``honest-parent`` in the same store: a sweep whose baseline is on its parent
    run (raycl.sweep.baseline: 0.3, with chance and the val size, and model.width searched), and
    one trial that also reported a baseline of its own (0.41, as an older raycl's did) but no
    chance; returns the tracking URI."""
    client = mlflow_client(sweep_uri)
    experiment = client.create_experiment("honest-parent")
    parent = client.create_run(experiment, tags={
        ROLE_TAG: "sweep", "raycl.metric": OBJECTIVE, "raycl.mode": "max",
        BASELINE_SCOPE_TAG: "model.width=32"}).info.run_id
    for key, value in {baseline_metric(OBJECTIVE): 0.3, "data/chance/shape": 0.5,
                       "data/val_size": 200.0}.items():
        client.log_metric(parent, key, value)
    run_id = client.create_run(experiment, run_name="t01 width=64", tags={
        ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: "t01", ENDED_TAG: "completed",
        "raycl.searched": "model.width=64"}).info.run_id
    for key, value in {OBJECTIVE: 0.7, baseline_metric(OBJECTIVE): 0.41}.items():
        client.log_metric(run_id, key, value, step=2)
    client.set_terminated(run_id)  # completed: FINISHED, as the callback closes it
    return sweep_uri


def test_the_parent_runs_baseline_is_read_before_the_trials(parent_sweep: str) -> None:
    board = build_leaderboard(parent_sweep, "honest-parent")
    assert board.baseline is not None
    by_column = dict(zip(board.header, board.baseline, strict=True))
    assert by_column["trial"] == "at init" and by_column[OBJECTIVE] == "0.3"
    # A searched model.* key: the row is the base configuration's network, and it says so.
    assert board.notes[0] == ("at init: the base configuration's backbone (model.width=32), "
                              "untrained; those keys are searched, so a trial of other values "
                              "started from another network")
    assert board.notes[1].startswith("chance (majority class on val): shape 0.5;")
    assert board.notes[2].startswith("val has 200 images:")
    client = mlflow_client(parent_sweep)
    experiment = client.get_experiment_by_name("honest-parent").experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`{ROLE_TAG}` = 'sweep'")
    children = trial_runs(client, experiment, parent.info.run_id)
    note = markdown_summary(trial_table(children, OBJECTIVE, "max", parent=parent), "p")
    assert "Random init (the same backbone untrained, the same probes): 0.3." in note
    assert "At init: the base configuration's backbone (model.width=32)" in note
    # Without the parent (an older raycl's sweep): the trials' own reports.
    assert trial_table(children, OBJECTIVE, "max").baseline == {OBJECTIVE: 0.41}


def test_the_plot_draws_chance_and_the_untrained_backbone(sweep_uri: str) -> None:
    from raycl.tracking.leaderboard_plot import leaderboard_figure

    client = mlflow_client(sweep_uri)
    runs = trial_runs(client, client.get_experiment_by_name("honest").experiment_id, None)
    axis = leaderboard_figure(trial_table(runs, OBJECTIVE, "max")).axes[0]
    levels = {line.get_label(): line.get_ydata()[0] for line in axis.get_lines()}
    assert levels == {"chance": 0.375, "at init": 0.41}


# A multi-objective sweep where the trials that did not finish look best by their last values.
COST = "perf/device_hours"
OBJECTIVES = [(OBJECTIVE, "max"), (COST, "min")]


@pytest.fixture(scope="module")
def unranked_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Experiment ``unranked`` (objectives val/linear/mean max, device hours min): t01 and t02
    completed (0.60 for 1.0 device hours, 0.70 for 2.0); t03 diverged at 35 % of t02's cost
    with the best last objective (0.90 for 0.7, FAILED); t04 still runs at 5 % (0.65 for 0.1,
    RUNNING, no ending yet). Each has the ``config.yaml`` and checkpoint tag find_trials reads.
    Returns the tracking URI."""
    from tests.finished_sweep import trial_config

    tmp = tmp_path_factory.mktemp("unranked")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = mlflow_client(uri)
    experiment_id = client.create_experiment("unranked")
    parent = client.create_run(experiment_id, tags={
        ROLE_TAG: "sweep", "raycl.metric": OBJECTIVE, "raycl.mode": "max",
        "raycl.objectives": f"{OBJECTIVE}:max,{COST}:min"}).info.run_id
    for name, objective, cost, ended, status in (
            ("t01 lr=0.1", 0.60, 1.0, "completed", "FINISHED"),
            ("t02 lr=0.2", 0.70, 2.0, "completed", "FINISHED"),
            ("t03 lr=0.3", 0.90, 0.7, "diverged", "FAILED"),
            ("t04 lr=0.4", 0.65, 0.1, None, "RUNNING")):
        lr = float(name.split("=")[1])
        tags = {ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: name[:3],
                "raycl.searched": f"train.lr={lr}", CHECKPOINT_TAG: str(tmp / name[:3]),
                **({ENDED_TAG: ended} if ended else {})}
        run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        client.log_metric(run_id, OBJECTIVE, objective, step=2)
        client.log_metric(run_id, COST, cost, step=2)
        path = tmp / name[:3] / "config.yaml"
        path.parent.mkdir(parents=True)
        path.write_text(yaml.safe_dump(trial_config(tmp, lr, "resnet18", "unranked").to_dict(),
                                       sort_keys=False))
        client.log_artifact(run_id, str(path))
        if status != "RUNNING":
            client.set_terminated(run_id, status=status)
    return uri


@pytest.mark.parametrize(("ended", "status", "ranked"), [
    ("completed", "FINISHED", True), ("stopped_by_scheduler", "FINISHED", True),
    (None, "FINISHED", True),  # a sweep logged before raycl.ended: as completed
    ("completed", "RUNNING", False),  # tagged, not closed yet
    (None, "RUNNING", False), ("diverged", "FAILED", False), ("error", "FAILED", False),
    ("error", "FINISHED", False), ("skipped", "KILLED", False), ("interrupted", "KILLED", False),
    ("lost", "KILLED", False),
])
def test_only_finished_trials_that_completed_or_were_stopped_may_be_ranked(
        ended: str | None, status: str, ranked: bool) -> None:
    run = SimpleNamespace(info=SimpleNamespace(status=status), data=SimpleNamespace(
        tags={ENDED_TAG: ended} if ended else {}))
    assert rankable(run) is ranked  # type: ignore[arg-type]


def test_failed_and_running_trials_are_listed_but_never_ranked(
        unranked_uri: str, tmp_path: Path) -> None:
    from raycl.results.trials import find_trials

    client = mlflow_client(unranked_uri)
    children = trial_runs(client, client.get_experiment_by_name("unranked").experiment_id, None)
    name = {run.info.run_id: (run.info.run_name or "")[:3] for run in children}
    assert sorted(name[run.info.run_id] for run in children if rankable(run)) == ["t01", "t02"]
    # By their last values t03 and t04 would dominate both completed trials.
    assert {name[run_id] for run_id in front_run_ids(children, OBJECTIVES)} == {"t01", "t02"}
    table = trial_table(children, OBJECTIVE, "max")
    best = table.best()
    assert best is not None and name[best.info.run_id] == "t02"
    assert "Best so far: **t02 lr=0.2** (0.7" in markdown_summary(table, "unranked")
    # leaderboard.csv lists all four; the two that did not finish have no rank, their ending.
    write_csv(table, tmp_path / "leaderboard.csv")
    with (tmp_path / "leaderboard.csv").open() as handle:
        rows = [(row["rank"], row["trial"][:3], row["status"]) for row in csv.DictReader(handle)]
    assert rows == [("1", "t02", "completed"), ("2", "t01", "completed"),
                    ("-", "t03", "diverged"), ("-", "t04", "running")]
    # The terminal's leaderboard: the front marked and first, the other two under it, unranked.
    board = build_leaderboard(unranked_uri, "unranked")
    pareto = board.header.index("pareto")
    assert [(row[0], row[1][:3], row[2], row[pareto]) for row in board.rows] == [
        ("1", "t02", "completed", "*"), ("2", "t01", "completed", "*"),
        ("-", "t03", "diverged", ""), ("-", "t04", "running", "")]
    assert "Pareto front on val/linear/mean (max), perf/device_hours (min): 2 of 2 trial(s)" \
        in board.title and "2 not ranked" in board.title
    # --trial best, --top and the warm start: the best completed trial, never t03 or t04.
    (found,) = find_trials(unranked_uri, "unranked", "best")
    assert found.label == "t02"
    assert [trial.label for trial in find_trials(unranked_uri, "unranked", top=4)] == \
        ["t02", "t01"]
    # The front as the sweep logs it: the description's section and each run's raycl.pareto.
    config = SimpleNamespace(tune=SimpleNamespace(objectives=[
        SimpleNamespace(metric=metric, mode=mode) for metric, mode in OBJECTIVES]))
    section = log_pareto(client, children[0].data.tags[PARENT_TAG], children, config)
    assert "2 of 2 trial(s) that finished and reported every objective" in section
    assert {name[run.info.run_id]: client.get_run(run.info.run_id).data.tags[PARETO_TAG]
            for run in children} == {"t01": "true", "t02": "true", "t03": "false",
                                     "t04": "false"}


def test_trial_runs_reads_every_page_of_a_sweep(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """7 trials (and a confirmation seed, another sweep's trial) read 3 runs a page, from a
    store that returns at most 3 runs a search: all 7, newest first, none twice. One
    ``search_runs`` call of 5 000 (the old read) cut a larger sweep's leaderboard and front."""
    from raycl.sweep.confirmation import CONFIRM_TAG
    from raycl.tracking import runs as runs_module

    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("paged")
    parent, other = (client.create_run(experiment, tags={ROLE_TAG: "sweep"}).info.run_id
                     for _ in range(2))
    made = [client.create_run(experiment, start_time=1000 + i, tags={
        ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: f"t{i}"}).info.run_id for i in range(7)]
    client.create_run(experiment, tags={ROLE_TAG: "trial", PARENT_TAG: parent,
                                        CONFIRM_TAG: "1"})
    client.create_run(experiment, tags={ROLE_TAG: "trial", PARENT_TAG: other})
    search_runs = client.search_runs
    pages: list[int] = []

    def capped(*args: object, **kwargs: object) -> object:  # a store's largest page: 3 runs
        kwargs["max_results"] = min(int(kwargs.get("max_results", 1000)), 3)  # type: ignore[arg-type]
        page = search_runs(*args, **kwargs)
        pages.append(len(page))
        return page

    monkeypatch.setattr(client, "search_runs", capped)
    monkeypatch.setattr(runs_module, "SEARCH_PAGE_SIZE", 3)
    found = trial_runs(client, experiment, parent)
    assert [run.info.run_id for run in found] == made[::-1]  # newest first, as MLflow orders
    assert len(pages) == 3  # 3 + 3 + 2 (the confirmation run is filtered after the search)
    confirmation = trial_runs(client, experiment, parent, confirmation=True)
    assert len(confirmation) == 1 and CONFIRM_TAG in confirmation[0].data.tags
