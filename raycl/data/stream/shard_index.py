"""A shard dataset's shards and their splits (see :mod:`raycl.data.stream.shards` for the layouts
and the split rule): :func:`list_shards` lists them with their sample counts, without reading a
sample, and :func:`split_shards` makes whole-shard splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raycl.config.training import DataConfig

ShardFormat = Literal["webdataset", "parquet"]


@dataclass(frozen=True)
class Shard:
    """One shard file of a split.

    Attributes:
        path: local path or bucket URI.
        count: samples it holds (as listed; a sample that cannot be decoded is skipped).
        offset: index, in its split, of its first sample.
    """

    path: str
    count: int
    offset: int


def list_shards(cfg: DataConfig, fmt: ShardFormat) -> list[Shard]:
    """Every shard of ``cfg.root`` sorted by name with its sample count (offsets over all of
    them; :func:`split_shards` re-bases them per split).

    Args:
        cfg: the data settings: ``root`` and (webdataset) ``samples_per_shard``.
        fmt: ``"webdataset"`` or ``"parquet"``.

    Returns:
        The shards, offsets counted from 0 over all of them. Listed once within a
        :func:`~raycl.data.listed_once.listed_once` scope, and once per node and launch in a
        Ray job (:mod:`raycl.data.stream.shard_manifest`).

    Raises:
        ValueError: no shard found, a shard named by the brace pattern or by sizes.json missing,
            no sample count for a shard (neither sizes.json, a _stats.json nor
            ``data.samples_per_shard``), or the bucket cannot be listed: one line naming
            ``data.root`` and what is wrong.
    """
    from raycl.data.stream.shard_listing import parquet_counts, webdataset_counts
    from raycl.data.stream.shard_manifest import listed_shards

    root = str(cfg.root or "")
    if not root:
        raise ValueError(f"dataset {fmt!r} needs data.root (a directory of shards, a shard "
                         f"file{' or a brace pattern' if fmt == 'webdataset' else ''})")
    per_shard = cfg.samples_per_shard
    # Once per launch's checks, and once per node for a launch's trials and workers.
    counts = listed_shards(root, fmt, per_shard, cfg.cache_dir,
                           lambda: webdataset_counts(root, per_shard) if fmt == "webdataset"
                           else parquet_counts(root))
    return _with_offsets(counts)


def _with_offsets(counts: list[tuple[str, int]]) -> list[Shard]:
    shards, offset = [], 0
    for path, count in counts:
        shards.append(Shard(path, int(count), offset))
        offset += int(count)
    return shards


def split_shards(
    shards: list[Shard], val_fraction: float, test_fraction: float
) -> dict[str, list[Shard]]:
    """``{"train", "val", "test"}`` shards (see the module docstring), offsets re-based per split.

    Args:
        shards: every shard (any order: they are sorted by path).
        val_fraction, test_fraction: the shares of the shards held out, each at least one.

    Returns:
        Train the first shards, validation the next, test the last; each split's offsets
        count from 0.

    Raises:
        ValueError: fewer than three shards (each split needs one), or the fractions leave no
            training shard.
    """
    ordered = sorted(shards, key=lambda shard: shard.path)
    total = len(ordered)
    if total < 3:
        raise ValueError(f"data.root: {total} shard(s), but training, validation and test each "
                         f"need a whole shard: at least 3")
    val = max(1, round(val_fraction * total))
    test = max(1, round(test_fraction * total))
    if total - val - test < 1:
        raise ValueError(f"data.root: {total} shards leave none for training after {val} for "
                         f"validation and {test} for test (data.val_fraction, "
                         f"data.test_fraction)")
    parts = {"train": ordered[:total - val - test], "val": ordered[total - val - test:total - test],
             "test": ordered[total - test:]}
    return {name: _with_offsets([(shard.path, shard.count) for shard in part])
            for name, part in parts.items()}


__all__ = ["Shard", "ShardFormat", "list_shards", "split_shards"]
