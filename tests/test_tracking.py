"""What MLflow records of a sweep: how a trial ended, decided from what the trial reported; what
a person reads in the UI (the experiment's kind, run names, the parent's leaderboard)."""

from __future__ import annotations

import csv
import json
import os
import pickle
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mlflow import MlflowClient

from raycl.config.schema import Domain
from raycl.config.search_config import search_config_class
from raycl.methods import SearchConfig
from raycl.tracking.callback import MLflowSweepCallback
from raycl.tracking.leaderboard_plot import leaderboard_figure
from raycl.tracking.naming import trial_run_name
from raycl.tracking.runs import EXPERIMENT_KIND_TAG, TRIAL_TAG, mlflow_ui_command
from raycl.tracking.trial_table import print_leaderboard, runs_page, trial_runs, trial_table


@dataclass
class StubTrial:
    """What the callback reads of a Tune trial."""

    trial_id: str
    config: dict
    last_result: dict
    error_file: str | None = None
    metric_analysis: dict = field(default_factory=dict)
    # Ray's "<n>_<values>": n numbers the trial in its sweep (the run name's t<n>).
    experiment_tag: str = ""
    status: str = "RUNNING"

    def __str__(self) -> str:
        return f"run_trial_{self.trial_id}"


@pytest.mark.parametrize(
    ("config", "last_result", "status", "ended", "stopped_at"),
    [
        # Tune marks a trial stopped by ASHA as done too: only the last stage and epoch tell.
        ({}, {"stage": 0, "epoch": 4, "global_epoch": 4, "done": True}, "FINISHED", "completed",
         None),
        # Stopped early by ASHA is no failure: FINISHED, with the tag and the epoch it stopped at.
        ({}, {"stage": 0, "epoch": 2, "global_epoch": 2, "done": True}, "FINISHED",
         "stopped_by_scheduler", 2.0),
        ({"train.epochs": 2}, {"stage": 0, "epoch": 2, "done": True}, "FINISHED", "completed",
         None),
        ({"mcl.stages": 2}, {"stage": 0, "epoch": 4, "global_epoch": 4, "done": True},
         "FINISHED", "stopped_by_scheduler", 4.0),
        # A restarted trial fast-forwards finished stages: few reports, yet complete.
        ({"mcl.stages": 2}, {"stage": 1, "epoch": 4, "training_iteration": 3, "done": True},
         "FINISHED", "completed", None),
        ({}, {"training_iteration": 1, "done": True, "raycl/skipped": 1.0}, "KILLED", "skipped",
         None),
        # A diverged trial is a failure (the loop reports it once, then stops the trial).
        ({}, {"stage": 0, "epoch": 1, "done": True, "raycl/failed": 1.0}, "FAILED", "diverged",
         None),
    ],
)
def test_trial_end_status(
    tmp_path: Path, config: dict, last_result: dict, status: str, ended: str,
    stopped_at: float | None,
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = SearchConfig.model_validate({"name": "ends", "method": "mcl", "train": {"epochs": 4},
                                         "mcl": {"stages": 1},
                                         "mlflow": {"tracking_uri": uri}})
    callback = MLflowSweepCallback(sweep)
    callback.setup()
    trial = StubTrial("t1", config, last_result)
    callback.on_trial_start(0, [], trial)
    callback.on_trial_complete(0, [], trial)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([callback.experiment_id], f"tags.`{TRIAL_TAG}` = 't1'")
    assert run.info.status == status and run.data.tags["raycl.ended"] == ended
    assert run.data.metrics.get("stopped_at_epoch") == stopped_at


def test_errored_trial_is_failed(tmp_path: Path) -> None:
    callback = MLflowSweepCallback(_sweep(tmp_path))
    callback.setup()
    trial = StubTrial("e1", {"seed": 0}, {"stage": 0, "epoch": 1})
    callback.on_trial_start(0, [], trial)
    callback.on_trial_error(0, [], trial)
    run = _run(callback, "e1")
    assert run.info.status == "FAILED" and run.data.tags["raycl.ended"] == "error"


# ---------------------------------------------------------------------------------------------
# What a person sees in the MLflow UI: the experiment's kind, run names, the parent's leaderboard


def _sweep(tmp_path: Path, space: dict | None = None, mode: str = "max", **sections: dict):
    """A validated sweep config logging to a fresh sqlite store under ``tmp_path``."""
    raw = {"name": "ui", "method": "simclr", "train": {"epochs": 2},
           "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
           "tune": {"mode": mode, "search_space": space or {}}, **sections}
    # The class of this moment: a test elsewhere rebuilds the registry's SearchConfig, and a
    # pickled callback (Tune's experiment state) names its config's class by import path.
    return search_config_class().model_validate(raw)


def _run(callback: MLflowSweepCallback, trial_id: str):
    (run,) = callback.client.search_runs([callback.experiment_id],
                                         f"tags.`{TRIAL_TAG}` = '{trial_id}'")
    return run


MCL_SPACE = {"mcl.clusters": {"choice": [2, 5, 10]}, "mcl.stages": {"choice": [1, 2, 3]},
             "simclr.temperature": {"loguniform": [0.1, 0.5]}}


@pytest.mark.parametrize(("before", "after"), [
    (None, "custom_model_development"),
    # A guess of MLflow's UI is replaced; a kind someone chose is kept.
    ("genai_development_inferred", "custom_model_development"),
    ("genai_development", "genai_development"),
])
def test_experiment_is_marked_as_model_training(
    tmp_path: Path, before: str | None, after: str
) -> None:
    config = _sweep(tmp_path, mode="min")
    client = MlflowClient(tracking_uri=config.mlflow.tracking_uri)
    if before is not None:  # the experiment exists already, re-used by the sweep
        experiment_id = client.create_experiment("ui")
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, before)
    callback = MLflowSweepCallback(config)
    callback.setup()
    tags = client.get_experiment(callback.experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == after
    assert tags["mlflow.experiment.primaryMetric.name"] == "objective"
    assert tags["mlflow.experiment.primaryMetric.greaterIsBetter"] == "False"


def test_experiment_gets_the_leaderboard_view_the_printed_link_opens(tmp_path: Path) -> None:
    config = _sweep(tmp_path, MCL_SPACE, method="mcl", mode="min")
    callback = MLflowSweepCallback(config)
    callback.setup()
    client = MlflowClient(tracking_uri=config.mlflow.tracking_uri)
    tags = client.get_experiment(callback.experiment_id).tags
    view = json.loads(tags["mlflow.sharedViewState.raycl-leaderboard"])
    # `objective` cannot be renamed in the UI: the metric it stands for is a column beside it.
    assert view == {"orderByKey": "metrics.`objective`", "orderByAsc": True,
                    "selectedColumns": ["metrics.`objective`", "metrics.`val/linear/mean`",
                                        "metrics.`objective_test`",
                                        *(f"params.`{key}`" for key in MCL_SPACE),
                                        "tags.`raycl.ended`", "metrics.`stopped_at_epoch`"]}
    # The UI drops a shared view whose link also carries search parameters.
    assert runs_page(callback.experiment_id, "min", with_view=True) == (
        f"#/experiments/{callback.experiment_id}/runs?workflowType=machine_learning"
        "&viewStateShareKey=raycl-leaderboard")


def test_child_run_name_says_what_was_tried(tmp_path: Path) -> None:
    config = _sweep(tmp_path, MCL_SPACE, method="mcl")
    callback = MLflowSweepCallback(config)
    callback.setup()
    # The order Ray's Optuna searcher hands values over (the tied K, N last), with Ray's number
    # of the trial in its experiment tag.
    trial = StubTrial("f1b9113e", {"simclr.temperature": 0.30972, "mcl.clusters": 5,
                                   "mcl.stages": 2}, {},
                      experiment_tag="3_mcl.clusters=5,mcl.stages=2,simclr.temperature=0.3097")
    callback.on_trial_start(0, [], trial)
    run = _run(callback, "f1b9113e")
    assert run.info.run_name == "t03 K=5 N=2 τ=0.31"
    assert run.data.tags["raycl.trial_index"] == "3"
    assert run.data.tags["raycl.searched"] == \
        "simclr.temperature=0.30972, mcl.clusters=5, mcl.stages=2"


def test_child_run_name_of_a_key_without_symbol(tmp_path: Path) -> None:
    """No symbol: the key's last component. No experiment tag: the counter of a variant
    generator's id; neither: the order trials appeared in."""
    space = {"nnclr.queue_size": {"choice": [512, 1024]}, "train.lr": {"loguniform": [1e-4, 1e-2]}}
    config = _sweep(tmp_path, space, method="nnclr")
    callback = MLflowSweepCallback(config)
    callback.setup()
    trials = [StubTrial("a1b2c_00007", {"train.lr": 0.000298, "nnclr.queue_size": 1024}, {}),
              StubTrial("0badcafe", {"train.lr": 0.00123, "nnclr.queue_size": 512}, {})]
    for trial in trials:
        callback.on_trial_start(0, [], trial)
    assert _run(callback, "a1b2c_00007").info.run_name == "t07 queue_size=1024 lr=3e-04"
    assert _run(callback, "0badcafe").info.run_name == "t02 queue_size=512 lr=0.0012"


@pytest.mark.parametrize(("values", "space", "name"), [
    # Values chosen from a list stay as written; two keys of one symbol get their section.
    ({"hscl.filter_exponent": 0.125}, {"hscl.filter_exponent": {"choice": [0.0, 0.125]}},
     "t01 p=0.125"),
    ({"mocov2.temperature": 0.2, "fgvr.temperature": 0.05}, {}, "t01 mocov2.τ=0.2 fgvr.τ=0.05"),
    ({"seed": 4}, {}, "t01 seed=4"),
    ({"all4one.eta": 123.4, "all4one.sigma": 0.5}, {"all4one.eta": {"loguniform": [1, 1000]},
                                                    "all4one.sigma": {"uniform": [0.2, 1]}},
     "t01 η=120 σ=0.5"),
])
def test_trial_run_name_formats(values: dict, space: dict, name: str) -> None:
    domains = {key: Domain.model_validate(domain) for key, domain in space.items()}
    assert trial_run_name(1, values, domains) == name


def test_trial_run_name_is_cut_at_mlflow_limit() -> None:
    values = {f"eval.key{i}": "x" * 40 for i in range(12)}
    name = trial_run_name(12, values, {})
    assert len(name) <= 250 and name.endswith(" …") and name.startswith("t12 key0=")
    assert "=x…" not in name  # cut between items, never inside one


def test_epoch_stage_and_objective_logged_per_epoch(tmp_path: Path) -> None:
    config = _sweep(tmp_path, method="mcl", mcl={"stages": 2})
    callback = MLflowSweepCallback(config)
    callback.setup()
    trial = StubTrial("t1", {}, {})
    callback.on_trial_start(0, [], trial)
    reports = [
        {"stage": 0, "epoch": 1, "global_epoch": 1, "train/loss": 2.0},
        {"stage": 0, "epoch": 2, "global_epoch": 2, "train/loss": 1.5, "val/linear/mean": 0.4},
        {"stage": 1, "epoch": 1, "global_epoch": 3, "train/loss": 1.0, "val/linear/mean": 0.6,
         "test/linear/mean": 0.55},
    ]
    for iteration, report in enumerate(reports, start=1):
        ray_keys = {"training_iteration": iteration, "time_this_iter_s": 0.1, "done": False,
                    "timestamp": 1_700_000_000 + iteration, "pid": 123}
        callback.on_trial_result(0, [], trial, {**report, **ray_keys})
    run = _run(callback, "t1")
    client = callback.client

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    assert history("epoch") == [(1, 1.0), (2, 2.0), (3, 1.0)]
    assert history("stage") == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert history("train/epoch") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert history("objective") == [(2, 0.4), (3, 0.6)]
    assert history("objective_test") == [(3, 0.55)]
    assert run.data.tags["raycl.objective"] == "val/linear/mean"
    assert not {"training_iteration", "time_this_iter_s", "done", "timestamp", "pid"} \
        & set(run.data.metrics)


def _finish(callback: MLflowSweepCallback, trial: StubTrial, values: dict) -> None:
    """Start a trial, report one final epoch with ``values``, complete it."""
    result = {"stage": 0, "epoch": 2, "global_epoch": 2, **values}
    trial.last_result = result
    callback.on_trial_start(0, [], trial)
    callback.on_trial_result(0, [], trial, result)
    callback.on_trial_complete(0, [], trial)


@pytest.mark.parametrize("mode", ["max", "min"])
def test_parent_leaderboard_after_two_trials(tmp_path: Path, mode: str) -> None:
    space = {"simclr.temperature": {"loguniform": [0.1, 0.5]}}
    # An earlier sweep in the same experiment: its trial is not on this sweep's leaderboard.
    earlier = MLflowSweepCallback(_sweep(tmp_path, space, mode))
    earlier.setup()
    _finish(earlier, StubTrial("old", {"simclr.temperature": 0.3}, {}, experiment_tag="1"),
            {"val/linear/mean": 0.99})

    callback = MLflowSweepCallback(_sweep(tmp_path, space, mode))
    callback.setup()
    low = StubTrial("aaaa0001", {"simclr.temperature": 0.12}, {}, experiment_tag="1_x")
    high = StubTrial("aaaa0002", {"simclr.temperature": 0.41}, {}, experiment_tag="2_x")
    _finish(callback, low, {"val/linear/mean": 0.4, "test/linear/mean": 0.35,
                            "val/linear/shape": 0.3})
    _finish(callback, high, {"val/linear/mean": 0.7, "test/linear/mean": 0.6,
                             "val/linear/shape": 0.5})
    client = callback.client
    parent = callback.parent_run_id
    assert {a.path for a in client.list_artifacts(parent)} >= {"leaderboard.csv",
                                                               "leaderboard.png"}
    folder = tmp_path / "downloaded"
    folder.mkdir()
    with Path(client.download_artifacts(parent, "leaderboard.csv", str(folder))).open() as f:
        rows = list(csv.DictReader(f))
    best, worst = ("t02 τ=0.41", "t01 τ=0.12") if mode == "max" else ("t01 τ=0.12", "t02 τ=0.41")
    assert [row["trial"] for row in rows] == [best, worst]
    assert [row["rank"] for row in rows] == ["1", "2"]
    by_name = {row["trial"]: row for row in rows}
    assert by_name["t02 τ=0.41"]["trial_id"] == "aaaa0002"
    assert by_name["t02 τ=0.41"]["status"] == "completed"
    assert float(by_name["t02 τ=0.41"]["val/linear/mean"]) == 0.7
    assert float(by_name["t01 τ=0.12"]["test/linear/mean"]) == 0.35
    assert by_name["t01 τ=0.12"]["simclr.temperature"] == "0.12"
    assert float(by_name["t01 τ=0.12"]["val/linear/shape"]) == 0.3
    png = Path(client.download_artifacts(parent, "leaderboard.png", str(folder)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    note = client.get_run(parent).data.tags["mlflow.note.content"]
    assert f"Best so far: **{best}**" in note and "`val/linear/mean` (" + mode + ")" in note


def test_leaderboard_rewritten_at_experiment_end(tmp_path: Path) -> None:
    """A trial still running when the driver stops is on the parent's last leaderboard."""
    callback = MLflowSweepCallback(_sweep(tmp_path))
    callback.setup()
    done = StubTrial("d1", {"seed": 0}, {}, experiment_tag="0_seed=0", status="TERMINATED")
    _finish(callback, done, {"val/linear/mean": 0.5})
    running = StubTrial("r1", {"seed": 1}, {}, experiment_tag="1_seed=1", status="RUNNING")
    callback.on_trial_start(0, [], running)
    callback.on_experiment_end([done, running])
    folder = tmp_path / "downloaded"
    folder.mkdir()
    path = callback.client.download_artifacts(callback.parent_run_id, "leaderboard.csv",
                                              str(folder))
    with Path(path).open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["trial"], row["status"]) for row in rows] == [("t00 seed=0", "completed"),
                                                              ("t01 seed=1", "interrupted")]
    assert _run(callback, "r1").info.status == "KILLED"  # resumed by the same command


def test_the_sweeps_best_trial_is_never_one_that_diverged(tmp_path: Path) -> None:
    """The parent's ``best/`` metrics and ``raycl.best_trial``/``best_run`` name the best trial
    that may be ranked: a diverged trial's higher last objective came from part of its
    training, and its leaderboard row has no rank."""
    callback = MLflowSweepCallback(_sweep(tmp_path))
    callback.setup()
    trials = [StubTrial(trial_id, {"seed": seed}, {}, experiment_tag=f"{seed}_seed={seed}",
                        status="TERMINATED", metric_analysis={"val/linear/mean": {"last": value}})
              for trial_id, seed, value in (("d1", 0, 0.5), ("x1", 1, 0.9))]
    _finish(callback, trials[0], {"val/linear/mean": 0.5})
    _finish(callback, trials[1], {"val/linear/mean": 0.9, "raycl/failed": 1.0})  # diverged
    callback.on_experiment_end(trials)
    parent = callback.client.get_run(callback.parent_run_id)
    assert parent.data.tags["raycl.best_trial"] == "d1"
    assert parent.data.tags["raycl.best_run"] == _run(callback, "d1").info.run_id
    assert parent.data.metrics["best/val/linear/mean"] == 0.5
    folder = tmp_path / "downloaded"
    folder.mkdir()
    path = callback.client.download_artifacts(callback.parent_run_id, "leaderboard.csv",
                                              str(folder))
    with Path(path).open() as f:
        rows = [(row["rank"], row["trial"], row["status"]) for row in csv.DictReader(f)]
    assert rows == [("1", "t00 seed=0", "completed"), ("-", "t01 seed=1", "diverged")]
    assert "Best so far: **t00 seed=0**" in parent.data.tags["mlflow.note.content"]


def _table(tmp_path: Path, space: dict, trials: list[tuple[dict, float | None]], mode="max"):
    config = _sweep(tmp_path, space, mode)
    callback = MLflowSweepCallback(config)
    callback.setup()
    for i, (values, objective) in enumerate(trials, start=1):
        trial = StubTrial(f"t{i}", values, {}, experiment_tag=str(i))
        _finish(callback, trial, {} if objective is None else {"val/linear/mean": objective})
    children = trial_runs(callback.client, callback.experiment_id, callback.parent_run_id)
    return trial_table(children, "val/linear/mean", mode), config.tune.search_space


def test_leaderboard_plot_axes(tmp_path: Path) -> None:
    space = {"train.lr": {"loguniform": [1e-4, 1e-2]}, "train.optimizer": {"choice": ["adamw",
                                                                                      "sgd"]},
             "simclr.temperature": {"uniform": [0.1, 0.5]}}
    table, domains = _table(tmp_path, space, [
        ({"train.lr": 1e-4, "train.optimizer": "sgd", "simclr.temperature": 0.2}, 0.3),
        ({"train.lr": 5e-3, "train.optimizer": "adamw", "simclr.temperature": 0.4}, 0.6),
        ({"train.lr": 1e-3, "train.optimizer": "sgd", "simclr.temperature": 0.3}, None),
    ])
    figure = leaderboard_figure(table, domains)
    lr, optimizer, temperature = figure.axes[:3]
    assert lr.get_xscale() == "log" and temperature.get_xscale() == "linear"
    assert lr.get_xlabel() == "lr (train.lr)" and temperature.get_xlabel().startswith("τ ")
    assert [tick.get_text() for tick in optimizer.get_xticklabels()] == ["adamw", "sgd"]
    trials, best = lr.collections  # every trial that reported the objective, then the best
    assert len(trials.get_offsets()) == 2
    assert tuple(best.get_offsets()[0]) == (5e-3, 0.6)
    assert "val/linear/mean (max)" in figure.get_suptitle()


def test_leaderboard_plot_without_search_space(tmp_path: Path) -> None:
    table, domains = _table(tmp_path, {}, [({"seed": 0}, 0.5), ({"seed": 1}, 0.2)], mode="min")
    figure = leaderboard_figure(table, domains)
    (axis,) = [axis for axis in figure.axes if axis.get_visible()]
    assert axis.get_xlabel() == "trial index"
    _, best = axis.collections
    assert tuple(best.get_offsets()[0]) == (2, 0.2)  # mode min: the second trial is best


def test_restored_sweep_keeps_run_names(tmp_path: Path) -> None:
    config = _sweep(tmp_path, MCL_SPACE, method="mcl")
    callback = MLflowSweepCallback(config)
    callback.setup()
    values = {"mcl.clusters": 5, "mcl.stages": 2, "simclr.temperature": 0.31}
    callback.on_trial_start(0, [], StubTrial("f1b9113e", values, {}, experiment_tag="3_k"))
    # Tune pickled the callback before the trial started; the restored driver meets the trial
    # again, and could not number it the same way.
    restored = pickle.loads(pickle.dumps(callback))
    restored._children = {}
    restored.setup()
    restored.on_trial_start(0, [], StubTrial("f1b9113e", values, {}))
    runs = restored.client.search_runs([restored.experiment_id],
                                       f"tags.`{TRIAL_TAG}` = 'f1b9113e'")
    assert [run.info.run_name for run in runs] == ["t03 K=5 N=2 τ=0.31"]
    assert restored.parent_run_id == callback.parent_run_id


def test_a_run_its_killed_driver_left_undescribed_is_completed_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL between creating a trial's run and logging its params: the resumed driver
    re-attaches to that run and gives it its params, config.yaml and searched values."""
    config = _sweep(tmp_path, MCL_SPACE, method="mcl")
    callback = MLflowSweepCallback(config)
    callback.setup()
    values = {"mcl.clusters": 5, "mcl.stages": 2, "simclr.temperature": 0.31}

    def killed(*args: object) -> None:
        raise KeyboardInterrupt  # the driver's end, right after create_run

    monkeypatch.setattr(MLflowSweepCallback, "_describe_trial_run", killed)
    with pytest.raises(KeyboardInterrupt):
        callback.on_trial_start(0, [], StubTrial("f1b9113e", values, {}, experiment_tag="3_k"))
    monkeypatch.undo()
    restored = pickle.loads(pickle.dumps(callback))
    restored._children = {}
    restored.setup()
    restored.on_trial_start(0, [], StubTrial("f1b9113e", values, {}))
    (run,) = restored.client.search_runs([restored.experiment_id],
                                         f"tags.`{TRIAL_TAG}` = 'f1b9113e'")
    assert run.data.params["mcl.clusters"] == "5" and run.data.params["seed"] == "0"
    assert run.data.tags["raycl.searched"] == \
        "mcl.clusters=5, mcl.stages=2, simclr.temperature=0.31"
    assert [a.path for a in restored.client.list_artifacts(run.info.run_id)] == ["config.yaml"]


def test_parent_params_are_what_every_trial_shares(tmp_path: Path) -> None:
    """A searched key's default is used by no trial: the parent logs its domain instead."""
    callback = MLflowSweepCallback(_sweep(tmp_path, MCL_SPACE, method="mcl"))
    callback.setup()
    parent = callback.client.get_run(callback.parent_run_id)
    params = parent.data.params
    assert not {"mcl.clusters", "mcl.stages", "simclr.temperature", "tune.search_space"} & \
        set(params)
    assert params["search_space.mcl.clusters"] == "choice [2, 5, 10]"
    assert params["search_space.simclr.temperature"] == "loguniform [0.1, 0.5]"
    assert params["train.epochs"] == "2" and params["seed"] == "0"
    assert parent.data.tags["raycl.objective"] == "val/linear/mean, max"


@pytest.mark.parametrize(("num_samples", "seed_param", "seed_domain"),
                         [(3, None, "grid [0, 1, 2]"), (1, "0", None)])
def test_parent_params_of_seed_repeats(
    tmp_path: Path, num_samples: int, seed_param: str | None, seed_domain: str | None
) -> None:
    """Nothing searched: the trials differ by seed alone, when there are several."""
    config = _sweep(tmp_path)
    config.tune.num_samples = num_samples
    callback = MLflowSweepCallback(config)
    callback.setup()
    params = callback.client.get_run(callback.parent_run_id).data.params
    assert params.get("seed") == seed_param
    assert params.get("search_space.seed") == seed_domain


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_ui_command_runs_from_the_users_shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The venv's own script when the venv is not activated, plain ``mlflow`` when it is,
    ``python -m mlflow`` with this interpreter when there is no script."""
    uri = "sqlite:///mlflow.db"
    monkeypatch.chdir(tmp_path)
    python = _executable(tmp_path / ".venv" / "bin" / "python")
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert mlflow_ui_command(uri) == f".venv/bin/python -m mlflow ui --backend-store-uri {uri}"
    _executable(tmp_path / ".venv" / "bin" / "mlflow")
    assert mlflow_ui_command(uri) == f".venv/bin/mlflow ui --backend-store-uri {uri}"
    monkeypatch.setenv("PATH", f"{tmp_path / '.venv' / 'bin'}:/usr/bin:/bin")
    assert mlflow_ui_command(uri) == f"mlflow ui --backend-store-uri {uri}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert mlflow_ui_command(uri).startswith(f"{tmp_path}/.venv/bin/mlflow ui ")


def test_printed_ui_hint_runs_as_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hint under the leaderboard, run as printed (with ``--help``) from a shell whose PATH
    does not hold the venv, and the link into the leaderboard view."""
    _table(tmp_path, {}, [({"seed": 0}, 0.5)])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    print_leaderboard(uri, "ui")
    printed = capsys.readouterr().out.splitlines()
    (hint,) = [line for line in printed if " ui --backend-store-uri " in line]
    assert hint == mlflow_ui_command(uri)
    assert any(line.startswith("then open http://127.0.0.1:5000/#/experiments/")
               and line.endswith("viewStateShareKey=raycl-leaderboard") for line in printed)
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run([*shlex.split(hint), "--help"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0 and "--backend-store-uri" in done.stdout, done.stderr[-2000:]
