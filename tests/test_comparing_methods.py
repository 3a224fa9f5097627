"""Comparing methods (issue 47): a search over ``method`` samples a method's knobs only for its
own trials, warm start seeds only trials of the same method, and seed confirmation is paired:
the same seeds for every configuration, on the same data. No Ray session: the searcher, the
confirmation's param space and the data are exercised directly."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_search import proposals

from raycl.config.schema import ConfigError, active_values, conditional_keys, trial_sections
from raycl.config.search_config import apply_overrides
from raycl.config.sweep import CONFIRM_CASE_KEY, trial_values
from raycl.data import load_dataset
from raycl.launch.load import load_search
from raycl.sweep.confirm_tuner import PinnedValue, case_rank, confirm_cases, confirm_space
from raycl.sweep.confirmation import confirmation_seeds
from raycl.sweep.run import confirmation_trial_config
from raycl.sweep.searchers import build_searcher
from raycl.sweep.warm_start import _seed_of

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "searches" / "quickstart.yaml"
METHOD_SEARCH = ("tune.search_space={method: {choice: [simclr, hscl]}, "
                 "simclr.temperature: {uniform: [0.1, 0.5]}, "
                 "hscl.filter_exponent: {uniform: [0.0, 0.6]}, "
                 "train.lr: {loguniform: [0.0001, 0.01]}}")


@pytest.mark.parametrize("searcher", ["optuna", "random"])
def test_a_method_search_samples_each_methods_knobs_for_its_own_trials_only(
        searcher: str) -> None:
    config = load_search(QUICKSTART, [METHOD_SEARCH, f"tune.searcher={searcher}"])
    suggested = proposals(config, 24)
    methods = [params["method"] for params in suggested]
    assert set(methods) == {"simclr", "hscl"}
    for params in suggested:
        own = {"simclr": "simclr.temperature", "hscl": "hscl.filter_exponent"}[params["method"]]
        assert set(params) == {"method", "train.lr", own}, params
        # What the trial's run logs: the config of its own method only.
        logged = apply_overrides(config, params).trial_dict(params)
        other = "hscl" if params["method"] == "simclr" else "simclr"
        assert other not in logged and params["method"] in logged
    # Optuna's study holds the same: TPE models each method's knob over its own trials.
    study = build_searcher(config)._ot_study
    assert study is not None


def test_an_mcl_base_search_follows_the_base_down_to_its_knobs() -> None:
    config = load_search(QUICKSTART, [
        "tune.search_space={method: {choice: [simclr, mcl]}, mcl.base: {choice: [simclr, hscl]},"
        " mcl.stages: {choice: [1, 2]}, simclr.temperature: {uniform: [0.1, 0.5]},"
        " hscl.filter_exponent: {uniform: [0.0, 0.6]}}", "tune.searcher=random"])
    assert conditional_keys(config) == ["mcl.base", "mcl.stages", "simclr.temperature",
                                        "hscl.filter_exponent"]
    seen = set()
    for params in proposals(config, 40):
        if params["method"] == "simclr":
            assert set(params) == {"method", "simclr.temperature"}, params
        else:
            knob = {"simclr": "simclr.temperature", "hscl": "hscl.filter_exponent"}[
                params["mcl.base"]]
            assert set(params) == {"method", "mcl.base", "mcl.stages", knob}, params
            seen.add(params["mcl.base"])
    assert seen == {"simclr", "hscl"}
    assert trial_sections(config, {"method": "mcl", "mcl.base": "hscl"}) == {"mcl", "hscl"}
    assert active_values(config, {"method": "simclr", "mcl.stages": 2, "train.lr": 0.1}) == \
        {"method": "simclr", "train.lr": 0.1}


def test_grid_refuses_knobs_only_some_searched_methods_read() -> None:
    with pytest.raises(ConfigError, match=r"tune.search_space.simclr.temperature: read by some "
                                          "of the searched methods only"):
        load_search(QUICKSTART, [
            "tune.search_space={method: {choice: [simclr, hscl]}, "
            "simclr.temperature: {choice: [0.1, 0.2]}}", "tune.searcher=grid"])


def test_warm_start_seeds_only_trials_of_this_sweeps_method(
        capsys: pytest.CaptureFixture[str]) -> None:
    hscl_only = load_search(QUICKSTART, [
        "method=hscl", "tune.warm_start=earlier",
        "tune.search_space={hscl.filter_exponent: {uniform: [0.0, 0.6]}, "
        "train.lr: {loguniform: [0.0001, 0.01]}}"])

    def earlier(label: str, **values: object) -> SimpleNamespace:
        return SimpleNamespace(label=label, config=apply_overrides(hscl_only, values))

    simclr = earlier("t01", method="simclr", **{"hscl.filter_exponent": 0.3, "train.lr": 0.001})
    assert _seed_of(hscl_only, simclr, None) is None
    assert "t01: trained simclr, this sweep trains hscl; skipped" in capsys.readouterr().out
    hscl = _seed_of(hscl_only, earlier("t02", **{"hscl.filter_exponent": 0.2,
                                                  "train.lr": 0.002}), None)
    assert hscl is not None and hscl.values == {"hscl.filter_exponent": 0.2, "train.lr": 0.002}
    # A search over method takes both, each with its own method's knobs only.
    both = apply_overrides(load_search(QUICKSTART, [METHOD_SEARCH]),
                           {"tune.warm_start": "earlier"})
    seeded = _seed_of(both, simclr, None)
    assert seeded is not None
    assert set(seeded.values) == {"method", "simclr.temperature", "train.lr"}


def test_confirmation_pairs_its_seeds_and_runs_each_configuration_on_the_searchs_data(
        tmp_path: Path) -> None:
    """Two configurations confirmed with the same seeds; every case trains on the split the
    search trained on (its indices read back), unless tune.confirm.redraw_data."""
    overrides = ["seed=5", f"data.cache_dir={tmp_path}", "data.resolution=8",
                 "data.samples_per_combination=1", METHOD_SEARCH,
                 "tune.confirm={top_k: 2, seeds: 2}"]
    config = load_search(QUICKSTART, overrides)
    chosen = [{"method": "simclr", "simclr.temperature": 0.2, "train.lr": 0.001},
              {"method": "hscl", "hscl.filter_exponent": 0.3, "train.lr": 0.002}]
    seeds = confirmation_seeds(config.seed, 2, 2)
    assert seeds[0] == seeds[1]
    choice = {"configurations": chosen, "seeds": seeds}
    space = confirm_space(chosen, seeds, {"simclr.temperature": 0.5,
                                          "hscl.filter_exponent": 0.5})
    cases = confirm_cases(seeds)
    assert len(space[CONFIRM_CASE_KEY]["grid_search"]) == len(cases) == 4
    trial_configs = []
    for case in range(len(cases)):
        values = {CONFIRM_CASE_KEY: case}
        values.update({key: sample.func(values) if isinstance(sample.func, PinnedValue)
                       else sample for key, sample in space.items() if key != CONFIRM_CASE_KEY})
        trial_configs.append(values)
    assert [case_rank(values, choice, config.seed) for values in trial_configs] == [1, 1, 2, 2]
    assert [values["seed"] for values in trial_configs] == seeds[0] + seeds[1]
    assert trial_configs[2]["hscl.filter_exponent"] == 0.3
    # The knob a configuration lacks is pinned to the default and never shown or applied.
    assert active_values(config, trial_values(trial_configs[0])) == {
        "seed": seeds[0][0], **chosen[0]}

    def split_of(base, values) -> tuple[np.ndarray, np.ndarray]:
        resolved = apply_overrides(base, active_values(base, trial_values(values)))
        data = load_dataset(resolved.data, resolved.data_seed)
        return data.val.labels[data.attributes[0]], np.asarray(data.test.images[:4])

    base = confirmation_trial_config(config, "memory")
    searched = split_of(config, {})
    for values in trial_configs:
        labels, images = split_of(base, values)
        assert np.array_equal(labels, searched[0]) and np.array_equal(images, searched[1])
    redraw = confirmation_trial_config(load_search(QUICKSTART, [
        *overrides[:-1], "tune.confirm={top_k: 2, seeds: 2, redraw_data: true}"]), "memory")
    first, second = (split_of(redraw, trial_configs[i]) for i in (0, 1))
    assert not np.array_equal(first[1], second[1])  # each seed its own data


def test_confirm_per_method_confirms_each_methods_best_winner_first() -> None:
    from raycl.sweep.confirmation import chosen_configurations

    scored = [({"method": "simclr", "lr": 1}, 0.9), ({"method": "simclr", "lr": 2}, 0.8),
              ({"method": "hscl", "lr": 1}, 0.5), ({"method": "hscl", "lr": 3}, 0.7),
              ({"method": "hscl", "lr": 4}, float("nan"))]
    # top_k 2 overall: both SimCLR, HSCL never confirmed (the starved comparison).
    assert [v["method"] for v in chosen_configurations(scored, 2, "max")] == ["simclr"] * 2
    assert chosen_configurations(scored, 1, "max", per="method") == [
        {"method": "simclr", "lr": 1}, {"method": "hscl", "lr": 3}]
    assert chosen_configurations(scored, 1, "min", per="method") == [
        {"method": "hscl", "lr": 1}, {"method": "simclr", "lr": 2}]
    with pytest.raises(ConfigError, match=r"confirm.per=train.lr: not a choice"):
        load_search(QUICKSTART, [METHOD_SEARCH, "tune.confirm={per: train.lr, seeds: 2}"])
    config = load_search(QUICKSTART, [METHOD_SEARCH, "tune.confirm={per: method, seeds: 2}"])
    assert config.tune.confirm is not None and config.tune.confirm.per == "method"
