"""Which datasets stream (``data.loader: stream``) and what ``data.loader: auto`` picks; the
loading itself is :func:`raycl.data.load.load_streamed`. In stream mode nothing is decoded up
front.

Image files (a folder, ImageNet's wnid folders, a pairs file) are listed by their readers as in
memory mode (:class:`~raycl.data.types.ImageFiles`) and split the same way, for the same seed,
into the same rows; each split's images are then a :class:`~raycl.data.streamed.FileRows`
instead of a view into the decoded cache. Shards (webdataset, parquet) are split by whole shards
(:mod:`raycl.data.shard_sources`). Sources that are arrays in the first place (Trifeature,
CIFAR, STL-10, the packaged MNIST sets) have nothing to stream: the config check refuses them.
"""

from __future__ import annotations

from typing import Any

from raycl.data.registry import CHANNELS, reader
from raycl.data.streamed import decoded_bytes

# The sources whose samples are packed in shards, read in sequence.
SHARD_DATASETS: tuple[str, ...] = ("webdataset", "parquet")


def streams_files(dataset: str) -> bool:
    """Whether ``dataset`` can be streamed: its reader lists image files, or it is sharded."""
    return dataset in SHARD_DATASETS or dataset in ("folder", "pairs", "imagenet", "imagenet100")


def choose_loader(cfg: Any, node_memory: float) -> tuple[str, str]:
    """What ``data.loader: auto`` means for this dataset on nodes of ``node_memory`` bytes:
    ``("memory" | "stream", why)``. Memory when the decoded set (images x channels x
    resolution^2) takes at most ``data.memory_share`` of a node's memory; shards always stream,
    array sources never do. A set or explicit choice is returned as it is.
    """
    if cfg.loader != "auto":
        return cfg.loader, "set in the config"
    if cfg.dataset in SHARD_DATASETS:
        return "stream", f"{cfg.dataset} is streamed only"
    if not streams_files(cfg.dataset):
        return "memory", f"{cfg.dataset} is read whole"
    count = sum(sum(part) for part in reader(cfg.dataset).class_counts(cfg).values())
    size = decoded_bytes(count, int(cfg.resolution), CHANNELS.get(cfg.dataset, 3))
    limit = float(cfg.memory_share) * node_memory
    choice = "memory" if size <= limit else "stream"
    return choice, (f"{count} images decoded at {cfg.resolution} px take {size / 1e9:.1f} GB, "
                    f"{'within' if choice == 'memory' else 'over'} data.memory_share "
                    f"({cfg.memory_share:g}) of the smallest node's {node_memory / 1e9:.1f} GB")


__all__ = ["SHARD_DATASETS", "choose_loader", "streams_files"]
