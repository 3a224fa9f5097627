"""Seed confirmation's Ray and MLflow side (``tune.confirm``; the pure parts:
:mod:`raycl.sweep.confirmation`).

After the search's ``Tuner.fit()``, :func:`confirmation_tuner` builds a second Tuner: a grid over
the confirmation seeds (each seed names its configuration, whose searched values are pinned
beside it), FIFO (every seed runs to the end), in its own experiment directory
``<name>-confirm`` beside the sweep's, logging into the sweep's parent run through
:class:`ConfirmCallback` (children tagged ``raycl.confirm=<rank>``). A re-run of the sweep
restores that Tuner: finished seeds are not run again. What was chosen (the configurations, their
seeds, the parent run) is stored there as ``raycl_confirm.json``, so a resumed confirmation
confirms the same configurations. :func:`report_confirmation` writes ``confirm.csv`` on the
parent run (a seed that did not finish named with how it ended) and returns the lines printed
under the leaderboard. A seed's own generated-data caches are removed once its trial has ended
(:mod:`raycl.sweep.confirm_caches`).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycl.config.schema import CoreConfig
from raycl.config.search_config import apply_overrides, flatten
from raycl.config.sweep import (
    CONFIRM_CASE_KEY,
    reported_test_metric,
    resolve_tracking_uri,
)
from raycl.launch.identity import read_stored_json, write_stored_json
from raycl.launch.sweep_plan import resolved_storage, set_aside, storage_child
from raycl.sweep.confirmation import (
    CONFIRM_TAG,
    CSV_NAME,
    Confirmed,
    chosen_configurations,
    confirm_lines,
    confirm_table,
    confirmation_seeds,
    leading_section,
    rank_of_seed,
    ranked_by_validation,
    separation_sentence,
    verdict_sentence,
    write_confirm_csv,
)
from raycl.sweep.old_names import alias_moved_modules
from raycl.tracking.callback import INTERRUPTED, MLflowSweepCallback
from raycl.tracking.naming import trial_run_name
from raycl.tracking.runs import (
    CONFIRMED_RUN_TAG,
    ENDED_TAG,
    NOTE_TAG,
    PARENT_TAG,
    SEARCHED_TAG,
    TRIAL_TAG,
    experiment_name,
    find_trial_run,
    mlflow_client,
    rankable,
)
from raycl.tracking.trial_table import searched_values, trial_runs
from raycl.tracking.tune_stop import tune_stop_requested, unfinished_trials
from raycl.worker.outcome import FAILED_KEY, SKIPPED_KEY

if TYPE_CHECKING:
    from ray.tune import ResultGrid
    from ray.tune.experiment import Trial

CHOICE_FILE = "raycl_confirm.json"


def confirm_path(config: CoreConfig) -> str:
    """The confirmation Tuner's experiment directory: ``<storage>/<name>-confirm``."""
    return storage_child(resolved_storage(config.tune.storage_path), f"{config.name}-confirm")


class PinnedValue:
    """``tune.sample_from`` of one config key: its value in the configuration of the trial's
    case (a class, not a lambda: Tune pickles the param space with the sweep). A configuration
    without the key (a knob its method does not read) gets ``fallback``, which its trial never
    reads."""

    def __init__(self, key: str, cases: list[tuple[int, int]], chosen: list[dict[str, Any]],
                 fallback: Any = None) -> None:
        self.key = key
        self.cases = cases
        self.chosen = chosen
        self.fallback = fallback

    def __call__(self, config: dict[str, Any]) -> Any:
        rank, seed = self.cases[int(config[CONFIRM_CASE_KEY])]
        if self.key == "seed":
            return seed
        return self.chosen[rank - 1].get(self.key, self.fallback)


def confirm_cases(seeds: list[list[int]]) -> list[tuple[int, int]]:
    """``(rank, seed)`` of every confirmation trial, rank by rank."""
    return [(rank, seed) for rank, own in enumerate(seeds, start=1) for seed in own]


def confirm_space(chosen: list[dict[str, Any]], seeds: list[list[int]],
                  defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The confirmation's param space: a grid over the cases (:func:`confirm_cases`, under
    :data:`CONFIRM_CASE_KEY`: ranks share their seeds), the seed and every searched key pinned
    to the case's (a key some configuration lacks: ``defaults``' value there)."""
    from ray import tune

    cases = confirm_cases(seeds)
    keys: list[str] = []
    for values in chosen:
        keys += [key for key in values if key not in keys]
    space: dict[str, Any] = {CONFIRM_CASE_KEY: tune.grid_search(list(range(len(cases)))),
                             "seed": tune.sample_from(PinnedValue("seed", cases, chosen))}
    space.update({key: tune.sample_from(PinnedValue(key, cases, chosen,
                                                    (defaults or {}).get(key)))
                  for key in keys})
    return space


def case_rank(trial_config: dict[str, Any], choice: dict[str, Any], base_seed: int) -> int:
    """The rank of the configuration a confirmation trial runs: its case's, or (a confirmation
    started before seeds were paired, resumed) its seed's."""
    case = trial_config.get(CONFIRM_CASE_KEY)
    if case is None:
        return rank_of_seed(int(trial_config["seed"]), base_seed)
    return confirm_cases(choice["seeds"])[int(case)][0]


class ConfirmCallback(MLflowSweepCallback):
    """The sweep's MLflow callback for its confirmation trials: same parent run (reopened, not
    created), children tagged ``raycl.confirm=<rank>`` and named ``c<rank> …``; the search's
    leaderboard and best-trial record on the parent stay the search's."""

    def __init__(self, config: CoreConfig, search_file: str | None, parent_run_id: str,
                 choice: dict[str, Any]) -> None:
        super().__init__(config, search_file)
        self.parent_run_id = parent_run_id
        self.choice = choice

    def _drop_lost_trial_runs(self, known: set[str]) -> None:
        """As the search's callback does (a driver killed before Tune saved a trial), for the
        confirmation's own runs only: the search's children are no trials of this Tuner."""
        if self.parent_run_id is None or self.experiment_id is None:
            return
        ours = set(self._children.values())
        for run in trial_runs(self.client, self.experiment_id, self.parent_run_id,
                              confirmation=True):
            if run.data.tags.get(TRIAL_TAG) in known or run.info.run_id in ours:
                continue
            self.client.set_tag(run.info.run_id, ENDED_TAG, "lost")
            self.client.set_terminated(run.info.run_id, status="KILLED")
            self.client.delete_run(run.info.run_id)

    def _child(self, trial: Trial) -> str:
        seen = trial.trial_id in self._children
        run_id = super()._child(trial)
        if not seen:  # first sight in this driver: tag (again, harmless after a restore)
            rank = case_rank(trial.config, self.choice, self.config.seed)
            name = trial_run_name(0, self.trial_values(trial), self.config.tune.search_space)
            self.client.set_tag(run_id, CONFIRM_TAG, str(rank))
            self.client.set_tag(run_id, "mlflow.runName", f"c{rank} {name.split(' ', 1)[-1]}")
        return run_id

    def _log_leaderboard(self) -> None:
        """The parent's leaderboard ranks the search's trials; confirm.csv is the confirmation's."""

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        unfinished = unfinished_trials(trials, self._started, self._ended)
        if unfinished or tune_stop_requested() or self.parent_run_id is None:
            super().on_experiment_end(trials, **info)  # marks them interrupted, parent KILLED
            return
        INTERRUPTED[self.config.name] = False
        self.client.set_terminated(self.parent_run_id, status="FINISHED")


def _ending(result: Any) -> str | None:
    """How a trial's ``result`` ended when it did not finish (``error``, ``diverged``,
    ``skipped``); None when it finished."""
    metrics = result.metrics or {}
    if result.error is not None:
        return "error"
    if metrics.get(FAILED_KEY):
        return "diverged"
    if metrics.get(SKIPPED_KEY):
        return "skipped"
    return None


def _finished(result: Any) -> bool:
    return _ending(result) is None


def _rankable_trial_ids(config: CoreConfig, parent: str) -> set[str]:
    """The trial ids of the search's runs under ``parent`` that may be ranked
    (:func:`raycl.tracking.runs.rankable`): confirmation's winners are among the trials the
    leaderboard ranks, never one that failed, was killed or still runs."""
    client = mlflow_client(resolve_tracking_uri(config.mlflow.tracking_uri))
    experiment = client.get_experiment_by_name(experiment_name(config))
    if experiment is None:
        return set()
    return {run.data.tags.get(TRIAL_TAG, "") for run in
            trial_runs(client, experiment.experiment_id, parent) if rankable(run)}


def sweep_parent_run(config: CoreConfig, results: ResultGrid) -> str | None:
    """The sweep's parent run, read from MLflow through one of its trials' runs."""
    client = mlflow_client(resolve_tracking_uri(config.mlflow.tracking_uri))
    experiment = client.get_experiment_by_name(experiment_name(config))
    if experiment is None:
        return None
    for result in results:
        trial_id = (result.metrics or {}).get("trial_id")
        run_id = find_trial_run(client, experiment.experiment_id, trial_id) if trial_id else None
        if run_id is not None:
            return client.get_run(run_id).data.tags.get(PARENT_TAG)
    return None


def _read_choice(path: str) -> dict[str, Any] | None:
    """The confirmation's stored choice in its directory ``path`` (None: none stored)."""
    return read_stored_json(path, CHOICE_FILE)


def _write_choice(path: str, choice: dict[str, Any]) -> None:
    """Store the confirmation's choice in its directory ``path`` (local or a bucket)."""
    write_stored_json(path, CHOICE_FILE, choice)


def _choose(config: CoreConfig, results: ResultGrid, parent: str) -> dict[str, Any] | None:
    """This sweep's confirmation choice: the stored one when its parent run is this sweep's
    (a resumed confirmation), else the top configurations of ``results`` whose runs may be
    ranked (:func:`_rankable_trial_ids`; None: none scored)."""
    from ray import tune

    path = confirm_path(config)
    stored = _read_choice(path) if tune.Tuner.can_restore(path) else None
    if stored is not None and stored.get("parent_run_id") == parent:
        return stored
    if tune.Tuner.can_restore(path):
        set_aside(path)  # an earlier sweep of this name (--fresh): its confirmation is kept
    confirm = config.tune.confirm
    assert confirm is not None
    metric, ranked = config.tune.metric, _rankable_trial_ids(config, parent)
    scored = [(result.config or {}, (result.metrics or {}).get(metric, math.nan))
              for result in results
              if _finished(result) and (result.metrics or {}).get("trial_id") in ranked]
    chosen = chosen_configurations(scored, confirm.top_k, config.tune.mode, confirm.per)
    if not chosen:
        return None
    seeds = confirmation_seeds(config.seed, len(chosen), confirm.seeds)
    return {"parent_run_id": parent, "configurations": chosen, "seeds": seeds}


def _stopped_after_search(config: CoreConfig, parent: str | None) -> bool:
    """Whether a Ctrl+C came after the search's loop ended (the search's callback had closed
    its parent run FINISHED): the sweep is then interrupted (``INTERRUPTED``, parent KILLED), the
    confirmation not started; the same command again starts it.

    Tune's handler of the search's ``tune.run`` stays installed until the confirmation's own,
    and takes that Ctrl+C silently: unchecked, the confirmation ran to its end.
    """
    if not tune_stop_requested():
        return False
    INTERRUPTED[config.name] = True
    if parent is not None:
        client = mlflow_client(resolve_tracking_uri(config.mlflow.tracking_uri))
        client.set_tag(parent, "raycl.interrupted", "true")
        client.set_terminated(parent, status="KILLED")
    return True


def confirmation_tuner(config: CoreConfig, trial_config: CoreConfig, search_file: str | None,
                       results: ResultGrid, trainable: Any, verbose: bool = False
                       ) -> tuple[Any, dict[str, Any]] | None:
    """The confirmation's Tuner (restored when it exists for this sweep) and its choice; None
    (with a line printed) when no trial of the search scored the objective, or when the sweep
    was interrupted after its search (:func:`_stopped_after_search`).

    Args:
        config: the sweep's config; ``trial_config``: as its trials get it (absolute paths,
            settled loader); ``trainable``: the trials' trainable (``raycl.tune``).
        results: the search's results; ``verbose``: Tune's own tables instead of raycl's.
    """
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from raycl.results.run_encoder import RunEncoderCallback
    from raycl.sweep.confirm_caches import SeedCacheRemoval
    from raycl.sweep.display import ProgressDisplay

    parent = sweep_parent_run(config, results)
    if _stopped_after_search(config, parent):
        return None
    choice = _choose(config, results, parent) if parent else None
    if choice is None:
        print("raycl: seed confirmation skipped: no trial of the search scored "
              f"{config.tune.metric}", flush=True)
        return None
    path = confirm_path(config)
    space = confirm_space(choice["configurations"], choice["seeds"],
                          flatten(trial_config.to_dict()))
    if tune.Tuner.can_restore(path):
        print(f"raycl: resuming the seed confirmation of {config.name!r} from {path}", flush=True)
        alias_moved_modules()  # one started before House III pickled the old names
        return tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=True,
                                  param_space=space), choice
    _write_choice(path, choice)
    total = sum(len(own) for own in choice["seeds"])
    # Confirmation runs every seed to its end (FIFO): the display must not promise ASHA stops.
    shown = apply_overrides(config, {"name": f"{config.name}-confirm", "tune.num_samples": total,
                                     "tune.scheduler.type": "none"})
    run_config = tune.RunConfig(
        name=f"{config.name}-confirm", storage_path=resolved_storage(config.tune.storage_path),
        # SeedCacheRemoval: a finished seed's generated data (one copy per seed and node)
        # is removed, not left to fill the nodes' disks.
        callbacks=[ConfirmCallback(trial_config, search_file, parent, choice),
                   RunEncoderCallback(trial_config), ProgressDisplay(shown),
                   SeedCacheRemoval(trial_config)],
        failure_config=tune.FailureConfig(max_failures=config.tune.max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2), verbose=1 if verbose else 0)
    tune_config = tune.TuneConfig(
        metric=config.tune.metric, mode=config.tune.mode, scheduler=FIFOScheduler(),
        num_samples=1, max_concurrent_trials=config.tune.max_concurrent_trials, reuse_actors=True)
    return tune.Tuner(trainable, param_space=space, tune_config=tune_config,
                      run_config=run_config), choice


def seed_ending(result: Any, metric: str) -> str | None:
    """How a confirmation seed's ``result`` ended when it is left out of the intervals
    (``error``, ``diverged``, ``skipped``, ``no <metric>``); None when it is in them."""
    ending = _ending(result)
    value = (result.metrics or {}).get(metric)
    if ending is None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
        return f"no {metric}"
    return ending


def record_seed(item: Confirmed, seed: int, result: Any, metric: str,
                test_metric: str | None) -> None:
    """Add one seed's ``result`` to ``item``: its objective and test counterpart when it
    finished, else how it ended (a seed that did not finish is named, never left out
    silently)."""
    ending = seed_ending(result, metric)
    if ending is not None:
        item.dropped[seed] = ending
        return
    metrics = result.metrics or {}
    test = metrics.get(test_metric) if test_metric else None
    item.add(seed, float(metrics[metric]), float(test) if isinstance(test, (int, float)) else None)


def confirmed(config: CoreConfig, choice: dict[str, Any], results: ResultGrid) -> list[Confirmed]:
    """Each chosen configuration with the objective (and its test counterpart) of its finished
    seeds, and how each other planned seed ended (``not run``: no result at all)."""
    items = [Confirmed(rank, dict(values), list(seeds)) for rank, (values, seeds) in
             enumerate(zip(choice["configurations"], choice["seeds"], strict=True), start=1)]
    test_metric = reported_test_metric(config.tune.metric)
    seen: set[tuple[int, int]] = set()
    for result in results:
        seed = (result.config or {}).get("seed")
        if seed is None:
            continue
        rank = case_rank(result.config, choice, config.seed)
        seen.add((rank, int(seed)))
        record_seed(items[rank - 1], int(seed), result, config.tune.metric, test_metric)
    for item in items:
        item.dropped.update({seed: "not run" for seed in item.seeds
                             if (item.rank, seed) not in seen})
    return items


def report_confirmation(config: CoreConfig, choice: dict[str, Any],
                        results: ResultGrid) -> list[str]:
    """Write ``confirm.csv`` on the sweep's parent run and the confirmation into its description;
    name the confirmed winner's search trial the sweep's best (:func:`mark_confirmed_winner`);
    return the lines to print."""
    items = confirmed(config, choice, results)
    header, rows = confirm_table(items, config.tune.metric,
                                 reported_test_metric(config.tune.metric), config.tune.mode)
    separation = separation_sentence(items, config.tune.mode)
    client = mlflow_client(resolve_tracking_uri(config.mlflow.tracking_uri))
    parent = choice["parent_run_id"]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, CSV_NAME)
        write_confirm_csv(header, rows, path)
        client.log_artifact(parent, str(path))
    if separation:
        client.set_tag(parent, "raycl.confirm_separation", separation)
    lines = confirm_lines(header, rows, verdict_sentence(items, config.tune.mode))
    winner = mark_confirmed_winner(client, config, parent, items)
    if winner:
        lines.append(f"--trial best now names {winner}: the confirmed winner")
    describe_confirmation(client, parent, lines)
    return lines


def mark_confirmed_winner(client: Any, config: CoreConfig, parent: str,
                          items: list[Confirmed]) -> str | None:
    """Tag the parent with the search trial of the configuration that won confirmation (best
    validation mean; among that configuration's search trials, the best-scored), so
    ``--trial best``, the parent's best-trial tags and the leaderboard name it. Returns its
    run name; None when no configuration finished a seed."""
    ranked = [item for item in ranked_by_validation(items, config.tune.mode) if item.finished]
    if not ranked:
        return None
    wanted = {key: str(value) for key, value in ranked[0].values.items()}
    experiment_id = client.get_run(parent).info.experiment_id
    metric, sign = config.tune.metric, 1.0 if config.tune.mode == "max" else -1.0
    same = [run for run in trial_runs(client, experiment_id, parent) if rankable(run)
            and searched_values(run.data.tags.get(SEARCHED_TAG, "")) == wanted
            and math.isfinite(run.data.metrics.get(metric, math.nan))]
    if not same:
        return None
    run = max(same, key=lambda run: sign * run.data.metrics[metric])
    client.set_tag(parent, CONFIRMED_RUN_TAG, run.info.run_id)
    client.set_tag(parent, "raycl.best_run", run.info.run_id)
    client.set_tag(parent, "raycl.best_trial", run.data.tags.get(TRIAL_TAG, ""))
    return run.info.run_name or run.info.run_id


# The parent's description leads with the confirmation (replaced on a resume).
CONFIRMATION_HEADING = "**Seed confirmation**"
# MLflow's search syntax (the runs table's search box, ``search_runs``' filter_string) for the
# confirmation's runs only, and for every run but them: its children are tagged, no other run is.
CONFIRM_RUNS_FILTER = f"tags.{CONFIRM_TAG} IS NOT NULL"
NOT_CONFIRM_RUNS_FILTER = f"tags.{CONFIRM_TAG} IS NULL"


def describe_confirmation(client: Any, parent: str, lines: list[str]) -> None:
    """The confirmation's table and verdict at the top of the parent run's description (the
    answer first, the search's leaderboard below it), with the runs table's search filters
    that show only the confirmation's runs and that hide them."""
    note = client.get_run(parent).data.tags.get(NOTE_TAG, "")
    block = "\n".join(lines)
    filters = (f"In the runs table, search `{CONFIRM_RUNS_FILTER}` to see only the "
               f"confirmation's runs (tagged `{CONFIRM_TAG}` with their configuration's rank), "
               f"`{NOT_CONFIRM_RUNS_FILTER}` to hide them.")
    client.set_tag(parent, NOTE_TAG, leading_section(
        note, CONFIRMATION_HEADING, f" (paired seeds; what `--trial best` exports):\n\n"
                                    f"```\n{block}\n```\n\n{filters}"))


__all__ = ["CHOICE_FILE", "CONFIRM_RUNS_FILTER", "NOT_CONFIRM_RUNS_FILTER", "ConfirmCallback",
           "PinnedValue", "confirm_path", "confirm_space", "confirmation_tuner",
           "confirmed", "record_seed", "report_confirmation", "seed_ending",
           "sweep_parent_run"]
