"""``eval.online_probe`` fits the trial it runs in: checked before launch.

The online probe's heads read one encoder's backbone outputs while it trains and are applied to
the embeddings evaluation computes: that needs those embeddings to be the backbone's (not an
image-text method's, whose embedding is its own projection), one encoder (not MCL's stages,
whose representation is several), and labels to train on. An objective naming its metrics
(``val/online_linear/...``) needs it switched on.
"""

from __future__ import annotations

from collections.abc import Iterator

from raycl.config.metric_names import ONLINE_LINEAR, maybe_metric
from raycl.config.schema import CoreConfig, Problem
from raycl.config.search_config import searched_note, searched_variants
from raycl.launch.linear_sgd_check import several_encoders

KEY = "eval.online_probe"


def check_online_probe(config: CoreConfig) -> Iterator[Problem]:
    """``eval.online_probe`` on a single-encoder image-only method with labels, and set when
    ``tune.metric`` names its metrics.

    Args:
        config: the validated config (its search space's choices of ``method`` and
            ``mcl.stages`` each checked).

    Yields:
        At most one problem, of ``eval.online_probe`` or ``tune.metric``.
    """
    from raycl.data import attributes_of
    from raycl.methods import METHODS, Method

    name = maybe_metric(config.tune.metric)
    if not config.eval.online_probe:
        if name is not None and name.family == ONLINE_LINEAR:
            yield Problem("tune.metric", f"{config.tune.metric} is reported only with {KEY}: "
                                         f"true")
        return
    if attributes_of(config.data) == ():
        yield Problem(KEY, f"{config.data.dataset} has no labels to train its heads on")
        return
    several = several_encoders(config)
    if several:
        yield Problem(KEY, several)
        return
    for chosen, candidate in searched_variants(config, ("method", "mcl.stages")):
        trained = candidate.mcl.base if candidate.method == "mcl" else candidate.method
        method = METHODS.get(trained)
        if method is not None and (method.multimodal or method.embed is not Method.embed):
            yield Problem(KEY, f"{searched_note(chosen)}not for {trained}: its embedding is not "
                               f"its backbone's output, which the heads are trained on")
            return


__all__ = ["check_online_probe"]
