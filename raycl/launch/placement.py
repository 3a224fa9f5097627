"""Where a trial's processes go, checked before launch: ranks that would share a GPU, and trials
that no node set of the cluster can ever hold.

Both follow :mod:`raycl.launch.checks`' convention (``check_x(config) -> Iterator[Problem]``) and
look at every combination of the searched scaling keys. Their bounds suffice (a continuous
domain's ends, a ``randint``'s ends, every choice): each rule here is monotone in each key.

- :func:`check_gpu_sharing` needs only the config (one of ``CONFIG_CHECKS``): with
  ``scaling.gpus_per_worker`` below 1, Ray may pack two ranks of one trial onto one GPU, and
  NCCL refuses a process group with a GPU twice ("Duplicate GPU detected").
- :func:`check_placement` needs the running Ray (:data:`CLUSTER_CHECKS`, run by
  ``python -m raycl.tune`` after Ray starts, before any trial): a trial larger than every
  placement on the cluster's nodes waits for nodes. That is an error where nothing can add one
  (the local Ray the command started, a cluster without an autoscaler) and a warning
  (:func:`placement_warning`) where an autoscaler can, or might.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from raycl.config.schema import CoreConfig, Problem
from raycl.config.search_config import searched_note, searched_variants
from raycl.data.load import settled_loader

Check = Callable[[CoreConfig], Iterator[Problem]]

# The keys that decide what a trial reserves (tune.* is not searchable).
SCALING_KEYS = ("scaling.num_workers", "scaling.use_gpu", "scaling.cpus_per_worker",
                "scaling.gpus_per_worker")  # scaling.resources_per_worker: fixed per sweep
# Ray keeps resources in fixed point (1e-4); below that two amounts are equal.
EPSILON = 1e-6


def check_gpu_sharing(config: CoreConfig) -> Iterator[Problem]:
    """Two or more GPU workers need a whole GPU each: a fraction lets Ray place two ranks of one
    trial on one GPU, and NCCL then fails at set-up."""
    for chosen, variant in searched_variants(config, SCALING_KEYS):
        scaling = variant.scaling
        if scaling.use_gpu and scaling.num_workers >= 2 and scaling.gpus_per_worker < 1:
            yield Problem("scaling.gpus_per_worker", (
                f"{searched_note(chosen)}{scaling.gpus_per_worker:g} GPU per worker with "
                f"scaling.num_workers={scaling.num_workers} lets Ray place two ranks of a trial on "
                f"one GPU, which NCCL refuses (\"Duplicate GPU detected\"); give each worker a "
                f"whole GPU (1), or share GPUs between trials with scaling.num_workers: 1 or 0"))
            return


# ---------------------------------------------------------------------------------------------
# What one trial holds, and whether a cluster can hold it.


def trial_resources(config: CoreConfig) -> dict[str, float]:
    """What the trial process itself reserves (its Ray Train workers reserve their own)."""
    scaling = config.scaling
    if scaling.num_workers > 0:
        return {"CPU": config.tune.trial_cpus}
    # Training runs inside the trial process: reserve the worker's resources for the trial.
    return worker_resources(config)


def worker_resources(config: CoreConfig) -> dict[str, float]:
    """What each Ray Train worker reserves (its bundle of the worker group's placement group):
    CPUs, GPUs with ``scaling.use_gpu``, and ``scaling.resources_per_worker``."""
    scaling = config.scaling
    return {"CPU": scaling.cpus_per_worker,
            **({"GPU": scaling.gpus_per_worker} if scaling.use_gpu else {}),
            **scaling.resources_per_worker}


def data_cpus(config: CoreConfig) -> float:
    """CPUs a trial reserves for stream mode's Ray Data decoders: ``data.stream_cpus`` per
    worker (per trial process when it trains itself); 0 in memory mode (``data.loader`` as the
    launch settled it)."""
    if settled_loader(config.data) != "stream":
        return 0.0
    return config.data.stream_cpus * max(1, config.scaling.num_workers)


def trial_bundles(config: CoreConfig) -> list[dict[str, float]]:
    """The trial's placement group bundles as Tune reserves them: the trial process, then in
    stream mode one bundle per worker of ``data.stream_cpus`` CPUs that the decoders run in
    (:mod:`raycl.worker.stream_loader`), so trials never wait on each other's decoding."""
    bundles = [trial_resources(config)]
    if data_cpus(config) > 0:
        workers = max(1, config.scaling.num_workers)
        bundles += [{"CPU": config.data.stream_cpus} for _ in range(workers)]
    return bundles


def trial_demand(config: CoreConfig) -> dict[str, float]:
    """Resources one trial holds at once: its own process, its decoders' CPUs (stream mode) and
    its worker group. (The Ray Train controller reserves no CPU.)"""
    scaling = config.scaling
    demand = trial_resources(config)
    demand["CPU"] = demand.get("CPU", 0.0) + data_cpus(config)
    if scaling.num_workers > 0:
        demand["CPU"] += scaling.num_workers * scaling.cpus_per_worker
        if scaling.use_gpu:
            demand["GPU"] = scaling.num_workers * scaling.gpus_per_worker
        for name, amount in scaling.resources_per_worker.items():
            demand[name] = scaling.num_workers * amount
    return demand


def _copies(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many ``bundle`` fit into ``node``'s resources."""
    counts = [math.floor((node.get(name, 0.0) + EPSILON) / need)
              for name, need in bundle.items() if need > 0]
    return min(counts) if counts else sys.maxsize


def fits(nodes: tuple[dict[str, float], ...], trial: dict[str, float],
         worker: dict[str, float], workers: int) -> bool:
    """Whether the trial's bundle and ``workers`` worker bundles can be placed at once, each
    bundle on one node (exact for identical workers: try the trial bundle on every node)."""
    for i, node in enumerate(nodes):
        if _copies(node, trial) < 1:
            continue
        rest = {name: amount - trial.get(name, 0.0) for name, amount in node.items()}
        room = sum(min(_copies(rest if j == i else other, worker), workers)
                   for j, other in enumerate(nodes))
        if room >= workers:
            return True
    return False


def _amounts(resources: dict[str, float]) -> str:
    """``1 CPU, 1 GPU, 1 gpu_node``: CPUs and GPUs first, then custom resources by name."""
    names = [name for name in ("CPU", "GPU") if name in resources]
    names += sorted(name for name in resources if name not in ("CPU", "GPU"))
    return ", ".join(f"{resources.get(name, 0.0):g} {name}" for name in names)


def _missing_resource(config: CoreConfig, nodes: tuple[dict[str, float], ...]) -> Problem | None:
    """A ``scaling.resources_per_worker`` resource that no node declares at all (a node type's
    name mistyped, or a node type the cluster lacks)."""
    for name, amount in config.scaling.resources_per_worker.items():
        if not any(node.get(name, 0.0) > 0 for node in nodes):
            count = len(nodes)
            return Problem("scaling.resources_per_worker",
                           f"a worker needs {amount:g} {name!r}, a resource none of this Ray's "
                           f"{count} node{'s' if count != 1 else ''} declares")
    return None


def _short_key(bundle: dict[str, float], nodes: tuple[dict[str, float], ...],
               cpu_key: str, gpu_key: str) -> str:
    """``scaling.use_gpu`` when no node has a GPU, ``gpu_key`` when none has the bundle's GPUs,
    else ``cpu_key``."""
    if bundle.get("GPU", 0.0) > 0 and all(_copies(n, {"GPU": bundle["GPU"]}) < 1 for n in nodes):
        return gpu_key if any(n.get("GPU", 0.0) > 0 for n in nodes) else "scaling.use_gpu"
    return cpu_key


def _where(nodes: tuple[dict[str, float], ...], gpu: bool) -> str:
    """``this Ray's 2 nodes (2 CPU; 4 CPU, 1 GPU)``: the CPUs (and GPUs) of each node."""
    shown = ("CPU", "GPU") if gpu else ("CPU",)
    shape = "; ".join(_amounts({name: node.get(name, 0.0) for name in shown}) for node in nodes)
    return f"this Ray's {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({shape or 'none'})"


def _decoders(config: CoreConfig) -> str:
    """``1 data.stream_cpus`` (``2 x 1 data.stream_cpus`` for two workers): stream mode's
    decoder CPUs of one trial, named by the key that sets them."""
    workers = config.scaling.num_workers
    each = f"{config.data.stream_cpus:g} data.stream_cpus"
    return f"{workers} x {each}" if workers > 1 else each


def _parts(config: CoreConfig, own: dict[str, float], what: str, key: str) -> str:
    """`` (2 for the trial + 1 data.stream_cpus for its decoders; lower KEY or
    data.stream_cpus)``: what a CPU total is made of, and what to lower, in stream mode only
    (in memory mode the total is the one key's)."""
    if data_cpus(config) <= 0:
        return ""
    return (f" ({own.get('CPU', 0.0):g} for {what} + {_decoders(config)} for its decoders; "
            f"lower {key} or data.stream_cpus)")


def _shortfall(config: CoreConfig, nodes: tuple[dict[str, float], ...]) -> Problem | None:
    """Why no placement on ``nodes`` holds one trial of ``config``; None when one does."""
    own, worker = trial_resources(config), worker_resources(config)
    # The decoders' bundles counted with the trial's (conservative: Tune packs them together).
    trial = {**own, "CPU": own.get("CPU", 0.0) + data_cpus(config)}
    workers = config.scaling.num_workers
    if fits(nodes, trial, worker, workers):
        return None
    missing = _missing_resource(config, nodes)
    if missing is not None:
        return missing
    where = _where(nodes, config.scaling.use_gpu)
    per_worker = ("scaling.cpus_per_worker", "scaling.gpus_per_worker")
    if workers == 0:
        key = _short_key(trial, nodes, *per_worker)
        return Problem(key, f"a trial trains in its own process (scaling.num_workers: 0) and "
                            f"needs {_amounts(trial)}"
                            f"{_parts(config, own, 'the trial', per_worker[0])}; none of "
                            f"{where} has that")
    if all(_copies(node, worker) < 1 for node in nodes):
        return Problem(_short_key(worker, nodes, *per_worker),
                       f"one worker needs {_amounts(worker)}; none of {where} has that")
    if all(_copies(node, trial) < 1 for node in nodes):
        parts = _parts(config, own, "the trial process", "tune.trial_cpus")
        # Blame the larger share: the decoders' CPUs dwarf the trial process's 0.01.
        key = "data.stream_cpus" if data_cpus(config) > own.get("CPU", 0.0) else "tune.trial_cpus"
        return Problem(key, f"the trial process needs {_amounts(trial)}{parts}; none of {where} "
                            f"has that")
    decoders = f" + {_decoders(config)} for its decoders" if data_cpus(config) > 0 else ""
    return Problem("scaling.num_workers",
                   f"one trial holds {_amounts(trial_demand(config))} at once ({workers} workers "
                   f"x {_amounts(worker)} + {_amounts(own)} for the trial process{decoders}); "
                   f"{where} cannot place it")


@dataclass(frozen=True)
class Cluster:
    """What trials are placed on.

    Attributes:
        nodes: each alive node's total resources (CPU, GPU, ...).
        can_add_nodes: True where an autoscaler can add nodes, False where nothing can, None
            where it cannot be told.
        how: how that was told, for the messages.
    """

    nodes: tuple[dict[str, float], ...]
    can_add_nodes: bool | None
    how: str


def placement_problem(config: CoreConfig, cluster: Cluster) -> tuple[Problem, bool] | None:
    """The first trial (for each combination of searched scaling values) that no placement on
    ``cluster``'s nodes holds, and whether that is fatal (nothing can add a node); None when
    every trial fits."""
    for chosen, variant in searched_variants(config, SCALING_KEYS):
        problem = _shortfall(variant, cluster.nodes)
        if problem is not None:
            why = f"{searched_note(chosen)}{problem.why}"
            return Problem(problem.key, why), cluster.can_add_nodes is False
    return None


# ---------------------------------------------------------------------------------------------
# The running Ray: its nodes, and whether an autoscaler can add more.


def readonly_autoscaler(status: dict[str, Any]) -> bool | None:
    """Whether the autoscaler v1 monitor's status (what ``ray status`` prints) is the read-only
    provider's, which only mirrors the nodes that joined (``ray start`` without a cluster
    config): it names every node's type ``node_<node id>``. None when the status says nothing."""
    mapping = (status.get("autoscaler_report") or {}).get("node_type_mapping")
    if not mapping:
        return None
    return all(node_type == f"node_{node_id}" for node_id, node_type in mapping.items())


def node_groups_grow(groups: list[tuple[int, int]]) -> bool:
    """Whether a node group of an autoscaler's cluster config, as ``(min_count, max_count)``,
    can grow: ``max_count`` -1 (unbounded) or above ``min_count`` (Ray Data's rule)."""
    return any(high == -1 or high > low for low, high in groups)


def _autoscaling(alive: int) -> tuple[bool | None, str]:
    """Whether an autoscaler can add nodes to the Ray this process uses (``alive`` nodes now),
    and how that was told.

    Ray 2.60 has no public API for this; everything private raycl reads about it is here, each
    piece what one of Ray's own components reads:

    - ``ray._private.worker._global_node.head``: this process started the Ray it uses
      (``ray.init()`` found no cluster to join, as ``python -m raycl.tune`` on a workstation):
      a local Ray has no autoscaler, for certain.
    - ``ray._private.state.state.get_cluster_config()``: the node groups an autoscaler reported
      to the GCS (what Ray Train V2's fail-fast check and Ray Data's autoscaler read).
    - the monitor's status in the GCS key-value store (``DEBUG_AUTOSCALING_STATUS``, what
      ``ray status`` prints): a cluster started by hand (``ray start``, KubeRay without in-tree
      autoscaling) runs the read-only provider; any other provider is an autoscaler.

    Anything else (no status yet, an autoscaler v2 that reports no cluster config) cannot be
    told: a warning, not an error.
    """
    try:
        from ray._private import worker

        node = worker._global_node
        if node is not None and node.head:
            return False, "the local Ray this command started has no autoscaler"
    except Exception:  # a private API changed: try the next source
        pass
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
        if config is not None and config.node_group_configs:
            groups = [(g.min_count, g.max_count) for g in config.node_group_configs if g.resources]
            if node_groups_grow(groups):
                return True, "its autoscaler can add them"
            # Certain only once every group is up: more nodes than their sum (the head may be in
            # no group); until then a node that would fit may still be starting.
            if alive > sum(high for _, high in groups):
                return False, "its autoscaler's node groups are all at their maximum"
            return None, "its autoscaler is still starting its fixed node groups"
    except Exception:  # a private API changed: try the next source
        pass
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        readonly = readonly_autoscaler(json.loads(raw)) if raw else None
        if readonly is True:
            return False, "this cluster was started without an autoscaler (ray start)"
        if readonly is False:
            return True, "an autoscaler runs on this cluster"
    except Exception:  # a private API changed: try the next source
        pass
    return None, "if this cluster has none, they wait forever"


def read_cluster() -> Cluster:
    """The running Ray's alive nodes and whether an autoscaler can add more (Ray is started)."""
    import ray

    nodes = tuple({name: float(amount) for name, amount in node["Resources"].items()}
                  for node in ray.nodes() if node.get("Alive"))
    can_add_nodes, how = _autoscaling(len(nodes))
    return Cluster(nodes, can_add_nodes, how)


def check_placement(config: CoreConfig, cluster: Cluster | None = None) -> Iterator[Problem]:
    """Every trial fits the running Ray's nodes, or something can add nodes (else it would wait
    forever)."""
    cluster = cluster or read_cluster()
    found = placement_problem(config, cluster)
    if found is not None and found[1]:
        problem = found[0]
        yield Problem(problem.key, f"{problem.why}, and nothing will add a node: {cluster.how}; "
                                   f"ask for less, or run on a larger cluster (--address)")


def placement_warning(config: CoreConfig, cluster: Cluster | None = None) -> str | None:
    """The warning where trials wait for nodes that an autoscaler can (or might) add."""
    cluster = cluster or read_cluster()
    found = placement_problem(config, cluster)
    if found is None or found[1]:
        return None
    problem = found[0]
    return f"{problem.key}: {problem.why}; trials wait until an autoscaler adds nodes " \
           f"({cluster.how})"


CLUSTER_CHECKS: tuple[Check, ...] = (check_placement,)

__all__ = [
    "CLUSTER_CHECKS",
    "EPSILON",
    "SCALING_KEYS",
    "Cluster",
    "check_gpu_sharing",
    "check_placement",
    "data_cpus",
    "fits",
    "node_groups_grow",
    "placement_problem",
    "placement_warning",
    "read_cluster",
    "readonly_autoscaler",
    "trial_bundles",
    "trial_demand",
    "trial_resources",
    "worker_resources",
]
