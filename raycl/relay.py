"""Trials log to MLflow through the sweep driver's node.

On a cluster the MLflow server listens on the head's loopback only (there is no open port to
secure), and a local ``sqlite:///`` store is a file on one disk: either way a trial running on
a GPU worker cannot reach the store itself. The driver therefore starts :class:`MLflowRelay`,
a small actor pinned to its own node, and trials hand it what they log (metrics, and artifact
files as bytes) over Ray's own authenticated connections. Metrics reported to Tune never pass
through here: the driver's callback logs those.

Importable without Ray's cluster running; everything Ray is imported where it is used.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RELAY_NAME = "raycl-mlflow-relay"
# The driver keeps its relay's handle here: a named actor lives as long as its owner holds it.
_RELAY: Any = None


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
        from raycl.tracking import log_to_trial_run_directly

        with tempfile.TemporaryDirectory() as directory:
            root = Path(directory)
            for relative, content in files.items():
                path = root / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(content)
            return log_to_trial_run_directly(tracking_uri, experiment, trial_id, metrics,
                                             root if files else None, timeout_s)


def start_relay() -> Any:
    """Start (or find) this driver's relay on this node; call after ``ray.init``."""
    global _RELAY
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    _RELAY = ray.remote(MLflowRelay).options(
        name=RELAY_NAME, get_if_exists=True, num_cpus=0, max_restarts=-1,
        max_task_retries=3,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote()
    return _RELAY


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
