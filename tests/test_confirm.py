"""Seed confirmation (``tune.confirm``): the pure parts on hand-computed cases, the config's
refusals, and one real quickstart sweep that confirms its winner over two seeds, interrupted
twice in the middle of its confirmation (Ctrl+C, then SIGKILL) and resumed."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from local_servers import spawn
from mlflow import MlflowClient
from test_end_to_end import NO_PLOTS, TINY, quickstart_args, runs_of
from test_tracking_faults import wait_until

from raycl.config.schema import ConfigError
from raycl.config.sweep import CONFIRM_CASE_KEY
from raycl.launch.load import load_search
from raycl.results.trials import find_trials
from raycl.sweep.confirmation import (
    CONFIRM_TAG,
    SEED_STRIDE,
    Confirmed,
    confirm_lines,
    confirm_table,
    confirmation_seeds,
    intervals_overlap,
    paired_differences,
    rank_of_seed,
    separation_sentence,
    t_interval,
    top_configurations,
    verdict_sentence,
    write_confirm_csv,
)
from raycl.tracking import PARENT_TAG
from raycl.tracking.runs import CONFIRMED_RUN_TAG, NOTE_TAG
from raycl.tracking.trial_table import leaderboard_rows
from raycl.tune import main

REPO = Path(__file__).resolve().parents[1]

# t_{0.975, 2} (two-sided 95 %, 2 degrees of freedom), from a t table.
T_975_DF2 = 4.302652729911275


def test_t_interval_of_three_seeds_matches_the_hand_computed_one() -> None:
    # [1, 2, 3]: mean 2, sample sd 1, half width t * 1 / sqrt(3).
    mean, low, high = t_interval([1.0, 2.0, 3.0])
    half = T_975_DF2 / math.sqrt(3)
    assert mean == pytest.approx(2.0)
    assert (low, high) == pytest.approx((2.0 - half, 2.0 + half))


def test_t_interval_with_one_seed_has_no_bounds_and_rejects_bad_confidence() -> None:
    mean, low, high = t_interval([0.7, math.nan])
    assert mean == pytest.approx(0.7) and math.isnan(low) and math.isnan(high)
    assert all(math.isnan(v) for v in t_interval([]))
    with pytest.raises(ValueError, match="confidence"):
        t_interval([1.0, 2.0], confidence=1.0)


def test_top_configurations_by_mode_with_ties_duplicates_and_missing_objectives() -> None:
    scored = [({"lr": 1}, 0.5), ({"lr": 2}, 0.9), ({"lr": 3}, math.nan), ({"lr": 4}, 0.5),
              ({"lr": 2}, 0.1), ({"lr": 5}, 0.2)]
    # max: 0.9 first; the tie at 0.5 keeps trial order (lr 1 before lr 4); lr 2 counted once.
    assert top_configurations(scored, 3, "max") == [{"lr": 2}, {"lr": 1}, {"lr": 4}]
    # min: lr 2 at its best (lowest) 0.1, then 0.2; NaN never chosen.
    assert top_configurations(scored, 2, "min") == [{"lr": 2}, {"lr": 5}]
    assert len(top_configurations(scored, 10, "max")) == 4
    with pytest.raises(ValueError, match="top_k"):
        top_configurations(scored, 0, "max")
    with pytest.raises(ValueError, match="mode"):
        top_configurations(scored, 1, "best")


def test_confirmation_seeds_are_fresh_deterministic_and_shared_by_every_rank() -> None:
    """Paired: every confirmed configuration gets the same fresh seeds (issue 47)."""
    seeds = confirmation_seeds(7, 3, 4)
    assert seeds == confirmation_seeds(7, 3, 4)
    assert seeds == [[7 + SEED_STRIDE + j for j in range(4)]] * 3
    assert 7 not in seeds[0] and len(set(seeds[0])) == 4
    # A confirmation started before pairing (rank-owned seeds) is still read back.
    assert [rank_of_seed(7 + rank * SEED_STRIDE + 1, 7) for rank in (1, 2, 3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="not a confirmation seed"):
        rank_of_seed(7, 7)
    with pytest.raises(ValueError, match="seeds"):
        confirmation_seeds(0, 1, 0)


def test_the_paired_interval_is_narrower_than_the_unpaired_one_on_the_same_numbers() -> None:
    """Seeds that move both configurations alike (the split, the initialisation) widen each
    one's interval but cancel in the seed-by-seed difference: hand-made numbers."""
    a = Confirmed(1, {"lr": 0.01}, [1, 2, 3])
    b = Confirmed(2, {"lr": 0.02}, [1, 2, 3])
    for seed, (mine, theirs) in zip([1, 2, 3], [(0.70, 0.68), (0.80, 0.78), (0.90, 0.87)],
                                    strict=True):
        a.add(seed, mine, None)
        b.add(seed, theirs, None)
    differences = paired_differences(a, b)
    assert differences == pytest.approx([0.02, 0.02, 0.03])
    mean, low, high = t_interval(differences)
    t_df2 = 4.302652729749464  # t_{0.975, 2}
    # sd of [0.02, 0.02, 0.03] is 0.01 / sqrt(3); the half-width t * sd / sqrt(3)
    assert (mean, high - mean) == pytest.approx((0.07 / 3, t_df2 * 0.01 / 3))
    assert low > 0.0  # separated, paired
    a_low, a_high = t_interval(a.val)[1:]
    b_low, b_high = t_interval(b.val)[1:]
    assert intervals_overlap((a_low, a_high), (b_low, b_high))  # not separated, unpaired
    assert high - low < min(a_high - a_low, b_high - b_low) / 10
    assert separation_sentence([b, a], "max") == (
        "the winner #1 (lr=0.01) is separated from #2 (lr=0.02) at 95 %: paired difference "
        f"+0.02333 [{low:.4g}, {high:.4g}] over 3 shared seeds")
    header, rows = confirm_table([a, b], "val/linear/mean", None, "max")
    assert header[-3:] == ["Δ vs winner val/linear/mean mean",
                           "Δ vs winner val/linear/mean ci95_low",
                           "Δ vs winner val/linear/mean ci95_high"]
    assert all(math.isnan(v) for v in rows[0][-3:])  # the winner's own row
    assert rows[1][-3:] == pytest.approx([-mean, -high, -low])
    # The same difference on every seed (a coarse metric on a small split): no interval, and
    # no claim of separation.
    c = Confirmed(3, {"lr": 0.03}, [1, 2, 3])
    for seed, value in zip([1, 2, 3], [0.69, 0.79, 0.89], strict=True):
        c.add(seed, value, None)
    assert separation_sentence([a, c], "max") == (
        "the winner #1 (lr=0.01) and #3 (lr=0.03) differ by +0.01 on each of 3 shared seeds: "
        "no spread, no 95 % interval; confirm over more seeds")


def test_separation_sentence_says_whether_the_winner_stands_apart() -> None:
    winner = Confirmed(2, {"lr": 0.01}, [1, 2, 3], val=[0.80, 0.81, 0.82])
    close = Confirmed(1, {"lr": 0.02}, [4, 5, 6], val=[0.78, 0.80, 0.82])
    far = Confirmed(1, {"lr": 0.02}, [4, 5, 6], val=[0.50, 0.51, 0.52])
    assert separation_sentence([close, winner], "max") == \
        "the winner #2 (lr=0.01) is not separated from #1 (lr=0.02) at 95 % " \
        "(unpaired: intervals over 3 of 3 and 3 of 3 planned seeds)"
    assert separation_sentence([far, winner], "max") == \
        "the winner #2 (lr=0.01) is separated from #1 (lr=0.02) at 95 % " \
        "(unpaired: intervals over 3 of 3 and 3 of 3 planned seeds)"
    # min: the lower mean wins.
    assert separation_sentence([far, winner], "min").startswith("the winner #1 (lr=0.02) is ")
    assert separation_sentence([winner], "max") is None
    assert intervals_overlap((0.0, 1.0), (1.0, 2.0)) and not intervals_overlap((0, 1), (2, 3))
    assert intervals_overlap((math.nan, 1.0), (2.0, 3.0))  # unknown: nothing separates them


def test_confirm_table_has_interval_columns_best_validation_mean_first() -> None:
    items = [Confirmed(1, {"lr": 0.1}, [10, 11], val=[0.5, 0.7], test=[0.4, 0.6]),
             Confirmed(2, {"lr": 0.2}, [20, 21], val=[0.8, 0.8], test=[0.7])]
    header, rows = confirm_table(items, "val/linear/mean", "test/linear/mean", "max")
    assert header[:11] == ["rank", "lr", "seeds", "n", "dropped",
                           "val/linear/mean mean", "val/linear/mean ci95_low",
                           "val/linear/mean ci95_high", "test/linear/mean mean",
                           "test/linear/mean ci95_low", "test/linear/mean ci95_high"]
    # The paired differences from the winner: none here (values recorded without seeds).
    assert len(header) == 17 and all(math.isnan(v) for row in rows for v in row[11:])
    assert [row[0] for row in rows] == [2, 1]
    assert rows[1][:5] == [1, 0.1, "10 11", 2, ""]
    t_df1 = 12.706204736174707  # t_{0.975, 1}
    half = t_df1 * math.sqrt(0.02) / math.sqrt(2)  # sd of [0.5, 0.7] is sqrt(0.02)
    assert rows[1][5:8] == pytest.approx([0.6, 0.6 - half, 0.6 + half])
    assert rows[0][6:8] == pytest.approx([0.8, 0.8])  # no spread: a zero-width interval
    assert math.isnan(rows[0][9])  # one test value: no interval
    lines = confirm_lines(header, rows, "sentence")
    assert lines[1].split()[:11] == ["rank", "lr", "seeds", "n", "dropped", "val/linear/mean",
                                     "(95", "%)", "test/linear/mean", "(95", "%)"]
    assert lines[3].split()[:9] == ["1", "0.1", "10", "11", "2", "-", "0.6",
                                    f"[{0.6 - half:.4g},", f"{0.6 + half:.4g}]"]
    assert lines[2].split()[-3] == "0.7"  # one test value: its mean, no interval
    assert lines[-1] == "sentence"


def test_seeds_that_did_not_finish_are_named_in_confirm_csv_and_the_verdict(
        tmp_path: Path) -> None:
    """A seed that diverged, failed or never ran is left out of its interval and named, with
    how it ended, in confirm.csv's ``dropped`` column, the printed table and the verdict's
    "over n of the planned seeds" (before: only ``n`` showed it)."""
    from types import SimpleNamespace

    from raycl.sweep.confirm_tuner import confirmed
    from raycl.worker.outcome import FAILED_KEY

    config = load_search(REPO / "searches" / "quickstart.yaml",
                         ["seed=0", "tune.confirm={top_k: 2, seeds: 3}"])
    seeds = confirmation_seeds(0, 2, 3)
    choice = {"parent_run_id": "p", "configurations": [{"train.lr": 0.001}, {"train.lr": 0.002}],
              "seeds": seeds}
    (a, b, c), (d, e, f) = seeds

    cases = iter(range(6))  # (rank, seed) in order: rank 1's seeds, then rank 2's

    def result(seed: int, val: float | None = None, error: Exception | None = None,
               **metrics: float) -> SimpleNamespace:
        if val is not None:
            metrics.update({"val/linear/mean": val, "test/linear/mean": val - 0.1})
        return SimpleNamespace(config={CONFIRM_CASE_KEY: next(cases), "seed": seed,
                                       "train.lr": 0.0}, error=error, metrics=metrics)

    results = [result(a, 0.80), result(b, 0.82), result(c, math.nan, **{FAILED_KEY: 1.0}),
               result(d, 0.70), result(e, error=RuntimeError("node lost")),
               result(f, math.inf)]  # f reported no finite objective
    assert (a, b, c) == (d, e, f)  # paired
    items = confirmed(config, choice, results)
    assert items[0].dropped == {c: "diverged"} and items[0].val == [0.80, 0.82]
    assert items[1].dropped == {e: "error", f: "no val/linear/mean"} and items[1].val == [0.70]
    header, rows = confirm_table(items, "val/linear/mean", "test/linear/mean", "max")
    path = tmp_path / "confirm.csv"
    write_confirm_csv(header, rows, path)
    with path.open(newline="") as handle:
        by_rank = {row["rank"]: row for row in csv.DictReader(handle)}
    assert (by_rank["1"]["n"], by_rank["1"]["dropped"]) == ("2", f"{c} diverged")
    assert (by_rank["2"]["n"], by_rank["2"]["dropped"]) == (
        "1", f"{e} error; {f} no val/linear/mean")
    verdict = verdict_sentence(items, "max")
    assert verdict is not None
    # One shared finished seed: too few to pair, so the two intervals are compared.
    assert verdict.endswith("(unpaired: intervals over 2 of 3 and 1 of 3 planned seeds)")
    lines = confirm_lines(header, rows, verdict)
    assert f"{c} diverged" in lines[2] and f"{e} error; {f} no val/linear/mean" in lines[3]
    assert lines[-1] == verdict

    # One configuration: the verdict still says over how many of its seeds; one never run
    # (no result at all) is named too.
    alone = confirmed(config, {**choice, "configurations": choice["configurations"][:1],
                               "seeds": seeds[:1]}, results[:2])
    assert alone[0].dropped == {c: "not run"}
    assert verdict_sentence(alone, "max") == \
        "the interval of #1 (train.lr=0.001) is over 2 of 3 planned seeds"


@pytest.mark.parametrize("override, message", [
    ("tune.confirm={top_k: 1, seeds: 1}", "tune.confirm.seeds"),
    ("tune.confirm={top_k: 4, seeds: 2}", "exceeds the search's num_samples=3"),
])
def test_confirm_config_refusals(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_search(REPO / "searches" / "quickstart.yaml", [override])


def test_confirm_needs_a_search_space_and_is_off_by_default() -> None:
    assert load_search(REPO / "searches" / "quickstart.yaml", []).tune.confirm is None
    with pytest.raises(ConfigError, match="confirm needs a search space"):
        load_search(REPO / "searches" / "quickstart.yaml",
                    ["tune.search_space={}", "tune.confirm={top_k: 1, seeds: 2}"])


@pytest.mark.parametrize("kind", ["pbt", "pb2"])
def test_confirm_of_a_population_is_one_line_and_exit_2_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A population's trials train on a schedule of values: re-running the last ones from
    scratch confirms a run none of them was, so tune.confirm on pbt/pb2 is refused."""
    text = (REPO / "searches" / "pbt_temperature.yaml").read_text()
    path = tmp_path / "search.yaml"
    scheduler = "  scheduler: {type: pbt,"
    assert scheduler in text
    path.write_text(text.replace(scheduler, "  confirm: {top_k: 1, seeds: 2}\n"
                                 + scheduler.replace("pbt", kind)))
    assert main([str(path), "--storage", str(tmp_path / "ray"),
                 "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {path}: tune.confirm: not with tune.scheduler.type {kind}")
    assert not (tmp_path / "ray").exists() and not (tmp_path / "mlflow.db").exists()


def test_confirm_space_pins_each_seeds_configuration() -> None:
    from ray.tune.search.variant_generator import generate_variants

    from raycl.sweep.confirm_tuner import confirm_space

    space = confirm_space([{"lr": 0.1, "tau": 0.2}, {"lr": 0.3, "tau": 0.4}], [[11, 12], [21, 22]])
    configs = [config for _, config in generate_variants(space)]
    assert sorted((c["seed"], c["lr"], c["tau"]) for c in configs) == [
        (11, 0.1, 0.2), (12, 0.1, 0.2), (21, 0.3, 0.4), (22, 0.3, 0.4)]


def confirm_children(uri: str, name: str) -> list:
    """The confirmation's child runs of sweep ``name`` (none before its experiment exists)."""
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`{CONFIRM_TAG}` LIKE '%'")


def sigint_once(check: Callable[[], bool], stop: threading.Event) -> threading.Thread:
    """A thread that sends this process SIGINT (Ctrl+C) once ``check()`` holds: Tune's handler
    in the main thread, where ``main`` runs the sweep, takes it."""
    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # the store being created, or busy
                if check():
                    os.kill(os.getpid(), signal.SIGINT)
                    return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def signal_handlers_kept() -> Iterator[None]:
    """The handlers of SIGINT and SIGUSR1 as they were: the in-process sweeps install Tune's,
    and the test's Ctrl+C sets the stop event of one (read by raycl.tracking.tune_stop)."""
    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGUSR1)}
    yield
    for number, handler in before.items():
        signal.signal(number, handler)


def test_quickstart_confirms_its_winner_over_two_seeds_through_sigint_and_sigkill(
    ray_session, data_cache, tmp_path, capsys, signal_handlers_kept
) -> None:
    """A quickstart sweep confirming its winner over two seeds, stopped twice in the middle of
    its confirmation and resumed with the same command each time: Ctrl+C once the first
    confirmation trial runs (exit 130, parent KILLED), then SIGKILL to a second driver (joined
    to the same Ray) once one seed has finished and the other runs. The third driver
    finishes (exit 0): one parent run FINISHED, the search's trials not run again, one child
    run per confirmation seed, each epoch logged once, a confirmation run finished before the
    SIGKILL left as it was, and confirm.csv over both seeds."""
    name, uri = "e2e-confirm", f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = quickstart_args(tmp_path)
    args[args.index("train.epochs=2")] = "train.epochs=1"
    args[args.index("e2e-quick")] = name
    # The torch probe: a trial process then never imports scikit-learn (~1.5 s of CPU in each
    # of the four trial processes of the three drivers).
    args += ["--set", NO_PLOTS, "--set", "tune.confirm={top_k: 1, seeds: 2}",
             "--set", "eval.linear_backend=torch"]

    # 1. Ctrl+C once a confirmation trial has its run: the search is done, a seed is left.
    # MLflow is asked only once the confirmation's Tuner directory exists (not while searching).
    started = tmp_path / "ray" / f"{name}-confirm"
    stop = threading.Event()
    watcher = sigint_once(lambda: started.exists() and bool(confirm_children(uri, name)), stop)
    try:
        assert main(args) == 130
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert "interrupted; run the same command again" in capsys.readouterr().err
    client, (parent,), children = runs_of(tmp_path, name)
    assert parent.info.status == "KILLED" and parent.data.tags["raycl.interrupted"] == "true"
    search = {c.info.run_id: c for c in children if CONFIRM_TAG not in c.data.tags}
    assert len(search) == 2
    first = confirm_children(uri, name)
    assert 1 <= len(first) <= 2
    for child in first:  # the one Tune stopped is marked so (a Ctrl+C between two: none is)
        assert child.info.status in ("FINISHED", "KILLED"), child.data.tags
        if child.info.status == "KILLED":
            assert child.data.tags["raycl.ended"] == "interrupted"
    finished_before = sum(c.info.status == "FINISHED" for c in first)

    # 2. The same command in a driver of its own, SIGKILLed mid-confirmation: once a seed has
    # finished and the other runs (or has finished since this driver started).
    def confirming() -> list | None:
        runs = confirm_children(uri, name)
        done = [r for r in runs if r.info.status == "FINISHED"]
        running = any(r.info.status == "RUNNING" for r in runs)
        return done if done and (running or len(done) > finished_before) else None

    gcs = ray_session.get_runtime_context().gcs_address
    log = tmp_path / "killed.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": gcs}
    killed = spawn([sys.executable, "-m", "raycl.tune", *args, "--address", gcs], log=log,
                   env=env)
    try:
        done_at_kill = wait_until(confirming, killed.process, log, timeout_s=300)
        killed.process.kill()  # the driver alone, outright: the shared Ray stays up
        killed.process.wait(timeout=30)
    finally:
        killed.stop(grace_s=5)
    assert "resuming the seed confirmation of 'e2e-confirm'" in log.read_text()

    # 3. The same command again: it finishes the confirmation.
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "resuming the seed confirmation of 'e2e-confirm'" in printed
    assert "seed confirmation (mean and 95 % interval over seeds):" in printed
    client, parents, children = runs_of(tmp_path, name)
    (parent,) = parents
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["raycl.interrupted"] == "false"
    confirm = [c for c in children if CONFIRM_TAG in c.data.tags]
    # The search's trials were not run again; one run per confirmation seed, each epoch once.
    assert {c.info.run_id: c.info.end_time for c in children if CONFIRM_TAG not in c.data.tags} \
        == {run_id: c.info.end_time for run_id, c in search.items()}
    assert sorted(c.data.params["seed"] for c in confirm) == [str(SEED_STRIDE),
                                                               str(SEED_STRIDE + 1)]
    winner = max(search.values(), key=lambda c: c.data.metrics.get("val/linear/mean", -1.0))
    for child in confirm:
        assert child.info.status == "FINISHED" and child.data.tags["raycl.ended"] == "completed"
        assert child.data.tags[PARENT_TAG] == parent.info.run_id
        assert child.data.tags[CONFIRM_TAG] == "1" and child.info.run_name.startswith("c1 ")
        for key in ("simclr.temperature", "train.lr"):
            assert child.data.params[key] == winner.data.params[key]
        assert "test/linear/mean" in child.data.metrics
        for key in ("train/loss", "val/linear/mean"):
            assert [m.step for m in client.get_metric_history(child.info.run_id, key)] == [1]
    for before in done_at_kill:  # finished before the SIGKILL: not run again
        assert client.get_run(before.info.run_id).info.end_time == before.info.end_time
    # The search's winner record and leaderboard stay the search's.
    assert parent.data.tags["raycl.best_run"] == winner.info.run_id
    _, rows, _ = leaderboard_rows(uri, name)
    assert len(rows) == 2

    local = client.download_artifacts(parent.info.run_id, "confirm.csv", str(tmp_path))
    with open(local, newline="") as handle:
        (row,) = list(csv.DictReader(handle))
    values = [float(c.data.metrics["val/linear/mean"]) for c in confirm]
    mean, low, high = t_interval(values)
    assert float(row["val/linear/mean mean"]) == pytest.approx(mean)
    assert float(row["val/linear/mean ci95_low"]) == pytest.approx(low)
    assert float(row["val/linear/mean ci95_high"]) == pytest.approx(high)
    assert float(row["test/linear/mean ci95_high"]) >= float(row["test/linear/mean mean"])
    assert row["seeds"] == f"{SEED_STRIDE} {SEED_STRIDE + 1}" and row["n"] == "2"
    assert row["dropped"] == ""  # both seeds finished: none left out
    assert "the interval of #1 (" in printed and "is over 2 of 2 planned seeds" in printed

    # Each confirmation seed's own Trifeature copy is gone, also the one that finished before
    # the SIGKILL (removed at the third driver's end); the search seed's copy stays.
    from raycl.data.cache.store import cache_path
    from raycl.data.registry import reader

    data = load_search(REPO / "searches" / "quickstart.yaml", list(TINY)).data
    trifeature = reader("trifeature")
    assert cache_path(data, trifeature.content_key(data, 0)).is_dir()
    for seed in (SEED_STRIDE, SEED_STRIDE + 1):
        assert not cache_path(data, trifeature.content_key(data, seed)).exists()
    # Paired seeds on the search's data (issue 47): each seed drew its initialisation and
    # augmentations only, so no seed built a set of its own.
    assert {child.data.params["data.seed"] for child in confirm} == {"0"}
    # One winner everywhere: the parent names the confirmed configuration's search trial, its
    # description carries the confirmation, and --trial best finds it.
    assert parent.data.tags[CONFIRMED_RUN_TAG] == winner.info.run_id
    assert "**Seed confirmation**" in parent.data.tags[NOTE_TAG]
    assert "--trial best now names" in printed
    assert find_trials(uri, name, "best")[0].run_id == winner.info.run_id


def test_resumed_confirmation_keeps_its_choice_and_a_stale_one_is_set_aside(tmp_path) -> None:
    """A re-run of the sweep (same parent run) confirms what the first run chose, even when the
    search's results would now choose otherwise; a confirmation left by an earlier sweep of the
    name (another parent run: --fresh) is moved aside, never restored into this one. A fresh
    choice is among the trials whose runs may be ranked: never one still running (or failed,
    killed), whatever its last objective."""
    from types import SimpleNamespace

    from raycl.sweep.confirm_tuner import CHOICE_FILE, _choose, _write_choice, confirm_path
    from raycl.tracking.runs import ENDED_TAG, ROLE_TAG, TRIAL_TAG, mlflow_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_search(REPO / "searches" / "quickstart.yaml", [
        "name=resumed", f"tune.storage_path={tmp_path}", "tune.confirm={top_k: 1, seeds: 2}",
        f"mlflow.tracking_uri={uri}"])
    path = confirm_path(config)
    stored = {"parent_run_id": "p1", "configurations": [{"train.lr": 0.001}],
              "seeds": [[SEED_STRIDE, SEED_STRIDE + 1]]}
    _write_choice(path, stored)
    Path(path, "tuner.pkl").write_bytes(b"")  # what Tuner.can_restore looks for
    client = mlflow_client(uri)
    experiment = client.create_experiment("resumed")
    parent = client.create_run(experiment, tags={ROLE_TAG: "sweep"}).info.run_id
    for trial_id, ended in (("a1", "completed"), ("a2", None)):  # a2's run still runs
        run_id = client.create_run(experiment, tags={
            ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: trial_id,
            **({ENDED_TAG: ended} if ended else {})}).info.run_id
        if ended:
            client.set_terminated(run_id)
    results = [SimpleNamespace(config={"train.lr": lr}, error=None,
                               metrics={"val/linear/mean": value, "trial_id": trial_id})
               for lr, value, trial_id in ((0.004, 0.9, "a1"), (0.008, 0.95, "a2"))]
    assert _choose(config, results, "p1") == stored

    fresh = _choose(config, results, parent)
    assert fresh == {"parent_run_id": parent, "configurations": [{"train.lr": 0.004}],
                     "seeds": [[SEED_STRIDE, SEED_STRIDE + 1]]}
    assert not Path(path).exists()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("resumed-confirm.")]
    assert (aside / CHOICE_FILE).is_file()
