"""``python -m raycl.tune SEARCH.yaml``: run (or resume) a sweep.

Every trial is :func:`raycl.trial.trainable.run_trial`, which builds and fits one ``TorchTrainer``
for all its stages (the Ray Train V2 pattern); Optuna proposes the trials (feasible ones only), ASHA
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
import sys
from typing import Any

from raycl.config.problems import with_checks
from raycl.config.schema import ConfigError, CoreConfig, error_lines
from raycl.config.search_config import apply_overrides, schema_markdown
from raycl.data.listed_once import listed_once
from raycl.data.load import LoaderChoice, choose_loader
from raycl.data.sources.folders import skip_notice
from raycl.launch.checks import ENVIRONMENT_CHECKS, run_checks
from raycl.launch.feasibility import max_reports
from raycl.launch.identity import store_settings
from raycl.launch.linear_sgd_check import check_linear_sgd
from raycl.launch.load import load_search, with_absolute_paths
from raycl.launch.placement import CLUSTER_CHECKS, placement_warning
from raycl.launch.ray_nodes import smallest_node_memory
from raycl.launch.reservations import trial_resources
from raycl.launch.stream_rate import stream_cpus_warning
from raycl.launch.sweep_plan import SweepPlan, plan_sweep, resolved_storage, storage_child
from raycl.sweep.dry_run import collapse_notices, print_dry_run
from raycl.tracking.closed_stdout import CLOSED_EXIT_CODE, stdout_closed

EPILOG = """\
examples:
  python -m raycl.tune searches/quickstart.yaml
  python -m raycl.tune searches/mcl_k_n.yaml --set train.epochs=1 --num-samples 2
  ray job submit --working-dir . -- python -m raycl.tune searches/mcl_k_n.yaml \\
      --storage s3://bucket/raycl --tracking-uri http://mlflow:5000
  python -m raycl.tune --show-schema        # every config key, its type, default and meaning

Re-running a sweep with the same name (and storage), settings and data resumes it; with other
settings or data it stops before Ray starts and names what changed (run them under --name NEW,
or --fresh to start over).
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
    parser.add_argument("--warm-start", metavar="EXPERIMENT", help="seed the searcher with an "
                        "earlier sweep's best configurations (tune.warm_start)")
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
             "tracking_uri": args.tracking_uri, "warm_start": args.warm_start}
    if args.tracking_uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
        # MLflow's own variable: it names the server for every tool of a session, so it wins
        # over the YAML (whose sqlite default is for a laptop); --tracking-uri wins over both.
        flags["tracking_uri"] = os.environ["MLFLOW_TRACKING_URI"]
        notices.append(f"mlflow.tracking_uri={flags['tracking_uri']} (from $MLFLOW_TRACKING_URI)")
    for flag, key in (("num_samples", "tune.num_samples"), ("name", "name"),
                      ("storage", "tune.storage_path"), ("tracking_uri", "mlflow.tracking_uri"),
                      ("warm_start", "tune.warm_start")):
        if flags[flag] is not None:
            overrides.append(f"{key}={flags[flag]}")
    return load_search(args.search, overrides, notices=notices)


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
    verbose: bool = False,
    loader: LoaderChoice | None = None,
    plan: SweepPlan | None = None,
) -> Any:
    """A ``Tuner`` for the sweep, or the restored one when a sweep of that name exists. Call it
    after ``ray.init``: it starts this driver's MLflow relay, which trials log through.

    ``loader``: ``data.loader`` as :func:`settle_loader` settled it for the trials. raycl's
    progress lines (:class:`raycl.sweep.display.ProgressDisplay`) replace Tune's tables unless
    ``verbose``. A restored sweep keeps the callbacks and verbosity it was started with.
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
    if _trains_with_workers(config):  # in-process trials start no Train controller
        _keep_train_coordinator_on_this_node()

    # Trials run in directories of their own: every path they get must be absolute.
    config = with_absolute_paths(config)
    # What the trials run: data.loader as settled at launch. The sweep's identity (a re-run's
    # comparison) keeps the user's setting, so "auto" settled differently is the same sweep.
    trial_config = apply_overrides(config, {"data.loader": loader}) if loader else config
    storage = resolved_storage(config.tune.storage_path)
    trainable = _trainable(trial_config, storage_child(storage, f"{config.name}-train"))

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
    )
    experiment_path = plan.experiment_path
    if plan.resume:
        print(f"raycl: resuming sweep {config.name!r} from {experiment_path}", flush=True)
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


def _trainable(config: CoreConfig, storage_path: str) -> Any:
    """The Tune trainable of ``config``'s trials with the one bundle each trial process
    reserves (its worker group reserves its own, decoders included: raycl.launch.reservations)."""
    from ray import tune

    from raycl.trial.trainable import run_trial

    trainable = tune.with_parameters(run_trial, base_config=config.to_dict(),
                                     storage_path=storage_path)
    return tune.with_resources(trainable, trial_resources(config))


def _warn_if_trials_wait(config: CoreConfig) -> None:
    """A trial larger than the cluster waits for nodes an autoscaler can (or might) add; where
    nothing can add one, :data:`CLUSTER_CHECKS` already refused the sweep. Also stream mode's
    decoders too few to feed a GPU (:func:`raycl.launch.stream_rate.stream_cpus_warning`)."""
    for warning in (placement_warning(config), stream_cpus_warning(config)):
        if warning:
            print(f"raycl: warning: {warning}", file=sys.stderr, flush=True)


# Ray's switch to its local-only mode, read once at import by each Ray process (see below).
_RAY_CLUSTER_MODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _loopback_only(address: str | None, temp_dir: str | None) -> tuple[bool, str | None] | None:
    """Ray's local-only mode on, when ``ray.init(address)`` is to start a Ray of its own (it
    finds no cluster to join: no address, ``local``) or to join one on this machine's loopback;
    returns what :func:`_restore_cluster_mode` puts back (None: a cluster, left as it is).

    Otherwise a local Ray listens on the node's address, which Ray on Linux resolves to the
    LAN's: GCS, raylet and worker gRPC servers on every interface, the agents and metrics
    exporters on the LAN address. ``_node_ip_address="127.0.0.1"`` is no way out: Ray replaces a
    loopback address with the LAN's (ray-project/ray#26293; and a loopback ``address`` too,
    ray-project/ray#59110). Its local-only mode (node address and every server on 127.0.0.1,
    the default on macOS and Windows) is selected by ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``:
    this process read it at ``import ray`` (``ray_constants.ENABLE_RAY_CLUSTER``), the processes
    Ray starts read it from the environment they inherit.
    """
    from ray._common.network_utils import is_localhost, parse_address
    from ray._private import ray_constants, services

    found = address
    if found in (None, "auto"):  # where ray.init looks: $RAY_ADDRESS, then a `ray start` head
        try:
            found = services.get_ray_address_from_environment(found, temp_dir)
        except ConnectionError:  # "auto" and nothing found: ray.init says so itself
            return None
    if found not in (None, "local"):
        parsed = None if "://" in found else parse_address(found)
        if parsed is None or not is_localhost(parsed[0]):
            return None
    before = (ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_RAY_CLUSTER_MODE))
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_RAY_CLUSTER_MODE] = "0"
    return before


def _restore_cluster_mode(before: tuple[bool, str | None] | None) -> None:
    """Undo :func:`_loopback_only` once Ray is up: a later ``ray.init`` of this process (a
    cluster's address) and the processes it starts see Ray as they did."""
    if before is None:
        return
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = before[0]
    if before[1] is None:
        os.environ.pop(_RAY_CLUSTER_MODE, None)
    else:
        os.environ[_RAY_CLUSTER_MODE] = before[1]


def init_ray(quiet: bool = False, **init_kwargs: Any) -> None:
    """Start (or join) Ray the way every raycl sweep needs it; tests and benchmarks use it too.

    Intermediate reports without the objective are fine (evaluation every N epochs, MCL's skipped
    trials): ASHA and our Optuna searcher ignore them, so Tune's strict metric check is turned off
    in the driver and, through the runtime env, in every trial process.

    ``quiet`` (a sweep without ``-v``): the job's processes log warnings and errors only
    (``ray.LoggingConfig``: no "Checkpoint successfully created" per epoch; Ray Train's own
    ``ray.train`` loggers follow ``RAYCL_TRAIN_LOG_LEVEL``, read by :mod:`raycl.trial.trainable`),
    and the dashboard's address is printed in one line.

    A Ray started here (no cluster to join) listens on 127.0.0.1 only, every process of it;
    so does one joined through a loopback address. A cluster is joined as Ray does
    (:func:`_loopback_only`; docs/clusters.md "What listens where").
    """
    import ray

    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    if ray.is_initialized():
        return
    env_vars = {"TUNE_DISABLE_STRICT_METRIC_CHECKING": "1"}
    if quiet:
        env_vars["RAYCL_TRAIN_LOG_LEVEL"] = "WARNING"
        init_kwargs.setdefault("logging_config", ray.LoggingConfig(log_level="WARNING"))
    before = _loopback_only(init_kwargs.get("address"), init_kwargs.get("_temp_dir"))
    try:
        # Every worker process names its cluster (raycl.sweep.worker_setup says why).
        context = ray.init(runtime_env={
            "env_vars": env_vars,
            "worker_process_setup_hook": "raycl.sweep.worker_setup.name_this_cluster"},
            **init_kwargs)
    finally:
        _restore_cluster_mode(before)
    dashboard = getattr(context, "dashboard_url", None)
    if quiet and dashboard:
        url = dashboard if "://" in dashboard else f"http://{dashboard}"
        print(f"raycl: Ray dashboard at {url}", flush=True)


def run(config: CoreConfig, search_file: str | None = None, fresh: bool = False,
        address: str | None = None, verbose: bool = False, plan: SweepPlan | None = None) -> int:
    """Run the sweep on the current (or a new embedded) Ray; return the process exit code.
    Ray's, Tune's and Optuna's own output is turned down to warnings unless ``verbose``
    (:func:`raycl.sweep.display.quiet_ray`)."""
    from raycl.sweep.display import quiet_ray

    with quiet_ray(verbose):
        return _run(config, search_file, fresh, address, verbose, plan)


def _confirm(config: CoreConfig, search_file: str | None, results: Any, loader: str,
             verbose: bool) -> list[str]:
    """Seed confirmation (``tune.confirm``) after the search: :mod:`raycl.sweep.confirm_tuner`
    re-runs
    the best configurations over fresh seeds (or resumes doing so) and writes ``confirm.csv``
    on the parent run; returns the lines printed under the leaderboard (none if interrupted)."""
    from raycl.sweep.confirm_tuner import confirmation_tuner, report_confirmation
    from raycl.tracking.callback import INTERRUPTED

    absolute = with_absolute_paths(config)  # as build_tuner gives the search's trials
    trial_config = apply_overrides(absolute, {"data.loader": loader})
    storage = resolved_storage(config.tune.storage_path)
    trainable = _trainable(trial_config, storage_child(storage, f"{config.name}-confirm-train"))
    built = confirmation_tuner(config, trial_config, search_file, results, trainable, verbose)
    if built is None:
        return []
    tuner, choice = built
    confirm_results = tuner.fit()
    return [] if INTERRUPTED.get(config.name) else report_confirmation(config, choice,
                                                                        confirm_results)


def _run(config: CoreConfig, search_file: str | None, fresh: bool, address: str | None,
         verbose: bool, plan: SweepPlan | None = None) -> int:
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
    finished = [r for r in results
                if r.error is None and not (r.metrics or {}).get(FAILED_KEY)]
    print(flush=True)
    print_leaderboard(config.mlflow.tracking_uri, config.mlflow.experiment or config.name,
                      top=10)
    for line in confirmation:  # the confirmed ranking: the sweep's last word
        print(line, flush=True)
    if INTERRUPTED.get(config.name):
        # Tune stops on the first Ctrl+C/SIGINT after saving the sweep's state.
        print(f"raycl: sweep {config.name!r} interrupted; run the same command again to resume "
              f"it", file=sys.stderr, flush=True)
        return 130
    return 0 if finished else 1


def main(argv: list[str] | None = None) -> int:
    # The launch's checks ask for a dataset's listing several times: one listing serves them.
    try:
        with listed_once():
            code = _main(argv)
        sys.stdout.flush()  # here, where a reader that stopped early (`| head`) is caught
    except BrokenPipeError:
        stdout_closed()  # no traceback (a sweep's own lines already go on unprinted)
        return CLOSED_EXIT_CODE
    return code


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    import raycl.methods  # noqa: F401  (after --help, which needs none: the schema's sections)

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
        notices.extend(filter(None, [skip_notice(config.data)]))  # data.skip_unreadable's count
    except ConfigError as exc:
        # Every problem at once, one line each (the environment's too, where the YAML's
        # problems left a config to check): a config is fixed in one pass.
        for line in with_checks(exc, args.search, ENVIRONMENT_CHECKS):
            print(f"error: {line}", file=sys.stderr)
        return 2
    for notice in notices:
        print(f"raycl: {notice}", flush=True)
    if args.dry_run:
        print_dry_run(config)  # never starts Ray
        return 0
    try:
        # Resume, set aside or start: decided (a changed sweep refused) before Ray starts.
        plan = plan_sweep(config, args.search, fresh=args.fresh)
        return run(config, args.search, fresh=args.fresh, address=args.address,
                   verbose=args.verbose, plan=plan)
    except ConfigError as exc:
        for line in error_lines(exc):
            print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
