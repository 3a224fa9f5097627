"""Servers the tests start on loopback (a Ray head, MLflow): a free port, waiting until one
answers, and stopping everything it spawned by the process group the test started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

# Ray Train's controller collects a worker's report when it polls the workers' health (every 2 s
# by default), and the worker's next report waits for that: a test epoch of 0.1 s would take
# 2 s. Set for every Ray the suite starts (tests/conftest.py; the tests that start Ray from a
# cleared environment pass it on).
TRAIN_POLL = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_http(url: str, process: subprocess.Popen, timeout_s: float,
                  any_status: bool = True) -> None:
    """Return once ``url`` answers: with any HTTP status (a head that wants its token answers
    401), or only 200 when not ``any_status``. Raises RuntimeError when ``process`` exits first,
    TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            if any_status:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def stop_group(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the process group a test started (``start_new_session=True``: the server and
    its workers), SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)  # anyone of the group left?
            except ProcessLookupError:
                return
            process.poll()
            time.sleep(0.2)
