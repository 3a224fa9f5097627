"""Warm start (``tune.warm_start: EXPERIMENT``, ``--warm-start NAME``): an earlier sweep's best
configurations are the searcher's first trials.

The earlier sweep's best trials (:func:`raycl.results.trials.find_trials`, ranked by its own
objective, the first of its ``tune.objectives``) give their resolved configs; of each, only the
keys this sweep searches whose values lie inside this search space's domains are kept (a line
says what is dropped), and Optuna is handed them as enqueued trials (Ray's ``OptunaSearch``
``points_to_evaluate``, :func:`raycl.sweep.searchers.build_searcher`). Keys searched together as one
feasible combination (:class:`raycl.launch.feasibility.JointDomain`) are seeded as that
combination's label, or dropped together when it is not one. The parent run's tag
``raycl.warm_start`` lists the seeded configurations (:func:`warm_start_tag`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raycl.config.schema import CoreConfig, Domain, Problem, key_is_active, trial_sections
from raycl.config.search_config import flatten
from raycl.launch.feasibility import JointDomain, joint_domain

if TYPE_CHECKING:
    from raycl.results.trials import FinishedTrial

# The parent run's record of the seeded configurations.
WARM_START_TAG = "raycl.warm_start"


@dataclass(frozen=True)
class Seed:
    """One seeded configuration.

    Attributes:
        trial: the earlier trial's label (``t03``).
        values: the config keys and values it seeds (every searched key that fits).
        point: the same as Optuna's parameters (a joint combination under its label).
    """

    trial: str
    values: dict[str, Any]
    point: dict[str, Any]


# Seeds found in this process, by sweep (name, store, earlier experiment): the pre-launch check
# finds them, the searcher and the callback (in the same driver) reuse them, and the earlier
# sweep is read once.
_FOUND: dict[tuple[str, str, str], list[Seed]] = {}


def found_key(config: CoreConfig) -> tuple[str, str, str]:
    """Which seeds :func:`find_seeds` keeps for ``config``: its name, store and warm start."""
    return config.name, config.mlflow.tracking_uri, config.tune.warm_start or ""


def seed_count(num_samples: int) -> int:
    """How many earlier configurations seed a sweep of ``num_samples`` trials: half of them
    (at least 1), so the searcher still explores with the rest.

    Raises:
        ValueError: ``num_samples`` below 1.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    return max(1, num_samples // 2)


def in_domain(value: Any, domain: Domain) -> bool:
    """Whether ``value`` is one ``domain`` can propose (bounds included)."""
    if domain.choice is not None:
        return any(value == choice and isinstance(value, bool) == isinstance(choice, bool)
                   for choice in domain.choice)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if domain.randint is not None:
        low, high = domain.randint
        return float(value).is_integer() and low <= value <= high
    low, high = domain.loguniform or domain.uniform or (math.nan, math.nan)
    return low <= value <= high


def fit_to_space(values: Mapping[str, Any], space: Mapping[str, Domain],
                 joint: JointDomain | None = None) -> tuple[dict[str, Any], list[str]]:
    """An earlier trial's config values as a point of this search space.

    Args:
        values: the earlier trial's config, flattened (dotted key -> value).
        space: this sweep's search space.
        joint: this sweep's constrained keys searched together (None: none).

    Returns:
        The point (searched key -> value; a joint combination under its parameter's name)
        and one line per key dropped, saying why.
    """
    point: dict[str, Any] = {}
    dropped: list[str] = []
    tied = set(joint.keys) if joint else set()
    for key, domain in space.items():
        if key not in values:
            dropped.append(f"{key}: not in its config")
        elif key not in tied and not in_domain(values[key], domain):
            dropped.append(f"{key}={values[key]!r}: outside {domain.kind} "
                           f"{domain.candidates()}")
        elif key not in tied:
            point[key] = values[key]
    if joint is not None:
        combination = tuple(values.get(key) for key in joint.keys)
        if combination in joint.combinations:
            # The label exactly as the searcher offers it (raycl.sweep.searchers.ConstrainedSpace).
            point[joint.name] = joint.labels()[joint.combinations.index(combination)]
        else:
            given = ", ".join(f"{key}={value!r}"
                              for key, value in zip(joint.keys, combination, strict=True))
            dropped.append(f"{given}: not a feasible combination of this search")
    return point, dropped


def seed_values(point: Mapping[str, Any], joint: JointDomain | None) -> dict[str, Any]:
    """A point's config keys and values (a joint label spelled out as its keys)."""
    values = {key: value for key, value in point.items() if not (joint and key == joint.name)}
    if joint is not None and joint.name in point:
        values.update(joint.values(point[joint.name]))
    return values


def find_seeds(config: CoreConfig) -> list[Seed]:
    """The seeded configurations of ``config`` (none without ``tune.warm_start``), distinct,
    best first; what is dropped is printed, once per sweep and process.

    Raises:
        raycl.results.trials.TrialLookupError: no such experiment, sweep or ranked trial.
    """
    experiment = config.tune.warm_start
    if not experiment or not config.tune.search_space:
        return []
    if found_key(config) in _FOUND:
        return _FOUND[found_key(config)]
    from raycl.results.trials import find_trials

    joint = joint_domain(config)
    trials = find_trials(config.mlflow.tracking_uri, experiment,
                         top=seed_count(config.tune.num_samples))
    seeds: list[Seed] = []
    for trial in trials:
        seed = _seed_of(config, trial, joint)
        if seed is not None and seed.point not in [known.point for known in seeds]:
            seeds.append(seed)
            print(f"raycl: warm start: {experiment} {seed.trial} seeds "
                  f"{json.dumps(seed.values, sort_keys=True)}", flush=True)
    _FOUND[found_key(config)] = seeds
    return seeds


def _seed_of(config: CoreConfig, trial: FinishedTrial, joint: JointDomain | None) -> Seed | None:
    """The earlier ``trial`` as a seed of this search, or None (said in a line): a trial of
    another method than this sweep's is skipped, and of its values only the keys its method
    reads are kept."""
    experiment = config.tune.warm_start
    values = flatten(trial.config.to_dict())
    theirs = trial_sections(trial.config, {})
    space = config.tune.search_space
    deciding = {key: values[key] for key in space
                if (key == "method" or key.endswith(".base")) and key in values}
    ours = trial_sections(config, deciding)
    if ours != theirs:
        print(f"raycl: warm start: {experiment} {trial.label}: trained "
              f"{'+'.join(sorted(theirs))}, this sweep trains {'+'.join(sorted(ours))}; "
              f"skipped", flush=True)
        return None
    active = {key: domain for key, domain in space.items() if key_is_active(key, theirs)}
    point, dropped = fit_to_space(values, active, joint)
    for line in dropped:
        print(f"raycl: warm start: {experiment} {trial.label}: {line}; dropped", flush=True)
    return Seed(trial.label, seed_values(point, joint), point) if point else None


def warm_start_tag(experiment: str, seeds: list[Seed]) -> str:
    """The parent run's ``raycl.warm_start``: the experiment and each seeded configuration."""
    listed = "; ".join(f"{seed.trial} {json.dumps(seed.values, sort_keys=True)}"
                       for seed in seeds)
    return f"{experiment}: {listed or 'no configuration fits this search space'}"


def check_warm_start(config: CoreConfig) -> Iterator[Problem]:
    """``tune.warm_start`` names an experiment of ``mlflow.tracking_uri`` with a sweep whose
    trials reported its objective (an environment check: it reads the MLflow store)."""
    if not config.tune.warm_start:
        return
    if not config.tune.search_space:
        yield Problem("tune.warm_start", "needs a search space (the trials are repeats of one "
                                         "configuration without one)")
        return
    from raycl.results.trials import TrialLookupError

    try:
        find_seeds(config)
    except TrialLookupError as exc:
        yield Problem("tune.warm_start", str(exc))


__all__ = ["WARM_START_TAG", "Seed", "check_warm_start", "find_seeds", "fit_to_space",
           "found_key", "in_domain", "seed_count", "seed_values", "warm_start_tag"]
