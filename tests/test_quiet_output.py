"""Quiet means quiet: other processes' chatter that Ray forwards is left out of a quiet sweep
(``-v`` keeps it), and output piped into a reader that stops early ends without a traceback."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from raycl.sweep.display import quiet_ray
from raycl.sweep.quiet_lines import DropLines

REPO = Path(__file__).resolve().parents[1]

# What a quiet stream-mode sweep printed (Ray 2.60, Optuna's grid sampler, the raylet).
CHATTER = [
    "\u2714\ufe0f  Dataset dataset_0353kzQ8DuDJkRMtfYLbtx_0 execution finished in 46.58 seconds",
    "(run_trial pid=4242) \u2714\ufe0f  Dataset dataset_7_0 execution finished in 0.51 seconds",
    "Progress bars disabled. To enable, set "
    "`ray.data.DataContext.get_current().enable_progress_bars = True`.",
    "(raylet) WARNING: 12 PYTHON worker processes have been started on node: 5f0c1d2e3a4b with "
    "address: 127.0.0.1, which is 6x the maximum expected startup concurrency (2).",
    "  This could be a result of using a large number of actors, or tasks blocked in ray.get()",
    "2026-11-25 14:32:17,208\tWARNING optuna_search.py:571 -- `Study.stop` is supposed to be "
    "invoked inside an objective function or a callback. job_id=01000000 worker_id=01000000ff "
    "node_id=d740cc21320f6d46 timestamp_ns=1795617137208817141",
]
# A warning that stays loses the ids Ray's log format appends.
WARNING = ("2026-11-25 14:32:17,208\tWARNING tune.py:1 -- No trial is running. job_id=01000000 "
           "worker_id=01000000ff node_id=d740cc21320f6d46 timestamp_ns=1795617137208817141")
KEPT = [
    "[00:34] t01 τ=0.24 lr=0.0026: epoch 1/1: val/linear/mean 0.6613, train/loss 4.156",
    "\u26a0\ufe0f Dataset dataset_9_0 execution failed",
    "(run_trial pid=4242) Traceback (most recent call last):",
    "  File \"raycl/trial/trainable.py\", line 1, in run_trial",
    "raycl: warning: scaling.num_workers: trials wait until an autoscaler adds nodes",
]


def test_chatter_lines_are_dropped_and_the_rest_kept_whole() -> None:
    out = io.StringIO()
    stream = DropLines(out)
    text = "\n".join([KEPT[0], *CHATTER, *KEPT[1:], WARNING]) + "\n"
    for start in range(0, len(text), 7):  # written in pieces, as print and Ray's threads do
        stream.write(text[start:start + 7])
    stream.write("partial")
    # The indented line after a kept one stays; the one after a dropped one goes with it.
    assert out.getvalue().splitlines() == [
        *KEPT, "2026-11-25 14:32:17,208\tWARNING tune.py:1 -- No trial is running."]
    stream.flush()
    assert out.getvalue().endswith("\npartial")


def test_quiet_ray_filters_the_streams_and_verbose_does_not(
        capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    tune_search = logging.getLogger("ray.tune.search.optuna.optuna_search")
    with quiet_ray(verbose=False):
        print(CHATTER[0])
        print(KEPT[0], file=sys.stderr)
        record = tune_search.makeRecord(tune_search.name, logging.WARNING, "f", 1, RuntimeError(
            "`Study.stop` is supposed to be invoked inside an objective function or a "
            "callback."), None, None)
        assert not tune_search.filter(record)  # the driver's own log record, dropped too
        slow = logging.getLogger("ray.tune.utils.util")
        assert not slow.filter(slow.makeRecord(
            slow.name, logging.WARNING, "f", 1, "The `choose_trial_to_run` operation took 0.845 "
            "s, which may be a performance bottleneck.", None, None))
    with quiet_ray(verbose=True):
        print(CHATTER[0])
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [CHATTER[0]]  # once: under -v
    assert captured.err.splitlines() == [KEPT[0]]
    assert not isinstance(sys.stdout, DropLines) and not isinstance(sys.stderr, DropLines)


def _sweep_store(tmp_path: Path) -> str:
    """A sqlite MLflow store holding one finished two-trial sweep (no Ray)."""
    from raycl.config.search_config import search_config_class
    from raycl.tracking.callback import MLflowSweepCallback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = search_config_class().model_validate(
        {"name": "piped", "train": {"epochs": 2}, "mlflow": {"tracking_uri": uri},
         "tune": {"search_space": {"simclr.temperature": {"loguniform": [0.1, 0.5]}}}})
    callback = MLflowSweepCallback(config)
    callback.setup()
    for n, temperature in ((1, 0.2), (2, 0.4)):
        trial = type("Trial", (), {
            "trial_id": f"piped{n}", "config": {"simclr.temperature": temperature},
            "experiment_tag": f"{n}_x", "error_file": None, "metric_analysis": {},
            "status": "RUNNING", "__str__": lambda self: f"run_trial_{self.trial_id}"})()
        result = {"stage": 0, "epoch": 2, "global_epoch": 2, "val/linear/mean": 0.1 * n}
        trial.last_result = result
        callback.on_trial_start(0, [], trial)
        callback.on_trial_result(0, [], trial, result)
        callback.on_trial_complete(0, [], trial)
    return uri


def test_a_leaderboard_piped_into_a_reader_that_stops_ends_without_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m raycl.leaderboard | head -1`: the reader's end of the pipe closes before the
    table is written (as head's does after its line); no traceback, no "Exception ignored"."""
    uri = _sweep_store(tmp_path)
    for command in (["raycl.leaderboard", "--tracking-uri", uri],
                    ["raycl.tune", "--show-schema"]):  # raycl.tune's own output too
        process = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, cwd=tmp_path, text=True)
        assert process.stdout is not None
        process.stdout.close()  # before the child has written anything: every write fails
        _, err = process.communicate(timeout=120)
        assert "Traceback" not in err and "BrokenPipeError" not in err, (command, err)
        assert process.returncode in (0, 1), command
    # Read whole, the same leaderboard is a table (so the piped one had lines to write).
    from raycl.leaderboard import main

    assert main(["--tracking-uri", uri]) == 0
    assert "t02 τ=0.4" in capsys.readouterr().out
