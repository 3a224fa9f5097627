"""Seed confirmation's data caches (``tune.confirm``): removed once their seed has finished.

A generated set (Trifeature, digits, MNIST-Fashion's pairing) is cached per seed: a
confirmation seed's trial builds a copy of its own on every node it trains on (a paper-scale
Trifeature: about 4.9 GB each), which no other trial reads, so ``top_k x seeds`` copies piled
up on each node, never removed. :class:`SeedCacheRemoval` (a Tune callback of the confirmation)
removes a seed's copies on every alive node as soon as the last trial reading them has ended
(completed, or failed for good: configurations share their seeds), so a node holds at most the
copies of the seeds running on it. By default there are none: confirmation trains on the
search's data (``data.seed`` pinned; ``tune.confirm.redraw_data: true`` redraws it per seed).
Only caches keyed by the seed are touched: those the sweep's own seed shares (a file source's,
a set not keyed by the seed, the search's) stay. A seed run again later (a resumed sweep
re-running a failed one, ``raycl.evaluate``) builds its copy again.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray.tune import Callback

from raycl.config.schema import CoreConfig
from raycl.config.search_config import apply_overrides
from raycl.config.sweep import trial_values

if TYPE_CHECKING:
    from raycl.config.training import DataConfig

# Seconds the confirmation's end waits for the removals still running (each a directory
# removal per node).
REMOVAL_WAIT_S = 60.0
# Tune's states of a trial that has ended (completed, or failed for good).
_ENDED_STATES = ("TERMINATED", "ERROR")


def seed_data_configs(config: CoreConfig) -> list[DataConfig]:
    """The data settings of a trial of ``config`` that read array sources: the pretraining set
    and each ``eval.transfer`` set. A file source's cache is named by its listing, never by the
    seed (and its key costs a listing): left out."""
    from raycl.data.registry import SOURCES
    from raycl.eval.transfer import transfer_data_config

    configs = [config.data, *(transfer_data_config(config, entry)
                              for entry in config.eval.transfer)]
    return [cfg for cfg in configs if cfg.dataset in SOURCES and SOURCES[cfg.dataset].stream
            == "no"]


def remove_seed_caches(data_configs: Sequence[DataConfig], seed: int,
                       base_seed: int) -> list[str]:
    """Remove, on this node, the cache directories ``seed`` has of its own: those of
    ``data_configs`` whose cache key names the seed (not shared with ``base_seed``'s, the
    search's). The body of :func:`launch_removal`'s tasks: the cache directory is the node's
    (``$RAYCL_CACHE`` or the home directory, unless ``data.cache_dir`` names one).

    Returns:
        The directories removed (none when there were none here).
    """
    from raycl.data.cache.build import remove_cache
    from raycl.data.cache.store import cache_path
    from raycl.data.registry import reader

    removed = []
    for cfg in data_configs:
        source = reader(cfg.dataset)
        own = cache_path(cfg, source.content_key(cfg, seed))
        if own == cache_path(cfg, source.content_key(cfg, base_seed)):
            continue  # not keyed by the seed: the search's trials read the same copy
        if remove_cache(own):
            removed.append(str(own))
    return removed


def launch_removal(data_configs: Sequence[DataConfig], seed: int, base_seed: int) -> list[Any]:
    """:func:`remove_seed_caches` on every alive node of the Ray cluster (one task each, no
    CPU reserved: a removal never waits for a trial's resources).

    Returns:
        The tasks' ``ObjectRef``.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(remove_seed_caches)
    return [task.options(num_cpus=0, max_retries=0, name="raycl-confirm-cache",
                         scheduling_strategy=NodeAffinitySchedulingStrategy(
                             node["NodeID"], soft=False)).remote(list(data_configs), seed,
                                                                 base_seed)
            for node in ray.nodes() if node.get("Alive")]


def _warn(text: str) -> None:
    print(f"raycl: warning: {text}", file=sys.stderr, flush=True)


class SeedCacheRemoval(Callback):
    """Removes a confirmation seed's own data caches on every node once its trial has ended
    (:func:`launch_removal`); the confirmation's end waits for the removals at most
    :data:`REMOVAL_WAIT_S`. A failure is one warning: the confirmation goes on."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config  # as the confirmation's trials get it (absolute cache_dir)
        self._pending: list[Any] = []
        self._launched: set[int] = set()  # seeds whose removal this driver launched

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its callbacks: the tasks belong to the driver that launched them.
        return {**self.__dict__, "_pending": [], "_launched": set()}

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trials, trial)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trials, trial)  # failed for good (a retried trial is on_trial_recover)

    def _ended(self, trials: list, trial: Any) -> None:
        # Configurations share their seeds (paired): a seed's copies go once the last trial
        # that reads them has ended (on_experiment_end removes what is left).
        seed = self._data_seed(trial.config)
        if not any(other is not trial and other.status not in _ENDED_STATES
                   and self._data_seed(other.config) == seed for other in trials):
            self.remove(trial.config)

    def _data_seed(self, trial_config: dict[str, Any]) -> int | None:
        try:
            return apply_overrides(self.config, trial_values(trial_config)).data_seed
        except Exception:  # judged (and warned about) by remove()
            return None

    def remove(self, trial_config: dict[str, Any]) -> None:
        """Launch the removal of the caches of the trial of ``trial_config`` (its data seed and
        its pinned values: a searched data key names its set)."""
        try:
            resolved = apply_overrides(self.config, trial_values(trial_config))
            configs = seed_data_configs(resolved)
            seed, base_seed = resolved.data_seed, self.config.data_seed
            self._launched.add(seed)
            if configs and seed != base_seed:
                self._pending += launch_removal(configs, seed, base_seed)
        except Exception as exc:  # a cache left on disk is never worth a confirmation
            _warn(f"the data caches of confirmation seed {trial_config.get('seed')} were not "
                  f"removed: {type(exc).__name__}: {exc}")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        # Seeds that ended in an earlier driver (killed before its removals ran) too: a
        # resumed confirmation does not run them again, so no trial event names them here.
        for trial in trials:
            if trial.status in _ENDED_STATES and trial.config \
                    and self._data_seed(trial.config) not in self._launched:
                self.remove(trial.config)
        self.wait(REMOVAL_WAIT_S)

    def wait(self, timeout_s: float) -> list[str]:
        """Wait at most ``timeout_s`` for the removals launched; returns the directories they
        removed (a failed one: one warning)."""
        if not self._pending:
            return []
        import ray

        pending, self._pending = self._pending, []
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        removed: list[str] = []
        for ref in ready:
            try:
                removed += ray.get(ref)
            except Exception as exc:
                _warn(f"a confirmation seed's data cache was not removed: "
                      f"{type(exc).__name__}: {exc}")
        return removed


__all__ = ["REMOVAL_WAIT_S", "SeedCacheRemoval", "launch_removal", "remove_seed_caches",
           "seed_data_configs"]
