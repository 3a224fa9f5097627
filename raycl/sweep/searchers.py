"""Search algorithms, with the workarounds they need in one place.

The searcher is always Optuna (TPE, its random sampler for ``tune.searcher: random``, or its grid
sampler for ``tune.searcher: grid``) driven by a define-by-run space (:class:`ConstrainedSpace`):
keys that decide whether a trial can train at all (batch size, MCL's K and N) are offered only in
feasible combinations, so Optuna never proposes a trial that would be skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch as _RayOptunaSearch

from raycl.config.collapse import CollapseConfig
from raycl.config.schema import CoreConfig, Domain, key_is_active, trial_sections
from raycl.launch.feasibility import JOINT_PREFIX, JointDomain, joint_domain
from raycl.sweep.warm_start import find_seeds
from raycl.worker.outcome import FAILED_KEY

if TYPE_CHECKING:
    import optuna


def suggest(trial: optuna.Trial, key: str, domain: Domain) -> Any:
    """One value of ``domain`` from an Optuna trial, under the config key's name."""
    if domain.choice is not None:
        return trial.suggest_categorical(key, domain.choice)
    if domain.randint is not None:
        return trial.suggest_int(key, *domain.randint)  # both ends included, as documented
    if domain.loguniform is not None:
        return trial.suggest_float(key, *domain.loguniform, log=True)
    assert domain.uniform is not None
    return trial.suggest_float(key, *domain.uniform)


class ConstrainedSpace:
    """A define-by-run search space for Ray's ``OptunaSearch``.

    Independent keys are suggested one by one. The searched keys tied by a feasibility
    constraint are suggested together as one categorical parameter over their feasible
    combinations (Optuna has no dynamic categorical domains, so K's choices cannot depend on N);
    the returned dict puts their values under their own config keys.

    Conditional on the method: when ``method`` (or a ``<section>.base``) is searched, it is
    suggested first and a method's knobs only for the trials that run that method
    (:func:`raycl.config.schema.key_is_active`): a SimCLR trial of a ``method: [simclr, hscl]``
    search has no ``hscl.filter_exponent``, in Optuna's study (so TPE models each method's
    knobs over that method's trials only), in its config, its name or its MLflow params.

    A class rather than a closure so that Tune can pickle the searcher with the experiment
    state.
    """

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.space = dict(config.tune.search_space)
        self.joint: JointDomain | None = joint_domain(config)

    def __call__(self, trial: optuna.Trial) -> dict[str, Any] | None:
        tied = set(self.joint.keys) if self.joint else set()
        values = self._suggest_active(trial, [key for key in self.space if key not in tied])
        if self.joint is None:
            return None
        label = trial.suggest_categorical(self.joint.name, self.joint.labels())
        # A tied key the trial does not read (MCL's K for a SimCLR trial) is left out.
        sections = trial_sections(self.config, values)
        return {key: value for key, value in self.joint.values(label).items()
                if key_is_active(key, sections)}

    def _suggest_active(self, trial: optuna.Trial, keys: list[str]) -> dict[str, Any]:
        """Suggest ``keys`` that the trial reads: ``method`` and the ``.base`` keys first, each
        choice deciding which knobs follow."""
        deciding = [key for key in keys if key == "method" or key.endswith(".base")]
        pending = deciding + [key for key in keys if key not in deciding]
        values: dict[str, Any] = {}
        progress = True
        while progress:
            progress = False
            sections = trial_sections(self.config, values)
            for key in pending:
                if key_is_active(key, sections):
                    values[key] = suggest(trial, key, self.space[key])
                    pending.remove(key)
                    progress = True
                    break  # a method or base may have changed what the trial reads
        return values


class OptunaSearch(_RayOptunaSearch):
    """Ray's ``OptunaSearch`` that hides the joint parameter from trials and ignores reports
    without the objective.

    Ray 2.60's ``OptunaSearch.on_trial_result`` indexes ``result[metric]`` unconditionally
    (ray/tune/search/optuna/optuna_search.py; no upstream issue found) and the KeyError kills the
    whole sweep on the first report without the objective: an epoch without evaluation
    (``eval.every_n_epochs > 1``) or an MCL trial skipped for its budget. Such reports carry
    nothing for Optuna, so they are skipped; completion (``on_trial_complete``) already handles a
    missing metric by recording the trial as pruned. With several objectives
    (``tune.objectives``: metric and mode are lists) Optuna takes no intermediate values, and a
    last report that lacks one objective is recorded as pruned too (Ray would hand Optuna a
    None among the values).
    """

    # tune.collapse (set by build_searcher; a class default for a searcher pickled before it)
    collapse: CollapseConfig | None = None

    def suggest(self, trial_id: str) -> dict | None:
        config = super().suggest(trial_id)
        if isinstance(config, dict):
            # The joint parameter is Optuna's business; the trial gets the keys it stands for.
            config = {key: value for key, value in config.items()
                      if not key.startswith(JOINT_PREFIX)}
        return config

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        # Several objectives: Optuna takes no intermediate values (Ray's method returns).
        if isinstance(self.metric, str) and self.metric in result:
            super().on_trial_result(trial_id, result)

    def on_trial_complete(
        self, trial_id: str, result: dict | None = None, error: bool = False
    ) -> None:
        # A diverged trial (NaN loss) ends without an error in Tune's eyes (it is a result, not
        # a crash to retry); Optuna records it as FAIL, what it is, not PRUNED (stopped early).
        if result and result.get(FAILED_KEY):
            result, error = None, True
        # tune.collapse stopped it: pruned, so TPE learns the region is bad but no value counts
        if result and self.collapse is not None and self.collapse.reason(result):
            result, error = None, False
        # Several objectives: a last report without one of them tells Optuna nothing (Ray would
        # hand it a None among the values, which Optuna refuses): recorded as pruned.
        if result and isinstance(self.metric, list) and any(m not in result for m in self.metric):
            result = None
        super().on_trial_complete(trial_id, result, error)


def build_searcher(config: CoreConfig,
                   first_points: list[dict[str, Any]] | None = None) -> OptunaSearch:
    """The seeded Optuna searcher for a config with a non-empty search space.

    ``first_points``: Optuna's first trials (None: the warm start's, :func:`find_seeds`)."""
    from optuna.samplers import BaseSampler, GridSampler, RandomSampler, TPESampler

    space = ConstrainedSpace(config)
    sampler: BaseSampler
    if config.tune.searcher == "grid":
        # Under the names and values ConstrainedSpace suggests (choice domains only: checked
        # at load).
        grid = {key: list(domain.candidates()) for key, domain in space.space.items()
                if not (space.joint and key in space.joint.keys)}
        if space.joint:
            grid[space.joint.name] = space.joint.labels()
        sampler = GridSampler(grid, seed=config.seed)
    elif config.tune.searcher == "random":
        sampler = RandomSampler(seed=config.seed)
    else:
        sampler = TPESampler(seed=config.seed)
    metric, mode = searched_objectives(config)
    # tune.warm_start: the earlier sweep's best configurations are Optuna's first trials.
    seeds = (first_points if first_points is not None
             else [seed.point for seed in find_seeds(config)])
    searcher = OptunaSearch(space=space, metric=metric, mode=mode, sampler=sampler,
                            points_to_evaluate=seeds or None)
    searcher.collapse = config.tune.collapse
    return searcher


def searched_objectives(config: CoreConfig) -> tuple[str | list[str], str | list[str]]:
    """The searcher's metric and mode: ``tune.objectives`` as lists (Optuna's multi-objective
    study), else ``tune.metric`` and ``tune.mode``."""
    objectives = config.tune.objectives
    if objectives:
        return [o.metric for o in objectives], [o.mode for o in objectives]
    return config.tune.metric, config.tune.mode



class FinishingASHA(ASHAScheduler):
    """ASHA that lets a trial end by itself at its last report (``max_t``).

    Tune stops a trial's process as soon as the scheduler answers STOP, and plain ASHA answers
    STOP at every trial's final report: the trial's work after that report (its diagnostics
    plots, MCL's AMI) would never reach MLflow. Past ``max_t`` there is nothing left to save by
    stopping, so the trial runs its last few seconds; earlier rungs stop trials as usual.
    """

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        if action == self.STOP and result.get(self._time_attr, 0) >= self._max_t:
            self._num_stopped -= 1
            return self.CONTINUE
        return action
