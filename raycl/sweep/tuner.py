"""The sweep's ``Tuner``: searcher and scheduler (:func:`tuner_search`), the trainable every trial
runs (:func:`sweep_trainable`), its callbacks (MLflow, the baseline, the encoders, the progress
lines), new or restored (:func:`build_tuner`)."""

from __future__ import annotations

import logging
from typing import Any

from raycl.config.schema import CoreConfig
from raycl.config.search_config import apply_overrides
from raycl.data.load import LoaderChoice
from raycl.launch.feasibility import max_reports
from raycl.launch.identity import store_settings
from raycl.launch.load import with_absolute_paths
from raycl.launch.reservations import trial_resources
from raycl.launch.sweep_plan import SweepPlan, plan_sweep, resolved_storage, storage_child
from raycl.sweep.collapse import collapse_stopper
from raycl.sweep.old_names import alias_moved_modules


def _print_notice(notice: str | None) -> None:
    if notice:
        print(f"raycl: {notice}", flush=True)


def _keep_train_coordinator_on_this_node(config: CoreConfig) -> None:
    """Create Ray Train's detached ``AutoscalingCoordinator`` actor here, on the driver's node
    (the head on a cluster), before any trial does; nothing for in-process trials
    (``scaling.num_workers: 0``), which start no Train controller.

    Works around ray-project/ray#58481 (Ray 2.60; the fix proposed for Ray Data's actors,
    ray-project/ray#62260, was not merged): each trial's Train controller gets-or-creates this
    detached actor pinned to the controller's own node, which with a head of ``CPU: 0`` is a
    GPU worker; the actor then keeps that node from ever counting as idle, so the autoscaler
    never removes it. Created first by the driver, it lives on the head and controllers reuse
    it (it is looked up by name). Best effort: a private API that may move.
    """
    if not _trains_with_workers(config):
        return
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        get_or_create_autoscaling_coordinator()
    except Exception:  # a later Ray moved or fixed it: nothing to pin
        logging.getLogger(__name__).debug("Ray Train's autoscaling coordinator not pinned",
                                          exc_info=True)


def _trains_with_workers(config: CoreConfig) -> bool:
    """Whether any trial of the sweep may train with Ray Train workers (scaling.num_workers is
    searchable)."""
    from raycl.config.search_config import searched_variants

    return any(variant.scaling.num_workers > 0
               for _, variant in searched_variants(config, ("scaling.num_workers",)))


def tuner_search(config: CoreConfig) -> tuple[dict[str, Any], Any, int, Any]:
    """``(param_space, search_alg, num_samples, scheduler)`` of the sweep's Tuner: the searcher
    and ASHA (or FIFO) for a search space; for an empty one, ``num_samples`` repeats of the
    configuration as a grid over seeds, each run to the end."""
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from raycl.sweep.searchers import FinishingASHA, build_searcher

    if not config.tune.search_space:
        # Nothing searched: repeats of one configuration that differ only by seed, all run to
        # the end (stopping a repeat early would bias the spread it is there to measure).
        seeds = [config.seed + i for i in range(config.tune.num_samples)]
        return {"seed": tune.grid_search(seeds)}, None, 1, FIFOScheduler()
    if config.tune.scheduler.type in ("pbt", "pb2"):  # random first values, then mutations
        from raycl.sweep.pbt import population_tuner_parts

        return population_tuner_parts(config)
    def new_scheduler() -> Any:
        if config.tune.scheduler.type != "asha":
            return FIFOScheduler()
        return FinishingASHA(time_attr="training_iteration", max_t=max_reports(config),
                             grace_period=config.tune.scheduler.grace_period,
                             reduction_factor=config.tune.scheduler.reduction_factor)

    if config.tune.compare is not None:  # a searcher and ASHA brackets per compared value
        from raycl.sweep.compare import compare_search

        searcher, scheduler = compare_search(config, build_searcher, new_scheduler)
        return {}, searcher, config.tune.num_samples, scheduler
    # The searcher owns the space (define-by-run, feasible combinations only).
    return {}, build_searcher(config), config.tune.num_samples, new_scheduler()


def build_tuner(
    config: CoreConfig,
    search_file: str | None,
    fresh: bool = False,
    verbose: bool = False,
    loader: LoaderChoice | None = None,
    plan: SweepPlan | None = None,
) -> Any:
    """A ``Tuner`` for the sweep, or the restored one when a sweep of that name exists. Call it
    after ``ray.init``: it starts this driver's MLflow relay, which trials log through.

    ``loader``: ``data.loader`` as :func:`raycl.sweep.run.settle_loader` settled it for the trials.
    raycl's progress lines (:class:`raycl.sweep.display.ProgressDisplay`) replace Tune's tables
    unless ``verbose``. A restored sweep keeps the callbacks and verbosity it was started with.
    ``plan``: what :func:`plan_sweep` decided before Ray started (None: decided here).
    """
    from ray import tune

    from raycl.results.run_encoder import RunEncoderCallback
    from raycl.sweep.baseline import with_baseline
    from raycl.sweep.display import ProgressDisplay
    from raycl.tracking.callback import MLflowSweepCallback
    from raycl.tracking.relay import start_relay
    from raycl.trial.population_workers import reuses_trial_actors

    plan = plan or plan_sweep(config, search_file, fresh)
    start_relay()  # trials on other nodes log to MLflow through this one
    _keep_train_coordinator_on_this_node(config)

    # Trials run in directories of their own: every path they get must be absolute.
    config = with_absolute_paths(config)
    # What the trials run: data.loader as settled at launch. The sweep's identity (a re-run's
    # comparison) keeps the user's setting, so "auto" settled differently is the same sweep.
    trial_config = apply_overrides(config, {"data.loader": loader}) if loader else config
    storage = resolved_storage(config.tune.storage_path)
    trainable = sweep_trainable(trial_config, storage_child(storage, f"{config.name}-train"))

    param_space, search_alg, num_samples, scheduler = tuner_search(config)
    run_config = tune.RunConfig(
        name=config.name,
        storage_path=storage,
        # eval.baseline's one task (raycl.sweep.baseline) before the tracker: the parent run's
        # last leaderboard, written by the tracker at the end, then has its row.
        callbacks=[*with_baseline(trial_config, MLflowSweepCallback(trial_config, search_file)),
                   # after the tracker, which ends the trial's run first
                   RunEncoderCallback(trial_config), ProgressDisplay(config)],
        failure_config=tune.FailureConfig(max_failures=config.tune.max_failures),
        # Two, so a corrupt latest checkpoint can fall back to the one before it.
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
        verbose=1 if verbose else 0,  # 0: raycl.sweep.display prints the sweep
        stop=collapse_stopper(config),  # tune.collapse (None: off)
    )
    experiment_path = plan.experiment_path
    if plan.resume:
        print(f"raycl: resuming sweep {config.name!r} from {experiment_path}", flush=True)
        alias_moved_modules()  # a sweep started before House III pickled the old names
        return tune.Tuner.restore(experiment_path, trainable, resume_unfinished=True,
                                  resume_errored=True, param_space=param_space)
    # What a re-run is compared with (the user's data.loader, not the settled one).
    _print_notice(store_settings(config, experiment_path, plan.data))
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=config.tune.metric, mode=config.tune.mode, search_alg=search_alg,
            scheduler=scheduler, num_samples=num_samples,
            max_concurrent_trials=config.tune.max_concurrent_trials,
            # A finished trial's process (torch, raycl and the node's data cache already
            # loaded) takes the next trial of the same resources: ~5 s less per trial on a
            # CPU node. Nothing of a trial outlives it in the process (its function returns;
            # seeds, threads and MLflow runs are set per trial). Not for a PBT population
            # with workers: a reused process keeps a paused trial's worker group.
            reuse_actors=reuses_trial_actors(config)),
        run_config=run_config,
    )


def sweep_trainable(config: CoreConfig, storage_path: str) -> Any:
    """The Tune trainable of ``config``'s trials with the one bundle each trial process
    reserves (its worker group reserves its own, decoders included: raycl.launch.reservations)."""
    from ray import tune

    from raycl.trial.trainable import run_trial

    trainable = tune.with_parameters(run_trial, base_config=config.to_dict(),
                                     storage_path=storage_path)
    return tune.with_resources(trainable, trial_resources(config))
