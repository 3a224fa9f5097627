"""A sweep once its config is valid: Ray up, ``data.loader: auto`` settled, the cluster's checks,
the search's ``Tuner`` fitted, seed confirmation, the leaderboard; the exit code."""

from __future__ import annotations

import sys
from typing import Any

from raycl.config.schema import CoreConfig
from raycl.config.search_config import apply_overrides
from raycl.data.load import choose_loader, split_sizes_for
from raycl.launch.checks import run_checks
from raycl.launch.eval_cost import evaluation_idle_warning
from raycl.launch.linear_sgd_check import check_linear_sgd
from raycl.launch.load import with_absolute_paths
from raycl.launch.placement import CLUSTER_CHECKS, placement_warning
from raycl.launch.ray_nodes import smallest_node_memory
from raycl.launch.stream_rate import stream_cpus_warning
from raycl.launch.sweep_plan import SweepPlan, resolved_storage, storage_child
from raycl.sweep.local_ray import init_ray
from raycl.sweep.tuner import build_tuner, sweep_trainable


def settle_loader(config: CoreConfig) -> CoreConfig:
    """``data.loader: auto`` settled once for the sweep (:func:`raycl.data.load.choose_loader`
    on the memory of the smallest node that can run the trials' workers, or of the node types an
    autoscaler may add when none is up: :func:`raycl.launch.ray_nodes.smallest_node_memory`),
    and the choice printed: the trials' config carries it, and every reader after this one
    (placement, the worker's loader) takes it as it is."""
    if config.data.loader != "auto":
        return config
    choice, why = choose_loader(config.data, smallest_node_memory(config))
    print(f"raycl: data.loader auto -> {choice} ({why})", flush=True)
    return apply_overrides(config, {"data.loader": choice})


def _warn_if_trials_wait(config: CoreConfig) -> None:
    """A trial larger than the cluster waits for nodes an autoscaler can (or might) add; where
    nothing can add one, :data:`CLUSTER_CHECKS` already refused the sweep. Also stream mode's
    decoders too few to feed a GPU (:func:`raycl.launch.stream_rate.stream_cpus_warning`), and
    rank 0's scoring leaving the other workers idle for much of each evaluation interval
    (:func:`raycl.launch.eval_cost.evaluation_idle_warning`)."""
    idle = None
    if config.scaling.num_workers > 1:  # a single worker waits for no one
        idle = evaluation_idle_warning(config, split_sizes_for(config.data))
    for warning in (placement_warning(config), stream_cpus_warning(config), idle):
        if warning:
            print(f"raycl: warning: {warning}", file=sys.stderr, flush=True)


def run(config: CoreConfig, search_file: str | None = None, fresh: bool = False,
        address: str | None = None, verbose: bool = False, plan: SweepPlan | None = None) -> int:
    """Run the sweep on the current (or a new embedded) Ray; return the process exit code.
    Ray's, Tune's and Optuna's own output is turned down to warnings unless ``verbose``
    (:func:`raycl.sweep.display.quiet_ray`)."""
    from raycl.sweep.display import quiet_ray

    with quiet_ray(verbose):
        return _run(config, search_file, fresh, address, verbose, plan)


def confirmation_trial_config(config: CoreConfig, loader: str) -> CoreConfig:
    """The config a confirmation trial's values are applied to: as the search's trials get it
    (absolute paths, settled ``loader``), on the search's data (``data.seed`` pinned) unless
    ``tune.confirm.redraw_data``: paired seeds then draw initialisation and augmentations
    only."""
    pinned: dict[str, Any] = {"data.loader": loader}
    if config.tune.confirm is not None and not config.tune.confirm.redraw_data:
        pinned["data.seed"] = config.data_seed
    return apply_overrides(with_absolute_paths(config), pinned)


def _confirm(config: CoreConfig, search_file: str | None, results: Any, loader: str,
             verbose: bool) -> list[str]:
    """Seed confirmation (``tune.confirm``) after the search: :mod:`raycl.sweep.confirm_tuner`
    re-runs the best configurations over fresh seeds (or resumes doing so) and writes
    ``confirm.csv`` on the parent run; returns the lines printed under the leaderboard (none if
    interrupted)."""
    from raycl.sweep.confirm_tuner import confirmation_tuner, report_confirmation
    from raycl.tracking.callback import INTERRUPTED

    trial_config = confirmation_trial_config(config, loader)
    storage = resolved_storage(config.tune.storage_path)
    trainable = sweep_trainable(trial_config, storage_child(storage,
    f"{config.name}-confirm-train"))
    built = confirmation_tuner(config, trial_config, search_file, results, trainable, verbose)
    if built is None:
        return []
    tuner, choice = built
    confirm_results = tuner.fit()
    return [] if INTERRUPTED.get(config.name) else report_confirmation(config, choice,
                                                                        confirm_results)


def _run(config: CoreConfig, search_file: str | None, fresh: bool, address: str | None,
         verbose: bool, plan: SweepPlan | None = None) -> int:
    from raycl.sweep.confirm_tuner import sweep_parent_run
    from raycl.sweep.repeats import is_seed_repeat, report_repeats
    from raycl.tracking.callback import INTERRUPTED
    from raycl.tracking.trial_table import print_leaderboard
    from raycl.worker.outcome import FAILED_KEY

    # Workers' warnings and errors (a trial's traceback) still reach this terminal.
    init_ray(quiet=not verbose, address=address, log_to_driver=True)
    # A trial no node set can hold would wait forever where nothing adds nodes: refused here,
    # before any trial (ConfigError: exit 2); a warning where an autoscaler can add them.
    settled = settle_loader(config)  # before the placement check: streaming reserves CPUs
    # eval.linear_sgd again on the settled loader: auto may have chosen stream.
    run_checks(settled, search_file or config.name, (*CLUSTER_CHECKS, check_linear_sgd))
    _warn_if_trials_wait(settled)
    tuner = build_tuner(config, search_file, fresh=fresh, verbose=verbose,
                        loader=settled.data.loader, plan=plan)
    results = tuner.fit()
    confirmation: list[str] = []
    if config.tune.confirm is not None and not INTERRUPTED.get(config.name):
        confirmation = _confirm(config, search_file, results, settled.data.loader, verbose)
    if is_seed_repeat(config) and not INTERRUPTED.get(config.name):
        # One configuration over seeds: its answer is their mean and interval, no best seed.
        confirmation = report_repeats(config, results, sweep_parent_run(config, results))
    finished = [r for r in results
                if r.error is None and not (r.metrics or {}).get(FAILED_KEY)]
    print(flush=True)
    print_leaderboard(config.mlflow.tracking_uri, config.mlflow.experiment or config.name,
                      top=10)
    for line in confirmation:  # the confirmed ranking (or the repeats): the sweep's last word
        print(line, flush=True)
    if INTERRUPTED.get(config.name):
        # Tune stops on the first Ctrl+C/SIGINT after saving the sweep's state.
        print(f"raycl: sweep {config.name!r} interrupted; run the same command again to resume "
              f"it", file=sys.stderr, flush=True)
        return 130
    return 0 if finished else 1
