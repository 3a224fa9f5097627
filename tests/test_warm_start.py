"""Warm start (``tune.warm_start``): which of an earlier trial's values fit the new search space,
how many configurations seed a sweep, the enqueued trials Optuna proposes first, and the refusal
of an experiment that does not exist (one line, exit 2, before launch). The end-to-end run is in
tests/test_pareto.py (a warm-started sweep after a two-objective one)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

import raycl.sweep.warm_start as warm_start
from raycl.config.schema import Domain
from raycl.launch.feasibility import JointDomain
from raycl.launch.load import load_search
from raycl.sweep.searchers import build_searcher
from raycl.sweep.warm_start import Seed, fit_to_space, in_domain, seed_count, warm_start_tag
from raycl.tune import main

BASE = """
name: warm
method: simclr
data: {dataset: trifeature, resolution: 32, samples_per_combination: 2}
train: {epochs: 2, batch_size: 64}
tune:
  num_samples: 4
  search_space:
    simclr.temperature: {loguniform: [0.1, 0.5]}
    train.lr: {choice: [0.001, 0.002]}
"""


def test_values_inside_domains_only() -> None:
    assert in_domain(0.1, Domain(loguniform=(0.1, 0.5)))  # bounds included
    assert not in_domain(0.6, Domain(loguniform=(0.1, 0.5)))
    assert in_domain(3, Domain(randint=(1, 4))) and not in_domain(2.5, Domain(randint=(1, 4)))
    assert in_domain("a", Domain(choice=["a", "b"])) and not in_domain("c", Domain(choice=["a"]))
    assert not in_domain(True, Domain(choice=[1, 2]))  # a bool is no 1
    assert not in_domain("0.2", Domain(uniform=(0.0, 1.0)))


def test_fit_keeps_the_fitting_keys_and_says_why_others_go() -> None:
    space = {"simclr.temperature": Domain(loguniform=(0.1, 0.5)),
             "train.lr": Domain(choice=[0.001, 0.002]),
             "model.width": Domain(choice=[16, 32])}
    point, dropped = fit_to_space(
        {"simclr.temperature": 0.3, "train.lr": 0.005, "train.epochs": 8}, space)
    assert point == {"simclr.temperature": 0.3}
    assert len(dropped) == 2
    assert dropped[0].startswith("train.lr=0.005: outside choice")
    assert dropped[1] == "model.width: not in its config"


def test_keys_searched_together_seed_their_combination_or_nothing() -> None:
    joint = JointDomain(keys=("mcl.clusters", "mcl.stages"), combinations=((2, 1), (2, 2)))
    space = {"mcl.clusters": Domain(choice=[2, 5]), "mcl.stages": Domain(choice=[1, 2])}
    point, dropped = fit_to_space({"mcl.clusters": 2, "mcl.stages": 2}, space, joint)
    assert point == {joint.name: joint.labels()[1]} and dropped == []
    point, dropped = fit_to_space({"mcl.clusters": 5, "mcl.stages": 2}, space, joint)
    assert point == {} and "not a feasible combination" in dropped[0]


def test_half_the_trials_are_seeded() -> None:
    assert [seed_count(n) for n in (1, 2, 3, 8)] == [1, 1, 1, 4]
    with pytest.raises(ValueError):
        seed_count(0)


def test_the_seeds_are_optunas_first_trials_and_the_parent_lists_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE) + "  warm_start: earlier\n")
    config = load_search(path)
    seeds = [Seed("t03", {"simclr.temperature": 0.25, "train.lr": 0.002},
                  {"simclr.temperature": 0.25, "train.lr": 0.002}),
             Seed("t01", {"simclr.temperature": 0.4}, {"simclr.temperature": 0.4})]
    # As the earlier sweep gave them (find_seeds keeps what it found).
    monkeypatch.setitem(warm_start._FOUND, warm_start.found_key(config), seeds)
    searcher = build_searcher(config)
    first, second = searcher.suggest("a"), searcher.suggest("b")
    assert first == {"simclr.temperature": 0.25, "train.lr": 0.002}
    assert second["simclr.temperature"] == 0.4  # train.lr: the searcher's own choice
    assert warm_start_tag("earlier", seeds) == (
        'earlier: t03 {"simclr.temperature": 0.25, "train.lr": 0.002}; '
        't01 {"simclr.temperature": 0.4}')


def test_a_missing_experiment_is_one_line_and_exit_2_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=store).search_experiments()  # a store without that experiment
    capsys.readouterr()  # MLflow's lines as it made the store
    assert main([str(path), "--warm-start", "no-such-sweep", "--storage", str(tmp_path / "ray"),
                 "--tracking-uri", store]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {path}: tune.warm_start: ")
    assert "no MLflow experiment named 'no-such-sweep'" in err
    assert not (tmp_path / "ray").exists()
