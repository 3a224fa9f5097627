"""The ``paper:`` block of a search YAML: the number a paper prints for the experiment, and how a
sweep's best trial compares with it.

``paper: {metric: test/linear_sgd/fine, value: 72.17, table: "Table 1"}`` names the metric a
trial reports that the paper's table measures, and the paper's value *as the paper prints it*:
``unit: percent`` (the default; 72.17 means 72.17 %) or ``unit: fraction`` (MCL's Trifeature
tables print 1.00). Every metric a paper can be compared on (a ``test/`` or ``transfer/`` score:
probes, kNN, retrieval, MMVP pairs, caption recall) is a fraction in [0, 1] in raycl, so the
comparison multiplies raycl's value by 100 for ``percent`` and reports the difference in the
paper's unit (percentage points): ``best trial - paper``, positive when raycl is above.

The best trial is the one the sweep selects on its validation objective (``tune.metric``); its
test value is reported beside the paper's, never used to choose it. The sweep's parent run
records the comparison as metrics (:func:`comparison_metrics`) and the leaderboard prints it
(:func:`comparison_line`). Imports nothing of raycl outside :mod:`raycl.config`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from raycl.config.metric_names import TEST, TRANSFER, MetricNameError, parse_metric
from raycl.config.section import Section

# The parent run's metrics (MLflow): the paper's value, the best trial's test value in the
# paper's unit, and their difference (best - paper).
PAPER_VALUE_METRIC = "paper/value"
PAPER_BEST_METRIC = "paper/best_trial_value"
PAPER_DIFFERENCE_METRIC = "paper/difference"
# Multiplier from raycl's fraction to the paper's unit.
UNIT_SCALE: dict[str, float] = {"percent": 100.0, "fraction": 1.0}


class PaperConfig(Section):
    """What a paper reports for this experiment (``paper:``), compared with the best trial."""

    metric: str = Field(
        ..., description="The metric a trial reports that the paper's table measures: a test/ "
        "or transfer/ name (test/linear_sgd/fine, test/linear_50pct/class, test/mmvp/mean, "
        "transfer/cifar100/linear/fine); papers report test scores, so no val/ or train/ name."
    )
    # Before value: value is checked against it.
    unit: Literal["percent", "fraction"] = Field(
        "percent", description="How the paper prints paper.value: percent (72.17) or fraction "
        "(1.00). raycl's scores are fractions in [0, 1]; the comparison multiplies them by 100 "
        "for percent and gives the difference (best trial - paper) in the paper's unit."
    )
    value: float = Field(
        ..., description="The paper's number as it prints it, in paper.unit (72.17 for "
        "72.17 %)."
    )
    table: str = Field(
        ..., min_length=1, description="Where the number is printed: 'Table 1', 'Table 3, "
        "p = 0.3'."
    )
    note: str | None = Field(
        None, description="What the comparison should be read with (which row, what the "
        "paper's protocol does differently); shown on the parent run, never parsed."
    )

    @field_validator("metric")
    @classmethod
    def _reported_test_metric(cls, metric: str) -> str:
        try:
            name = parse_metric(metric)
        except MetricNameError as exc:
            raise ValueError(f"{exc} (e.g. test/linear/mean, test/linear_sgd/<attribute>)") \
                from None
        if name.split not in (TEST, TRANSFER):
            raise ValueError(f"{metric!r} is not a test metric: a paper reports the test split "
                             f"(test/... or transfer/...); the sweep selects on tune.metric")
        return metric

    @field_validator("value")
    @classmethod
    def _value_in_unit(cls, value: float, info: ValidationInfo) -> float:
        unit = info.data.get("unit", "percent")
        high = UNIT_SCALE[unit]
        if not (math.isfinite(value) and 0.0 <= value <= high):
            hint = " (a percentage? set paper.unit: percent)" \
                if unit == "fraction" and math.isfinite(value) and 1.0 < value <= 100.0 else ""
            raise ValueError(f"{value:g} is outside [0, {high:g}] for paper.unit {unit!r}{hint}")
        return value


@dataclass(frozen=True)
class PaperComparison:
    """The best trial's test value beside the paper's, both in the paper's unit.

    Attributes:
        paper: the ``paper:`` block compared with.
        best: the best trial's value of ``paper.metric`` in the paper's unit, None when the
            best trial did not report it.
    """

    paper: PaperConfig
    best: float | None

    @property
    def difference(self) -> float | None:
        """``best - paper.value`` in the paper's unit (percentage points for percent)."""
        return None if self.best is None else self.best - self.paper.value


def compare_to_paper(paper: PaperConfig, reported: float | None) -> PaperComparison:
    """The comparison of a trial's reported value (a fraction, as raycl logs it) with the paper.

    Args:
        paper: the search's ``paper:`` block.
        reported: the best trial's value of ``paper.metric`` as logged (in [0, 1]); None or a
            non-finite value when it has none.

    Returns:
        The two values in the paper's unit, and their difference.
    """
    if reported is None or not math.isfinite(reported):
        return PaperComparison(paper, None)
    return PaperComparison(paper, reported * UNIT_SCALE[paper.unit])


def comparison_metrics(comparison: PaperComparison) -> dict[str, float]:
    """The parent run's metrics: ``paper/value`` always, ``paper/best_trial_value`` and
    ``paper/difference`` when the best trial reported the metric."""
    metrics = {PAPER_VALUE_METRIC: comparison.paper.value}
    if comparison.best is not None and comparison.difference is not None:
        metrics[PAPER_BEST_METRIC] = comparison.best
        metrics[PAPER_DIFFERENCE_METRIC] = comparison.difference
    return metrics


def _number(value: float, unit: str) -> str:
    return f"{value:.2f}" if unit == "percent" else f"{value:.3f}"


def comparison_line(comparison: PaperComparison, best_trial: str, objective: str) -> str:
    """One line for the leaderboard and the parent run: ``paper (Table 1): test/linear_sgd/fine
    72.17 %; best trial t01 (by val/linear/mean): 70.05 %, -2.12 points``.

    Args:
        comparison: from :func:`compare_to_paper`.
        best_trial: the best trial's name (its run name).
        objective: the validation metric it was selected on.
    """
    paper, unit = comparison.paper, comparison.paper.unit
    suffix = " %" if unit == "percent" else ""
    line = (f"paper ({paper.table}): {paper.metric} {_number(paper.value, unit)}{suffix}; "
            f"best trial {best_trial} (by {objective}): ")
    if comparison.best is None or comparison.difference is None:
        return line + f"no {paper.metric} reported"
    difference = (f"{comparison.difference:+.2f} points" if unit == "percent"
                  else f"{comparison.difference:+.3f}")
    return line + f"{_number(comparison.best, unit)}{suffix}, {difference}"


def paper_from_params(params: Mapping[str, str]) -> PaperConfig | None:
    """The ``paper:`` block as a sweep's parent run logged it (its flattened ``paper.*``
    params), or None when the sweep had none (or an older raycl logged it)."""
    if "paper.metric" not in params:
        return None
    fields = {key.removeprefix("paper."): value for key, value in params.items()
              if key.startswith("paper.") and value not in ("None", "")}
    try:
        return PaperConfig.model_validate(fields)
    except ValidationError:
        return None


__all__ = ["PAPER_BEST_METRIC", "PAPER_DIFFERENCE_METRIC", "PAPER_VALUE_METRIC", "UNIT_SCALE",
           "PaperComparison", "PaperConfig", "compare_to_paper", "comparison_line",
           "comparison_metrics", "paper_from_params"]
