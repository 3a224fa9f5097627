"""Servers the tests start on loopback (a Ray head, MLflow, PostgreSQL, the cloud scenarios'
process): a free port, a short temp directory, waiting until one answers, and one way to start
and stop them all.

Every process a test starts goes through :func:`spawn` (or, for a command that daemonizes, such
as ``pg_ctl start``, runs with the environment of :func:`marked_env`). Its environment carries
``RAYCL_TEST_SPAWNS``: the token of every spawn it descends from, each naming the process that
spawned it (pid and start time). Everything a process starts inherits its environment — a
daemon that leaves the process group included (PostgreSQL's postmaster, which ``pg_ctl``
detaches with setsid; Ray's workers, each in a process group of its own) — so a scan of /proc
finds the whole tree. What was spawned is stopped:

- by its handle's :meth:`Spawned.stop` (a fixture's ``finally``, or :func:`running`);
- by :func:`stop_all` for everything this process spawned: ``pytest_sessionfinish`` (which runs
  after a failed fixture and after Ctrl-C too; tests/conftest.py), and atexit;
- when the spawning process died without either (SIGKILL): the direct child gets SIGTERM from
  the kernel (PR_SET_PDEATHSIG, set by util-linux's ``setpriv``), and the next test session
  stops whatever still names a dead spawner (:func:`stop_orphans`, tests/conftest.py).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Ray Train's controller collects a worker's report when it polls the workers' health (every 2 s
# by default), and the worker's next report waits for that: a test epoch of 0.1 s would take
# 2 s. Set for every Ray the suite starts (tests/conftest.py; the tests that start Ray from a
# cleared environment pass it on).
TRAIN_POLL = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# An MLflow server (``python -m raycl.server``, ``mlflow ui``) starts seven huey consumers for
# MLflow's job runner, which nothing in raycl or the tests uses: ~16 s of CPU to start and ~0.3
# of a core while they poll, taken from the trials the test waits on. Every spawn turns it off.
NO_MLFLOW_JOBS = ("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")

MARKER = "RAYCL_TEST_SPAWNS"  # the spawn tokens a process descends from, space-separated
# Ray's unix sockets live at TEMP/ray/session_<date>_<pid>/sockets/plasma_store, and a socket
# path has at most 107 bytes: a temp root longer than this leaves too little room.
LONGEST_TEMP_ROOT = 40
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None
_spawns = itertools.count(1)
_at_exit: list[bool] = []  # whether stop_all is registered with atexit yet


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_s3(monkeypatch: Any) -> Iterator[tuple[Any, int]]:
    """A local S3 (moto's threaded server on a free port) with test credentials: yields a boto3
    client of it and its port (``?endpoint_override=127.0.0.1:<port>&scheme=http`` in a URI);
    skips the test when boto3 or moto is missing.

    Args:
        monkeypatch: the test's ``monkeypatch`` (the AWS variables are set through it).
    """
    import logging

    import pytest

    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}"), port
    finally:
        server.stop()


def short_temp_dir(prefix: str) -> Path:
    """A new directory under the temp directory ($TMPDIR), or under /tmp where that path is too
    long for Ray's unix sockets (macOS's is ~50 bytes)."""
    base = tempfile.gettempdir()
    if len(base) > LONGEST_TEMP_ROOT:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def wait_for_http(url: str, process: subprocess.Popen, timeout_s: float,
                  any_status: bool = True) -> None:
    """Return once ``url`` answers: with any HTTP status (a head that wants its token answers
    401), or only 200 when not ``any_status``. Raises RuntimeError when ``process`` exits first,
    TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{_shown(process.args)[:4]} exited with {process.returncode}")
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


@dataclass
class Spawned:
    """One spawn: its token (in the environment of every process it started) and, when started
    by :func:`spawn`, the process, leader of a process group of its own."""

    token: str
    process: subprocess.Popen | None = None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process group and to every process that carries the token, SIGKILL to
        what is left after ``grace_s``."""
        group = None
        if self.process is not None and self.process.poll() is None:
            group = self.process.pid  # not reaped yet: the group id is still its own
        _terminate(lambda: _find(lambda chain, pgrp: self.token in chain or pgrp == group),
                   grace_s)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)


def marked_env(env: dict[str, str] | None = None) -> tuple[dict[str, str], Spawned]:
    """``env`` (default: this process's) with a new spawn token added to the marker, and the
    handle that stops everything started with it."""
    token = f"{_owner(os.getpid())}#{next(_spawns)}"
    marked = dict(os.environ if env is None else env)
    # The chain comes from this process's own environment: a spawn inside a spawn (the cloud
    # scenarios' PostgreSQL) is still found by the outer one's token.
    marked[MARKER] = " ".join([*os.environ.get(MARKER, "").split(), token])
    marked.setdefault(*NO_MLFLOW_JOBS)
    if not _at_exit:
        atexit.register(stop_all)
        _at_exit.append(True)
    return marked, Spawned(token)


def spawn(command: list[str], *, log: Path | None = None, env: dict[str, str] | None = None,
          cwd: Path | str | None = None) -> Spawned:
    """``command`` in a new session (its own process group), marked (:func:`marked_env`), its
    output appended to ``log`` (else discarded); SIGTERMed by the kernel should this process
    die first."""
    marked, handle = marked_env(env)
    prefix = [_SETPRIV, "--pdeathsig", "TERM", "--"] if _SETPRIV else []
    out = log.open("ab") if log is not None else None
    try:
        handle.process = subprocess.Popen(
            [*prefix, *command], env=marked, cwd=cwd, start_new_session=True,
            stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT)
    finally:
        if out is not None:
            out.close()  # the child holds its own copy
    return handle


@contextlib.contextmanager
def running(command: list[str], grace_s: float = 20.0, **options: object) -> Iterator[Spawned]:
    """:func:`spawn`, stopped when the block ends, however it ends."""
    handle = spawn(command, **options)  # type: ignore[arg-type]
    try:
        yield handle
    finally:
        handle.stop(grace_s)


def stop_group(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the process group of ``process`` (started with ``start_new_session=True``),
    SIGKILL to what is left after ``grace_s``. (A process from :func:`spawn`: its handle's
    ``stop``, which also finds what left the group.)"""
    if process.poll() is None:
        group = process.pid
        _terminate(lambda: _find(lambda chain, pgrp: pgrp == group), grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def stop_all(grace_s: float = 10.0) -> int:
    """Stop everything this process spawned and has not stopped yet; how many were left."""
    owner = _owner(os.getpid())
    return _terminate(lambda: _find(
        lambda chain, pgrp: any(token.split("#")[0] == owner for token in chain)), grace_s)


def stop_orphans(grace_s: float = 5.0) -> int:
    """Stop every marked process whose spawner, or a spawner above it, is gone (a test session
    killed outright); how many there were."""
    alive: dict[str, bool] = {}

    def orphaned(chain: list[str], _pgrp: int) -> bool:
        for token in chain:
            owner = token.split("#")[0]
            if owner not in alive:
                pid, _, started = owner.partition("@")
                alive[owner] = pid.isdigit() and _start_time(int(pid)) == started
            if not alive[owner]:
                return True
        return False

    return _terminate(lambda: _find(orphaned), grace_s)


def marked_processes(token: str) -> list[int]:
    """The live processes that carry ``token`` (a test's check that nothing survived)."""
    return sorted(_find(lambda chain, _pgrp: token in chain))


def _shown(args: object) -> list[str]:
    """A spawned command's arguments without the ``setpriv`` launcher."""
    shown = [str(arg) for arg in args] if isinstance(args, (list, tuple)) else [str(args)]
    return shown[4:] if _SETPRIV and shown[:1] == [_SETPRIV] else shown


def _owner(pid: int) -> str:
    """A process named so that a later one with the same pid is not taken for it."""
    return f"{pid}@{_start_time(pid)}"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, … (None: gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields else None  # starttime, field 22 of proc(5)


def _chain(pid: int) -> list[str]:
    """The spawn tokens in a process's environment (as it was started)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return []
    prefix = MARKER.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace").split()
    return []


def _find(match: Callable[[list[str], int], bool]) -> set[int]:
    """Live processes (not zombies) for which ``match(chain, pgrp)`` holds; never this process
    or one of its ancestors (a test session that was itself spawned carries a token too)."""
    if not Path("/proc").is_dir():
        return set()  # not Linux: the handles' process groups are all there is
    spared, pid = set(), os.getpid()
    while pid > 1 and pid not in spared:
        spared.add(pid)
        fields = _stat(pid)
        pid = int(fields[1]) if fields else 0
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        fields = _stat(int(entry.name))
        if fields and fields[0] != "Z" and match(_chain(int(entry.name)), int(fields[2])):
            found.add(int(entry.name))
    return found


def _terminate(find: Callable[[], set[int]], grace_s: float) -> int:
    """SIGTERM to what ``find`` returns, again as it turns up, until nothing is left or
    ``grace_s`` passed; then SIGKILL, likewise for 10 s. How many were found first."""
    first = find()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        deadline, signalled = time.monotonic() + wait_s, set()
        while True:
            left = find()
            if not left:
                return len(first)
            for pid in left - signalled:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            signalled |= left
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    return len(first)
