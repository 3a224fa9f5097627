"""``eval.linear_sgd`` fits the trial it evaluates: checked before launch.

The papers' linear evaluation trains heads on one frozen encoder's images in memory: MCL's
representation (several stages' encoders, concatenated or a soup) and stream mode's files are
not covered yet, and a dataset without labels has nothing to classify. An objective naming the
protocol's metrics (``val/linear_sgd/...``) needs it switched on.
"""

from __future__ import annotations

from collections.abc import Iterator

from raycl.config.metric_names import LINEAR_SGD, VAL, maybe_metric
from raycl.config.schema import CoreConfig, Problem
from raycl.config.search_config import searched_note, searched_variants

KEY = "eval.linear_sgd"


def check_linear_sgd(config: CoreConfig) -> Iterator[Problem]:
    """``eval.linear_sgd`` on a single-encoder method, in memory, with labels; and set when
    ``tune.metric`` names its metrics.

    Args:
        config: the validated config (its search space's choices of ``method`` and
            ``mcl.stages`` each checked).

    Yields:
        At most one problem, of ``eval.linear_sgd`` or ``tune.metric``.
    """
    from raycl.data import attributes_of
    from raycl.data.registry import streamed_only

    name = maybe_metric(config.tune.metric)
    if config.eval.linear_sgd is None:
        if name is not None and name.split == VAL and name.family == LINEAR_SGD:
            yield Problem("tune.metric", f"{config.tune.metric} is reported only with "
                                         f"{KEY} set (e.g. {KEY}: {{epochs: 100}})")
        return
    data = config.data
    if data.loader == "stream" or streamed_only(data.dataset):
        yield Problem(KEY, "not yet for data.loader: stream (its images are files decoded in "
                           "batches); use data.loader: memory")
        return
    if attributes_of(data) == ():
        yield Problem(KEY, f"{data.dataset} has no labels to train a linear head on")
        return
    several = several_encoders(config)
    if several:
        yield Problem(KEY, several)


def several_encoders(config: CoreConfig) -> str | None:
    """Why a probe of one encoder (``eval.linear_sgd``, ``eval.online_probe``) cannot score a
    trial of ``config``: the first of its searched ``method`` / ``mcl.stages`` combinations
    that trains several stages (MCL), named; None when none does."""
    for chosen, candidate in searched_variants(config, ("method", "mcl.stages")):
        if candidate.num_stages > 1:
            return (f"{searched_note(chosen)}not yet for MCL (its representation is several "
                    f"stages' encoders)")
    return None


__all__ = ["check_linear_sgd", "several_encoders"]
