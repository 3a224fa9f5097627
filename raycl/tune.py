"""``python -m raycl.tune SEARCH.yaml``: run (or resume) a sweep.

Every trial is :func:`raycl.pipeline.run_trial`, which builds and fits one ``TorchTrainer`` for
all its stages (the Ray Train V2 pattern); Optuna proposes the trials (feasible ones only), ASHA
stops weak ones early on the validation objective, and :class:`raycl.tracking.MLflowSweepCallback`
mirrors everything into MLflow. With an empty search space the trials are repeats that differ only
by seed, each run to the end.

Exit codes: 0 when at least one trial finished, 1 when none did, 2 for invalid input (nothing is
launched), 130 when interrupted (Ctrl+C; the same command resumes).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from raycl.config.checks import ENVIRONMENT_CHECKS, run_checks
from raycl.config.identity import check_same_sweep, store_settings
from raycl.config.load import load_search, with_absolute_paths
from raycl.config.placement import CLUSTER_CHECKS, placement_warning, trial_bundles
from raycl.config.schema import ConfigError, CoreConfig
from raycl.config.search_config import apply_overrides, max_reports, schema_markdown
from raycl.data.listed_once import listed_once
from raycl.dry_run import collapse_notices, print_dry_run

EPILOG = """\
examples:
  python -m raycl.tune searches/quickstart.yaml
  python -m raycl.tune searches/mcl_k_n.yaml --set train.epochs=1 --num-samples 2
  ray job submit --working-dir . -- python -m raycl.tune searches/mcl_k_n.yaml \\
      --storage s3://bucket/raycl --tracking-uri http://mlflow:5000
  python -m raycl.tune --show-schema        # every config key, its type, default and meaning

Re-running a sweep with the same name (and storage) and settings resumes it; with other
settings it stops and lists them (run them under --name NEW, or --fresh to start over).
Results: mlflow ui --backend-store-uri sqlite:///mlflow.db ; python -m raycl.leaderboard
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m raycl.tune", description=__doc__.splitlines()[0],
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("search", nargs="?", help="search YAML (see searches/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config key (dotted, type-checked); repeatable")
    parser.add_argument("--num-samples", type=int, help="trials to run (tune.num_samples)")
    parser.add_argument("--name", help="sweep name: MLflow experiment and Ray run (name)")
    parser.add_argument("--storage", help="Ray storage path or URI (tune.storage_path)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (mlflow.tracking_uri; "
                        "default $MLFLOW_TRACKING_URI, else the YAML's)")
    parser.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, or "
                        "start an embedded local Ray)")
    parser.add_argument("--fresh", action="store_true",
                        help="start the sweep over instead of resuming a sweep of the same name")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and print the resolved config, launch nothing")
    parser.add_argument("--show-schema", action="store_true",
                        help="print every config key with type, default and description")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show Ray's and Optuna's full output beside raycl's progress lines")
    return parser.parse_args(argv)


def resolve(args: argparse.Namespace, notices: list[str] | None = None) -> CoreConfig:
    """Load the YAML with all command-line overrides applied (raises ConfigError); decisions
    such as a pinned search key are appended to ``notices``."""
    overrides = list(args.overrides)
    notices = [] if notices is None else notices
    flags = {"num_samples": args.num_samples, "name": args.name, "storage": args.storage,
             "tracking_uri": args.tracking_uri}
    if args.tracking_uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
        # MLflow's own variable: it names the server for every tool of a session, so it wins
        # over the YAML (whose sqlite default is for a laptop); --tracking-uri wins over both.
        flags["tracking_uri"] = os.environ["MLFLOW_TRACKING_URI"]
        notices.append(f"mlflow.tracking_uri={flags['tracking_uri']} (from $MLFLOW_TRACKING_URI)")
    for flag, key in (("num_samples", "tune.num_samples"), ("name", "name"),
                      ("storage", "tune.storage_path"), ("tracking_uri", "mlflow.tracking_uri")):
        if flags[flag] is not None:
            overrides.append(f"{key}={flags[flag]}")
    return load_search(args.search, overrides, notices=notices)


def _storage_path(path: str) -> str:
    return path if "://" in path else str(Path(path).expanduser().resolve())


def storage_child(storage: str, name: str) -> str:
    """``storage``/``name``, before a URI's query: ``s3://b/raycl?endpoint_override=h:9000`` gives
    ``s3://b/raycl/NAME?endpoint_override=h:9000`` (pyarrow reads the options from the query)."""
    path, mark, query = storage.partition("?")
    return f"{path.rstrip('/')}/{name}{mark}{query}"


def _set_aside(experiment_path: str) -> None:
    """--fresh keeps the old sweep's state (nothing a user ran is lost): it is renamed."""
    if "://" in experiment_path:
        raise ConfigError(f"--fresh: {experiment_path} is remote; choose a new --name instead")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = f"{experiment_path}.{stamp}"
    shutil.move(experiment_path, aside)
    print(f"raycl: --fresh: previous sweep state moved to {aside}", flush=True)


def _print_notice(notice: str | None) -> None:
    if notice:
        print(f"raycl: {notice}", flush=True)


def _keep_train_coordinator_on_this_node() -> None:
    """Create Ray Train's detached ``AutoscalingCoordinator`` actor here, on the driver's node
    (the head on a cluster), before any trial does.

    Works around ray-project/ray#58481 (Ray 2.60; the fix proposed for Ray Data's actors,
    ray-project/ray#62260, was not merged): each trial's Train controller gets-or-creates this
    detached actor pinned to the controller's own node, which with a head of ``CPU: 0`` is a
    GPU worker; the actor then keeps that node from ever counting as idle, so the autoscaler
    never removes it. Created first by the driver, it lives on the head and controllers reuse
    it (it is looked up by name). Best effort: a private API that may move.
    """
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        get_or_create_autoscaling_coordinator()
    except Exception:  # a later Ray moved or fixed it: nothing to pin
        logging.getLogger(__name__).debug("Ray Train's autoscaling coordinator not pinned",
                                          exc_info=True)


def tuner_search(config: CoreConfig) -> tuple[dict[str, Any], Any, int, Any]:
    """``(param_space, search_alg, num_samples, scheduler)`` of the sweep's Tuner: the searcher
    and ASHA (or FIFO) for a search space; for an empty one, ``num_samples`` repeats of the
    configuration as a grid over seeds, each run to the end."""
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from raycl.searchers import FinishingASHA, build_searcher

    if not config.tune.search_space:
        # Nothing searched: repeats of one configuration that differ only by seed, all run to
        # the end (stopping a repeat early would bias the spread it is there to measure).
        seeds = [config.seed + i for i in range(config.tune.num_samples)]
        return {"seed": tune.grid_search(seeds)}, None, 1, FIFOScheduler()
    # The searcher owns the space (define-by-run, feasible combinations only).
    scheduler: Any = FIFOScheduler()
    if config.tune.scheduler.type == "asha":
        scheduler = FinishingASHA(time_attr="training_iteration", max_t=max_reports(config),
                                  grace_period=config.tune.scheduler.grace_period,
                                  reduction_factor=config.tune.scheduler.reduction_factor)
    return {}, build_searcher(config), config.tune.num_samples, scheduler


def build_tuner(
    config: CoreConfig,
    search_file: str | None,
    fresh: bool = False,
    fault: dict[str, Any] | None = None,
    verbose: bool = False,
    loader: str | None = None,
) -> Any:
    """A ``Tuner`` for the sweep, or the restored one when a sweep of that name exists. Call it
    after ``ray.init``: it starts this driver's MLflow relay, which trials log through.

    ``fault`` is a test hook passed to every trial (see :mod:`raycl.worker.faults`).
    ``loader``: ``data.loader`` as :func:`settle_loader` settled it for the trials. raycl's
    progress lines (:class:`raycl.progress.ProgressDisplay`) replace Tune's tables unless
    ``verbose``. A restored sweep keeps the callbacks and verbosity it was started with.
    """
    from ray import tune

    from raycl.progress import ProgressDisplay
    from raycl.tracking.callback import MLflowSweepCallback
    from raycl.tracking.relay import start_relay

    start_relay()  # trials on other nodes log to MLflow through this one
    _keep_train_coordinator_on_this_node()

    # Trials run in directories of their own: every path they get must be absolute.
    config = with_absolute_paths(config)
    # What the trials run: data.loader as settled at launch. The sweep's identity (a re-run's
    # comparison) keeps the user's setting, so "auto" settled differently is the same sweep.
    trial_config = apply_overrides(config, {"data.loader": loader}) if loader else config
    storage = _storage_path(config.tune.storage_path)
    trainable = _trainable(trial_config, storage_child(storage, f"{config.name}-train"), fault)

    param_space, search_alg, num_samples, scheduler = tuner_search(config)
    run_config = tune.RunConfig(
        name=config.name,
        storage_path=storage,
        callbacks=[MLflowSweepCallback(trial_config, search_file), ProgressDisplay(config)],
        failure_config=tune.FailureConfig(max_failures=config.tune.max_failures),
        # Two, so a corrupt latest checkpoint can fall back to the one before it.
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
        verbose=1 if verbose else 0,  # 0: raycl.progress prints the sweep
    )
    experiment_path = storage_child(storage, config.name)
    if tune.Tuner.can_restore(experiment_path) and fresh:
        _set_aside(experiment_path)
    elif tune.Tuner.can_restore(experiment_path):
        # Other settings stop here (ConfigError: exit 2); identical ones resume.
        _print_notice(check_same_sweep(config, experiment_path, search_file))
        print(f"raycl: resuming sweep {config.name!r} from {experiment_path}", flush=True)
        return tune.Tuner.restore(experiment_path, trainable, resume_unfinished=True,
                                  resume_errored=True, param_space=param_space)
    _print_notice(store_settings(config, experiment_path))  # what a re-run is compared with
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
            # seeds, threads and MLflow runs are set per trial).
            reuse_actors=True),
        run_config=run_config,
    )


def smallest_node_memory() -> float:
    """Bytes of memory of the smallest alive node of the running Ray (its ``memory``
    resource), or this machine's when Ray reports none."""
    import ray

    sizes = [float(node["Resources"].get("memory", 0.0)) for node in ray.nodes()
             if node.get("Alive") and node["Resources"].get("memory")]
    if sizes:
        return min(sizes)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def settle_loader(config: CoreConfig) -> CoreConfig:
    """``data.loader: auto`` settled once for the sweep, and the choice printed: every trial
    then reads the data the same way (:func:`raycl.data.load.choose_loader`)."""
    from raycl.data.load import choose_loader

    if config.data.loader != "auto":
        return config
    choice, why = choose_loader(config.data, smallest_node_memory())
    print(f"raycl: data.loader auto -> {choice} ({why})", flush=True)
    return apply_overrides(config, {"data.loader": choice})


def _trainable(config: CoreConfig, storage_path: str, fault: dict[str, Any] | None) -> Any:
    """The Tune trainable of ``config``'s trials with the resources each reserves: the trial
    process, and in stream mode its decoders' bundles (one placement group per trial)."""
    from ray import tune

    from raycl.pipeline import run_trial

    trainable = tune.with_parameters(run_trial, base_config=config.to_dict(),
                                     storage_path=storage_path, fault=fault)
    bundles = trial_bundles(config)
    return tune.with_resources(
        trainable, tune.PlacementGroupFactory(bundles) if len(bundles) > 1 else bundles[0])


def _warn_if_trials_wait(config: CoreConfig) -> None:
    """A trial larger than the cluster waits for nodes an autoscaler can (or might) add; where
    nothing can add one, :data:`CLUSTER_CHECKS` already refused the sweep."""
    warning = placement_warning(config)
    if warning:
        print(f"raycl: warning: {warning}", file=sys.stderr, flush=True)


def init_ray(quiet: bool = False, **init_kwargs: Any) -> None:
    """Start (or join) Ray the way every raycl sweep needs it; tests and benchmarks use it too.

    Intermediate reports without the objective are fine (evaluation every N epochs, MCL's skipped
    trials): ASHA and our Optuna searcher ignore them, so Tune's strict metric check is turned off
    in the driver and, through the runtime env, in every trial process.

    ``quiet`` (a sweep without ``-v``): the job's processes log warnings and errors only
    (``ray.LoggingConfig``: no "Checkpoint successfully created" per epoch; Ray Train's own
    ``ray.train`` loggers follow ``RAYCL_TRAIN_LOG_LEVEL``, read by :mod:`raycl.pipeline`), and
    the dashboard's address is printed in one line.
    """
    import ray

    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    if ray.is_initialized():
        return
    env_vars = {"TUNE_DISABLE_STRICT_METRIC_CHECKING": "1"}
    if quiet:
        env_vars["RAYCL_TRAIN_LOG_LEVEL"] = "WARNING"
        init_kwargs.setdefault("logging_config", ray.LoggingConfig(log_level="WARNING"))
    context = ray.init(runtime_env={"env_vars": env_vars}, **init_kwargs)
    dashboard = getattr(context, "dashboard_url", None)
    if quiet and dashboard:
        url = dashboard if "://" in dashboard else f"http://{dashboard}"
        print(f"raycl: Ray dashboard at {url}", flush=True)


def run(config: CoreConfig, search_file: str | None = None, fresh: bool = False,
        address: str | None = None, verbose: bool = False) -> int:
    """Run the sweep on the current (or a new embedded) Ray; return the process exit code.
    Ray's, Tune's and Optuna's own output is turned down to warnings unless ``verbose``
    (:func:`raycl.progress.quiet_ray`)."""
    from raycl.progress import quiet_ray

    with quiet_ray(verbose):
        return _run(config, search_file, fresh, address, verbose)


def _run(config: CoreConfig, search_file: str | None, fresh: bool, address: str | None,
         verbose: bool) -> int:
    from raycl.tracking.callback import INTERRUPTED
    from raycl.tracking.leaderboard import print_leaderboard
    from raycl.worker.outcome import FAILED_KEY

    # Workers' warnings and errors (a trial's traceback) still reach this terminal.
    init_ray(quiet=not verbose, address=address, log_to_driver=True)
    # A trial no node set can hold would wait forever where nothing adds nodes: refused here,
    # before any trial (ConfigError: exit 2); a warning where an autoscaler can add them.
    settled = settle_loader(config)  # before the placement check: streaming reserves CPUs
    run_checks(settled, search_file or config.name, CLUSTER_CHECKS)
    _warn_if_trials_wait(settled)
    tuner = build_tuner(config, search_file, fresh=fresh, verbose=verbose,
                        loader=settled.data.loader)
    results = tuner.fit()
    finished = [r for r in results
                if r.error is None and not (r.metrics or {}).get(FAILED_KEY)]
    print(flush=True)
    print_leaderboard(config.mlflow.tracking_uri, config.mlflow.experiment or config.name,
                      top=10)
    if INTERRUPTED.get(config.name):
        # Tune stops on the first Ctrl+C/SIGINT after saving the sweep's state.
        print(f"raycl: sweep {config.name!r} interrupted; run the same command again to resume "
              f"it", file=sys.stderr, flush=True)
        return 130
    return 0 if finished else 1


def main(argv: list[str] | None = None) -> int:
    # The launch's checks ask for a dataset's listing several times: one listing serves them.
    with listed_once():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        # The pre-launch MLflow check may create a new database: MLflow says so at INFO.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    if args.show_schema:
        print(schema_markdown())
        return 0
    if not args.search:
        print("error: give a search YAML (see searches/), or --show-schema", file=sys.stderr)
        return 2
    notices: list[str] = []
    try:
        config = resolve(args, notices)
        run_checks(config, args.search, ENVIRONMENT_CHECKS)
        notices.extend(collapse_notices(config))  # constraints that narrow the search
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for notice in notices:
        print(f"raycl: {notice}", flush=True)
    if args.dry_run:
        print_dry_run(config)  # never starts Ray
        return 0
    try:
        return run(config, args.search, fresh=args.fresh, address=args.address,
                   verbose=args.verbose)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
