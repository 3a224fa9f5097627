"""The Pareto front of a multi-objective sweep (``tune.objectives``).

A trial is on the front when no other trial is at least as good on every objective and better
on one. :func:`pareto_front` computes it (pure, on plain numbers); :func:`pareto_first` and
:func:`mark_front` put it in the terminal's leaderboard (:mod:`raycl.tracking.trial_table`);
:mod:`raycl.tracking.pareto_log` writes it to the sweep's runs. Only trials that may be ranked
are points (:func:`raycl.tracking.runs.rankable`: a failed, killed or running trial's last values
came at part of its cost). Imports no other raycl module but that one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from raycl.tracking.runs import rankable

if TYPE_CHECKING:
    from mlflow.entities import Run

# The parent run's list of objectives (``metric:mode,metric:mode``) and a trial's membership.
OBJECTIVES_TAG = "raycl.objectives"
PARETO_TAG = "raycl.pareto"
# The terminal leaderboard's column and its mark for a trial on the front.
PARETO_COLUMN = "pareto"
ON_FRONT = "*"


def dominates(a: Sequence[float], b: Sequence[float], modes: Sequence[str]) -> bool:
    """Whether point ``a`` dominates ``b``: no worse on every objective, better on one.

    Args:
        a: one value per objective.
        b: one value per objective.
        modes: ``max`` or ``min`` per objective.

    Raises:
        ValueError: lengths that differ, or a mode other than max/min.
    """
    if not len(a) == len(b) == len(modes):
        raise ValueError(f"points of {len(a)} and {len(b)} values for {len(modes)} modes")
    better = False
    for x, y, mode in zip(a, b, modes, strict=True):
        if mode not in ("max", "min"):
            raise ValueError(f"mode {mode!r}: expected max or min")
        gain = x - y if mode == "max" else y - x
        if gain < 0:
            return False
        better = better or gain > 0
    return better


def pareto_front(points: Sequence[Sequence[float]], modes: Sequence[str]) -> list[int]:
    """The indices of the non-dominated points, in their order. Equal points are all on the
    front (neither dominates the other). Quadratic: a sweep has hundreds of trials at most.

    Args:
        points: one sequence of finite values per trial, one value per objective.
        modes: ``max`` or ``min`` per objective (at least one).

    Returns:
        The indices of the points no other point dominates.

    Raises:
        ValueError: no modes, or a point that is not finite or has the wrong length.
    """
    if not modes:
        raise ValueError("no objectives")
    for point in points:
        if len(point) != len(modes) or not all(math.isfinite(v) for v in point):
            raise ValueError(f"point {list(point)}: expected {len(modes)} finite values")
    return [i for i, point in enumerate(points)
            if not any(dominates(other, point, modes) for j, other in enumerate(points) if j != i)]


def parse_objectives(tag: str) -> list[tuple[str, str]]:
    """The parent run's ``raycl.objectives`` tag as ``(metric, mode)`` pairs ([] for none)."""
    pairs = (item.rpartition(":") for item in tag.split(",") if item)
    return [(metric, mode) for metric, _, mode in pairs if metric]


def objectives_tag(objectives: Sequence[tuple[str, str]]) -> str:
    """Objectives as the parent run records them (``metric:mode,...``)."""
    return ",".join(f"{metric}:{mode}" for metric, mode in objectives)


def scored_runs(runs: Sequence[Run], metrics: Sequence[str]) -> list[tuple[Run, list[float]]]:
    """The runs that may be ranked (:func:`~raycl.tracking.runs.rankable`) and reported every
    objective (a finite last value), with those values."""
    scored = []
    for run in filter(rankable, runs):
        values = [run.data.metrics.get(metric, math.nan) for metric in metrics]
        if all(math.isfinite(value) for value in values):
            scored.append((run, values))
    return scored


def front_run_ids(runs: Sequence[Run], objectives: Sequence[tuple[str, str]]) -> set[str]:
    """The run ids of ``runs`` on the Pareto front of ``objectives``, among those
    :func:`scored_runs` keeps."""
    scored = scored_runs(runs, [metric for metric, _ in objectives])
    front = pareto_front([values for _, values in scored], [mode for _, mode in objectives])
    return {scored[i][0].info.run_id for i in front}


def pareto_first(runs: list[Run], rows: list[list[Any]],
                 front: set[str]) -> tuple[list[Run], list[list[Any]]]:
    """``runs`` and their ``rows`` with the front's first, each part in its given order (the
    first objective's ranking)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i].info.run_id not in front)
    return [runs[i] for i in order], [rows[i] for i in order]


def mark_front(header: list[str], rows: list[list[str]], runs: Sequence[Run], front: set[str],
               objectives: Sequence[tuple[str, str]], fmt: Callable[[object], str],
               baseline: list[str] | None = None,
               ) -> tuple[list[str], list[list[str]], list[str] | None]:
    """The terminal table with a ``pareto`` column (``*`` on the front) after the first
    objective and the other objectives' columns beside it (moved there when shown elsewhere).

    Args:
        header: the table's columns, ``#``, trial, status, the first objective first.
        rows: the shown rows' cells, in the order of ``runs``.
        runs: the shown trials' runs.
        front: the run ids on the front.
        objectives: ``(metric, mode)`` per objective, the first ranking the table.
        fmt: how a number is shown (the table's own cells').
        baseline: the random-init row's cells, or None.
    """
    others = [metric for metric, _ in objectives[1:]]
    keep = [i for i, name in enumerate(header) if name not in others]
    new_header = [*header[:4], PARETO_COLUMN, *others, *[header[i] for i in keep[4:]]]
    new_rows = [[*row[:4], ON_FRONT if run.info.run_id in front else "",
                 *[fmt(run.data.metrics.get(metric)) for metric in others],
                 *[row[i] for i in keep[4:]]]
                for row, run in zip(rows, runs, strict=True)]
    new_baseline = None if baseline is None else [
        *baseline[:4], "", *["-"] * len(others), *[baseline[i] for i in keep[4:]]]
    return new_header, new_rows, new_baseline


def front_title(objectives: Sequence[tuple[str, str]], on_front: int, scored: int) -> str:
    """The line that says what the ``pareto`` column marks."""
    names = ", ".join(f"{metric} ({mode})" for metric, mode in objectives)
    return (f"Pareto front on {names}: {on_front} of {scored} trial(s), marked {ON_FRONT} in "
            f"column {PARETO_COLUMN} and listed first")


__all__ = ["OBJECTIVES_TAG", "ON_FRONT", "PARETO_COLUMN", "PARETO_TAG", "dominates",
           "front_run_ids", "front_title", "mark_front", "objectives_tag", "pareto_first",
           "pareto_front", "parse_objectives", "scored_runs"]
