"""``tune.compare``: a fair comparison of a searched choice's values as one sweep.

``tune.compare: method`` over ``search_space: {method: {choice: [simclr, hscl]}, ...}`` gives each
compared value the same share of ``tune.num_samples``, a searcher of its own (TPE learns each
method's knobs from that method's trials only) and ASHA brackets of its own (a trial is stopped
against its own method's rungs, so a slow-starting method is not starved by a fast one), then
confirms each value's best configuration over the same fresh seeds
(``tune.confirm.per``), which answers "does HSCL beat SimCLR on this data?" with a paired
difference and its interval. :mod:`raycl.sweep.compare` builds the searcher and scheduler; this
module holds the rules a config must meet. Nothing here needs Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class TuneSection(Protocol):
    """What these rules read of :class:`raycl.config.sweep.TuneSection` (which calls them while
    it is validated, so they cannot import it)."""

    compare: str | None
    search_space: Mapping[str, Any]
    scheduler: Any
    searcher: str
    objectives: list[Any] | None
    num_samples: int
    confirm: Any


def compared_values(tune: TuneSection) -> list[Any]:
    """The compared values of ``tune.compare``, in the search space's order (none: off)."""
    if tune.compare is None:
        return []
    domain = tune.search_space.get(tune.compare)
    return list(domain.choice or []) if domain is not None else []


def compare_problem(tune: TuneSection) -> str | None:
    """What keeps ``tune.compare`` from a fair comparison, as the line after ``tune.compare``
    (None: nothing). Checked where the section is validated, so the line comes before launch."""
    key = tune.compare
    if key is None:
        return None
    domain = tune.search_space.get(key)
    if domain is None or domain.choice is None:
        return (f"{key} is not a choice of tune.search_space (compare gives each value of a "
                f"searched choice, e.g. method: {{choice: [simclr, hscl]}}, its own budget)")
    values = compared_values(tune)
    if len(values) < 2 or len({repr(value) for value in values}) < len(values):
        return f"{key} needs at least 2 distinct values to compare, got {values}"
    if tune.scheduler.type in ("pbt", "pb2"):
        return (f"not with tune.scheduler.type {tune.scheduler.type}: a population's trials "
                f"copy each other across values (use asha or none)")
    if tune.searcher == "grid":
        return ("not with tune.searcher grid: a grid already gives every value its share "
                "(use optuna or random)")
    if tune.objectives:
        return "needs one objective (tune.metric/mode): its verdict is one paired difference"
    if tune.num_samples % len(values):
        below = tune.num_samples - tune.num_samples % len(values)
        return (f"tune.num_samples={tune.num_samples} does not split evenly over the "
                f"{len(values)} values of {key}: every value gets the same budget (use "
                f"{below or len(values)} or {below + len(values)})")
    per = tune.confirm.per if tune.confirm is not None and tune.confirm.per else key
    if per != key:
        return (f"tune.confirm.per={per}: a comparison of {key} confirms each of its values' "
                f"best configuration (drop confirm.per or set it to {key})")
    return None


def budget_per_value(tune: TuneSection) -> int:
    """Trials each compared value gets: ``tune.num_samples`` split evenly."""
    return tune.num_samples // max(len(compared_values(tune)), 1)


def trials_phrase(tune: TuneSection, total: int, method: str) -> str:
    """How the sweep's first line counts its trials: ``8 trial(s) of simclr, hscl``, or for a
    comparison ``4 trials each of simclr, hscl (8 in all), stopped against their own rungs``."""
    if tune.compare is None:
        space = tune.search_space
        methods = (", ".join(map(str, space["method"].candidates())) if "method" in space
                   else method)
        return f"{total} trial(s) of {methods}"
    values = ", ".join(map(str, compared_values(tune)))
    rungs = ", stopped against their own rungs" if tune.scheduler.type == "asha" else ""
    return (f"{budget_per_value(tune)} trials each of {tune.compare} {values} ({total} in all)"
            f"{rungs}")


__all__ = ["budget_per_value", "compare_problem", "compared_values", "trials_phrase"]
