"""What makes a trial impossible, and which combinations of searched keys avoid it.

Two constraints decide whether a trial can run at all, and both are known before launch:

- the global batch must fit the training split (and divide among the workers);
- MCL needs ``K^N <= M/b`` (paper Eq. 4): ``N`` stages of ``K`` clusters make up to ``K^N``
  pseudo-label groups, each of which must on average fill a batch of ``b`` from ``M`` samples.

A config with fixed values is rejected at load (:func:`trial_problem`, run by
:func:`raycl.launch.checks.check_feasible`). When the keys involved are searched,
:func:`joint_domain` enumerates their combinations and keeps the feasible ones; the searcher
(:mod:`raycl.sweep.searchers`) then offers Optuna only those, as one categorical parameter, so
no trial slot is spent on a configuration that cannot train.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from raycl.config.schema import CoreConfig, Domain, Problem
from raycl.config.search_config import apply_overrides

# Keys whose values decide feasibility: batch size, MCL's K and N, and the dataset size.
CONSTRAINED_KEYS: tuple[str, ...] = (
    "train.batch_size", "mcl.clusters", "mcl.stages",
    "data.samples_per_combination", "data.num_samples",
)
# Enumerating more combinations than this is a sign of a space better written differently.
MAX_COMBINATIONS = 20_000
JOINT_PREFIX = "feasible:"


def train_split_size(data: Any) -> int:
    """Exact training-split size for a data config (lists the files of a folder dataset)."""
    from raycl.data import split_sizes_for

    return split_sizes_for(data)["train"]


def stage_budget_problem(
    clusters: int, stages: int, train_size: int, batch_size: int
) -> str | None:
    """MCL's constraint K^N <= M/b in the paper's literal form (Eq. 4).

    One stage (N = 1) never clusters, so K is irrelevant there and nothing is checked.
    :func:`raycl.kmeans.check_stage_budget` explains why K^(N-1) would suffice; the literal
    form is K times stricter and guarantees every last-stage group averages K batches.
    """
    if stages == 1:
        return None
    from raycl.kmeans import check_stage_budget  # late: faiss is slow to import

    problem = check_stage_budget(clusters, stages, train_size, batch_size,
                                 count_final_clustering=True)
    return f"MCL needs K^N <= M/b with K={clusters}, N={stages}: {problem}" if problem else None


def trial_problem(config: CoreConfig, train_size: int | None = None) -> Problem | None:
    """Why a trial with this config cannot train, as a ``(key, why)`` :class:`Problem`; None when
    it can.

    Args:
        config: the trial's resolved config.
        train_size: the training split's size if already known (else computed exactly from
            the data config).
    """
    if train_size is None:
        train_size = train_split_size(config.data)
    batch, workers = config.train.batch_size, config.scaling.num_workers
    if batch > train_size:
        return Problem("train.batch_size", f"{batch} exceeds the training split ({train_size} "
                                           f"samples); lower it or use more data")
    if workers > 0 and batch % workers:
        return Problem("train.batch_size", f"{batch} is not divisible by scaling.num_workers="
                                           f"{workers}")
    if config.method == "mcl":
        problem = stage_budget_problem(config.mcl.clusters, config.mcl.stages, train_size,
                                       batch)
        if problem:
            return Problem("mcl.clusters/mcl.stages", problem)
    return None


def finite_values(domain: Domain) -> list[Any] | None:
    """Every value of a finite domain (choice, randint); None for a continuous one."""
    if domain.choice is not None:
        return list(domain.choice)
    if domain.randint is not None:
        low, high = domain.randint
        return list(range(low, high + 1))
    return None


@dataclass(frozen=True)
class JointDomain:
    """Constrained searched keys offered to the searcher as one categorical parameter.

    Attributes:
        keys: the config keys, in a fixed order.
        combinations: the feasible value tuples, one entry per distinct trial.
    """

    keys: tuple[str, ...]
    combinations: tuple[tuple[Any, ...], ...]

    @property
    def name(self) -> str:
        """The parameter's name as the searcher sees it (never reaches a trial's config)."""
        return JOINT_PREFIX + ",".join(self.keys)

    def labels(self) -> list[str]:
        """One categorical choice per combination (JSON, as Optuna needs str/int/float)."""
        return [json.dumps(list(combination)) for combination in self.combinations]

    def values(self, label: str) -> dict[str, Any]:
        """The config keys and values of a chosen label."""
        return dict(zip(self.keys, json.loads(label), strict=True))


def joint_domain(config: CoreConfig) -> JointDomain | None:
    """The feasible combinations of the searched constrained keys.

    Returns:
        None when no constrained key is searched, or when every combination is feasible and
        distinct (then the keys stay independent parameters, which TPE models better).

    Raises:
        ValueError: no combination is feasible, a constrained key has a continuous domain, or
            the combinations are too many to enumerate.
    """
    space = config.tune.search_space
    keys = tuple(key for key in CONSTRAINED_KEYS if key in space)
    if not keys:
        return None
    domains = {key: finite_values(space[key]) for key in keys}
    for key, values in domains.items():
        if values is None:
            raise ValueError(f"{key} decides whether a trial fits; search it with choice or "
                             f"randint")
    count = 1
    for values in domains.values():
        count *= len(values)
    if count > MAX_COMBINATIONS:
        raise ValueError(f"{' x '.join(keys)} make {count} combinations to check "
                         f"(> {MAX_COMBINATIONS}); narrow their ranges")

    sizes: dict[str, int] = {}  # train-split size per data config: a folder is listed once
    feasible: list[tuple[Any, ...]] = []
    seen: set[str] = set()
    first_problem = None
    for combination in itertools.product(*(domains[key] for key in keys)):
        trial = apply_overrides(config, dict(zip(keys, combination, strict=True)))
        data_key = trial.data.model_dump_json()
        if data_key not in sizes:
            sizes[data_key] = train_split_size(trial.data)
        problem = trial_problem(trial, sizes[data_key])
        if problem:
            first_problem = first_problem or problem
            continue
        # Equivalent trials are offered once: with one MCL stage, K is never used.
        canonical = dict(zip(keys, combination, strict=True))
        if trial.method == "mcl" and trial.mcl.stages == 1 and "mcl.clusters" in canonical:
            canonical["mcl.clusters"] = min(domains["mcl.clusters"])
        signature = json.dumps(canonical, sort_keys=True)
        if signature not in seen:
            seen.add(signature)
            feasible.append(tuple(canonical[key] for key in keys))
    if not feasible:
        key, why = first_problem or ("", "")
        raise ValueError(f"no combination of {', '.join(keys)} can train; e.g. {key}: {why}")
    if len(feasible) == count:
        return None
    return JointDomain(keys=keys, combinations=tuple(feasible))


def grid_size(config: CoreConfig) -> int:
    """Combinations ``tune.searcher: grid`` runs: the product of the choice domains' sizes, with
    constrained keys counted by their feasible combinations only."""
    joint = joint_domain(config)
    tied = set(joint.keys) if joint else set()
    size = len(joint.labels()) if joint else 1
    for key, domain in config.tune.search_space.items():
        if key not in tied:
            size *= len(domain.candidates())
    return size


def max_reports(config: CoreConfig) -> int:
    """ASHA's max_t: ``scheduler.max_t``, or the reports of the longest trial the search space
    allows (every phase's epochs, e.g. FGVR's decoder pre-training, times stages)."""
    from raycl.methods import stage_epochs  # late: keeps `--help` and config errors fast

    if config.tune.scheduler.max_t:
        return config.tune.scheduler.max_t
    space = config.tune.search_space
    # The largest value of every searched epoch count and of the stage count.
    longest = {key: max(int(v) for v in domain.candidates()) for key, domain in space.items()
               if key.endswith("epochs") or key == "mcl.stages"}
    longest_config = apply_overrides(config, longest) if longest else config
    try:
        epochs = stage_epochs(longest_config)
    except ValueError:  # an unknown method: reported by raycl.launch.checks, not here
        epochs = longest_config.train.epochs
    return max(1, epochs * longest_config.num_stages)


__all__ = ["CONSTRAINED_KEYS", "JOINT_PREFIX", "MAX_COMBINATIONS", "JointDomain",
           "finite_values", "grid_size", "joint_domain", "max_reports", "stage_budget_problem",
           "train_split_size", "trial_problem"]
