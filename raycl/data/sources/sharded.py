"""The readers of ``data.dataset: webdataset`` and ``data.dataset: parquet``: samples packed in
shards (:mod:`raycl.data.stream.shards`), streamed only (``data.loader: stream``).

Nothing is cached: :meth:`ShardReader.read` refuses, and :func:`shard_splits` gives the splits
as whole shards, each split's images a lazy :class:`~raycl.data.stream.shards.ShardRows`. The checks
list the shards (and read their counts) without reading a sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.bucket_paths import is_remote
from raycl.data.stream.shard_captions import ShardCaptions
from raycl.data.stream.shards import ShardFormat, ShardRows, list_shards, split_shards
from raycl.data.types import DatasetSplits, ImageSet, root_problem


class ShardReader:
    """A :class:`~raycl.data.types.Reader` of shards of one format; unlabelled, so its one
    "class" holds every sample."""

    def __init__(self, fmt: ShardFormat) -> None:
        self.fmt = fmt

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        root = str(cfg.root)
        shards = list_shards(cfg, self.fmt)
        return {"root": root if is_remote(root) else str(Path(root).resolve()),
                "shards": [[shard.path.rsplit("/", 1)[-1], shard.count] for shard in shards]}

    def read(self, cfg: DataConfig, seed: int) -> ImageSet:
        raise ValueError(f"data.dataset: {self.fmt} is streamed only; set data.loader: stream "
                         f"(or auto)")

    def check(self, cfg: DataConfig) -> Problem | None:
        """The shards list, each with its sample count, and make a split each."""
        try:
            split_shards(list_shards(cfg, self.fmt), float(cfg.val_fraction),
                         float(cfg.test_fraction))
        except (OSError, ValueError) as error:
            return root_problem(error)
        return None

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        return {"all": [sum(shard.count for shard in list_shards(cfg, self.fmt))]}

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        """Samples of each split as listed: whole shards (:func:`shard_split_sizes`)."""
        return shard_split_sizes(cfg)


WEBDATASET_READER = ShardReader("webdataset")
PARQUET_READER = ShardReader("parquet")


def _format(cfg: DataConfig) -> ShardFormat:
    if cfg.dataset not in ("webdataset", "parquet"):
        raise ValueError(f"data.dataset: {cfg.dataset!r} is not read from shards (webdataset, "
                         f"parquet)")
    return cfg.dataset


def shard_split_sizes(cfg: DataConfig) -> dict[str, int]:
    """Samples of each split as listed (``{"train", "val", "test"}``), without reading one: the
    shard datasets' answer to :func:`raycl.data.load.split_sizes_for` (their splits are whole
    shards, not random shares).

    Raises:
        ValueError: see :func:`~raycl.data.stream.shards.list_shards` and
            :func:`~raycl.data.stream.shards.split_shards`.
    """
    splits = split_shards(list_shards(cfg, _format(cfg)), float(cfg.val_fraction),
                          float(cfg.test_fraction))
    return {name: sum(shard.count for shard in shards) for name, shards in splits.items()}


def shard_splits(cfg: DataConfig, seed: int) -> DatasetSplits:
    """The splits of a shard dataset: whole shards (see :mod:`raycl.data.stream.shards`), images
    lazy.

    Args:
        cfg: the data settings (dataset, root, samples_per_shard, val_fraction, test_fraction,
            resolution).
        seed: unused (the split is by shard name); kept for load_dataset's signature.

    Returns:
        DatasetSplits whose splits' images are :class:`~raycl.data.stream.shards.ShardRows`; no
        labels;
        training captions None (they stream with the samples), validation and test captions
        a :class:`~raycl.data.stream.shard_captions.ShardCaptions`, read (text only) by the
        rank that scores them when it first does: no shard is opened here.

    Raises:
        ValueError: see :func:`~raycl.data.stream.shards.list_shards` and
            :func:`~raycl.data.stream.shards.split_shards`.
    """
    fmt = _format(cfg)
    resolution = int(cfg.resolution)
    splits = split_shards(list_shards(cfg, fmt), float(cfg.val_fraction),
                          float(cfg.test_fraction))

    def image_set(name: str) -> ImageSet:
        shards = splits[name]
        # Held-out captions: read when scored, by the scoring rank only (never by every worker).
        captions = None if name == "train" else ShardCaptions(
            [(shard.path, shard.count) for shard in shards], fmt)
        return ImageSet(images=ShardRows(shards, fmt, resolution), labels={},
                        captions=captions)  # type: ignore[arg-type]

    return DatasetSplits(name=fmt, train=image_set("train"), val=image_set("val"),
                         test=image_set("test"), attributes=[], num_classes={}, channels=3,
                         resolution=resolution)


__all__ = ["PARQUET_READER", "WEBDATASET_READER", "ShardReader", "shard_split_sizes",
           "shard_splits"]
