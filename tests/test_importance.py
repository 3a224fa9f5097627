"""Which knobs mattered: parameter importance over a sweep's finished trials
(:mod:`raycl.tracking.importance`), and the parent run's ``importance.csv``/``importance.png``
written with the leaderboard. No Ray: the callback's leaderboard hook runs against a real
MLflow store in ``tmp_path``."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from raycl.config.schema import Domain
from raycl.config.search_config import search_config_class
from raycl.tracking.callback import MLflowSweepCallback
from raycl.tracking.importance import (
    CSV_HEADER,
    IMPORTANCE_TAG,
    ScoredTrial,
    importance_line,
    log_knobs,
    on_search_scale,
    optuna_distributions,
    param_importance,
    required_trials,
    scaled_params,
    scored_trials,
    sweep_importance,
    trials_for_importance,
    write_importance_csv,
)
from raycl.tracking.runs import ENDED_TAG, NOTE_TAG, PARENT_TAG, ROLE_TAG, TRIAL_TAG
from raycl.tracking.trial_table import print_leaderboard

METRIC = "val/linear/mean"
SPACE = {"train.lr": Domain(loguniform=(1e-4, 1e-1)),
         "simclr.temperature": Domain(uniform=(0.1, 0.5)),
         "model.backbone": Domain(choice=["small_cnn", "resnet18"])}


def _trials(count: int, seed: int = 0) -> list[ScoredTrial]:
    """Trials whose objective is the learning rate's decade, nearly nothing of the others."""
    rng = random.Random(seed)
    trials = []
    for _ in range(count):
        params = {"train.lr": 10 ** rng.uniform(-4, -1),
                  "simclr.temperature": rng.uniform(0.1, 0.5),
                  "model.backbone": rng.choice(["small_cnn", "resnet18"])}
        objective = 0.5 + 0.1 * math.log10(params["train.lr"]) \
            + 0.001 * params["simclr.temperature"]
        trials.append(ScoredTrial(params, objective, stopped_early=False))
    return trials


@pytest.mark.parametrize("evaluator", ["fanova", "ped_anova"])
def test_the_knob_the_objective_depends_on_ranks_first(evaluator: str) -> None:
    result = param_importance(_trials(16), SPACE, "max", seed=0, evaluator=evaluator)
    assert next(iter(result.importances)) == "train.lr"
    assert result.importances["train.lr"] > 0.7
    assert result.importances["simclr.temperature"] < 0.2
    assert math.isclose(sum(result.importances.values()), 1.0, rel_tol=1e-6)
    assert set(result.importances) == set(SPACE) and result.trials_used == 16


def test_importance_is_reproducible_with_the_seed_and_direction_free() -> None:
    trials = _trials(12, seed=3)
    first = param_importance(trials, SPACE, "max", seed=7)
    assert param_importance(trials, SPACE, "max", seed=7) == first
    # fANOVA decomposes the objective's variance: the same for its negation minimised.
    negated = [ScoredTrial(t.params, -t.objective, t.stopped_early) for t in trials]
    assert param_importance(negated, SPACE, "min", seed=7).importances == \
        pytest.approx(first.importances)


def test_search_space_maps_to_the_searchers_optuna_distributions() -> None:
    space = {**SPACE, "mcl.clusters": Domain(randint=(2, 10))}
    distributions = optuna_distributions(space)
    assert distributions["train.lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert distributions["simclr.temperature"] == FloatDistribution(0.1, 0.5)
    assert distributions["model.backbone"] == CategoricalDistribution(["small_cnn", "resnet18"])
    assert distributions["mcl.clusters"] == IntDistribution(2, 10)  # both ends included


def test_log_uniform_knobs_are_measured_on_their_log_scale() -> None:
    searched = optuna_distributions(SPACE)
    logged = log_knobs(searched)
    assert logged == {"train.lr"}
    scaled = on_search_scale(searched, logged)
    assert scaled["train.lr"] == FloatDistribution(-4.0, -1.0)
    assert scaled["simclr.temperature"] == searched["simclr.temperature"]
    params = scaled_params({"train.lr": 0.01, "model.backbone": "resnet18"}, logged)
    assert params == {"train.lr": pytest.approx(-2.0), "model.backbone": "resnet18"}


@pytest.mark.parametrize(("knobs", "needed"), [(0, 4), (1, 4), (3, 4), (4, 5), (7, 8)])
def test_required_trials(knobs: int, needed: int) -> None:
    assert required_trials(knobs) == needed


def test_required_trials_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError, match="knob_count"):
        required_trials(-1)


def test_csv_has_one_row_per_knob_most_important_first(tmp_path: Path) -> None:
    result = param_importance(_trials(10), SPACE, "max", seed=0)
    path = tmp_path / "importance.csv"
    write_importance_csv(result, path)
    with path.open() as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert tuple(reader.fieldnames or ()) == CSV_HEADER == (
        "knob", "importance", "evaluator", "trials_used", "stopped_early")
    assert [row["knob"] for row in rows] == list(result.importances)
    values = [float(row["importance"]) for row in rows]
    assert values == sorted(values, reverse=True)
    assert {(row["evaluator"], row["trials_used"], row["stopped_early"]) for row in rows} == \
        {("fanova", "10", "0")}


def _fake_run(params: dict[str, Any], objective: float | None,
              ended: str | None = "completed", **tags: str) -> Any:
    """What importance reads of an MLflow run: params (text), tags and last metrics."""
    metrics = {} if objective is None else {METRIC: objective}
    all_tags = {**({ENDED_TAG: ended} if ended else {}), **tags}
    return SimpleNamespace(data=SimpleNamespace(
        params={key: str(value) for key, value in params.items()}, tags=all_tags,
        metrics=metrics))


def _config(space: dict[str, dict] | None = None, tmp_path: Path | None = None) -> Any:
    raw: dict[str, Any] = {"name": "knobs", "method": "simclr", "seed": 5,
                           "train": {"epochs": 2},
                           "tune": {"metric": METRIC, "search_space": space or {}}}
    if tmp_path is not None:
        raw["mlflow"] = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    return search_config_class().model_validate(raw)


SPACE_RAW = {"train.lr": {"loguniform": [1e-4, 1e-1]},
             "simclr.temperature": {"uniform": [0.1, 0.5]},
             "model.backbone": {"choice": ["small_cnn", "resnet18"]}}


def test_only_finished_trials_with_a_finite_objective_count() -> None:
    params = {"train.lr": 0.01, "simclr.temperature": 0.2, "model.backbone": "resnet18"}
    runs = [_fake_run(params, 0.5), _fake_run(params, 0.4, "stopped_by_scheduler"),
            _fake_run(params, math.nan), _fake_run(params, None),
            _fake_run(params, 0.6, "interrupted"), _fake_run(params, 0.6, None),
            _fake_run(params, 0.9, **{"raycl.confirm": "1"}),  # a confirmation re-run
            _fake_run({**params, "model.backbone": "vit"}, 0.6)]  # not in the domain
    trials = scored_trials(runs, SPACE, METRIC)
    assert [(t.objective, t.stopped_early) for t in trials] == [(0.5, False), (0.4, True)]
    assert trials[0].params == params  # back in the domains' types


def test_no_importance_says_why() -> None:
    params = {"train.lr": 0.01, "simclr.temperature": 0.2, "model.backbone": "resnet18"}
    runs = [_fake_run(params, 0.5)] * 3 + [_fake_run(params, 0.5, "error")]
    assert sweep_importance(runs, _config(SPACE_RAW)) == \
        f"importance: needs ≥ 4 finished trials with {METRIC}, have 3"
    assert sweep_importance(runs, _config()).startswith("importance: nothing searched")
    # Four finished, all alike: no variance for fANOVA to apportion.
    assert sweep_importance([*runs[:3], _fake_run(params, 0.5)], _config(SPACE_RAW)) == \
        f"importance: all 4 finished trials scored 0.5 on {METRIC}; no knob made a difference"


def test_trials_asha_stopped_count_only_without_enough_full_runs() -> None:
    full, early = _trials(5), _trials(3, seed=1)
    early = [ScoredTrial(t.params, t.objective, stopped_early=True) for t in early]
    assert trials_for_importance(full + early, needed=4) == full
    mixed = trials_for_importance(full[:2] + early, needed=4)
    assert len(mixed) == 5
    line = importance_line(param_importance(mixed, SPACE, "max", seed=0))
    assert line.startswith("knobs that mattered (fANOVA over 5 trials, 3 stopped early by ASHA")


def _log_trial(client: MlflowClient, experiment_id: str, parent: str, index: int,
               params: dict[str, Any], objective: float) -> None:
    """A finished child run as the callback leaves it."""
    run = client.create_run(experiment_id, run_name=f"t{index:02d}", tags={
        PARENT_TAG: parent, ROLE_TAG: "trial", TRIAL_TAG: f"trial{index}",
        ENDED_TAG: "completed",
        "raycl.searched": ", ".join(f"{key}={value}" for key, value in params.items())})
    client.log_batch(run.info.run_id, metrics=[Metric(METRIC, objective, 0, 1)],
                     params=[Param(key, str(value)) for key, value in params.items()])
    client.set_terminated(run.info.run_id)


def test_parent_run_gets_importance_with_the_leaderboard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = MLflowSweepCallback(_config(SPACE_RAW, tmp_path))
    callback.setup()
    assert callback.parent_run_id is not None and callback.experiment_id is not None
    client = MlflowClient(tracking_uri=callback.tracking_uri)
    trials = _trials(6)
    for index, trial in enumerate(trials[:3], start=1):
        _log_trial(client, callback.experiment_id, callback.parent_run_id, index, trial.params,
                   trial.objective)
    callback._log_leaderboard()  # what every trial's end and the sweep's end call
    parent = client.get_run(callback.parent_run_id)
    artifacts = {entry.path for entry in client.list_artifacts(callback.parent_run_id)}
    assert "importance.csv" not in artifacts and "leaderboard.csv" in artifacts
    assert parent.data.tags[IMPORTANCE_TAG] == \
        f"importance: needs ≥ 4 finished trials with {METRIC}, have 3"

    for index, trial in enumerate(trials[3:], start=4):
        _log_trial(client, callback.experiment_id, callback.parent_run_id, index, trial.params,
                   trial.objective)
    callback._log_leaderboard()
    artifacts = {entry.path for entry in client.list_artifacts(callback.parent_run_id)}
    assert {"importance.csv", "importance.png"} <= artifacts
    with Path(client.download_artifacts(callback.parent_run_id, "importance.csv",
                                        str(tmp_path))).open() as handle:
        rows = list(csv.DictReader(handle))
    assert rows[0]["knob"] == "train.lr"
    assert {row["trials_used"] for row in rows} == {"6"}
    png = Path(client.download_artifacts(callback.parent_run_id, "importance.png",
                                         str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parent = client.get_run(callback.parent_run_id)
    line = parent.data.tags[IMPORTANCE_TAG]
    assert line.startswith("knobs that mattered (fANOVA over 6 trials): train.lr ")
    assert line in parent.data.tags[NOTE_TAG]  # the run's description names the top knobs
    monkeypatch.setenv("COLUMNS", "300")  # the line unwrapped
    print_leaderboard(callback.tracking_uri, "knobs")
    assert line in capsys.readouterr().out.splitlines()  # and so does the terminal's


def test_a_method_search_weighs_the_knobs_every_trial_reads() -> None:
    """Issue 47: a SimCLR trial has no hscl.filter_exponent. Importance is over method and the
    shared knobs, with every trial, and the line names the one-method knobs it left out."""
    import random

    import raycl.methods  # noqa: F401  (hscl's section)

    config = _config({"method": {"choice": ["simclr", "hscl"]},
                      "simclr.temperature": {"uniform": [0.1, 0.5]},
                      "hscl.filter_exponent": {"uniform": [0.0, 0.6]},
                      "train.lr": {"loguniform": [1e-4, 1e-1]}})
    rng = random.Random(0)
    runs = []
    for index in range(12):
        method = ("simclr", "hscl")[index % 2]
        own = {"simclr": {"simclr.temperature": rng.uniform(0.1, 0.5)},
               "hscl": {"hscl.filter_exponent": rng.uniform(0.0, 0.6)}}[method]
        runs.append(_fake_run({"method": method, "train.lr": 10 ** rng.uniform(-4, -1), **own},
                              (0.8 if method == "hscl" else 0.4) + rng.uniform(0, 0.01)))
    result = sweep_importance(runs, config)
    assert not isinstance(result, str), result
    assert set(result.importances) == {"method", "train.lr"} and result.trials_used == 12
    assert next(iter(result.importances)) == "method"  # the objective follows the method
