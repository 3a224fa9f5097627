"""``tune.collapse`` in a sweep: the stop condition that ends a collapsed trial at once. The MLflow
tracker then ends its run ``collapsed`` (:mod:`raycl.tracking.callback`), the searcher records
it as pruned (:mod:`raycl.sweep.searchers`), the leaderboard never ranks it; each asks the same
rule, :meth:`raycl.config.collapse.CollapseConfig.reason`, of the trial's last report.

A driver-side stop condition, not a check in the workers: the figures are computed on rank 0
and reach the driver in the report, so no rank decides alone and no collective is entered for
it. A plain callable (Tune wraps it in its ``FunctionStopper``): importing this module imports
no Ray.
"""

from __future__ import annotations

from typing import Any

from raycl.config.collapse import CollapseConfig
from raycl.config.schema import CoreConfig


class CollapseStopper:
    """``RunConfig(stop=...)``: true at the first report its :class:`CollapseConfig` calls
    collapsed."""

    def __init__(self, rule: CollapseConfig) -> None:
        self.rule = rule

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return self.rule.reason(result) is not None


def collapse_stopper(config: CoreConfig) -> CollapseStopper | None:
    """The sweep's stop condition for ``tune.collapse`` (None when it is off)."""
    return CollapseStopper(config.tune.collapse) if config.tune.collapse is not None else None


__all__ = ["CollapseStopper", "collapse_stopper"]
