"""The one way a raycl process starts or joins Ray: :func:`init_ray` (a sweep, re-evaluation,
the tests and benchmarks). A Ray it starts listens on the loopback only."""

from __future__ import annotations

import os
from typing import Any

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
