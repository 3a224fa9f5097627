"""The searcher proposes only trials that can train: constrained keys as feasible combinations."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest

from raycl.config.schema import ConfigError
from raycl.config.search_config import apply_overrides
from raycl.launch.feasibility import JOINT_PREFIX, joint_domain, trial_problem
from raycl.launch.load import load_search
from raycl.sweep.searchers import FinishingASHA, build_searcher
from raycl.sweep.tuner import tuner_search

REPO = Path(__file__).resolve().parents[1]


def proposals(config, count: int) -> list[dict]:
    """Ask the sweep's searcher for ``count`` trials, completing each with a random score."""
    searcher = build_searcher(config)
    rng = random.Random(0)
    suggested = []
    for index in range(count):
        params = searcher.suggest(f"t{index}")
        suggested.append(params)
        searcher.on_trial_complete(f"t{index}", {config.tune.metric: rng.random()})
    return suggested


@pytest.mark.parametrize("searcher", ["optuna", "random"])
def test_default_mcl_space_proposes_no_infeasible_pair(searcher: str) -> None:
    config = load_search(REPO / "searches" / "mcl_k_n.yaml", [f"tune.searcher={searcher}"])
    suggested = proposals(config, 50)
    for params in suggested:
        assert set(params) == {"mcl.clusters", "mcl.stages", "simclr.temperature"}
        assert trial_problem(apply_overrides(config, params)) is None, params
    pairs = {(p["mcl.clusters"], p["mcl.stages"]) for p in suggested}
    # M = 3500, b = 128: K^N <= 27.3 leaves these; with one stage K is never used, so N=1 is
    # offered once, not once per K.
    assert pairs <= {(2, 1), (2, 2), (5, 2), (2, 3)}
    assert len(pairs) >= 3
    temperatures = {round(p["simclr.temperature"], 6) for p in suggested}
    assert len(temperatures) > 40 and all(0.1 <= t <= 0.5 for t in temperatures)


def test_joint_domain_only_when_needed() -> None:
    config = load_search(REPO / "searches" / "mcl_k_n.yaml")
    joint = joint_domain(config)
    assert joint is not None and joint.keys == ("mcl.clusters", "mcl.stages")
    assert joint.name.startswith(JOINT_PREFIX)
    assert joint.values(joint.labels()[0]) == {"mcl.clusters": 2, "mcl.stages": 1}
    # Every combination feasible and distinct: the keys stay independent parameters.
    relaxed = load_search(REPO / "searches" / "mcl_k_n.yaml",
                          ["tune.search_space={mcl.clusters: {choice: [2, 3]}}"])
    assert joint_domain(relaxed) is None


def test_searcher_survives_pickling_with_the_experiment_state() -> None:
    config = load_search(REPO / "searches" / "mcl_k_n.yaml")
    searcher = build_searcher(config)
    searcher.suggest("t0")
    restored = pickle.loads(pickle.dumps(searcher))
    params = restored.suggest("t1")
    assert trial_problem(apply_overrides(config, params)) is None


def test_grid_searcher_runs_every_combination_once() -> None:
    config = load_search(REPO / "searches" / "hscl_filter.yaml")
    assert config.tune.searcher == "grid"
    values = sorted(p["hscl.filter_exponent"] for p in proposals(config, 4))
    assert values == [0.0, 0.1, 0.3, 0.5]
    # Constrained keys: the feasible (K, N) pairs once each, times the temperature choices.
    notices: list[str] = []
    mcl = load_search(REPO / "searches" / "mcl_k_n.yaml", [
        "tune.searcher=grid", "tune.num_samples=8",
        "tune.search_space.simclr.temperature={choice: [0.1, 0.5]}"], notices=notices)
    suggested = proposals(mcl, 8)
    combos = {(p["mcl.clusters"], p["mcl.stages"], p["simclr.temperature"]) for p in suggested}
    assert len(combos) == 8 and {(k, n) for k, n, _ in combos} == {(2, 1), (2, 2), (5, 2), (2, 3)}
    assert notices == []
    load_search(REPO / "searches" / "mcl_k_n.yaml", [
        "tune.searcher=grid", "tune.num_samples=3",
        "tune.search_space.simclr.temperature={choice: [0.1, 0.5]}"], notices=notices)
    assert notices == ["tune.searcher=grid: 8 combinations, tune.num_samples=3: 5 are not run"]
    with pytest.raises(ConfigError, match=r"tune\.search_space\.simclr\.temperature: tune\."
                                          r"searcher 'grid' needs choice domains, got loguniform"):
        load_search(REPO / "searches" / "mcl_k_n.yaml", ["tune.searcher=grid"])


def test_an_empty_space_runs_seed_repeats_to_the_end() -> None:
    """Nothing searched: ``tune.num_samples`` repeats that differ only by seed (from ``seed``
    up), none stopped early; a searched space gets the searcher and ASHA."""
    from ray.tune.schedulers import FIFOScheduler

    config = load_search(REPO / "searches" / "quickstart.yaml", [
        "tune.num_samples=2", "tune.search_space={}", "seed=3"])
    space, searcher, num_samples, scheduler = tuner_search(config)
    assert searcher is None and num_samples == 1 and type(scheduler) is FIFOScheduler
    seeds = space["seed"]["grid_search"]
    assert seeds == [3, 4]
    assert [apply_overrides(config, {"seed": seed}).seed for seed in seeds] == [3, 4]

    searched = load_search(REPO / "searches" / "quickstart.yaml", ["tune.num_samples=2"])
    space, searcher, num_samples, scheduler = tuner_search(searched)
    assert space == {} and searcher is not None and num_samples == 2
    assert isinstance(scheduler, FinishingASHA)
