"""``tune.compare`` (issue 47): each compared value gets an equal budget, a searcher of its own
and ASHA rungs of its own, then its best configuration is confirmed over paired seeds; seed
repeats answer with a mean and interval. No Ray session: the searcher and scheduler are driven
directly."""

from __future__ import annotations

import csv
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_comparing_methods import METHOD_SEARCH, QUICKSTART

from raycl.config.schema import ConfigError
from raycl.launch.load import load_search
from raycl.sweep.compare import PerValueScheduler, PerValueSearch
from raycl.sweep.repeats import REPEATS_TAG, is_seed_repeat, report_repeats
from raycl.sweep.tuner import tuner_search
from raycl.tracking.runs import mlflow_client

REPO = Path(__file__).resolve().parents[1]
COMPARE = ["tune.compare=method", "tune.num_samples=8"]
ASHA = ["tune.scheduler.type=asha", "tune.scheduler.grace_period=1",
        "tune.scheduler.reduction_factor=2"]


@dataclass(eq=False)
class FakeTrial:
    """What ASHA reads of a Tune trial: its id and config (hashable by identity)."""

    trial_id: str
    config: dict[str, Any] = field(default_factory=dict)


def _drive(searcher: PerValueSearch, metric: str, count: int) -> list[dict | str | None]:
    rng = random.Random(0)
    suggested = []
    for index in range(count):
        params = searcher.suggest(f"t{index}")
        suggested.append(params)
        if isinstance(params, dict):
            searcher.on_trial_complete(f"t{index}", {metric: rng.random()})
    return suggested


@pytest.mark.parametrize("kind", ["optuna", "random"])
def test_each_compared_method_gets_the_same_budget_and_its_own_knobs(kind: str) -> None:
    config = load_search(QUICKSTART, [METHOD_SEARCH, *COMPARE, f"tune.searcher={kind}"])
    _, searcher, num_samples, _ = tuner_search(config)
    assert isinstance(searcher, PerValueSearch) and num_samples == 8
    suggested = _drive(searcher, config.tune.metric, 9)
    trials, last = suggested[:8], suggested[8]
    assert last == "FINISHED"  # every value had its share: the search is over
    methods = [params["method"] for params in trials]
    # Served in turn: never two of one method ahead of the other.
    assert methods.count("simclr") == methods.count("hscl") == 4
    assert all(abs(methods[:i].count("simclr") - methods[:i].count("hscl")) <= 1
               for i in range(1, 9))
    for params in trials:
        own = {"simclr": "simclr.temperature", "hscl": "hscl.filter_exponent"}[params["method"]]
        assert set(params) == {"method", "train.lr", own}
    # Each method's study saw only its own trials (TPE models its knobs from them alone).
    studies = {label: inner._ot_study for label, inner in searcher.searchers.items()}
    assert {label: len(study.trials) for label, study in studies.items()} == {
        "'simclr'": 4, "'hscl'": 4}
    assert {trial.params["method"] for trial in studies["'hscl'"].trials} == {"hscl"}


def test_the_comparison_searcher_survives_a_save_and_restore(tmp_path: Path) -> None:
    config = load_search(QUICKSTART, [METHOD_SEARCH, *COMPARE])
    _, searcher, _, _ = tuner_search(config)
    _drive(searcher, config.tune.metric, 3)
    searcher.save(str(tmp_path / "state.pkl"))
    _, restored, _, _ = tuner_search(config)
    restored.restore(str(tmp_path / "state.pkl"))
    assert restored.served == searcher.served and sum(restored.served.values()) == 3
    assert [p["method"] for p in _drive(restored, config.tune.metric, 6)[:5]].count("simclr") \
        + searcher.served["'simclr'"] == 4
    pickle.dumps(restored)  # Tune pickles the searcher with the experiment's state


def test_a_slow_starting_method_is_stopped_only_against_its_own_rungs() -> None:
    config = load_search(QUICKSTART, [METHOD_SEARCH, *COMPARE, *ASHA])
    _, _, _, scheduler = tuner_search(config)
    assert isinstance(scheduler, PerValueScheduler)
    scheduler.set_search_properties(config.tune.metric, config.tune.mode)
    metric = config.tune.metric

    def report(trial: FakeTrial, value: float) -> str:
        return scheduler.on_trial_result(None, trial, {"training_iteration": 1, metric: value})

    fast = [FakeTrial(f"s{i}", {"method": "simclr"}) for i in range(3)]
    slow = [FakeTrial(f"h{i}", {"method": "hscl"}) for i in range(2)]
    for trial in fast + slow:
        scheduler.on_trial_add(None, trial)
    assert [report(trial, 0.9 + i / 100) for i, trial in enumerate(fast)] == ["CONTINUE"] * 3
    # HSCL starts at 0.2, far below every SimCLR trial at this rung: its first trial goes on,
    # compared with no one yet; its second, worse than its own method's first, is stopped.
    assert report(slow[0], 0.2) == "CONTINUE"
    assert report(slow[1], 0.1) == "STOP"
    # One ASHA over both methods stops HSCL's first trial at once: what the issue saw.
    _, _, _, shared = tuner_search(load_search(QUICKSTART, [METHOD_SEARCH, *ASHA]))
    shared.set_search_properties(metric, config.tune.mode)
    for trial in fast + slow:
        shared.on_trial_add(None, trial)
    for trial in fast:
        shared.on_trial_result(None, trial, {"training_iteration": 1, metric: 0.9})
    assert shared.on_trial_result(None, slow[0], {"training_iteration": 1,
                                                  metric: 0.2}) == "STOP"


def test_a_comparison_confirms_each_values_best_over_paired_seeds() -> None:
    config = load_search(QUICKSTART, [METHOD_SEARCH, *COMPARE])
    assert config.tune.confirm is not None and config.tune.confirm.per == "method"
    assert config.tune.confirm.seeds == 3
    given = load_search(QUICKSTART, [METHOD_SEARCH, *COMPARE, "tune.confirm={seeds: 5}"])
    assert given.tune.confirm.per == "method" and given.tune.confirm.seeds == 5
    # Without a scheduler's rungs the trials need no split: plain FIFO.
    _, _, _, fifo = tuner_search(load_search(QUICKSTART, [METHOD_SEARCH, *COMPARE,
                                                         "tune.scheduler.type=none"]))
    assert type(fifo).__name__ == "FIFOScheduler"


@pytest.mark.parametrize(("overrides", "message"), [
    (["tune.compare=train.lr"], r"compare=train.lr: train.lr is not a choice"),
    (["tune.compare=method", "tune.num_samples=7"],
     r"num_samples=7 does not split evenly over the 2 values of method.*use 6 or 8"),
    (["tune.compare=method", "tune.num_samples=8", "tune.searcher=grid"],
     r"not with tune.searcher grid"),
    (["tune.compare=method", "tune.num_samples=8", "tune.confirm={per: train.lr}"],
     r"confirm.per"),
])
def test_an_unfair_comparison_is_refused_before_launch(overrides: list[str], message: str,
                                                       ) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_search(QUICKSTART, [METHOD_SEARCH, *overrides])
    assert "tune" in str(caught.value) and "\n" not in str(caught.value)


def _result(seed: int, val: float | None, test: float | None = None,
            error: Exception | None = None) -> SimpleNamespace:
    metrics = {} if val is None else {"val/linear/mean": val, "test/linear/mean": test}
    return SimpleNamespace(config={"seed": seed}, metrics=metrics, error=error)


def test_seed_repeats_answer_with_a_mean_and_interval_not_a_best_seed(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_search(QUICKSTART, ["tune.search_space={}", "tune.num_samples=5", "seed=7",
                                      f"mlflow.tracking_uri={uri}"])
    assert is_seed_repeat(config)
    results = [_result(7, 0.60, 0.58), _result(8, 0.64, 0.61), _result(9, 0.62, 0.60),
               _result(10, None, error=RuntimeError("node lost"))]  # seed 11 never ran
    client = mlflow_client(uri)
    parent = client.create_run(client.create_experiment("repeats")).info.run_id
    lines = report_repeats(config, results, parent)
    # mean 0.62, s = 0.02, t(0.975, 2) = 4.303: half-width 0.0497
    assert lines[0].startswith("seed repeats")
    assert lines[-1] == ("the sweep's answer: val/linear/mean 0.62 [0.5703, 0.6697] (95 %) over "
                         "3 of 5 planned seeds (one configuration, no best seed)")
    tags = client.get_run(parent).data.tags
    assert tags[REPEATS_TAG].startswith("val/linear/mean 0.62 [0.5703, 0.6697]")
    # The description leads with the answer; the search's own text stays below it.
    client.set_tag(parent, "mlflow.note.content", "the search's leaderboard")
    report_repeats(config, results, parent)
    note = client.get_run(parent).data.tags["mlflow.note.content"]
    assert note.startswith("**Seed repeats**") and note.endswith("the search's leaderboard")
    with open(client.download_artifacts(parent, "confirm.csv", str(tmp_path))) as handle:
        (row,) = list(csv.DictReader(handle))
    assert row["seeds"] == "7 8 9 10 11" and row["n"] == "3"
    assert row["dropped"] == "10 error; 11 not run"
    assert float(row["test/linear/mean mean"]) == pytest.approx(0.5966667)
    # A resumed sweep writes its section again, not twice.
    report_repeats(config, results, parent)
    again = client.get_run(parent).data.tags["mlflow.note.content"]
    assert again.count("Seed repeats") == 1 and again.endswith("the search's leaderboard")
    assert not is_seed_repeat(load_search(QUICKSTART, [METHOD_SEARCH]))
