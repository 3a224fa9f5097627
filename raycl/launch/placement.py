"""Where a trial's processes go, checked before launch: ranks that would share a GPU, trials that
no node set of the cluster can ever hold, and ``tune.max_concurrent_trials`` trials that cannot
all be held at once.

Both follow :mod:`raycl.launch.checks`' convention (``check_x(config) -> Iterator[Problem]``) and
look at every combination of the searched scaling keys. Their bounds suffice (a continuous
domain's ends, a ``randint``'s ends, every choice): each rule here is monotone in each key.

- :func:`check_gpu_sharing` needs only the config (one of ``CONFIG_CHECKS``): with
  ``scaling.gpus_per_worker`` below 1, Ray may pack two ranks of one trial onto one GPU, and
  NCCL refuses a process group with a GPU twice ("Duplicate GPU detected").
- :func:`check_placement` needs the running Ray (:data:`CLUSTER_CHECKS`, run by
  ``python -m raycl.tune`` after Ray starts, before any trial): a trial larger than every
  placement on the cluster's nodes, or more concurrent trials than they hold
  (:mod:`raycl.launch.packing`), wait for nodes. That is an error where nothing can add one
  (the local Ray the command started, a cluster without an autoscaler, an autoscaler whose node
  types cannot hold them either) and a warning (:func:`placement_warning`) where an autoscaler
  can, or might.

What a trial reserves is :mod:`raycl.launch.reservations`' (re-exported here), the running
Ray's nodes :mod:`raycl.launch.ray_nodes`'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from raycl.config.schema import CoreConfig, Problem
from raycl.config.search_config import searched_note, searched_variants
from raycl.launch.packing import largest_nodes, pack_trials, trials_at_once
from raycl.launch.ray_nodes import (
    Cluster,
    NodeType,
    _autoscaling,
    node_groups_grow,
    read_cluster,
    readonly_autoscaler,
)
from raycl.launch.reservations import (
    EPSILON,
    copies,
    data_cpus,
    decoder_cpus,
    training_resources,
    trial_bundles,
    trial_demand,
    trial_resources,
    worker_resources,
)

Check = Callable[[CoreConfig], Iterator[Problem]]

# The keys that decide what a trial reserves (tune.* is not searchable).
SCALING_KEYS = ("scaling.num_workers", "scaling.use_gpu", "scaling.cpus_per_worker",
                "scaling.gpus_per_worker")  # scaling.resources_per_worker: fixed per sweep


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
# One trial: whether any placement on a cluster's nodes holds it.


def fits(nodes: tuple[dict[str, float], ...], trial: dict[str, float],
         worker: dict[str, float], workers: int) -> bool:
    """Whether the trial's bundle and ``workers`` worker bundles can be placed at once, each
    bundle on one node (exact for identical workers: try the trial bundle on every node)."""
    for i, node in enumerate(nodes):
        if copies(node, trial) < 1:
            continue
        rest = {name: amount - trial.get(name, 0.0) for name, amount in node.items()}
        room = sum(min(copies(rest if j == i else other, worker), workers)
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
    if bundle.get("GPU", 0.0) > 0 and all(copies(n, {"GPU": bundle["GPU"]}) < 1 for n in nodes):
        return gpu_key if any(n.get("GPU", 0.0) > 0 for n in nodes) else "scaling.use_gpu"
    return cpu_key


def _where(nodes: tuple[dict[str, float], ...], gpu: bool) -> str:
    """``this Ray's 2 nodes (2 CPU; 4 CPU, 1 GPU)``: the CPUs (and GPUs) of each node."""
    shown = ("CPU", "GPU") if gpu else ("CPU",)
    shape = "; ".join(_amounts({name: node.get(name, 0.0) for name in shown}) for node in nodes)
    return f"this Ray's {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({shape or 'none'})"


def _parts(config: CoreConfig, what: str) -> str:
    """`` (2 for the trial + 1 data.stream_cpus for its decoders; lower scaling.cpus_per_worker
    or data.stream_cpus)``: what a worker's (or an in-process trial's) CPUs are made of, in
    stream mode only (in memory mode the total is the one key's)."""
    decoders = decoder_cpus(config)
    if decoders <= 0:
        return ""
    return (f" ({config.scaling.cpus_per_worker:g} for {what} + {decoders:g} data.stream_cpus "
            f"for its decoders; lower scaling.cpus_per_worker or data.stream_cpus)")


def _worker_shares(config: CoreConfig) -> str:
    """``; a worker's 1.5 CPU: 0.5 scaling.cpus_per_worker + 1 data.stream_cpus for its
    decoders`` in stream mode; empty in memory mode."""
    decoders = decoder_cpus(config)
    if decoders <= 0:
        return ""
    return (f"; a worker's {worker_resources(config)['CPU']:g} CPU: "
            f"{config.scaling.cpus_per_worker:g} scaling.cpus_per_worker + {decoders:g} "
            f"data.stream_cpus for its decoders")


def _holds(config: CoreConfig) -> str:
    """``2 workers x 1 CPU + 0.01 CPU for the trial process`` (what one trial holds, in parts)."""
    return (f"{config.scaling.num_workers} workers x {_amounts(worker_resources(config))} + "
            f"{_amounts(trial_resources(config))} for the trial process{_worker_shares(config)}")


def _shortfall(config: CoreConfig, nodes: tuple[dict[str, float], ...]) -> Problem | None:
    """Why no placement on ``nodes`` holds one trial of ``config``; None when one does."""
    trial, worker = trial_resources(config), worker_resources(config)
    workers = config.scaling.num_workers
    if fits(nodes, trial, worker, workers):
        return None
    missing = _missing_resource(config, nodes)
    if missing is not None:
        return missing
    where = _where(nodes, config.scaling.use_gpu)
    # Blame the larger share of a worker's CPUs: its training's or its decoders'.
    cpu_key = ("data.stream_cpus" if decoder_cpus(config) > config.scaling.cpus_per_worker
               else "scaling.cpus_per_worker")
    per_worker = (cpu_key, "scaling.gpus_per_worker")
    if workers == 0:
        return Problem(_short_key(trial, nodes, *per_worker),
                       f"a trial trains in its own process (scaling.num_workers: 0) and needs "
                       f"{_amounts(trial)}{_parts(config, 'the trial')}; none of {where} has "
                       f"that")
    if all(copies(node, worker) < 1 for node in nodes):
        return Problem(_short_key(worker, nodes, *per_worker),
                       f"one worker needs {_amounts(worker)}{_parts(config, 'training')}; none "
                       f"of {where} has that")
    if all(copies(node, trial) < 1 for node in nodes):
        return Problem("tune.trial_cpus", f"the trial process needs {_amounts(trial)}; none of "
                                          f"{where} has that")
    return Problem("scaling.num_workers",
                   f"one trial holds {_amounts(trial_demand(config))} at once ({_holds(config)}); "
                   f"{where} cannot place it")


# ---------------------------------------------------------------------------------------------
# tune.max_concurrent_trials trials at once.


def _concurrency_shortfall(config: CoreConfig,
                           nodes: tuple[dict[str, float], ...]) -> Problem | None:
    """Why ``nodes`` cannot hold ``tune.max_concurrent_trials`` trials of ``config`` at once
    (one trial fits); None when they can."""
    count = config.tune.max_concurrent_trials
    trial, worker = trial_resources(config), worker_resources(config)
    workers = config.scaling.num_workers
    if count < 2 or pack_trials(nodes, trial, worker, workers, count) is not None:
        return None
    held = trials_at_once(nodes, trial, worker, workers, count)
    total = {name: amount * count for name, amount in trial_demand(config).items()}
    each = _holds(config) if workers else f"each {_amounts(trial)}{_parts(config, 'training')}"
    return Problem("tune.max_concurrent_trials", (
        f"{count} trials at once hold {_amounts(total)} ({each}); "
        f"{_where(nodes, config.scaling.use_gpu)} hold{'s' if len(nodes) == 1 else ''} {held} "
        f"of them at once (a trial whose worker group finds no room waits, Ray Train retrying it "
        f"every 60 s, while it holds a slot)"))


def _never_fits(config: CoreConfig, cluster: Cluster, concurrent: bool) -> bool:
    """Whether not even the largest cluster ``cluster``'s autoscaler may grow to holds one trial
    (``concurrent``: ``tune.max_concurrent_trials`` trials at once); False when that cannot be
    told (no node type known)."""
    workers = config.scaling.num_workers
    count = config.tune.max_concurrent_trials if concurrent else 1
    largest = largest_nodes(cluster, count * (workers + 1))
    if largest is None:
        return False
    if concurrent:
        return pack_trials(largest, trial_resources(config), worker_resources(config), workers,
                           count) is None
    return _shortfall(config, largest) is not None


def _fatal(cluster: Cluster, never: bool) -> str | None:
    """What makes a shortfall an error, said after it; None for a warning."""
    if cluster.can_add_nodes is False:
        return f"nothing will add a node: {cluster.how}"
    if never:
        types = "; ".join(
            f"{kind.name} ({_amounts({n: kind.resources.get(n, 0.0) for n in ('CPU', 'GPU')})})"
            f" x {'any' if kind.max_count < 0 else kind.max_count}"
            for kind in cluster.node_types)
        return f"not even the node types its autoscaler may add, at their maximum, can: {types}"
    return None


def placement_problem(config: CoreConfig, cluster: Cluster) -> tuple[Problem, str | None] | None:
    """What ``cluster``'s nodes cannot hold, for each combination of searched scaling values:
    one trial, or ``tune.max_concurrent_trials`` trials at once; with what makes it fatal
    (nothing can add a node that helps), None for a warning. The first fatal one, else the
    first; None when every trial fits."""
    variants = list(searched_variants(config, SCALING_KEYS))
    first = None
    for concurrent, shortfall in ((False, _shortfall), (True, _concurrency_shortfall)):
        for chosen, variant in variants:
            problem = shortfall(variant, cluster.nodes)
            if problem is None:
                continue
            fatal = _fatal(cluster, _never_fits(variant, cluster, concurrent))
            found = Problem(problem.key, f"{searched_note(chosen)}{problem.why}"), fatal
            if fatal is not None:
                return found
            first = first or found
    return first


def check_placement(config: CoreConfig, cluster: Cluster | None = None) -> Iterator[Problem]:
    """Every trial fits the running Ray's nodes, and so do ``tune.max_concurrent_trials`` of them
    at once, or an autoscaler can add nodes that hold them (else they would wait forever)."""
    cluster = cluster or read_cluster()
    found = placement_problem(config, cluster)
    if found is not None and found[1] is not None:
        problem, fatal = found
        advice = ("lower tune.max_concurrent_trials, or ask less per trial"
                  if problem.key == "tune.max_concurrent_trials"
                  else "ask for less, or run on a larger cluster (--address)")
        yield Problem(problem.key, f"{problem.why}, and {fatal}; {advice}")


def placement_warning(config: CoreConfig, cluster: Cluster | None = None) -> str | None:
    """The warning where trials wait for nodes that an autoscaler can (or might) add."""
    cluster = cluster or read_cluster()
    found = placement_problem(config, cluster)
    if found is None or found[1] is not None:
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
    "NodeType",
    "_autoscaling",
    "check_gpu_sharing",
    "check_placement",
    "data_cpus",
    "decoder_cpus",
    "fits",
    "node_groups_grow",
    "placement_problem",
    "placement_warning",
    "read_cluster",
    "readonly_autoscaler",
    "training_resources",
    "trial_bundles",
    "trial_demand",
    "trial_resources",
    "worker_resources",
]
