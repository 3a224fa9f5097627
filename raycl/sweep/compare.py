"""``tune.compare``: one searcher and one set of ASHA brackets per compared value.

:class:`PerValueSearch` hands out trials in turn to a searcher of each compared value (the
least-served value first, up to its equal share of ``tune.num_samples``), each an Optuna study
over the search space with the compared key pinned to its value: TPE models a method's knobs,
and the shared ones, from that method's trials alone. :class:`PerValueScheduler` keeps an ASHA of
each value, so a trial is compared at a rung only with trials of its own value: a method that
starts slowly is not stopped for being behind another method at epoch 2. The rules a config must
meet are in :mod:`raycl.config.compare`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from ray.tune.schedulers import TrialScheduler
from ray.tune.search import Searcher

from raycl.config.compare import budget_per_value, compared_values
from raycl.config.schema import CoreConfig, Domain


def value_label(value: Any) -> str:
    """How a compared value keys the per-value searchers and schedulers (``repr``: a value
    from a YAML choice and the same value in a trial's config agree)."""
    return repr(value)


def pinned_config(config: CoreConfig, value: Any) -> CoreConfig:
    """``config`` whose search space offers only ``value`` of the compared key."""
    assert config.tune.compare is not None
    space = dict(config.tune.search_space)
    space[config.tune.compare] = Domain(choice=[value])
    tune = config.tune.model_copy(update={"search_space": space})
    return config.model_copy(update={"tune": tune})


class PerValueSearch(Searcher):
    """A searcher of each compared value, handed the trials in turn.

    Args:
        key: the compared config key (``method``).
        searchers: compared value (as :func:`value_label`) -> its searcher, in the order
            trials are offered when values are tied.
        budget: trials each value gets.
        metric, mode: the sweep's objective.
    """

    def __init__(self, key: str, searchers: dict[str, Searcher], budget: int,
                 metric: str | None = None, mode: str | None = None) -> None:
        super().__init__(metric=metric, mode=mode)
        self.key = key
        self.searchers = searchers
        self.budget = budget
        self.served = dict.fromkeys(searchers, 0)
        self.owner: dict[str, str] = {}  # trial id -> its value's label

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict,
                              **spec: Any) -> bool:
        done = [searcher.set_search_properties(metric, mode, config, **spec)
                for searcher in self.searchers.values()]
        self._metric, self._mode = metric or self._metric, mode or self._mode
        return all(done)

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        # Tune's ConcurrencyLimiter counts the sweep's running trials above this searcher.
        return False

    def suggest(self, trial_id: str) -> dict | str | None:
        """The next trial's config from the least-served value still under its budget
        (``FINISHED`` once every value had its share; None while none can suggest yet)."""
        order = sorted(self.searchers, key=lambda label: self.served[label])
        for label in order:
            if self.served[label] >= self.budget:
                continue
            config = self.searchers[label].suggest(trial_id)
            if config is None or config == Searcher.FINISHED:
                continue
            self.served[label] += 1
            self.owner[trial_id] = label
            return config
        if all(count >= self.budget for count in self.served.values()):
            return Searcher.FINISHED
        return None

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self._searcher_of(trial_id, lambda searcher: searcher.on_trial_result(trial_id, result))

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        self._searcher_of(trial_id, lambda searcher: searcher.on_trial_complete(
            trial_id, result=result, error=error))

    def _searcher_of(self, trial_id: str, call: Callable[[Searcher], None]) -> None:
        label = self.owner.get(trial_id)
        if label is not None:  # a trial this searcher never suggested (none today): nobody's
            call(self.searchers[label])

    def save(self, checkpoint_path: str) -> None:
        # The value searchers are Optuna searches, whose state pickles (as Ray's own save).
        with open(checkpoint_path, "wb") as handle:
            pickle.dump(self.__dict__, handle)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as handle:
            self.__dict__.update(pickle.load(handle))


class PerValueScheduler(TrialScheduler):
    """A scheduler of each compared value (ASHA's rungs per method); a trial's reports go to
    its own value's. Choosing the next trial to run is the same for all (first pending).

    Args:
        key: the compared config key.
        schedulers: compared value (as :func:`value_label`) -> its scheduler.
    """

    def __init__(self, key: str, schedulers: dict[str, TrialScheduler]) -> None:
        super().__init__()
        self.key = key
        self.schedulers = schedulers
        first = next(iter(schedulers.values()))
        self._supports_buffered_results = first.supports_buffered_results

    def _of(self, trial: Any) -> TrialScheduler:
        label = value_label(trial.config.get(self.key))
        return self.schedulers.get(label) or next(iter(self.schedulers.values()))

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        done = [scheduler.set_search_properties(metric, mode, **spec)
                for scheduler in self.schedulers.values()]
        self._metric = metric or self._metric
        return all(done)

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_add(tune_controller, trial)

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_error(tune_controller, trial)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        return self._of(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)

    def choose_trial_to_run(self, tune_controller: Any) -> Any:
        return next(iter(self.schedulers.values())).choose_trial_to_run(tune_controller)

    def debug_string(self) -> str:
        return "\n".join(f"{self.key}={label}: {scheduler.debug_string()}"
                         for label, scheduler in self.schedulers.items())


def compare_search(
    config: CoreConfig,
    build_searcher: Callable[[CoreConfig, list[dict[str, Any]]], Searcher],
    build_scheduler: Callable[[], TrialScheduler],
) -> tuple[Searcher, TrialScheduler]:
    """The searcher and scheduler of a ``tune.compare`` sweep.

    Args:
        config: the sweep's config (``tune.compare`` set).
        build_searcher: ``(config, first points) -> searcher``, called with each value's pinned
            config and the warm start's configurations of that value only.
        build_scheduler: a new scheduler; one per value unless it is plain FIFO (no rungs).

    Returns:
        ``(searcher, scheduler)`` for the sweep's Tuner.
    """
    from ray.tune.schedulers import FIFOScheduler

    from raycl.sweep.warm_start import find_seeds

    key = config.tune.compare
    assert key is not None
    values = compared_values(config.tune)
    # The warm start is read once, for the whole space; each value starts from its own points.
    points = [seed.point for seed in find_seeds(config)]
    searchers = {value_label(value): build_searcher(
        pinned_config(config, value),
        [point for point in points if value_label(point.get(key)) == value_label(value)])
        for value in values}
    searcher = PerValueSearch(key, searchers, budget_per_value(config.tune),
                              config.tune.metric, config.tune.mode)
    scheduler = build_scheduler()
    if type(scheduler) is not FIFOScheduler:
        scheduler = PerValueScheduler(key, {value_label(value): build_scheduler()
                                            for value in values})
    return searcher, scheduler


__all__ = ["PerValueScheduler", "PerValueSearch", "compare_search", "pinned_config",
           "value_label"]
