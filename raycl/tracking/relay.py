"""Trials log to MLflow through the sweep driver's node (:func:`log_to_trial_run`).

On a cluster the MLflow server listens on the head's loopback only (there is no open port to
secure), and a local ``sqlite:///`` store is a file on one disk: either way a trial running on
a GPU worker cannot reach the store itself. The driver therefore starts :class:`MLflowRelay`,
a small actor pinned to its own node, and trials hand it what they log (metrics, and artifact
files as bytes) over Ray's own authenticated connections. Metrics reported to Tune never pass
through here: the driver's callback logs those.

Importable without Ray's cluster running; everything Ray is imported where it is used. Sits on
:mod:`raycl.tracking.runs` (which logs straight to MLflow) and below nothing else.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycl.config.sweep import resolve_tracking_uri
from raycl.tracking.retry import retry_bound_s
from raycl.tracking.runs import experiment_name, log_to_trial_run_directly

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig

logger = logging.getLogger(__name__)

RELAY_NAME = "raycl-mlflow-relay"
# The driver keeps its relay's creating handle here, with the Ray session it belongs to: a named
# actor lives as long as its owner holds that handle. A handle looked up by name does not keep it
# alive (weak-reference semantics since ray-project/ray#45699), so the relay is never replaced
# by a looked-up one, or it dies and trials log past it.
_RELAY: tuple[str, Any] | None = None


class MLflowRelay:
    """Logs on behalf of trials, from the driver's node (see the module docstring)."""

    def log(
        self,
        tracking_uri: str,
        experiment: str,
        trial_id: str,
        metrics: dict[str, float],
        files: dict[str, bytes],
        timeout_s: float,
    ) -> bool:
        with tempfile.TemporaryDirectory() as directory:
            root = Path(directory)
            for relative, content in files.items():
                path = root / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
            return log_to_trial_run_directly(tracking_uri, experiment, trial_id, metrics,
                                             root if files else None, timeout_s)


def start_relay() -> Any:
    """Start this driver's relay on this node (once per Ray session; later calls return the
    same handle); call after ``ray.init``."""
    global _RELAY
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    session = f"{context.gcs_address}/{context.get_job_id()}"
    if _RELAY is not None and _RELAY[0] == session:
        return _RELAY[1]
    handle = ray.remote(MLflowRelay).options(
        name=RELAY_NAME, get_if_exists=True, num_cpus=0, max_restarts=-1,
        max_task_retries=3,
        scheduling_strategy=NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False),
    ).remote()
    _RELAY = (session, handle)
    return handle


def find_relay() -> Any:
    """The sweep's relay as seen from a trial, or None (not under Ray, or no relay started)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_actor(RELAY_NAME)
    except (ImportError, ValueError):
        return None


def read_files(directory: Path | None) -> dict[str, bytes]:
    """Every file under ``directory`` by its relative path (nothing for None)."""
    if directory is None:
        return {}
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def log_to_trial_run(
    config: CoreConfig,
    trial_id: str,
    metrics: dict[str, float],
    artifact_dir: Path | None = None,
    timeout_s: float = 30.0,
) -> bool:
    """From inside a trial: add metrics and artifacts to its child run. False when not found.

    Under a sweep this goes through the driver's relay (the trial's node may not reach the
    store); without one (a trial run by hand) straight to MLflow.
    """
    if trial_id == "local":  # not running under Tune: there is no child run
        return False
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    relay = find_relay()
    if relay is None:
        return log_to_trial_run_directly(tracking_uri, experiment_name(config), trial_id,
                                         metrics, artifact_dir, timeout_s)
    import ray

    reply = relay.log.remote(tracking_uri, experiment_name(config), trial_id, metrics,
                             read_files(artifact_dir), timeout_s)
    try:
        # The relay waits out a store briefly away (raycl.tracking.retry) before it answers.
        return bool(ray.get(reply, timeout=timeout_s + retry_bound_s() + 60.0))
    except (ray.exceptions.RayError, TimeoutError) as exc:  # diagnostics never fail a trial
        # (nor does a store away past the bound: TrackingUnavailableError comes as a RayError)
        logger.warning("trial %s: MLflow relay failed (%s); diagnostics not logged",
                       trial_id, exc)
        return False
