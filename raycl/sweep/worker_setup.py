"""Ray workarounds that must run in every worker process of a raycl job: Ray's
``worker_process_setup_hook``, set by :func:`raycl.sweep.local_ray.init_ray`. Imports Ray's core
only (it runs in every process, the MLflow relay's included)."""

from __future__ import annotations

import os


def name_this_cluster() -> None:
    """``RAY_ADDRESS`` = this job's cluster, in this worker process.

    Ray Train 2.60's ``PlacementGroupCleaner`` asks the State API whether its controller is alive
    without naming the cluster. With more than one Ray on the machine (two users, a test run beside
    another) that raises ``ConnectionError`` ("Found multiple active Ray instances"), its monitor
    thread dies, and a controller that dies without ending its run (a paused PBT trial's,
    :mod:`raycl.trial.population_workers`) leaves its worker group's placement group reserved for
    good: the population waits forever for those CPUs (seen in CI). The State API reads
    ``RAY_ADDRESS`` first. Upstream: ray-project/ray#65447 (open) only catches the error.
    """
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


__all__ = ["name_this_cluster"]
