"""The order in which ``make test``'s xdist workers get their work units (tests/xdist_order.py):
longest first, each unit's tests together."""

from __future__ import annotations

import itertools
import sys

import conftest
import pytest
from conftest import RAY_GROUP, work_unit
from xdist_order import EXPECTED_S, expected_seconds, longest_first, unit_order


def test_units_are_queued_longest_first_and_kept_together() -> None:
    """A two-test group of long sweeps is queued before a group of many short tests (xdist's
    own order, by number of tests, put it last); a long test without a group by its node id;
    ties and the tests inside a unit keep their order."""
    items = ["a.py::t1@short", "a.py::t2@short", "a.py::t3@short", "b.py::x",
             "tests/test_tracking_faults.py::test_driver_sigkilled_x", "a.py::t4@short",
             "c.py::s1@ray-session", "c.py::s2@ray-session", "d.py::y"]

    def unit(name: str) -> str:
        return name.rsplit("@", 1)[1] if "@" in name else name

    ordered = longest_first(items, unit)
    assert unit_order(ordered) == ["ray-session",
                                   "tests/test_tracking_faults.py::test_driver_sigkilled_x",
                                   "short", "b.py::x", "d.py::y"]
    assert ordered[2:6] == ["tests/test_tracking_faults.py::test_driver_sigkilled_x",
                            "a.py::t1@short", "a.py::t2@short", "a.py::t3@short"]
    assert sorted(ordered) == sorted(items)
    assert expected_seconds("short", 4) == 4 * expected_seconds("b.py::x", 1)


def test_this_sessions_collection_is_in_that_order(request: pytest.FixtureRequest) -> None:
    """conftest.py's hook ordered what this session collected (the order xdist's queue hands
    out, its own reordering turned off): each unit's tests together, longest first."""
    units = [work_unit(item) for item in request.session.items]
    order = list(dict.fromkeys(units))
    assert sum(1 for a, b in itertools.pairwise(units) if a != b) == len(order) - 1
    sizes = {name: units.count(name) for name in order}
    seconds = [expected_seconds(name, sizes[name]) for name in order]
    assert seconds == sorted(seconds, reverse=True)
    if RAY_GROUP in order:
        assert order[0] == RAY_GROUP and EXPECTED_S[RAY_GROUP] == max(EXPECTED_S.values())
    if request.config.getoption("loadgroup", False):  # an xdist worker of --dist loadgroup
        assert request.config.option.loadscopereorder is False


def test_the_ray_session_ends_after_its_last_test() -> None:
    """Where this process has run every test on the shared Ray session (the worker that ran
    their group; or one process, which runs that group first), its Ray is down: not left idle
    for the rest of the run. Elsewhere there is nothing to check."""
    ray = sys.modules.get("ray")
    if conftest._ray_tests_left or ray is None:
        pytest.skip("the shared Ray session's tests did not all run in this process")
    assert not ray.is_initialized()
