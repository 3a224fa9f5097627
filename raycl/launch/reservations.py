"""What one trial reserves from Ray, bundle by bundle: the one place that arithmetic lives, read
by the trainable's resources (:mod:`raycl.tune`), the worker group's ``ScalingConfig``
(:mod:`raycl.trial.trainable`) and the pre-launch checks (:mod:`raycl.launch.placement`,
:mod:`raycl.launch.packing`).

A trial with Ray Train workers (``scaling.num_workers`` >= 1) holds two placement groups under
Ray Train V2: Tune's, with one bundle for the trial process (``tune.trial_cpus``), and the worker
group's, one bundle per worker. In stream mode each worker's bundle also holds its decoders'
CPUs (``data.stream_cpus``), so they sit on the node of the GPU whose batches they decode
(:mod:`raycl.worker.stream_loader` schedules the worker's Ray Data tasks into that bundle). With
``scaling.num_workers: 0`` the trial process trains itself and its one bundle holds all of it.
"""

from __future__ import annotations

import math
import sys

from raycl.config.schema import CoreConfig
from raycl.data.load import settled_loader

# Ray keeps resources in fixed point (1e-4); below that two amounts are equal.
EPSILON = 1e-6


def decoder_cpus(config: CoreConfig) -> float:
    """CPUs one worker (the trial process, when it trains itself) reserves for stream mode's
    Ray Data decoders: ``data.stream_cpus``; 0 in memory mode (``data.loader`` as the launch
    settled it)."""
    if settled_loader(config.data) != "stream":
        return 0.0
    return float(config.data.stream_cpus)


def data_cpus(config: CoreConfig) -> float:
    """CPUs one trial reserves for its decoders in all: :func:`decoder_cpus` per worker (per
    trial process when it trains itself)."""
    return decoder_cpus(config) * max(1, config.scaling.num_workers)


def training_resources(config: CoreConfig) -> dict[str, float]:
    """What training itself needs per worker, decoders left out: CPUs, GPUs with
    ``scaling.use_gpu``, and ``scaling.resources_per_worker``."""
    scaling = config.scaling
    return {"CPU": scaling.cpus_per_worker,
            **({"GPU": scaling.gpus_per_worker} if scaling.use_gpu else {}),
            **scaling.resources_per_worker}


def worker_resources(config: CoreConfig) -> dict[str, float]:
    """Each Ray Train worker's bundle (``ScalingConfig.resources_per_worker``): what training
    needs plus, in stream mode, its decoders' CPUs, all on one node."""
    resources = training_resources(config)
    resources["CPU"] = resources["CPU"] + decoder_cpus(config)
    return resources


def trial_resources(config: CoreConfig) -> dict[str, float]:
    """What the trial process reserves (Tune's one bundle): ``tune.trial_cpus`` beside a worker
    group, or a worker's whole bundle when it trains itself (``scaling.num_workers: 0``)."""
    if config.scaling.num_workers > 0:
        return {"CPU": config.tune.trial_cpus}
    return worker_resources(config)


def trial_bundles(config: CoreConfig) -> list[dict[str, float]]:
    """Every bundle one trial holds while it trains: the trial process's, then one per Ray Train
    worker (the worker group's placement group)."""
    return [trial_resources(config)] + [worker_resources(config)
                                        for _ in range(config.scaling.num_workers)]


def trial_demand(config: CoreConfig) -> dict[str, float]:
    """Resources one trial holds at once, its bundles summed (the Ray Train controller reserves
    none)."""
    demand: dict[str, float] = {}
    for bundle in trial_bundles(config):
        for name, amount in bundle.items():
            demand[name] = demand.get(name, 0.0) + amount
    return demand


def copies(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many ``bundle`` fit into ``node``'s resources."""
    counts = [math.floor((node.get(name, 0.0) + EPSILON) / need)
              for name, need in bundle.items() if need > 0]
    return min(counts) if counts else sys.maxsize


__all__ = ["EPSILON", "copies", "data_cpus", "decoder_cpus", "training_resources",
           "trial_bundles", "trial_demand", "trial_resources", "worker_resources"]
