"""Every process a test starts is stopped, however the test ends (tests/local_servers.py).

Each test runs a small pytest session of its own, with tests/conftest.py's hooks, whose fixture
starts a server the way the suite's fixtures do (:func:`local_servers.spawn`: its own process
group) and a daemon that leaves the group and the session, as ``pg_ctl start`` leaves
PostgreSQL — and then fails on purpose, is interrupted with SIGINT, or is killed outright. A
marker set in that session's environment finds whatever of it is still running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from local_servers import Spawned, spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc; uses util-linux's setsid")

TESTS = Path(__file__).resolve().parent
INNER = '''
import os
import subprocess
import time
from pathlib import Path

import pytest
from local_servers import marked_env, spawn


@pytest.fixture
def servers():
    spawn(["sleep", "600"])  # a server in a process group of its own
    env, _ = marked_env()
    # A daemon in a session of its own, its starter gone: what `pg_ctl start` leaves.
    subprocess.run(["setsid", "-f", "sleep", "601"], env=env, check=True)
    if os.environ["MODE"] == "raise":
        Path(os.environ["READY"]).write_text("")
        raise RuntimeError("the fixture fails on purpose")
    yield


def test_with_servers(servers):
    # Ready only here: the outer test's signal lands in this test's sleep, not in pytest's own
    # code between the fixture and the test (a SIGINT there once left the session hanging).
    Path(os.environ["READY"]).write_text("")
    time.sleep(600)  # until the outer test interrupts or kills this session
'''


def survivors(probe: str) -> list[str]:
    """Command lines of the live processes whose environment carries ``probe``."""
    found, needle = [], probe.encode()
    for entry in Path("/proc").iterdir():
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # not a process, or gone
            continue
    return found


def inner_session(tmp_path: Path, mode: str, probe: str) -> tuple[Spawned, Path]:
    """A pytest session running :data:`INNER` with tests/conftest.py's hooks; the file its
    fixture writes once both servers run."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # its own root, no upward search
    (tmp_path / "test_inner.py").write_text(INNER)
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "MODE": mode, "READY": str(ready),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", probe.split("=")[0]: probe.split("=")[1]}
    env.pop("PYTEST_XDIST_WORKER", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
               "test_inner.py"]
    return spawn(command, env=env, cwd=tmp_path, log=tmp_path / "inner.log"), ready


def wait_until(condition: object, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def exit_code(inner: Spawned, log: Path, timeout_s: float = 60.0) -> int:
    """The inner session's exit code; its output in the failure should it not end in time."""
    assert inner.process is not None
    try:
        return inner.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        output = log.read_text(errors="replace")[-3000:] if log.is_file() else "(no output)"
        pytest.fail(f"the inner session did not end within {timeout_s:.0f} s:\n{output}")


@pytest.fixture
def probe() -> str:
    return f"RAYCL_CLEANUP_PROBE={uuid.uuid4().hex}"


def test_a_fixture_that_fails_after_starting_servers_leaves_none(tmp_path: Path,
                                                                  probe: str) -> None:
    """The fixture starts both and raises without stopping either: the session's end does."""
    inner, ready = inner_session(tmp_path, "raise", probe)
    try:
        assert exit_code(inner, tmp_path / "inner.log") == pytest.ExitCode.TESTS_FAILED
        log = (tmp_path / "inner.log").read_text()
        assert ready.exists() and "the fixture fails on purpose" in log, log
        assert survivors(probe) == []
    finally:
        inner.stop(grace_s=5)


def test_an_interrupted_session_leaves_none(tmp_path: Path, probe: str) -> None:
    """Ctrl-C (SIGINT) while the test runs with both servers up."""
    inner, ready = inner_session(tmp_path, "hold", probe)
    try:
        assert wait_until(lambda: ready.exists() and len(survivors(probe)) == 3)
        assert inner.process is not None
        os.kill(inner.process.pid, signal.SIGINT)
        assert exit_code(inner, tmp_path / "inner.log") == pytest.ExitCode.INTERRUPTED
        assert survivors(probe) == []
    finally:
        inner.stop(grace_s=5)


def test_a_killed_sessions_servers_are_stopped_by_the_next_session(tmp_path: Path,
                                                                   probe: str) -> None:
    """SIGKILL: no finaliser runs. The server in the session's own group goes with it (the
    kernel's parent-death signal); the daemon outlives it until the next session starts."""
    inner, ready = inner_session(tmp_path, "hold", probe)
    try:
        assert wait_until(lambda: ready.exists() and len(survivors(probe)) == 3)
        assert inner.process is not None
        os.kill(inner.process.pid, signal.SIGKILL)
        exit_code(inner, tmp_path / "inner.log")
        # The kernel signals the server at once; on a loaded machine (CI) it may take seconds to go.
        assert wait_until(lambda: len(survivors(probe)) == 1, 30), survivors(probe)
        assert survivors(probe) == ["sleep 601 "]
        env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        env.pop("PYTEST_XDIST_WORKER", None)
        following = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
             "--collect-only", "test_inner.py"], cwd=tmp_path, capture_output=True, text=True,
            env=env, timeout=60, check=False)
        assert re.search(r"stopped [1-9]\d* processes an earlier, killed test session left",
                         following.stdout), following.stdout + following.stderr
        assert survivors(probe) == []
    finally:
        inner.stop(grace_s=5)
