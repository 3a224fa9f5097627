"""Finding a dataset's shards and their sample counts without reading a sample, for
:func:`raycl.data.stream.shards.list_shards` (see :mod:`raycl.data.stream.shards` for the layouts).

The root is walked as a :class:`pathlib.Path` or a :class:`~raycl.data.bucket_paths.BucketPath`
(:func:`~raycl.data.bucket_paths.root_path`); the shard paths handed on are strings: a local
path, or a bucket URI with the root's query (``s3://b/dir/00000.tar?endpoint_override=...``),
so every shard is opened with the root's options. Every error is one line naming
``data.root``: a config check shows it before launch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

from raycl.data.bucket_paths import BucketPath, is_remote, open_random, read_bytes, root_path
from raycl.data.stream.shard_samples import CAPTION_COLUMNS, IMAGE_COLUMNS, parquet_columns

SIZES_FILE = "sizes.json"
# WebDataset's brace pattern: dir/{00000..00099}.tar (the start's width is the names' width).
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
# A local directory or file, or one in a bucket.
Listed = Path | BucketPath


def expand_braces(pattern: str) -> list[str] | None:
    """The names a brace pattern stands for (``{00000..00002}.tar`` -> ``00000.tar``,
    ``00001.tar``, ``00002.tar``), or None when ``pattern`` has no brace range.

    Raises:
        ValueError: the range runs backwards (one line naming data.root).
    """
    match = _BRACE.search(pattern)
    if match is None:
        return None
    first, last = match.group(1), match.group(2)
    if int(last) < int(first):
        raise ValueError(f"data.root: the brace range {{{first}..{last}}} runs backwards")
    width = len(first)
    return [pattern[:match.start()] + str(number).zfill(width) + pattern[match.end():]
            for number in range(int(first), int(last) + 1)]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _cannot_list(root: str, error: BaseException) -> ValueError:
    # A BucketPath's ValueError already reads "cannot list URI: why": its cause is the why.
    if isinstance(error, ValueError) and error.__cause__ is not None:
        error = error.__cause__
    return ValueError(f"data.root: cannot list {root!r}: {_first_line(error)}")


def _opened(root: str) -> Listed:
    """``root`` (a shard, a directory, or a brace pattern's first shard) as walked."""
    try:
        return root_path(root)
    except ValueError as error:  # a URI pyarrow cannot open
        raise _cannot_list(root, error) from error


def _listing(directory: Listed, root: str) -> set[str]:
    """Names of the files directly in ``directory``."""
    try:
        return {entry.name for entry in directory.iterdir() if entry.is_file()}
    except (OSError, ValueError) as error:
        raise _cannot_list(root, error) from error


def _files(path: Listed, root: str, suffix: str) -> tuple[Listed, set[str], list[Listed]]:
    """``(directory, names of the files there, shards)`` of a file or directory root (``path``
    is ``root`` opened; a file root is its own one shard)."""
    try:
        # A directory first: on a bucket that one listing also gives the names.
        is_dir = path.is_dir()
        is_file = not is_dir and path.is_file()
    except (OSError, ValueError) as error:
        raise _cannot_list(root, error) from error
    if is_file:
        return path.parent, _listing(path.parent, root), [path]
    if not is_dir:
        raise ValueError(f"data.root: {root!r} does not exist")
    names = _listing(path, root)
    shards = [path / name for name in sorted(names) if name.lower().endswith(suffix)]
    if not shards:
        raise ValueError(f"data.root: no {suffix} file in {root!r}")
    return path, names, shards


def _brace_shards(root: str) -> tuple[Listed, list[str]] | None:
    """The directory of a brace pattern's shards and their names, or None when ``root`` has no
    brace range. The range is in the file name (``dir/{00000..00099}.tar``); the directory is
    opened from the first shard's path (a URI with braces is no URI pyarrow reads)."""
    pattern = expand_braces(root)
    if pattern is None:
        return None
    directory = _opened(pattern[0]).parent
    bare = root.partition("?")[0] if is_remote(root) else root  # a URI's query follows the name
    names = expand_braces(PurePosixPath(bare).name)
    if names is None:
        raise ValueError(f"data.root: the brace range of {root!r} must be in the shards' file "
                         f"name")
    return directory, names


def _json(path: Listed) -> Any:
    try:
        return json.loads(read_bytes(path).decode("utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"data.root: cannot read {str(path)!r}: {_first_line(error)}") \
            from error


def _sizes(directory: Listed, names: set[str], check_all: bool) -> dict[str, int] | None:
    """sizes.json of ``directory`` as ``{shard file name: count}`` (None: there is none); with
    ``check_all``, every shard it names must be there."""
    if SIZES_FILE not in names:
        return None
    path = directory / SIZES_FILE
    sizes = _json(path)
    if not isinstance(sizes, dict) or not all(isinstance(count, int) for count in sizes.values()):
        raise ValueError(f"data.root: {str(path)!r} is not {{shard file name: sample count}}")
    missing = sorted(name for name in sizes if name not in names) if check_all else []
    if missing:
        raise ValueError(f"data.root: shard {str(directory / missing[0])!r} named by "
                         f"{SIZES_FILE} not found ({len(missing)} missing)")
    return sizes


def _count(shard: Listed, names: set[str], sizes: dict[str, int] | None,
           per_shard: int | None) -> int:
    """A tar shard's samples: sizes.json, else img2dataset's ``<stem>_stats.json``, else
    ``data.samples_per_shard``."""
    if sizes is not None and shard.name in sizes:
        return int(sizes[shard.name])
    stats_name = f"{shard.name.rsplit('.', 1)[0]}_stats.json"
    if stats_name in names:
        stats_path = shard.parent / stats_name
        stats = _json(stats_path)
        if not isinstance(stats, dict) or not isinstance(stats.get("successes"), int):
            raise ValueError(f"data.root: {str(stats_path)!r} has no 'successes' count")
        return int(stats["successes"])
    if per_shard:
        return int(per_shard)
    raise ValueError(f"data.root: no sample count for shard {str(shard)!r}: put {SIZES_FILE} "
                     f"({{shard file name: count}}) beside the shards, keep img2dataset's "
                     f"{stats_name}, or set data.samples_per_shard")


def webdataset_counts(root: str, per_shard: int | None) -> list[tuple[str, int]]:
    """``(shard path, samples)`` of every tar shard of ``root``, sorted by name.

    Raises:
        ValueError: see :func:`raycl.data.stream.shards.list_shards`.
    """
    braced = _brace_shards(root)
    if braced is not None:
        directory, wanted = braced
        names = _listing(directory, root)
        shards = [directory / name for name in sorted(wanted)]
        for shard in shards:
            if shard.name not in names:
                raise ValueError(f"data.root: shard {str(shard)!r} (from the brace pattern) not "
                                 f"found")
        sizes = _sizes(directory, names, check_all=False)
    else:
        path = _opened(root)
        directory, names, shards = _files(path, root, ".tar")
        # A single shard named as the root needs no sizes.json entry for its neighbours.
        sizes = _sizes(directory, names, check_all=shards != [path])
    return [(str(shard), _count(shard, names, sizes, per_shard)) for shard in shards]


def parquet_counts(root: str) -> list[tuple[str, int]]:
    """``(file path, rows)`` of every Parquet file of ``root``, sorted by name, from the files'
    metadata (their footers; no row is read).

    Raises:
        ValueError: see :func:`raycl.data.stream.shards.list_shards`; also a file without an image
            column.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, _, shards = _files(_opened(root), root, ".parquet")
    counts = []
    for shard in shards:
        path, source = str(shard), None
        try:
            source = open_random(shard)
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
