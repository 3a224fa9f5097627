"""``tune.collapse``: when a trial's representation has collapsed, judged from the label-free
figures of its evaluations (``eval.label_free``, :mod:`raycl.eval.label_free`).

A trial whose figures fall below a threshold at an evaluation from ``from_epoch`` on is stopped
at once (:mod:`raycl.sweep.collapse`), its run ends FINISHED with ``raycl.ended=collapsed`` and
the reason in its description, Optuna records it as pruned, and it is never ranked. Off unless
a threshold is set. Imports nothing of raycl but the metric names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from raycl.config.metric_names import LABEL_FREE, VAL, metric_name
from raycl.config.section import Section

STD = metric_name(VAL, LABEL_FREE, "std")
RANKME = metric_name(VAL, LABEL_FREE, "rankme")


class CollapseConfig(Section):
    """Stop a trial whose representation collapsed (tune.collapse.*)."""

    std_below: float | None = Field(
        None, gt=0.0, description="Collapsed when val/label_free/std (the L2-normalised "
        "features' per-dimension std times sqrt(D): ~1 spread out, 0 one direction) is below "
        "this; suggested 0.1. None: not judged by it.")
    rankme_below: float | None = Field(
        None, gt=0.0, description="Collapsed when val/label_free/rankme (the directions the "
        "representation uses) is below this; suggested 2 (one direction left), or a few "
        "percent of the feature width for dimensional collapse. None: not judged by it.")
    from_epoch: int = Field(
        1, ge=1, description="The first epoch, counted over a trial's stages (global_epoch), "
        "whose evaluation may stop it: an untrained network's figures are no verdict.")

    @model_validator(mode="after")
    def _a_threshold(self) -> CollapseConfig:
        if self.std_below is None and self.rankme_below is None:
            raise ValueError("set std_below, rankme_below or both (or leave tune.collapse out)")
        return self

    def reason(self, report: Mapping[str, Any]) -> str | None:
        """Why ``report`` (a trial's report, its figures at top level) shows a collapsed
        representation, in one line; None when it does not, or is not judged (an epoch before
        ``from_epoch``, no evaluation in it).

        Example:
            >>> CollapseConfig(std_below=0.1).reason({"global_epoch": 2, STD: 0.02})
            'val/label_free/std 0.02 < 0.1 at epoch 2'
        """
        epoch = report.get("global_epoch", report.get("epoch"))
        if not isinstance(epoch, int | float) or epoch < self.from_epoch:
            return None
        for name, threshold in ((STD, self.std_below), (RANKME, self.rankme_below)):
            value = report.get(name)
            if threshold is not None and isinstance(value, int | float) and value < threshold:
                return f"{name} {value:.3g} < {threshold:g} at epoch {int(epoch)}"
        return None


__all__ = ["RANKME", "STD", "CollapseConfig"]
