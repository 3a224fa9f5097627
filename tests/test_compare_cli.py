"""``python -m raycl.compare A B`` (issue 47, comparing methods): two finished sweeps on the same
data, each measured seed by seed (its confirmation winner, its seed repeats, or its best trial
alone), paired by seed where they share seeds, unpaired (said, with why) where they do not; two
sweeps on other data or objectives refused in one line.

No Ray: the sweeps' MLflow runs are written by hand with the tags, params and artifacts raycl
writes (:mod:`raycl.tracking.callback`, :mod:`raycl.sweep.confirm_tuner`).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from raycl.compare import main
from raycl.sweep.confirmation import (
    CONFIRM_TAG,
    CSV_NAME,
    SEED_STRIDE,
    Confirmed,
    confirm_table,
    t_interval,
    write_confirm_csv,
)
from raycl.tracking.runs import (
    ENDED_TAG,
    PARENT_TAG,
    ROLE_TAG,
    SEARCHED_TAG,
    SWEEP_TAG,
    TRIAL_TAG,
    get_or_create_experiment,
    mlflow_client,
)

REPO = Path(__file__).resolve().parents[1]
OBJECTIVE, TEST = "val/linear/mean", "test/linear/mean"
DATA = {"data.dataset": "fashion_mnist", "data.num_samples": "7000", "data.resolution": "28",
        "data.seed": "0"}


def _parent(client, uri: str, experiment: str, sweep: str, params: dict[str, str],
            metric: str = OBJECTIVE) -> tuple[str, str]:
    """A sweep's parent run (its tags and data params, as the callback logs them); returns
    ``(experiment id, parent run id)``."""
    experiment_id = get_or_create_experiment(client, experiment, uri)
    run = client.create_run(experiment_id, run_name=sweep, tags={
        ROLE_TAG: "sweep", SWEEP_TAG: sweep, "raycl.metric": metric, "raycl.mode": "max"})
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    return experiment_id, run.info.run_id


def _trial(client, experiment_id: str, parent: str, name: str, searched: str, seed: int,
           val: float, test: float, confirm: int | None = None) -> str:
    """A finished trial's run (a confirmation seed's with ``confirm``: its rank)."""
    tags = {ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: name, SEARCHED_TAG: searched,
            ENDED_TAG: "completed", **({CONFIRM_TAG: str(confirm)} if confirm else {})}
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    client.log_param(run_id, "seed", str(seed))
    for key, value in {OBJECTIVE: val, TEST: test, "val/linear/shape": val + 0.1,
                       "test/linear/shape": test + 0.1}.items():
        client.log_metric(run_id, key, value, step=4)
    client.set_terminated(run_id)
    return run_id


def confirmed_sweep(client, uri: str, experiment: str, sweep: str, base_seed: int,
                    ranks: dict[int, tuple[str, list[float]]]) -> str:
    """A sweep that ran seed confirmation: a search trial, then for each rank (its searched
    values and its validation value per seed; test = val - 0.05) the confirmation runs of the
    shared seeds, ``confirm.csv`` on the parent (best validation mean first). Returns the
    parent run id."""
    experiment_id, parent = _parent(client, uri, experiment, sweep,
                                    {**DATA, "seed": str(base_seed)})
    _trial(client, experiment_id, parent, "t01 lr=0.001", "train.lr=0.001", base_seed, 0.7, 0.6)
    items = []
    for rank, (searched, values) in ranks.items():
        seeds = [base_seed + SEED_STRIDE + j for j in range(len(values))]
        item = Confirmed(rank, dict(pair.split("=") for pair in searched.split(", ")), seeds)
        for seed, value in zip(seeds, values, strict=True):
            _trial(client, experiment_id, parent, f"c{rank} {searched}",
                   f"seed={seed}, {searched}", seed, value, value - 0.05, confirm=rank)
            item.add(seed, value, value - 0.05)
        items.append(item)
    header, rows = confirm_table(items, OBJECTIVE, TEST, "max")
    with tempfile.TemporaryDirectory() as directory:
        write_confirm_csv(header, rows, Path(directory, CSV_NAME))
        client.log_artifact(parent, str(Path(directory, CSV_NAME)))
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store (creating one takes seconds) with the sweeps the tests compare:

    - ``hscl``: confirmation, base seed 0; rank 2 (filter exponent 0.31) won it, 0.80 0.82 0.85;
    - ``simclr`` (sweep ``simclr-sweep``): confirmation, base seed 0, 0.78 0.79 0.83;
    - ``simclr-other-seed``: confirmation, base seed 100 (no seed shared with hscl), same data;
    - ``simclr-search``: a search without confirmation (best trial 0.81, seed 0);
    - ``repeats``: seed repeats over seeds 0 1 2, data seed pinned;
    - ``shape-objective``: another objective.
    """
    uri = f"sqlite:///{tmp_path_factory.mktemp('compare') / 'mlflow.db'}"
    client = mlflow_client(uri)
    confirmed_sweep(client, uri, "hscl", "hscl-sweep", 0, {
        1: ("method=hscl, hscl.filter_exponent=0.12", [0.70, 0.71, 0.74]),
        2: ("method=hscl, hscl.filter_exponent=0.31", [0.80, 0.82, 0.85])})
    confirmed_sweep(client, uri, "simclr-experiment", "simclr-sweep", 0, {
        1: ("method=simclr, simclr.temperature=0.2", [0.78, 0.79, 0.83])})
    confirmed_sweep(client, uri, "simclr-other-seed", "simclr-other-seed", 100, {
        1: ("method=simclr, simclr.temperature=0.2", [0.70, 0.72, 0.71])})
    experiment_id, parent = _parent(client, uri, "simclr-search", "simclr-search",
                                    {**DATA, "seed": "0"})
    for name, lr, val in (("t01 lr=0.001", "0.001", 0.75), ("t02 lr=0.002", "0.002", 0.81)):
        _trial(client, experiment_id, parent, name, f"train.lr={lr}", 0, val, val - 0.04)
    experiment_id, parent = _parent(client, uri, "repeats", "repeats",
                                    {**DATA, "search_space.seed": "grid [0, 1, 2]"})
    for seed, val in enumerate((0.60, 0.62, 0.61)):
        _trial(client, experiment_id, parent, f"t{seed:02d} seed={seed}", f"seed={seed}", seed,
               val, val - 0.02)
    _parent(client, uri, "shape-objective", "shape-objective", {**DATA, "seed": "0"},
            metric="val/linear/shape")
    return uri


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store with two seed-confirmed sweeps on other datasets (MLflow params cannot change:
    a sweep on other data is its own parent run)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('other') / 'mlflow.db'}"
    client = mlflow_client(uri)
    confirmed_sweep(client, uri, "fashion", "fashion", 0, {1: ("method=hscl", [0.8, 0.81])})
    experiment_id, parent = _parent(client, uri, "trifeature", "trifeature",
                                    {**DATA, "data.dataset": "trifeature", "seed": "0"})
    _trial(client, experiment_id, parent, "t01 lr=0.1", "train.lr=0.1", 0, 0.5, 0.45)
    return uri


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


def test_shared_seeds_give_the_paired_difference_and_its_interval(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    # B by its sweep's name (its experiment is called otherwise).
    code, out, err = _run(capsys, "hscl", "simclr-sweep", "--tracking-uri", store)
    assert code == 0, err
    # A is the confirmation's winner as confirm.csv ranks it (rank 2 beat the search's #1).
    assert out[2] == ("A hscl: confirmation winner #2 (method=hscl, hscl.filter_exponent=0.31), "
                      "3 of 3 seeds; seeds 10000 10001 10002")
    assert out[3].startswith("B simclr-sweep: confirmation winner #1 (method=simclr, ")
    differences = [0.80 - 0.78, 0.82 - 0.79, 0.85 - 0.83]
    mean, low, high = t_interval(differences)
    assert low > 0.0  # separated: the seeds move both sides alike and cancel
    assert mean == pytest.approx(0.07 / 3)
    row = next(line for line in out if line.startswith("  A − B"))
    assert f"{mean:+.4g} [{low:.4g}, {high:.4g}] (n=3)" in row
    assert out[-2] == (f"verdict: A and B are separated at 95 % on {OBJECTIVE}: paired "
                       f"difference A − B {mean:+.4g} [{low:.4g}, {high:.4g}] over 3 shared "
                       f"seeds; A is better (max)")
    # Test beside it, the same differences (test = val - 0.05 on both sides), never deciding.
    assert out[-1].startswith(f"test (reported, never deciding): A and B are separated at 95 % "
                              f"on {TEST}: paired difference A − B {mean:+.4g}")
    assert out[0] == (f"compare A = hscl vs B = simclr-sweep on {OBJECTIVE} (max; decides), "
                      f"{TEST} reported beside it, never deciding")
    # --metric: another validation metric, the winners still those of the objective.
    code, shape, err = _run(capsys, "hscl", "simclr-sweep", "--metric", "val/linear/shape",
                            "--tracking-uri", store)
    assert code == 0, err
    assert shape[0].startswith("compare A = hscl vs B = simclr-sweep on val/linear/shape (max; "
                               "decides), test/linear/shape reported beside it")
    assert shape[2] == out[2] and f"{mean:+.4g}" in shape[-2]
    assert _run(capsys, "hscl", "simclr-sweep", "--metric", "val/knn/mean", "--tracking-uri",
                store)[::2] == (2, "error: hscl: no finished trial reported val/knn/mean\n")
    assert out[1] == ("same data: data.dataset fashion_mnist, data.resolution 28, "
                      "data.num_samples 7000, data seed 0")


def test_disjoint_seeds_are_compared_unpaired_and_say_why(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "hscl", "simclr-other-seed", "--tracking-uri", store)
    assert code == 0, err
    assert out[3].endswith("seeds 10100 10101 10102")
    row = next(line for line in out if line.startswith("  A − B"))
    assert "unpaired: no shared seeds" in row
    a_mean, a_low, a_high = t_interval([0.80, 0.82, 0.85])
    assert f"{a_mean:.4g} [{a_low:.4g}, {a_high:.4g}] (n=3)" in \
        next(line for line in out if line.startswith("  A "))
    assert out[-2] == (f"verdict: A and B are separated at 95 % on {OBJECTIVE} (unpaired, no "
                       f"shared seeds: each side's interval, over 3 and 3 values); A is better "
                       f"(max)")


def test_seed_repeats_are_one_side_measured_over_their_trials(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "repeats", "repeats", "--tracking-uri", store)
    assert code == 0, err
    assert out[2] == ("A repeats: seed repeats of one configuration, 3 of 3 trials finished; "
                      "seeds 0 1 2")
    # The same runs on both sides: a difference of 0 on every seed, no interval claimed.
    assert out[-2] == (f"verdict: A and B differ by +0 on each of 3 shared seeds on {OBJECTIVE}: "
                       f"no spread, no 95 % interval; compare over more seeds")


def test_a_sweep_without_confirmation_is_its_best_trial_alone_and_says_so(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "hscl", "simclr-search", "--tracking-uri", store)
    assert code == 0, err
    assert out[3] == ("B simclr-search: best trial t02 lr=0.002 alone (no confirmation, no seed "
                      "repeats): one value, no interval; seeds 0")
    row = next(line for line in out if line.startswith("  B "))
    assert "0.81 (n=1, no interval)" in row
    assert "unpaired: no shared seeds" in next(line for line in out if "A − B" in line)
    # One value has no interval: nothing separates it.
    assert out[-2].startswith(f"verdict: A and B are not separated at 95 % on {OBJECTIVE} "
                              f"(unpaired, no shared seeds")


@pytest.mark.parametrize(("first", "second", "message"), [
    ("fashion", "trifeature", "error: fashion and trifeature ran on different data "
                              "(data.dataset fashion_mnist vs trifeature): compare sweeps on "
                              "the same data"),
    ("fashion", "nowhere", "error: no experiment or sweep named 'nowhere'"),
])
def test_other_data_and_unknown_sweeps_are_refused_in_one_line(
        other_data: str, capsys: pytest.CaptureFixture[str], first: str, second: str,
        message: str) -> None:
    code, out, err = _run(capsys, first, second, "--tracking-uri", other_data)
    assert (code, out, err.splitlines()) == (2, [], [message])


def test_another_objective_or_data_seed_is_refused(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "hscl", "shape-objective", "--tracking-uri", store)
    assert (code, out) == (2, [])
    assert err.splitlines() == [
        "error: hscl and shape-objective have different objectives (val/linear/mean max vs "
        "val/linear/shape max): their winners were chosen on different numbers"]
    # Seed repeats that drew each trial's data from its seed, against a sweep whose data seed
    # is pinned: not the same data.
    client = mlflow_client(store)
    experiment_id, parent = _parent(client, store, "redrawn", "redrawn",
                                    {**DATA, "data.seed": "None",
                                     "search_space.seed": "grid [0, 1, 2]"})
    _trial(client, experiment_id, parent, "t00 seed=0", "seed=0", 0, 0.6, 0.5)
    code, out, err = _run(capsys, "redrawn", "repeats", "--tracking-uri", store)
    assert code == 2 and len(err.splitlines()) == 1
    assert "data seed each trial's seed (grid [0, 1, 2]) vs 0" in err
    code, _, err = _run(capsys, "hscl", "hscl", "--tracking-uri",
                        f"sqlite:///{Path(tempfile.gettempdir()) / 'no-such-store.db'}")
    assert code == 2 and "no MLflow store at" in err


def test_the_documented_example_is_what_the_command_prints(
        store: str, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/after_the_sweep.md's example: its command, run on this store, prints its output."""
    text = (REPO / "docs" / "after_the_sweep.md").read_text()
    section = text.split("## Compare two sweeps", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block is not None, "the section shows no example"
    command, *shown = block.group(1).rstrip("\n").split("\n")
    words = command.removeprefix("$ ").split()
    assert words[:3] == ["python", "-m", "raycl.compare"]
    code, out, err = _run(capsys, *words[3:], "--tracking-uri", store)
    assert code == 0, err
    assert out == shown
