"""``leaderboard.png``: a sweep's objective against each searched parameter, one point per
trial, the best one highlighted (:func:`leaderboard_figure`). Sits on
:mod:`raycl.tracking.trial_table` (the ranked table it plots).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from raycl.config.search_config import key_symbol
from raycl.config.sweep import Domain
from raycl.tracking.reference_points import chance_of
from raycl.tracking.runs import SEARCHED_TAG, TRIAL_INDEX_TAG
from raycl.tracking.trial_table import TrialTable, searched_values

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_leaderboard(table: TrialTable, path: Path,
                     space: Mapping[str, Domain] | None = None) -> None:
    """``leaderboard.png``: :func:`leaderboard_figure`, saved."""
    leaderboard_figure(table, space).savefig(path, dpi=100)


class _Point(NamedTuple):
    """One trial that reported the objective, as the figure plots it."""

    name: str  # the run name
    values: dict[str, str]  # searched key -> value text
    index: int | None  # Ray's trial number
    objective: float


def leaderboard_figure(table: TrialTable, space: Mapping[str, Domain] | None = None) -> Figure:
    """One panel per searched parameter, the objective (y) against that parameter (x), one
    point per trial that reported it, the best trial highlighted. Numeric parameters on a log
    axis when searched log-uniformly or spanning more than two decades; others as categories.
    Nothing searched (seed repeats): the objective against the trial's index. ``space`` (the
    sweep's search space) orders the panels and gives each domain's kind; without it, the
    ``raycl.searched`` keys are plotted. A bare :class:`~matplotlib.figure.Figure` (Agg, no
    pyplot): the Tune driver's plotting state stays untouched and nothing needs closing."""
    from matplotlib.figure import Figure

    space = dict(space or {})
    keys = list(space) if space else [key for key in table.searched if key != "seed"]
    points = _scored_points(table)
    # table.runs is ranked, those not rankable last: the first scored is the best, if any is.
    best = points[0] if points and table.best() is not None else None
    panels = keys or ["trial index"]
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.4 * rows))
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis in axes.flat[len(panels):]:
        axis.set_visible(False)
    for axis, key in zip(axes.flat, panels, strict=False):
        if key == "trial index":
            xs: list[Any] = [point.index if point.index is not None else i
                             for i, point in enumerate(points)]
            axis.set_xlabel("trial index")
        else:
            xs = _parameter_axis(axis, key, [point.values.get(key) for point in points],
                                 space.get(key))
        ys = [point.objective for point in points]
        axis.scatter(xs, ys, s=28, color="tab:blue", alpha=0.8, label="trial")
        if best is not None:
            axis.scatter([xs[0]], [best.objective], s=140, marker="*", color="tab:red",
                         zorder=3, label=f"best: {best.name}")
        # What the trials are read against: chance and the untrained backbone.
        for level, style, label in ((chance_of(table.metric, table.chance), ":", "chance"),
                                    (table.baseline.get(table.metric), "--", "at init")):
            if level is not None:
                axis.axhline(level, color="grey", linestyle=style, linewidth=1, label=label)
        axis.set_ylabel(table.metric)
        axis.grid(alpha=0.3)
    if best is not None:
        axes.flat[0].legend(fontsize=7, loc="best")
    else:
        axes.flat[0].text(0.5, 0.5, f"no trial reported {table.metric} yet", ha="center",
                          va="center", transform=axes.flat[0].transAxes)
    figure.suptitle(f"{table.metric} ({table.mode}): {len(points)} of {len(table.runs)} "
                    f"trial(s)")
    figure.tight_layout()
    return figure


def _scored_points(table: TrialTable) -> list[_Point]:
    """The trials that reported the objective, in the table's (ranked) order."""
    points = []
    for run in table.runs:
        value = table.objective(run)
        if value is not None:
            index = run.data.tags.get(TRIAL_INDEX_TAG, "")
            points.append(_Point(run.info.run_name or run.info.run_id[:8],
                                 searched_values(run.data.tags.get(SEARCHED_TAG, "")),
                                 int(index) if index.isdigit() else None, value))
    return points


def _parameter_axis(
    axis: Axes, key: str, texts: list[str | None], domain: Domain | None
) -> list[Any]:
    """Label ``axis`` for the searched ``key`` and return the trials' x positions: the values
    themselves when every one is a number, else category indices."""
    axis.set_xlabel(f"{key_symbol(key)} ({key})")
    numbers = [_number(text) for text in texts]
    if texts and all(number is not None for number in numbers):
        _numeric_axis(axis, [number for number in numbers if number is not None], domain)
        return numbers
    # Categories, in the order the domain lists them, then as met.
    order = [str(value) for value in (domain.choice or [])] if domain else []
    order += [text for text in dict.fromkeys(str(t) for t in texts) if text not in order]
    axis.set_xticks(range(len(order)), order, rotation=30 if len(order) > 4 else 0)
    return [order.index(str(text)) for text in texts]


def _numeric_axis(axis: Axes, xs: list[float], domain: Domain | None) -> None:
    """A log scale when searched log-uniformly or spanning more than two decades, with a few
    labelled ticks (:func:`log_ticks`: a panel is 4 inches wide, and a label per 1, 2, ..., 9
    overlapped); the listed values as ticks when the domain is a short choice, slanted when
    there are more than four."""
    from matplotlib.ticker import NullFormatter

    positive = [x for x in xs if x > 0]
    if (domain is not None and domain.kind == "loguniform") or (
            len(positive) == len(xs) and max(xs) / min(xs) > 100):
        axis.set_xscale("log")
        if positive:
            ticks = log_ticks(min(positive), max(positive))
            axis.set_xticks(ticks, [f"{value:g}" for value in ticks])
        axis.xaxis.set_minor_formatter(NullFormatter())  # minor ticks marked, not labelled
    if domain is not None and domain.choice is not None and len(domain.choice) <= 12:
        ticks = sorted({float(value) for value in domain.choice})
        axis.set_xticks(ticks, [f"{value:g}" for value in ticks],
                        rotation=30 if len(ticks) > 4 else 0)


def log_ticks(low: float, high: float, most: int = 5) -> list[float]:
    """At most ``most`` round values in ``[low, high]`` for a log axis, evenly enough spread
    that their labels do not overlap: the mantissas 1-9, else 1, 2, 5, else 1, 3, else the
    powers of ten (every k-th decade when there are too many); a range narrower than the
    roundest of those (0.0021 to 0.0029) gets 2-significant-digit values spread evenly.
    """
    decades = range(math.floor(math.log10(low)), math.floor(math.log10(high)) + 1)
    span = math.log10(high / low)
    for mantissas in ((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 5), (1, 3), (1,)):
        ticks = [value for e in decades for m in mantissas
                 if low * (1 - 1e-9) <= (value := float(f"{m}e{e}")) <= high * (1 + 1e-9)]
        gaps = [math.log10(b / a) for a, b in itertools.pairwise(ticks)]
        if len(ticks) <= most and min(gaps, default=span) >= span / (most + 1):
            break
    if len(ticks) > most:  # powers of ten over many decades
        ticks = ticks[::math.ceil(len(ticks) / most)]
    if len(ticks) < 2 and high > low:  # within one step of the roundest values
        ticks = sorted({float(f"{low * (high / low) ** (k / 2):.2g}") for k in range(3)})
    return ticks or [low]


def _number(text: str | None) -> float | None:
    """A searched value's text as a number (None for text, booleans and missing values)."""
    if text is None or text in ("True", "False"):
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None
