"""What a sweep's parent run records of its configuration (:func:`parent_params`), and the
``objective`` aliases every trial's run logs beside its metrics (:func:`objective_aliases`):
pure functions of the config, used by :class:`raycl.tracking.callback.MLflowSweepCallback`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raycl.config.schema import CoreConfig
from raycl.config.search_config import flatten
from raycl.config.sweep import reported_test_metric
from raycl.launch.feasibility import JOINT_PREFIX
from raycl.tracking.runs import OBJECTIVE_ALIAS, OBJECTIVE_TEST_ALIAS


def varied_keys(config: CoreConfig) -> list[str]:
    """The config keys whose value differs between the sweep's trials: the searched keys, or,
    with nothing searched, ``seed`` when the sweep repeats the configuration over seeds."""
    if config.tune.search_space:
        return [key for key in config.tune.search_space if not key.startswith(JOINT_PREFIX)]
    return ["seed"] if config.tune.num_samples > 1 else []


def parent_params(config: CoreConfig) -> dict[str, Any]:
    """The parent run's params: the flattened config keys every trial shares (a searched key's
    default is used by no trial), and each varied key's domain as ``search_space.<key>``
    (``loguniform [0.1, 0.5]``, ``choice [2, 5, 10]``; seed repeats: ``grid [0, 1, 2]``)."""
    flat = flatten(config.to_dict(used_sections_only=True))
    flat.pop("tune.search_space", None)
    varied = varied_keys(config)
    for key in varied:
        flat.pop(key, None)
    for key in varied:
        domain = config.tune.search_space.get(key)
        if domain is None:  # the seed repeats of an empty search space (raycl.tune)
            flat[f"search_space.{key}"] = \
                f"grid {[config.seed + i for i in range(config.tune.num_samples)]}"
        else:
            flat[f"search_space.{key}"] = f"{domain.kind} {list(getattr(domain, domain.kind))}"
    return flat


def objective_aliases(metrics: Mapping[str, float], metric: str) -> dict[str, float]:
    """``objective`` (the sweep's objective) and ``objective_test`` (its test counterpart),
    for those of the two that ``metrics`` holds."""
    aliases = {}
    if metric in metrics:
        aliases[OBJECTIVE_ALIAS] = metrics[metric]
    test = reported_test_metric(metric)
    if test is not None and test in metrics:
        aliases[OBJECTIVE_TEST_ALIAS] = metrics[test]
    return aliases


__all__ = ["objective_aliases", "parent_params", "varied_keys"]
