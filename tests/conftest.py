"""Shared fixtures: one Ray session for the whole test run (start-up costs ~8 s).

``make test`` runs pytest with two xdist workers (``-n 2 --dist loadgroup``): every test that
uses the Ray session is put in one group, first in the queue, so one worker starts Ray once and
runs them in order while the other works through the rest. Most of a Ray test's time is spent
waiting (worker start-up, polls), which the other worker's CPU-bound tests fill.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import name_fault_file
from local_servers import TRAIN_POLL, stop_all, stop_orphans

# The whole schema (SearchConfig) holds the sections of the methods registered so far: every
# test module may name it at import, as the entry points do after importing the methods.
import raycl.methods  # noqa: F401

REPO = Path(__file__).resolve().parents[1]

# Every ray.init() of the suite (this process's and the sweeps it starts as subprocesses) starts
# its own local Ray: a bare ray.init() would join any cluster already running on the machine —
# the multi-node tests' own, or one of CI's — and fail or disturb it. Tests that mean to join a
# cluster pass its address explicitly.
os.environ.setdefault("RAY_ADDRESS", "local")
# Every Ray the suite starts inherits it (local_servers.TRAIN_POLL says why).
os.environ.setdefault(*TRAIN_POLL)
# Where the fault hook looks (tests/faults.py): named before Ray starts, so that every Ray
# worker of this process's session, and every sweep it starts as a subprocess, inherits it.
name_fault_file()


@pytest.fixture(scope="session")
def ray_session(data_cache: Path):
    """Started after data_cache so that Ray's workers inherit RAYCL_CACHE."""
    import ray

    from raycl.tune import init_ray

    init_ray(num_cpus=2, include_dashboard=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a test of tiny models: fastest for them, and no oversubscription
    of a busy machine (two threads made All4One steps ~10x slower under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Datasets generated once per test run, shared by every test, xdist worker and Ray worker
    (the cache writes each file atomically, so two workers building one set is safe)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base directory, which every xdist worker shares
    path = root / "raycl-cache"
    path.mkdir(exist_ok=True)
    os.environ["RAYCL_CACHE"] = str(path)
    return path


RAY_GROUP = "ray-session"


# tryfirst: xdist's own hook appends each item's group to its node id (what the scheduler
# groups by); it is registered after this conftest, so pluggy would call it first and the
# groups added here would never reach the scheduler (the Ray session's tests then ran on both
# workers, each starting a Ray of its own). The scheduler then queues the groups by their number
# of tests, largest first (xdist's --loadscope-reorder); the order set here only breaks ties.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests on the shared Ray session: one xdist group, run first (see the module docstring);
    then the other groups (tests/test_cloud_local.py's clusters; tests/test_stream.py, whose
    sweeps start a second Ray session on the other worker to even the two queues), so that the
    scheduler hands them to the other worker rather than queueing them behind the Ray
    session's."""
    on_ray = [item for item in items if "ray_session" in getattr(item, "fixturenames", ())
              and item.get_closest_marker("xdist_group") is None]
    for item in on_ray:
        item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
    chosen = set(on_ray)
    grouped = [item for item in items
               if item not in chosen and item.get_closest_marker("xdist_group") is not None]
    chosen.update(grouped)
    items[:] = on_ray + grouped + [item for item in items if item not in chosen]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Servers an earlier test session left when it was killed outright (SIGKILL: no finaliser
    ran) are stopped before this one starts its own (tests/local_servers.py)."""
    left = stop_orphans()
    if left:
        print(f"tests: stopped {left} processes an earlier, killed test session left running")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Whatever this session spawned and a fixture did not stop (a fixture that failed half-way,
    a test interrupted by Ctrl-C) is stopped here, after every fixture's own teardown."""
    stop_all()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers on two cores: one intra-op thread each (Ray's trial processes set their
        # own, from scaling.cpus_per_worker).
        import torch

        torch.set_num_threads(1)
