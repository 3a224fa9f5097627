"""``tune.max_concurrent_trials`` trials packed onto a cluster's nodes, bundle by bundle, before
launch.

Tune admits a trial once its own bundle (the trial process, :func:`raycl.launch.reservations
.trial_resources`) is placed; under Ray Train V2 the trial then asks for its worker group's
placement group, and one that cannot be placed is retried every 60 s for as long as the trial
lives, holding a slot of ``tune.max_concurrent_trials`` while nothing trains. So trials that
can never all run at once (in memory mode too: ``cpus_per_worker: 8`` x 2 workers x 4 trials
plus the trial processes' CPUs on a 64-CPU node) are found here, on the alive nodes and on the
largest cluster an autoscaler may grow to.

The packing imitates Ray: each worker group with Ray Train's ``PACK`` strategy (one node when
one holds it, the fullest such node; else bundle by bundle on the fullest node with room), the
trial processes afterwards where they take nothing a worker could use. It is greedy, so it may
miss a placement an exhaustive search would find; both verdicts it feeds (a warning where an
autoscaler may help, an error where it cannot) read the largest cluster optimistically.
"""

from __future__ import annotations

from dataclasses import dataclass

from raycl.launch.ray_nodes import Cluster
from raycl.launch.reservations import copies

# Nodes assumed of a node type with no upper bound (max_count -1): more than any packing uses.
UNBOUNDED = 1024


@dataclass(frozen=True)
class Placed:
    """One bundle of one trial, placed on a node.

    Attributes:
        trial: the trial's number (0 for the first of the concurrent ones).
        part: ``trial process`` or ``worker <rank>``.
        resources: the bundle.
    """

    trial: int
    part: str
    resources: dict[str, float]


def _take(free: dict[str, float], bundle: dict[str, float]) -> None:
    for name, amount in bundle.items():
        free[name] = free.get(name, 0.0) - amount


def _fullest(free: list[dict[str, float]], bundle: dict[str, float], at_least: int) -> int | None:
    """The node with room for ``at_least`` copies of ``bundle`` and the fewest copies left
    (best fit: larger nodes stay free for larger groups); None when none has room."""
    fitting = [i for i, node in enumerate(free) if copies(node, bundle) >= at_least]
    return min(fitting, key=lambda i: (copies(free[i], bundle), i)) if fitting else None


def _place_group(free: list[dict[str, float]], placed: list[list[Placed]], trial: int,
                 worker: dict[str, float], workers: int) -> bool:
    """One trial's worker group, Ray Train's ``PACK``: one node when one holds all of it, else
    bundle by bundle; False when a bundle finds no room."""
    whole = _fullest(free, worker, workers)
    for rank in range(workers):
        node = whole if whole is not None else _fullest(free, worker, 1)
        if node is None:
            return False
        _take(free[node], worker)
        placed[node].append(Placed(trial, f"worker {rank}", dict(worker)))
    return True


def _process_node(free: list[dict[str, float]], trial: dict[str, float],
                  worker: dict[str, float]) -> int | None:
    """Where a trial process goes: a node with room, preferring one where it takes no room a
    worker bundle could use (a ``CPU: 0`` head has none, a CPU node is best)."""
    fitting = [i for i, node in enumerate(free) if copies(node, trial) >= 1]

    def harm(i: int) -> tuple[int, int]:
        after = dict(free[i])
        _take(after, trial)
        return (copies(free[i], worker) - copies(after, worker) if worker else 0, i)

    return min(fitting, key=harm) if fitting else None


def pack_trials(nodes: tuple[dict[str, float], ...], trial: dict[str, float],
                worker: dict[str, float], workers: int,
                count: int) -> list[list[Placed]] | None:
    """``count`` trials, each a ``trial`` bundle and ``workers`` bundles of ``worker``, placed at
    once on ``nodes``: the bundles on each node, in node order; None when they do not fit.
    Worker groups go first (they are the large bundles), then the trial processes."""
    free = [dict(node) for node in nodes]
    placed: list[list[Placed]] = [[] for _ in nodes]
    for number in range(count):
        if workers and not _place_group(free, placed, number, worker, workers):
            return None
    for number in range(count):
        node = _process_node(free, trial, worker if workers else {})
        if node is None:
            return None
        _take(free[node], trial)
        placed[node].append(Placed(number, "trial process", dict(trial)))
    return placed


def trials_at_once(nodes: tuple[dict[str, float], ...], trial: dict[str, float],
                   worker: dict[str, float], workers: int, most: int) -> int:
    """How many such trials (up to ``most``) ``nodes`` hold at once."""
    held = 0
    while held < most and pack_trials(nodes, trial, worker, workers, held + 1) is not None:
        held += 1
    return held


def largest_nodes(cluster: Cluster, enough: int) -> tuple[dict[str, float], ...] | None:
    """The nodes of the largest cluster ``cluster``'s autoscaler may grow to: the alive nodes
    and every node type at its maximum (``enough`` nodes of an unbounded one). Optimistic (an
    alive node of a type counts twice); None when no node type is known."""
    if not cluster.node_types:
        return None
    added = []
    for kind in cluster.node_types:
        count = min(enough, UNBOUNDED) if kind.max_count < 0 else kind.max_count
        added += [dict(kind.resources) for _ in range(count)]
    return (*cluster.nodes, *added)


def bundles_per_node(placed: list[list[Placed]]) -> list[list[dict[str, float]]]:
    """Just the bundles of :func:`pack_trials`' answer, node by node (for the tests and the
    docs' arithmetic)."""
    return [[bundle.resources for bundle in node] for node in placed]


__all__ = ["UNBOUNDED", "Placed", "bundles_per_node", "largest_nodes", "pack_trials",
           "trials_at_once"]
