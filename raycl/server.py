"""``python -m raycl.server``: the MLflow tracking server raycl sweeps log to, on loopback.

The same command runs on a laptop and on a cluster's head node (the launcher configs in
``clusters/`` start it there). It binds to 127.0.0.1: MLflow's server has no authentication of
its own, so it is reached through a tunnel (``ssh -L 5000:127.0.0.1:5000``, ``ray attach -p
5000``, ``kubectl port-forward``), never through an open port. Sweeps pass
``--tracking-uri http://127.0.0.1:5000``; their trials, wherever Ray places them, log through
the driver's node (:mod:`raycl.tracking.relay`), so no worker needs to reach this server.

Runs and metrics go to a database (``--backend-store-uri``: sqlite on this disk by default, or
a PostgreSQL/MySQL URI); artifacts to ``--artifacts-destination`` (a directory, or shared
storage such as ``s3://bucket/raycl/mlflow`` or ``gs://…``), which the server proxies, so
clients need no storage credentials.

Exit code 2 with one line for bad arguments, before anything starts.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from raycl.config.schema import resolve_tracking_uri

DEFAULT_PORT = 5000
LOOPBACK_NAMES = {"localhost"}


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _absolute_sqlite(uri: str, create: bool) -> str:
    """``sqlite:///mlflow.db`` (or ``~/…``) made absolute, as sweeps resolve it; its directory
    created when ``create``."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return uri
    resolved = resolve_tracking_uri(prefix + os.path.expanduser(uri[len(prefix):]))
    if create:
        Path(resolved[len(prefix):]).parent.mkdir(parents=True, exist_ok=True)
    return resolved


def _artifacts_destination(value: str, create: bool) -> str:
    """A local directory becomes an absolute path (created when ``create``); a URI is passed
    as it is."""
    if "://" in value:
        return value
    path = Path(value).expanduser().resolve()
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return str(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m raycl.server", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m raycl.server                         # ./mlflow.db, ./mlartifacts\n"
               "  python -m raycl.server --backend-store-uri sqlite:///$HOME/mlflow/mlflow.db "
               "\\\n      --artifacts-destination s3://BUCKET/raycl/mlflow   # a cluster head\n"
               "then: python -m raycl.tune SEARCH.yaml --tracking-uri http://127.0.0.1:5000")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1; others need --allow-remote)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 5000)")
    parser.add_argument("--backend-store-uri", default="sqlite:///mlflow.db",
                        help="runs and metrics database (default sqlite:///mlflow.db)")
    parser.add_argument("--artifacts-destination", default="mlartifacts",
                        help="where artifacts are stored: a directory or s3://, gs://, … "
                             "(default ./mlartifacts)")
    parser.add_argument("--workers", type=int, default=2, help="server worker processes")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback --host (MLflow has no authentication: put "
                             "it behind your own access control)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mlflow command instead of running it")
    return parser.parse_args(argv)


def server_command(args: argparse.Namespace, create: bool = False) -> list[str]:
    """The ``mlflow server`` command line for these arguments (raises ValueError); ``create``
    makes the database's directory and a local artifact directory."""
    if not _is_loopback(args.host) and not args.allow_remote:
        raise ValueError(f"--host {args.host}: MLflow's server has no authentication; bind to "
                         f"127.0.0.1 and reach it through a tunnel (ssh -L / ray attach -p / "
                         f"kubectl port-forward), or pass --allow-remote")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: not a TCP port")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be >= 1")
    if "://" not in args.backend_store_uri:
        raise ValueError(f"--backend-store-uri {args.backend_store_uri}: give a database URI "
                         f"such as sqlite:///mlflow.db (MLflow 3 refuses plain file stores)")
    return [sys.executable, "-m", "mlflow", "server",
            "--host", args.host, "--port", str(args.port),
            "--backend-store-uri", _absolute_sqlite(args.backend_store_uri, create),
            "--serve-artifacts",
            "--artifacts-destination", _artifacts_destination(args.artifacts_destination, create),
            "--workers", str(args.workers)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        command = server_command(args, create=not args.dry_run)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(" ".join(command))
        return 0
    print(f"raycl: MLflow at http://{args.host}:{args.port} "
          f"(sweeps: --tracking-uri http://{args.host}:{args.port})", flush=True)
    # Replace this process: signals (Ctrl+C, kill by the pid a script saved) reach the server.
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
