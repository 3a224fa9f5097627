"""The ``paper:`` block's metric must be one the trials report: checked before launch.

The schema lets through only test/ and transfer/ metric names (:mod:`raycl.config.paper`); what
it cannot see alone is whether this config's trials report the name: an attribute the dataset
has, the evaluation that scores the family switched on (``eval.linear_sgd``, ``eval.mmvp``), the
label fraction among those probed, the transfer set among ``eval.transfer``, the stage among
``mcl.stages``. A sweep whose comparison could never be printed is refused with one line.
"""

from __future__ import annotations

from collections.abc import Iterator

from raycl.config.metric_names import (
    LABEL_FAMILIES,
    LINEAR,
    LINEAR_SGD,
    MEAN,
    MMVP,
    TRANSFER,
    MetricName,
    fraction_percent,
    parse_metric,
)
from raycl.config.schema import CoreConfig, Problem

KEY = "paper.metric"


def _attribute_problem(name: MetricName, dataset: str,
                       known: tuple[str, ...] | None) -> str | None:
    """Why ``dataset`` (labelled with the attributes ``known``, None: an unknown dataset) has
    no attribute for ``name`` (None when it has, or is not a label family's name)."""
    if name.family not in LABEL_FAMILIES or known is None:
        return None
    if not known:
        return f"{dataset} has no labels to score {name.family} on"
    if name.family in (LINEAR, LINEAR_SGD) and name.name not in (*known, MEAN):
        return f"{dataset} has no attribute {name.name!r} (attributes: {', '.join(known)}, or mean)"
    return None


def _evaluation_problem(name: MetricName, config: CoreConfig) -> str | None:
    """Why no trial of ``config`` scores ``name``'s family, fraction or transfer set."""
    evaluation = config.eval
    if name.family == LINEAR_SGD and evaluation.linear_sgd is None:
        return f"{name.format()} is scored by eval.linear_sgd, which is off (None)"
    if name.percent is not None:
        section = "eval.linear_sgd" if name.family == LINEAR_SGD else "eval"
        fractions = (evaluation.linear_sgd.label_fractions
                     if name.family == LINEAR_SGD and evaluation.linear_sgd is not None
                     else evaluation.label_fractions)
        if name.percent not in {fraction_percent(fraction) for fraction in fractions}:
            return (f"{name.format()} needs {float(name.percent) / 100:g} in "
                    f"{section}.label_fractions (now {fractions})")
    if name.family == MMVP and evaluation.mmvp is None:
        return f"{name.format()} needs eval.mmvp (a MMVP-VLM directory or synthetic)"
    if name.stage is not None and name.stage >= config.num_stages:
        return (f"{name.format()}: stage {name.stage} does not exist ({config.num_stages} "
                f"stage(s))")
    return None


def check_paper(config: CoreConfig) -> Iterator[Problem]:
    """The ``paper:`` metric is reported by this config's trials (nothing to check without a
    ``paper:`` block)."""
    if config.paper is None:
        return
    from raycl.data import ATTRIBUTES, attributes_of

    name = parse_metric(config.paper.metric)  # the schema let only reported names through
    dataset, known = config.data.dataset, attributes_of(config.data)
    if name.split == TRANSFER:
        sets = {entry.label: entry.dataset for entry in config.eval.transfer}
        if name.transfer not in sets:
            yield Problem(KEY, f"{name.format()} needs a transfer set named {name.transfer!r} "
                               f"in eval.transfer (now: {', '.join(sets) or 'none'})")
            return
        dataset = sets[name.transfer]
        known = ATTRIBUTES.get(dataset)
    problem = _attribute_problem(name, dataset, known) or _evaluation_problem(name, config)
    if problem:
        yield Problem(KEY, problem)


__all__ = ["check_paper"]
