"""What a sweep prints: raycl's progress lines and summary (fake trials, no Ray run), and the
leaderboard cut to the terminal's width."""

from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from raycl.config.search_config import search_config_class
from raycl.methods import SearchConfig
from raycl.sweep.display import ProgressDisplay, fmt_duration, quiet_ray
from raycl.tracking.trial_table import format_table
from raycl.worker.outcome import FAIL_REASON_KEY, FAILED_KEY

SPACE = {"simclr.temperature": {"loguniform": [0.1, 0.5]},
         "train.lr": {"loguniform": [0.0005, 0.005]}}


@dataclass
class FakeTrial:
    """What the display reads of a Tune trial."""

    trial_id: str
    config: dict
    experiment_tag: str
    last_result: dict = field(default_factory=dict)
    metric_analysis: dict = field(default_factory=dict)
    status: str = "PENDING"
    error_file: str | None = None
    num_failures: int = 0


def _config(**tune: object) -> SearchConfig:
    raw = {"name": "demo", "method": "simclr", "train": {"epochs": 8},
           "tune": {"num_samples": 3, "search_space": SPACE,
                    "scheduler": {"type": "asha", "grace_period": 2}, **tune}}
    return search_config_class().model_validate(raw)


def _trial(n: int, temperature: float, lr: float) -> FakeTrial:
    return FakeTrial(f"id{n}", {"simclr.temperature": temperature, "train.lr": lr},
                     f"{n}_simclr_temperature={temperature}")


def _report(trial: FakeTrial, epoch: int, objective: float | None, seconds: float) -> dict:
    result = {"epoch": epoch, "stage": 0, "global_epoch": epoch, "training_iteration": epoch,
              "train/loss": 4.123456, "time_total_s": seconds}
    if objective is not None:
        result["val/linear/mean"] = objective
        trial.metric_analysis = {"val/linear/mean": {"last": objective}}
    trial.last_result = result
    return result


def test_lines_name_each_trial_event_as_mlflow_does(capsys: pytest.CaptureFixture) -> None:
    display = ProgressDisplay(_config())
    display.setup(total_num_samples=3)
    first, second, third = _trial(1, 0.24188, 0.002551), _trial(2, 0.3, 0.001), _trial(3, 0.2, 1e-3)
    for trial in (first, second):
        trial.status = "RUNNING"
        display.on_trial_start(0, [], trial)
    display.on_trial_result(0, [], first, _report(first, 1, None, 10.0))  # no evaluation: silent
    display.on_trial_result(0, [], first, _report(first, 2, 0.412345, 20.0))
    _report(first, 8, 0.512345, 80.0)
    display.on_trial_complete(0, [], first)
    display.on_trial_result(0, [], second, _report(second, 2, 0.3, 20.0))
    display.on_trial_complete(0, [], second)  # Tune calls a trial ASHA stopped complete too
    third.last_result = {FAILED_KEY: 1.0, FAIL_REASON_KEY: "loss is nan at step 12"}
    display.on_trial_complete(0, [], third)
    lines = capsys.readouterr().out.splitlines()

    assert "sweep 'demo': 3 trial(s) of simclr, objective val/linear/mean (max)" in lines[0]
    assert lines[1].endswith("t01 τ=0.24 lr=0.0026: started with "
                             "simclr.temperature=0.2419, train.lr=0.002551")
    assert lines[3].endswith("t01 τ=0.24 lr=0.0026: epoch 2/8: val/linear/mean 0.4123, "
                             "train/loss 4.123")
    assert lines[4].endswith("t01 τ=0.24 lr=0.0026: finished: val/linear/mean 0.5123 (1m20s)")
    assert lines[6].endswith("t02 τ=0.3 lr=0.001: stopped early by ASHA after epoch 2/8: "
                             "val/linear/mean 0.3 (20s)")
    assert lines[7].endswith("t03 τ=0.2 lr=0.001: failed: loss is nan at step 12")
    assert all(line.startswith("[00:0") for line in lines)
    assert len(lines) == 8


def test_errors_skips_and_retries_say_why(tmp_path: Path, capsys) -> None:
    display = ProgressDisplay(_config())
    error = tmp_path / "error.txt"
    error.write_text("Traceback (most recent call last):\n  File x\nRuntimeError: boom\n\n")
    crashed = _trial(1, 0.2, 0.001)
    crashed.error_file, crashed.num_failures = str(error), 1
    display.on_trial_recover(0, [], crashed)
    display.on_trial_error(0, [], crashed)
    skipped = _trial(2, 0.2, 0.001)
    skipped.last_result = {"raycl/skipped": 1.0, "raycl/skip_reason": "K^N=27 > M/b=4"}
    display.on_trial_complete(0, [], skipped)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("t01 τ=0.2 lr=0.001: crashed (RuntimeError: boom); retrying from its "
                           "last checkpoint (failure 1 of 1 allowed)")
    assert out[1].endswith("t01 τ=0.2 lr=0.001: failed: RuntimeError: boom")
    assert out[2].endswith("t02 τ=0.2 lr=0.001: skipped: K^N=27 > M/b=4")


def test_summary_counts_best_and_estimate() -> None:
    display = ProgressDisplay(_config())
    done, running = _trial(1, 0.24, 0.002), _trial(2, 0.3, 0.001)
    for epoch in range(1, 5):  # stopped by ASHA after 4 of 8 epochs
        display.on_trial_result(0, [], done, _report(done, epoch, 0.51234567, 10.0 * epoch))
    done.status = "TERMINATED"
    for epoch in (1, 2):
        display.on_trial_result(0, [], running, _report(running, epoch, 0.6, 10.0 * epoch))
    running.status = "RUNNING"
    display._start = time.monotonic() - 60  # 6 epochs in 60 s: the sweep's pace, 10 s each
    text = display.summary([done, running])
    assert text.startswith("1 done, 1 running, 1 pending of 3 · best val/linear/mean 0.6 "
                           "(t02 τ=0.3 lr=0.001) · elapsed ")
    # Left under ASHA (grace 2, halving): rungs at epochs 2 and 4, so a new trial makes
    # 2 + 2/2 + 4/4 = 4 of its 8 epochs on average, and the running one (at epoch 2) 2 + 4/2
    # more: 8 epochs of 10 s. Every trial to its end would say 140 s.
    assert text.endswith("about 1m20s left (ASHA: ~4.0 of 8 epochs a trial) · now t02 τ=0.3 "
                         "lr=0.001 epoch 2/8")
    assert display.estimate_left([done], [running], 1, elapsed=60) == pytest.approx(80.0)
    # Without a scheduler: the running trial's 6 epochs, the pending one's 4 (as the ended one).
    fifo = ProgressDisplay(_config(scheduler={"type": "none"}))
    fifo._reports_seen, fifo._ended = 6, {"id1": "finished"}
    assert fifo.estimate_left([done], [running], 1, elapsed=60) == pytest.approx(100.0)
    assert "left ·" in fifo.summary([done, running])  # no ASHA note
    assert ProgressDisplay(_config()).estimate_left([], [], 3) is None  # nothing measured yet
    assert fmt_duration(3725) == "1h02m" and fmt_duration(59.6) == "1m00s"


def test_asha_time_left_follows_its_rungs() -> None:
    """A sweep of 16 pending trials of 16 epochs, grace 1, reduction 4 (rungs 1 and 4): a trial
    makes 1 + 3/4 + 12/16 = 2.5 epochs on average, not 16 (the estimate used to assume every
    trial ran to its end, several times too long)."""
    from raycl.sweep.display import asha_expected_reports

    assert asha_expected_reports(1, 4, 16) == pytest.approx(2.5)
    # A running trial past rung 1 makes 3 more, and a quarter of the 12 after rung 4; past
    # rung 4 it runs to its end.
    assert asha_expected_reports(1, 4, 16, reached=1) == pytest.approx(3 + 12 / 4)
    assert asha_expected_reports(1, 4, 16, reached=4) == 12
    assert asha_expected_reports(20, 2, 16) == 16  # no rung below the end: every epoch
    display = ProgressDisplay(search_config_class().model_validate(
        {"name": "a", "train": {"epochs": 16}, "eval": {"every_n_epochs": 1},
         "tune": {"num_samples": 16, "search_space": SPACE,
                  "scheduler": {"type": "asha", "grace_period": 1, "reduction_factor": 4}}}))
    display._reports_seen = 10
    assert display.estimate_left([], [], 16, elapsed=100) == pytest.approx(16 * 2.5 * 10)


def test_summary_says_where_each_running_trial_is() -> None:
    """What `ray job logs -f` shows every 30 s: each running trial's stage and epoch."""
    display = ProgressDisplay(_config(num_samples=6))
    trials = [_trial(n, 0.1 * n, 0.001) for n in range(1, 7)]
    for trial in trials:
        trial.status = "RUNNING"
    display.on_trial_result(0, [], trials[0], _report(trials[0], 3, None, 30.0))
    text = display.summary(trials)
    assert text.startswith("0 done, 6 running, 0 pending of 6 · elapsed ")
    assert text.endswith("· now t01 τ=0.1 lr=0.001 epoch 3/8, t02 τ=0.2 lr=0.001 starting, "
                         "t03 τ=0.3 lr=0.001 starting, t04 τ=0.4 lr=0.001 starting (+2 more)")
    mcl = ProgressDisplay(search_config_class().model_validate(
        {"name": "m", "method": "mcl", "train": {"epochs": 4}, "mcl": {"stages": 3}}))
    staged = FakeTrial("m1", {}, "1", status="RUNNING")
    staged.last_result = {"epoch": 2, "stage": 1, "training_iteration": 6}
    assert mcl.summary([staged]).endswith("· now t01 stage 2/3 epoch 2/4")


def test_display_never_breaks_a_sweep(caplog: pytest.LogCaptureFixture, capsys) -> None:
    display = ProgressDisplay(_config())
    broken = FakeTrial("x", None, "1")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="raycl.sweep.display"):
        display.on_trial_start(0, [], broken)
        display.on_trial_start(0, [], broken)
    assert [r.message for r in caplog.records].count(
        "raycl's progress display failed; the sweep goes on") == 1
    # Tune pickles its callbacks with the sweep's state.
    assert pickle.loads(pickle.dumps(display)).config.name == "demo"


def test_quiet_ray_turns_chatter_down_and_restores_it() -> None:
    import optuna

    before = optuna.logging.get_verbosity()
    tune_logger = logging.getLogger("ray.tune.tune")
    with quiet_ray(verbose=False):
        assert optuna.logging.get_verbosity() == optuna.logging.WARNING
        assert logging.getLogger("ray.train").level == logging.WARNING
        record = tune_logger.makeRecord(
            "ray.tune.tune", logging.WARNING, "f", 1, "Experiment has been interrupted, but "
            "the most recent state was saved.\nResume experiment with: Tuner.restore(...)",
            None, None)
        assert not tune_logger.filter(record)
    assert optuna.logging.get_verbosity() == before
    assert tune_logger.filter(record)


def test_leaderboard_fits_the_terminal() -> None:
    header = ["#", "trial", "status", "val/linear/mean", "test/linear/mean",
              "simclr.temperature", "train.lr", "diag/effective_rank", "val/linear/color"]
    rows = [["1", "t01 τ=0.24 lr=0.0026", "completed", "0.5123", "0.5012", "0.2419", "0.002551",
             "34.48", "0.99"]]
    full = format_table(header, rows)
    assert len(full.splitlines()[0]) > 100
    cut = format_table(header, rows, width=80)
    assert all(len(line) <= 80 for line in cut.splitlines())
    assert cut.splitlines()[0].split()[:5] == header[:5]
    assert cut.splitlines()[-1].startswith("4 more column(s) in leaderboard.csv and MLflow: "
                                           "simclr.temperature, ")
    # Narrower than the kept columns: the trial's name is cut, the objective stays.
    narrow = format_table(header, rows, width=45)
    assert "val/linear/mean" in narrow and "t01 τ=0.24 lr…" in narrow
    assert format_table(header, rows, width=500) == full


def test_verbose_keeps_rays_output(monkeypatch: pytest.MonkeyPatch) -> None:
    from raycl.tune import parse_args

    assert parse_args(["x.yaml", "-v"]).verbose and not parse_args(["x.yaml"]).verbose
    monkeypatch.delenv("RAY_AIR_NEW_OUTPUT", raising=False)
    level = logging.getLogger("ray.train").level
    with quiet_ray(verbose=True):
        assert "RAY_AIR_NEW_OUTPUT" not in os.environ  # Tune's own tables, as before
        assert logging.getLogger("ray.train").level == level
    with quiet_ray(verbose=False):
        assert os.environ["RAY_AIR_NEW_OUTPUT"] == "0"
    assert "RAY_AIR_NEW_OUTPUT" not in os.environ
