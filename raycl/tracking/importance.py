"""Which searched knobs mattered: Optuna's parameter importance over a sweep's finished trials.

The sweep's callback calls :func:`log_importance` with the leaderboard: once enough trials have
finished (:func:`required_trials`), the parent run gets ``importance.csv`` (one row per searched
knob: its importance, the evaluator, the trials used) and ``importance.png`` (horizontal bars),
rewritten after every trial and at the end, and the leaderboard's description a line naming
every knob (``knobs that mattered (fANOVA over 12 trials): lr 0.61, ...``), or, when the
importances cannot be told apart (:func:`is_flat`), saying so without numbers.

The importances are Optuna's (:func:`optuna.importance.get_param_importances`): an in-memory
study is built from the finished trials (:func:`optuna.trial.create_trial`), each knob under
the distribution raycl's searcher gives Optuna (:func:`raycl.sweep.searchers.suggest`, reused, not
redone), the objective as its value. fANOVA (the default) fits a random forest seeded with the
config's seed, so the same trials give the same numbers.

Trials stopped early by ASHA reported their objective at a smaller budget than those that ran
to the end; fANOVA over mixed budgets is biased (a knob that only slows early learning looks
important). So when enough trials ran to the end, only those are used; otherwise every finished
trial counts with its last reported objective, and the line says how many stopped early.
Sits on :mod:`raycl.tracking.runs` and :mod:`raycl.tracking.trial_table`.
"""

from __future__ import annotations

import csv
import logging
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycl.config.schema import CoreConfig, Domain, conditional_keys
from raycl.launch.feasibility import JOINT_PREFIX
from raycl.sweep.confirmation import CONFIRM_TAG
from raycl.tracking.runs import ENDED_TAG, RANKED_ENDINGS, SEARCHED_TAG, STOPPED_EARLY
from raycl.tracking.trial_table import searched_values

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities import Run
    from optuna.distributions import BaseDistribution

logger = logging.getLogger(__name__)

# The parent run's tag holding the importance line (what `python -m raycl.leaderboard` prints).
IMPORTANCE_TAG = "raycl.importance"
CSV_NAME = "importance.csv"
PNG_NAME = "importance.png"
CSV_HEADER = ("knob", "importance", "evaluator", "trials_used", "stopped_early")
# Evaluator name -> how the line and the CSV name it.
EVALUATORS: dict[str, str] = {"fanova": "fANOVA", "ped_anova": "PED-ANOVA"}
# Below this many trials any ranking is noise, whatever the number of knobs.
MIN_TRIALS = 4
# Importances whose largest and smallest differ by less than this are read as flat: a dozen
# trials move a knob of no effect by a few hundredths, and a forest that could not split
# (Optuna's normalisation of all-zero importances) gives exactly 1/knobs to each.
FLAT_SPREAD = 0.05


@dataclass(frozen=True)
class ScoredTrial:
    """A finished trial as importance sees it: its searched values and last objective."""

    params: dict[str, Any]
    objective: float
    stopped_early: bool


@dataclass(frozen=True)
class Importance:
    """Each searched knob's importance (normalised to sum to 1), most important first."""

    evaluator: str
    importances: dict[str, float]
    trials_used: int
    stopped_early: int
    # Too few distinct configurations among the trials for any ranking (equal shares then).
    flat: bool = False


def searched_knobs(space: Mapping[str, Domain]) -> list[str]:
    """The search space's config keys (never the searcher's joint parameter)."""
    return [key for key in space if not key.startswith(JOINT_PREFIX)]


def required_trials(knob_count: int) -> int:
    """Finished trials needed before importance is computed: ``max(4, knobs + 1)``.

    Args:
        knob_count: the number of searched knobs.

    Returns:
        One trial more than knobs (fANOVA's forest cannot tell apart more knobs than it has
        contrasts between trials), and never fewer than :data:`MIN_TRIALS`.
    """
    if knob_count < 0:
        raise ValueError(f"knob_count must be >= 0, got {knob_count}")
    return max(MIN_TRIALS, knob_count + 1)


def optuna_distributions(space: Mapping[str, Domain]) -> dict[str, BaseDistribution]:
    """The Optuna distribution of every searched knob: the one raycl's searcher suggests from
    (:func:`raycl.sweep.searchers.suggest` on a throwaway trial), so the two never disagree. Keys
    the searcher ties into one joint parameter get their own domain's distribution here.

    Args:
        space: the sweep's search space (config key -> domain).

    Returns:
        Knob -> distribution (choice: categorical, randint: int, loguniform: log float,
        uniform: float).
    """
    import optuna

    from raycl.sweep.searchers import suggest

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" line
    try:
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    finally:
        optuna.logging.set_verbosity(verbosity)
    for key in searched_knobs(space):
        suggest(trial, key, space[key])
    return dict(trial.distributions)


def log_knobs(distributions: Mapping[str, BaseDistribution]) -> set[str]:
    """The knobs searched on a log scale (Optuna's ``log=True`` float distributions)."""
    from optuna.distributions import FloatDistribution

    return {key for key, dist in distributions.items()
            if isinstance(dist, FloatDistribution) and dist.log}


def on_search_scale(distributions: Mapping[str, BaseDistribution],
                    logged: set[str]) -> dict[str, BaseDistribution]:
    """The distributions with each ``logged`` knob on its log10 scale (a plain float range).

    Optuna's fANOVA integrates each knob's marginal over its linear range, whatever its ``log``
    flag: a learning rate searched in [1e-4, 1e-1] would have 90 % of its weight above 0.01,
    where the search put a third of its trials. On the log scale the variance is measured under
    the measure the search sampled from.
    """
    from optuna.distributions import FloatDistribution

    scaled: dict[str, BaseDistribution] = {}
    for key, dist in distributions.items():
        if key in logged:
            assert isinstance(dist, FloatDistribution)
            dist = FloatDistribution(math.log10(dist.low), math.log10(dist.high))
        scaled[key] = dist
    return scaled


def scaled_params(params: Mapping[str, Any], logged: set[str]) -> dict[str, Any]:
    """``params`` on :func:`on_search_scale`'s scale: log10 of the ``logged`` knobs' values."""
    return {key: math.log10(value) if key in logged else value for key, value in params.items()}


def parse_value(text: str, domain: Domain) -> Any:
    """A searched value as a trial's run records it (text) back in its domain's type.

    Returns:
        The value (a choice as the domain lists it), or None when the text is not in the
        domain's type or list.
    """
    if domain.choice is not None:
        return next((value for value in domain.choice if str(value) == text), None)
    try:
        return int(text) if domain.randint is not None else float(text)
    except ValueError:
        return None


def scored_trials(runs: Sequence[Run], space: Mapping[str, Domain],
                  metric: str) -> list[ScoredTrial]:
    """The trials that finished (ran to the end, or stopped early by ASHA) with a finite last
    ``metric`` and every searched value readable, from their MLflow runs (params, else the
    ``raycl.searched`` tag). Seed confirmation's re-runs (tagged ``raycl.confirm``) are left
    out: repeats of the best configurations would weigh the winner's corner of the space."""
    knobs = searched_knobs(space)
    trials = []
    for run in runs:
        ended = run.data.tags.get(ENDED_TAG)
        objective = run.data.metrics.get(metric)
        if ended not in RANKED_ENDINGS or objective is None \
                or not math.isfinite(objective) or CONFIRM_TAG in run.data.tags:
            continue
        searched = searched_values(run.data.tags.get(SEARCHED_TAG, ""))
        texts = {key: run.data.params.get(key, searched.get(key)) for key in knobs}
        params = {key: parse_value(text, space[key]) if text is not None else None
                  for key, text in texts.items()}
        if all(value is not None for value in params.values()):
            trials.append(ScoredTrial(params, objective, ended == STOPPED_EARLY))
    return trials


def trials_for_importance(trials: Sequence[ScoredTrial], needed: int) -> list[ScoredTrial]:
    """Only the trials that ran to the end when at least ``needed`` did (one budget, unbiased);
    else every finished trial, early-stopped ones at their last objective."""
    full = [trial for trial in trials if not trial.stopped_early]
    return full if len(full) >= needed else list(trials)


def param_importance(trials: Sequence[ScoredTrial], space: Mapping[str, Domain], mode: str,
                     seed: int, evaluator: str = "fanova") -> Importance:
    """Each knob's importance for the objective over ``trials`` (Optuna's evaluator).

    Args:
        trials: the finished trials to use (at least two).
        space: the search space (config key -> domain).
        mode: ``max`` or ``min``: the objective's direction (PED-ANOVA looks at the best trials).
        seed: fANOVA's random forest seed (the config's seed: reproducible numbers).
        evaluator: ``fanova`` or ``ped_anova``.

    Returns:
        The importances, most important first, normalised to sum to 1.

    Raises:
        ValueError: an unknown evaluator or mode, fewer than 2 trials, or one objective for
            all (there is no variance to apportion).
    """
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

    if evaluator not in EVALUATORS:
        raise ValueError(f"evaluator must be one of {', '.join(EVALUATORS)}, got {evaluator!r}")
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    if len(trials) < 2:
        raise ValueError(f"importance needs at least 2 trials, got {len(trials)}")
    if len({trial.objective for trial in trials}) == 1:
        raise ValueError("every trial has the same objective: no knob explains any variance")
    if configurations(trials) < 2:  # repeats of one configuration: a forest cannot split
        return _flat(evaluator, searched_knobs(space), trials)
    searched = optuna_distributions(space)
    logged = log_knobs(searched)
    distributions = on_search_scale(searched, logged)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(direction="maximize" if mode == "max" else "minimize")
        study.add_trials([optuna.trial.create_trial(
            params=scaled_params(trial.params, logged), distributions=distributions,
            value=trial.objective) for trial in trials])
        chosen = FanovaImportanceEvaluator(seed=seed) if evaluator == "fanova" \
            else PedAnovaImportanceEvaluator()
        importances = _evaluate(study, chosen, list(distributions))
    finally:
        optuna.logging.set_verbosity(verbosity)
    ranked = dict(sorted(((key, float(importances.get(key, 0.0))) for key in distributions),
                         key=lambda item: -item[1]))
    return Importance(evaluator, ranked, len(trials),
                      sum(trial.stopped_early for trial in trials))


def _evaluate(study: Any, evaluator: Any, knobs: list[str]) -> dict[str, float]:
    """Optuna's importances of ``knobs``; equal shares (flat: :func:`is_flat`) when fANOVA's
    forest could not split the trials at all (every tree constant: Optuna raises)."""
    from optuna.importance import get_param_importances

    try:
        return dict(get_param_importances(study, evaluator=evaluator))
    except RuntimeError as exc:
        if "zero total variance" not in str(exc):
            raise
        return dict.fromkeys(knobs, 1.0 / len(knobs))


def configurations(trials: Sequence[ScoredTrial]) -> int:
    """The distinct configurations (searched values) among ``trials``: a seed repeat adds a
    trial, not a contrast a forest can split on."""
    return len({tuple(sorted((key, repr(value)) for key, value in trial.params.items()))
                for trial in trials})


def _flat(evaluator: str, knobs: list[str], trials: Sequence[ScoredTrial]) -> Importance:
    """Equal shares, marked flat: ``trials`` cannot tell the knobs apart."""
    return Importance(evaluator, dict.fromkeys(knobs, 1.0 / len(knobs)), len(trials),
                      sum(trial.stopped_early for trial in trials), flat=True)


def is_flat(result: Importance) -> bool:
    """Whether the importances cannot be told apart: too few distinct configurations
    (``flat``), or two or more knobs within :data:`FLAT_SPREAD` of each other (a forest that
    found nothing, or noise)."""
    values = list(result.importances.values())
    return result.flat or (len(values) > 1 and max(values) - min(values) < FLAT_SPREAD)


def importance_line(result: Importance) -> str:
    """The leaderboard's line naming every knob, most important first: ``knobs that mattered
    (fANOVA over 12 trials, 3 stopped early by ASHA, ...): train.lr 0.61, simclr.temperature
    0.27, method 0.12`` (long lines are wrapped where printed, never cut). Flat importances
    (:func:`is_flat`) give no numbers: ``knobs that mattered (fANOVA): indistinguishable (4
    trials): train.lr, method``."""
    early = f", {result.stopped_early} stopped early by ASHA, at their last objective" \
        if result.stopped_early else ""
    name = EVALUATORS[result.evaluator]
    if is_flat(result):  # numbers here would read as a ranking that is not there
        return (f"knobs that mattered ({name}{early}): indistinguishable "
                f"({result.trials_used} trials): {', '.join(result.importances)}")
    knobs = [f"{key} {value:.2f}" for key, value in result.importances.items()]
    return f"knobs that mattered ({name} over {result.trials_used} trials{early}): " \
        + ", ".join(knobs)


def write_importance_csv(result: Importance, path: Path) -> None:
    """``importance.csv``: one row per knob, most important first (:data:`CSV_HEADER`)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_HEADER)
        for key, value in result.importances.items():
            writer.writerow([key, value, result.evaluator, result.trials_used,
                             result.stopped_early])


def importance_figure(result: Importance, metric: str) -> Figure:
    """Horizontal bars, the most important knob on top. A bare
    :class:`~matplotlib.figure.Figure` (Agg, no pyplot), as ``leaderboard.png``: the Tune
    driver's plotting state stays untouched."""
    from matplotlib.figure import Figure

    knobs = list(result.importances)[::-1]  # barh draws bottom-up
    figure = Figure(figsize=(6.0, 1.2 + 0.45 * len(knobs)))
    axis = figure.subplots()
    bars = axis.barh(knobs, [result.importances[key] for key in knobs], color="tab:blue",
                     alpha=0.8)
    axis.bar_label(bars, fmt="%.2f", padding=3, fontsize=8)
    axis.set_xlim(0.0, 1.12)  # room for the label of a bar at 1
    axis.set_xlabel(f"importance for {metric}")
    axis.grid(axis="x", alpha=0.3)
    early = f", {result.stopped_early} stopped early" if result.stopped_early else ""
    axis.set_title(f"{EVALUATORS[result.evaluator]} over {result.trials_used} trials{early}",
                   fontsize=10)
    figure.tight_layout()
    return figure


def sweep_importance(runs: Sequence[Run], config: CoreConfig,
                     evaluator: str = "fanova") -> Importance | str:
    """The importance of the sweep's searched knobs over its finished trial ``runs``, or the
    line saying why there is none (nothing searched, too few finished trials, one objective
    for all). Flat importances are returned as they are: :func:`importance_line` says so.
    A search over ``method`` weighs the knobs every trial reads (``method`` among them): a
    method's own knobs (:func:`raycl.config.schema.conditional_keys`) exist on its trials only."""
    conditional = set(conditional_keys(config))
    space = {key: domain for key, domain in config.tune.search_space.items()
             if key not in conditional}
    knobs = searched_knobs(space)
    if not knobs:
        return "importance: nothing searched (the trials differ only by seed)"
    needed = required_trials(len(knobs))
    trials = scored_trials(runs, space, config.tune.metric)
    if len(trials) < needed:
        return (f"importance: needs ≥ {needed} finished trials with {config.tune.metric}, "
                f"have {len(trials)}")
    used = trials_for_importance(trials, needed)
    if len({trial.objective for trial in used}) == 1:
        return (f"importance: all {len(used)} finished trials scored {used[0].objective:.4g} "
                f"on {config.tune.metric}; no knob made a difference")
    if configurations(used) < needed:  # seed repeats: fewer contrasts than trials
        return _flat(evaluator, knobs, used)
    return param_importance(used, space, config.tune.mode, config.seed, evaluator)


def log_importance(client: MlflowClient, parent_run_id: str, runs: Sequence[Run],
                   config: CoreConfig, evaluator: str = "fanova") -> str:
    """Log the sweep's importance on its parent run (``importance.csv``, ``importance.png``,
    the tag ``raycl.importance``) and return the leaderboard's line. With too few trials,
    nothing searched or importances that cannot be told apart (:func:`is_flat`) only the tag
    is written. A failure is logged and said in the line, never raised: importance is never
    worth a sweep."""
    try:
        result = sweep_importance(runs, config, evaluator)
        line = result if isinstance(result, str) else importance_line(result)
        conditional = conditional_keys(config)
        if conditional:
            line += f" (one method's knobs left out: {', '.join(conditional)})"
        if not isinstance(result, str) and not is_flat(result):  # flat: no numbers to log
            with tempfile.TemporaryDirectory() as directory:
                csv_path, png_path = Path(directory, CSV_NAME), Path(directory, PNG_NAME)
                write_importance_csv(result, csv_path)
                importance_figure(result, config.tune.metric).savefig(png_path, dpi=100)
                client.log_artifact(parent_run_id, str(csv_path))
                client.log_artifact(parent_run_id, str(png_path))
        client.set_tag(parent_run_id, IMPORTANCE_TAG, line)
        return line
    except Exception as exc:  # importance is never worth a sweep
        logger.warning("could not compute the parameter importance", exc_info=True)
        return f"importance: could not be computed ({type(exc).__name__}: {exc})"


__all__ = ["CSV_HEADER", "IMPORTANCE_TAG", "Importance", "ScoredTrial", "configurations",
           "importance_figure", "importance_line", "is_flat", "log_importance", "log_knobs",
           "on_search_scale", "optuna_distributions", "param_importance", "parse_value",
           "required_trials", "scaled_params", "scored_trials", "sweep_importance",
           "trials_for_importance", "write_importance_csv"]
