"""The running Ray as the launch sees it: its alive nodes, the node types an autoscaler may add,
and whether it can add any; and which of those nodes can run a trial (``data.loader: auto``
decides on their memory, not on a ``CPU: 0`` head's).

Ray 2.60 has no public API for the autoscaler's side; everything private raycl reads about it
is here (:func:`_autoscaling`, :func:`_node_types`), each piece what one of Ray's own components
reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from raycl.config.schema import CoreConfig
from raycl.launch.reservations import copies, training_resources


@dataclass(frozen=True)
class NodeType:
    """A node group an autoscaler reported (a cluster config's node type).

    Attributes:
        name: the node type's name (``gpu``, ``ray.head.default``).
        resources: what one node of it has (CPU, GPU, memory in bytes, custom resources).
        max_count: at most this many nodes of it; -1: no bound.
    """

    name: str
    resources: dict[str, float]
    max_count: int


@dataclass(frozen=True)
class Cluster:
    """What trials are placed on.

    Attributes:
        nodes: each alive node's total resources (CPU, GPU, ...).
        can_add_nodes: True where an autoscaler can add nodes, False where nothing can, None
            where it cannot be told.
        how: how that was told, for the messages.
        node_types: the node types an autoscaler reported (empty where none did, or it could
            not be read): what it may add.
    """

    nodes: tuple[dict[str, float], ...]
    can_add_nodes: bool | None
    how: str
    node_types: tuple[NodeType, ...] = ()


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


def _node_types() -> tuple[NodeType, ...]:
    """The node groups an autoscaler reported to the GCS
    (``ray._private.state.state.get_cluster_config()``, what Ray Train V2's fail-fast check and
    Ray Data's autoscaler read); empty where none did or the private API moved."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
        if config is None:
            return ()
        return tuple(NodeType(group.name, {name: float(amount)
                                           for name, amount in group.resources.items()},
                              int(group.max_count))
                     for group in config.node_group_configs if group.resources)
    except Exception:  # a private API changed: no node types known
        return ()


def _autoscaling(alive: int) -> tuple[bool | None, str]:
    """Whether an autoscaler can add nodes to the Ray this process uses (``alive`` nodes now),
    and how that was told.

    - ``ray._private.worker._global_node.head``: this process started the Ray it uses
      (``ray.init()`` found no cluster to join, as ``python -m raycl.tune`` on a workstation):
      a local Ray has no autoscaler, for certain.
    - ``ray._private.state.state.get_cluster_config()``: the node groups an autoscaler reported
      to the GCS.
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
    """The running Ray's alive nodes, the node types its autoscaler may add, and whether it can
    add any (Ray is started)."""
    import ray

    nodes = tuple({name: float(amount) for name, amount in node["Resources"].items()}
                  for node in ray.nodes() if node.get("Alive"))
    can_add_nodes, how = _autoscaling(len(nodes))
    return Cluster(nodes, can_add_nodes, how, _node_types() if can_add_nodes is not False else ())


def trial_node_memory(config: CoreConfig, cluster: Cluster) -> float | None:
    """Bytes of Ray ``memory`` of the smallest node that can run a piece of a trial (one Ray
    Train worker's training bundle, GPUs included; the trial process's when it trains itself):
    the alive ones, else the node types an autoscaler may add (a ``CPU: 0`` head is often the
    only node at launch), else every alive node. None when none of them reports memory."""
    needed = training_resources(config)  # decoders aside: the loader is not settled yet
    sizes = [node.get("memory", 0.0) for node in cluster.nodes if copies(node, needed) >= 1]
    if not any(sizes):
        sizes = [kind.resources.get("memory", 0.0) for kind in cluster.node_types
                 if copies(kind.resources, needed) >= 1]
    if not any(sizes):
        sizes = [node.get("memory", 0.0) for node in cluster.nodes]
    known = [size for size in sizes if size > 0]
    return min(known) if known else None


def smallest_node_memory(config: CoreConfig) -> float:
    """:func:`trial_node_memory` of the running Ray, or this machine's memory when no node
    reports any (Ray is started)."""
    memory = trial_node_memory(config, read_cluster())
    if memory is not None:
        return memory
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


__all__ = ["Cluster", "NodeType", "node_groups_grow", "read_cluster", "readonly_autoscaler",
           "smallest_node_memory", "trial_node_memory"]
