"""The order in which ``make test``'s xdist workers get their work (tests/conftest.py).

pytest-xdist's ``--dist loadgroup`` hands out work units (an xdist group, or one test without
a group) in the order of a queue, each to the worker that runs out of work first. Its own order
is by number of tests, which queued some of the suite's longest units late (two fault sweeps
of 1-2 min each were a group of two tests, behind groups of many short ones), so one worker
could still be running them after the other had finished. Here the queue is ordered by each
unit's expected seconds, longest first (LPT scheduling): the short units fill in at the end,
whichever worker frees first.

The seconds are rough figures from the fresh-clone CI run on 2 busy cores; they only set the
order. A wrong one costs wall time, never a result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

# Expected seconds of the suite's long units: an xdist group by its name, or a test without a
# group by the start of its node id. From the fresh-clone CI runs of 2026-12-07 (the 1263-test
# suite, 804-812 s on 2 cores).
EXPECTED_S: dict[str, float] = {
    "ray-session": 680.0,  # every test on the shared Ray session (tests/test_stream.py's too)
    "cloud-local": 280.0,  # tests/test_cloud_local.py's cluster scenarios
    "cloud-autoscale": 130.0,  # tests/test_cloud_local.py's autoscaler
    "tests/test_tracking_faults.py::test_driver_sigkilled": 68.0,
    "tests/test_tracking_faults.py::test_mlflow_server_down": 55.0,
    "two-workers": 75.0,
    "job-submit": 87.0,
    "fgvr-reference": 45.0,
    "mlflow-ui": 30.0,
    "tests/test_clip.py::test_soup_trial": 26.0,
}
# Any other test: most take well under a second.
DEFAULT_S = 1.0

Item = TypeVar("Item")


def expected_seconds(unit: str, size: int) -> float:
    """The expected seconds of work unit ``unit`` (a group name or a node id) of ``size``
    tests."""
    if unit in EXPECTED_S:
        return EXPECTED_S[unit]
    for start, seconds in EXPECTED_S.items():
        if "::" in start and unit.startswith(start):
            return seconds
    return DEFAULT_S * size


def longest_first(items: Sequence[Item], unit_of: Callable[[Item], str]) -> list[Item]:
    """``items`` with each work unit's tests together, units in order of expected seconds,
    longest first; units of equal expectation, and the tests of a unit, keep their order."""
    units: dict[str, list[Item]] = {}
    for item in items:
        units.setdefault(unit_of(item), []).append(item)
    ordered = sorted(units.items(), key=lambda unit: -expected_seconds(unit[0], len(unit[1])))
    return [item for _, members in ordered for item in members]


def unit_order(names: Iterable[str]) -> list[str]:
    """Node ids as xdist's scheduler receives them (``nodeid@group`` in a group): the units in
    the order their first test appears, i.e. the order the queue hands them out."""
    seen: dict[str, None] = {}
    for name in names:
        seen.setdefault(name.rsplit("@", 1)[1] if "@" in name else name)
    return list(seen)
