"""``python -m raycl.tune SEARCH.yaml``: run (or resume) a sweep.

The command's door: it parses the arguments, loads and checks the YAML (``raycl.launch``) and
hands a valid config to :func:`raycl.sweep.run.run`: Optuna proposes the trials (feasible ones
only), each one :func:`raycl.trial.trainable.run_trial` (one ``TorchTrainer`` for all its
stages), ASHA stops weak ones early on the validation objective, and the MLflow callback mirrors
everything. With an empty search space the trials are repeats that differ only by seed.

Exit codes: 0 when at least one trial finished, 1 when none did, 2 for invalid input (nothing is
launched), 130 when interrupted (Ctrl+C; the same command resumes).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from raycl.config.problems import with_checks
from raycl.config.schema import ConfigError, CoreConfig, error_lines
from raycl.config.search_config import schema_markdown
from raycl.data.listed_once import listed_once
from raycl.data.sources.folders import skip_notice
from raycl.launch.checks import ENVIRONMENT_CHECKS, run_checks
from raycl.launch.load import load_search
from raycl.launch.sweep_plan import plan_sweep
from raycl.sweep.dry_run import collapse_notices, print_dry_run
from raycl.sweep.run import run
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
