"""Shared fixtures: one Ray session for the whole test run (start-up costs ~8 s).

``make test`` runs pytest with two xdist workers (``-n 2 --dist loadgroup``): every test that
uses the Ray session is put in one group, so one worker starts Ray once and runs them in order.
The work units (a group, or one test without one) are queued longest first
(tests/xdist_order.py): the Ray session's group and the other long ones (the simulated cloud,
the fault sweeps) start early, one on each worker, and the many short tests fill in at the end,
so neither worker finishes minutes before the other. Most of a Ray test's time is spent waiting
(worker start-up, polls), which the other worker's CPU-bound tests fill.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faults import name_fault_file
from local_servers import TRAIN_POLL, stop_all, stop_orphans
from xdist_order import longest_first

# The whole schema (SearchConfig) holds the sections of the methods registered so far: every
# test module may name it at import, as the entry points do after importing the methods.
import raycl.methods  # noqa: F401

REPO = Path(__file__).resolve().parents[1]

# Every ray.init() of the suite (this process's and the sweeps it starts as subprocesses) starts
# its own local Ray: a bare ray.init() would join any cluster already running on the machine —
# the multi-node tests' own, or one of CI's — and fail or disturb it. Tests that mean to join a
# cluster pass its address explicitly.
os.environ.setdefault("RAY_ADDRESS", "local")
# Two xdist workers, their Ray workers and the sweeps they start share a few cores: OpenMP
# threads that spin while they wait (libgomp's default) take the cores the other processes
# need (an in-process All4One resume: 2.5 s alone, 46-67 s beside two busy processes, 12 s
# with PASSIVE). Set here for the processes the suite starts; `make test` sets it for pytest's
# own processes too (libgomp reads it once, when torch is first imported).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every Ray the suite starts inherits it (local_servers.TRAIN_POLL says why).
os.environ.setdefault(*TRAIN_POLL)
# Where the fault hook looks (tests/faults.py): named before Ray starts, so that every Ray
# worker of this process's session, and every sweep it starts as a subprocess, inherits it.
name_fault_file()


PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # Ray Train V2's switch


@pytest.fixture(scope="session")
def ray_session(data_cache: Path):
    """Started after data_cache so that Ray's workers inherit RAYCL_CACHE."""
    import ray

    from raycl.sweep.local_ray import init_ray

    # Ray Train's PreemptionWatcher (one more actor process per worker-group start, ~1.5 s of
    # CPU) reports node drains, which only the cloud tests' own clusters see: off for this
    # session's processes (they take it from the environment Ray starts in), not for later Rays.
    before = os.environ.get(PREEMPTION_WATCHER)
    os.environ[PREEMPTION_WATCHER] = "0"
    try:
        # The dashboard serves the State API, which Ray Train's PlacementGroupCleaner asks
        # whether a controller is alive: without it a paused PBT trial's workers stay reserved
        # and the population waits forever (seen: the PBT workers test hung).
        init_ray(num_cpus=2, include_dashboard=True, log_to_driver=False)
    finally:
        if before is None:
            os.environ.pop(PREEMPTION_WATCHER)
        else:
            os.environ[PREEMPTION_WATCHER] = before
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def mlflow_store_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every new sqlite MLflow store a test process creates starts as a copy of one store this
    process made the ordinary way: MLflow builds a new database by running its ~60 schema
    migrations (~1.2 s of CPU each time, and the suite makes a new store in most tests that log);
    the copy is the same schema in ~0.04 s. Stores created by the processes a test starts (a
    ``python -m raycl.tune`` subprocess, a Ray trial) are built by MLflow itself, as a user's are.
    """
    import shutil

    import mlflow.store.db.utils as db_utils
    from mlflow import MlflowClient

    original = getattr(db_utils, "_initialize_tables", None)
    if original is None:  # another MLflow: nothing to speed up
        yield
        return
    template = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()

    def initialize_from_template(engine: Any) -> None:
        database = engine.url.database if engine.url.get_backend_name() == "sqlite" else None
        path = Path(database) if database and database != ":memory:" else None
        if path is None or not path.is_file() or path.stat().st_size != 0:
            original(engine)  # not a new, empty sqlite file: MLflow's own way
            return
        engine.dispose()  # the empty file SQLAlchemy created is replaced whole
        staged = path.with_name(f".{path.name}.{os.getpid()}.template")
        shutil.copyfile(template, staged)
        os.replace(staged, path)

    db_utils._initialize_tables = initialize_from_template
    yield
    db_utils._initialize_tables = original


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a test of tiny models: fastest for them, and no oversubscription
    of a busy machine (two threads made All4One steps ~10x slower under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Datasets generated once per test run, shared by every test, xdist worker and Ray worker
    (the cache writes each file atomically, so two workers building one set is safe). Used by
    every test: none writes into the user's own cache (~/.cache/raycl), whatever ran before it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base directory, which every xdist worker shares
    path = root / "raycl-cache"
    path.mkdir(exist_ok=True)
    os.environ["RAYCL_CACHE"] = str(path)
    return path


RAY_GROUP = "ray-session"


def work_unit(item: pytest.Item) -> str:
    """What xdist's loadgroup scheduler hands out whole: the item's group (xdist 3.8 joins the
    names of several ``xdist_group`` marks with ``_``), else the item."""
    names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
             for mark in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) if names else item.nodeid


# tryfirst: xdist's own hook appends each item's group to its node id (what the scheduler
# groups by); it is registered after this conftest, so pluggy would call it first and the
# groups added here would never reach the scheduler (the Ray session's tests then ran on both
# workers, each starting a Ray of its own). The scheduler queues the units in the order of
# their first test here (pytest_configure turns off its own reordering).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests on the shared Ray session: one xdist group (see the module docstring); every work
    unit's tests together, the units longest first (tests/xdist_order.py)."""
    for item in items:
        if ("ray_session" in getattr(item, "fixturenames", ())
                and item.get_closest_marker("xdist_group") is None):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
    items[:] = longest_first(items, work_unit)


# The tests on the shared Ray session that this process has not run yet (its whole collection's,
# counted once collected): when none is left, its Ray is shut down rather than left idle, taking
# CPU and memory, while this xdist worker goes on with other work until the run ends.
_ray_tests_left: set[str] = set()


def pytest_collection_finish(session: pytest.Session) -> None:
    _ray_tests_left.update(item.nodeid for item in session.items
                           if "ray_session" in getattr(item, "fixturenames", ()))


# trylast: after pytest's own teardown of the item (and of the module fixtures it was the last
# to use). With --dist loadgroup one worker runs the whole group, so its count reaches zero after
# the group's last test; on another worker, or with the tests spread by another --dist, it never
# does and the session's Ray ends with the session, as before.
@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if item.nodeid not in _ray_tests_left:
        return
    _ray_tests_left.discard(item.nodeid)
    if not _ray_tests_left and nextitem is not None:
        import ray

        ray.shutdown()  # the fixture's own ray.shutdown() at the session's end does nothing then


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
    if config.getoption("dist", "no") == "loadgroup" or config.getoption("loadgroup", False):
        # xdist's default queue is by number of tests per unit, largest first: the order of
        # pytest_collection_modifyitems (longest expected time first) is kept instead. (The
        # scheduler runs in the controller, whose --dist says loadgroup; xdist's workers have
        # dist "no" and their own loadgroup flag.)
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers on two cores: one intra-op thread each (Ray's trial processes set their
        # own, from scaling.cpus_per_worker).
        import torch

        torch.set_num_threads(1)
