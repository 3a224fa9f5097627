"""Finding a dataset's shards and their sample counts without reading a sample, for
:func:`raycl.data.shards.list_shards` (see :mod:`raycl.data.shards` for the layouts).

Every error is one line naming ``data.root``: a config check shows it before launch.
"""

from __future__ import annotations

import json
from typing import Any

from raycl.data.shard_files import (
    child,
    expand_braces,
    kind,
    list_files,
    open_random,
    parent_and_name,
    read_text,
)
from raycl.data.shard_samples import CAPTION_COLUMNS, IMAGE_COLUMNS, parquet_columns

SIZES_FILE = "sizes.json"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _kind(path: str) -> str:
    try:
        return kind(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"data.root: cannot list {path!r}: {_first_line(error)}") from error


def _listing(directory: str, root: str) -> set[str]:
    try:
        return set(list_files(directory))
    except (OSError, ValueError) as error:
        raise ValueError(f"data.root: cannot list {root!r}: {_first_line(error)}") from error


def _files(root: str, suffix: str) -> tuple[str, set[str], list[str]]:
    """``(directory, names of the files there, shard paths)`` of a file or directory root."""
    what = _kind(root)
    if what == "missing":
        raise ValueError(f"data.root: {root!r} does not exist")
    if what == "file":
        directory, _ = parent_and_name(root)
        return directory, _listing(directory, root), [root]
    names = _listing(root, root)
    paths = [child(root, name) for name in sorted(names) if name.lower().endswith(suffix)]
    if not paths:
        raise ValueError(f"data.root: no {suffix} file in {root!r}")
    return root, names, paths


def _json(path: str) -> Any:
    try:
        return json.loads(read_text(path))
    except (OSError, ValueError) as error:
        raise ValueError(f"data.root: cannot read {path!r}: {_first_line(error)}") from error


def _sizes(directory: str, names: set[str], check_all: bool) -> dict[str, int] | None:
    """sizes.json of ``directory`` as ``{shard file name: count}`` (None: there is none); with
    ``check_all``, every shard it names must be there."""
    if SIZES_FILE not in names:
        return None
    path = child(directory, SIZES_FILE)
    sizes = _json(path)
    if not isinstance(sizes, dict) or not all(isinstance(count, int) for count in sizes.values()):
        raise ValueError(f"data.root: {path!r} is not {{shard file name: sample count}}")
    missing = sorted(name for name in sizes if name not in names) if check_all else []
    if missing:
        raise ValueError(f"data.root: shard {child(directory, missing[0])!r} named by "
                         f"{SIZES_FILE} not found ({len(missing)} missing)")
    return sizes


def _count(path: str, names: set[str], sizes: dict[str, int] | None,
           per_shard: int | None) -> int:
    """A tar shard's samples: sizes.json, else img2dataset's ``<stem>_stats.json``, else
    ``data.samples_per_shard``."""
    directory, name = parent_and_name(path)
    if sizes is not None and name in sizes:
        return int(sizes[name])
    stats_name = f"{name.rsplit('.', 1)[0]}_stats.json"
    if stats_name in names:
        stats_path = child(directory, stats_name)
        stats = _json(stats_path)
        if not isinstance(stats, dict) or not isinstance(stats.get("successes"), int):
            raise ValueError(f"data.root: {stats_path!r} has no 'successes' count")
        return int(stats["successes"])
    if per_shard:
        return int(per_shard)
    raise ValueError(f"data.root: no sample count for shard {path!r}: put {SIZES_FILE} "
                     f"({{shard file name: count}}) beside the shards, keep img2dataset's "
                     f"{stats_name}, or set data.samples_per_shard")


def webdataset_counts(root: str, per_shard: int | None) -> list[tuple[str, int]]:
    """``(shard path, samples)`` of every tar shard of ``root``, sorted by name.

    Raises:
        ValueError: see :func:`raycl.data.shards.list_shards`.
    """
    pattern = expand_braces(root)
    if pattern is not None:
        directory, _ = parent_and_name(pattern[0])
        names = _listing(directory, root)
        for path in pattern:
            if parent_and_name(path)[1] not in names:
                raise ValueError(f"data.root: shard {path!r} (from the brace pattern) not "
                                 f"found")
        paths = sorted(pattern)
        sizes = _sizes(directory, names, check_all=False)
    else:
        directory, names, paths = _files(root, ".tar")
        sizes = _sizes(directory, names, check_all=len(paths) > 1 or paths[0] != root)
    return [(path, _count(path, names, sizes, per_shard)) for path in paths]


def parquet_counts(root: str) -> list[tuple[str, int]]:
    """``(file path, rows)`` of every Parquet file of ``root``, sorted by name, from the files'
    metadata (their footers; no row is read).

    Raises:
        ValueError: see :func:`raycl.data.shards.list_shards`; also a file without an image
            column.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, _, paths = _files(root, ".parquet")
    counts = []
    for path in paths:
        source = None
        try:
            source = open_random(path)
            parquet = pq.ParquetFile(source)
            rows, columns = parquet.metadata.num_rows, parquet.schema_arrow.names
        except (OSError, ValueError, pa.ArrowException) as error:
            raise ValueError(f"data.root: cannot read {path!r}: {_first_line(error)}") from error
        finally:
            if source is not None and hasattr(source, "close"):
                source.close()
        if parquet_columns(columns)[0] is None:
            raise ValueError(f"data.root: {path!r} has no image column ({', '.join(IMAGE_COLUMNS)}"
                             f"); its columns: {', '.join(columns)}")
        counts.append((path, int(rows)))
    return counts


__all__ = ["CAPTION_COLUMNS", "SIZES_FILE", "parquet_counts", "webdataset_counts"]
