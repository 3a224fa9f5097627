"""``tune.collapse`` in a sweep: the Tune stopper that ends a collapsed trial at once, and how
the rest of the sweep tells such a trial (:func:`collapse_reason`): the MLflow tracker ends its
run ``collapsed``, the searcher records it as pruned, the leaderboard never ranks it.

A driver-side stopper, not a check in the workers: the figures are computed on rank 0 and reach
the driver in the report, so no rank decides alone and no collective is entered for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import tune

from raycl.config.collapse import CollapseConfig
from raycl.config.schema import CoreConfig


def collapse_reason(config: CoreConfig, report: Mapping[str, Any] | None) -> str | None:
    """Why ``report`` shows a collapsed trial under ``config``'s ``tune.collapse`` (None: it
    does not, or the rule is off)."""
    rule = config.tune.collapse
    return rule.reason(report) if rule is not None and report else None


class CollapseStopper(tune.Stopper):
    """Stops a trial at the first report its :class:`CollapseConfig` calls collapsed."""

    def __init__(self, rule: CollapseConfig) -> None:
        self.rule = rule

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return self.rule.reason(result) is not None

    def stop_all(self) -> bool:
        return False


def collapse_stopper(config: CoreConfig) -> CollapseStopper | None:
    """The sweep's stopper for ``tune.collapse`` (None when it is off)."""
    return CollapseStopper(config.tune.collapse) if config.tune.collapse is not None else None


__all__ = ["CollapseStopper", "collapse_reason", "collapse_stopper"]
