"""Issue 46, finding 13: does a driver SIGKILLed mid-sweep duplicate or lose work on re-run?

Runs ``python -m raycl.tune searches/quickstart.yaml --set train.epochs=4 --num-samples 2
--set tune.scheduler.type=none`` in its own process group, SIGKILLs the group as soon as a
trial whose run name starts with ``--kill-at`` (``t01``: during trial 1's first epoch; ``t02``:
during the last trial) has a ``train/loss`` in MLflow, runs the same command again, and prints
every run with how many times each epoch and evaluation was logged (each should be 1), and how
many "Error handling checkpoint" lines the re-run printed (should be 0).

    .venv/bin/python tools/driver_kill.py /var/tmp/driver-kill --kill-at t01
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _losses(db: Path) -> list[str]:
    """Run names that have logged a train/loss."""
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db) as connection:
            return [name for (name,) in connection.execute(
                "select r.name from metrics m join runs r on r.run_uuid = m.run_uuid "
                "where m.key = 'train/loss'")]
    except sqlite3.Error:  # the store is being created
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="an empty folder for the sweep's files")
    parser.add_argument("--kill-at", default="t01", help="run-name prefix of the trial")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    db = args.work / "mlflow.db"
    command = [sys.executable, "-m", "raycl.tune", str(REPO / "searches" / "quickstart.yaml"),
               "--set", "train.epochs=4", "--num-samples", "2",
               "--set", "tune.scheduler.type=none", "--tracking-uri", f"sqlite:///{db}",
               "--storage", str(args.work / "ray_results"), "--name", "driver-kill"]
    with (args.work / "first.log").open("w") as log:
        driver = subprocess.Popen(command, cwd=args.work, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        started = time.time()
        while driver.poll() is None and time.time() - started < 900:
            if any(name.startswith(args.kill_at) for name in _losses(db)):
                os.killpg(driver.pid, signal.SIGKILL)
                print(f"killed after {time.time() - started:.0f} s", flush=True)
                break
            time.sleep(0.5)
        driver.wait()
    with (args.work / "second.log").open("w") as log:
        code = subprocess.run(command, cwd=args.work, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, timeout=1800).returncode
    errors = (args.work / "second.log").read_text().count("Error handling checkpoint")
    print(f"re-run exit code {code}; 'Error handling checkpoint' lines: {errors}")
    with sqlite3.connect(db) as connection:
        for name, status, run_id in connection.execute("select name, status, run_uuid from runs"):
            logged = connection.execute(
                "select key, step, count(*) from metrics where run_uuid = ? and key in "
                "('train/epoch', 'val/linear/mean') group by key, step", (run_id,)).fetchall()
            print(name, status, logged)


if __name__ == "__main__":
    main()
