"""Where shards live: local paths or bucket URIs (``s3://``, ``gs://``) read through pyarrow's
file systems, for :mod:`raycl.data.shards`.

A bucket URI may carry a query (``s3://b/dir?endpoint_override=...``, as pyarrow's
``FileSystem.from_uri`` reads it): a shard's URI is the directory's with the shard's name
appended before the query, so every shard is opened with the same options.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import IO, Any

from raycl.data.streamed import is_remote, read_bytes

# WebDataset's brace pattern: dir/{00000..00099}.tar (the start's width is the names' width).
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def split_query(uri: str) -> tuple[str, str]:
    """``(path, query)`` of a local path or bucket URI (query without its ``?``; "" if none)."""
    if not is_remote(uri):
        return uri, ""
    path, _, query = uri.partition("?")
    return path, query


def child(directory: str, name: str) -> str:
    """The path or URI of file ``name`` in ``directory`` (a bucket URI keeps its query)."""
    path, query = split_query(directory)
    if not is_remote(directory):
        return str(Path(directory) / name)
    joined = f"{path.rstrip('/')}/{name}"
    return f"{joined}?{query}" if query else joined


def parent_and_name(path: str) -> tuple[str, str]:
    """The directory (path or URI, with its query) holding ``path``, and the file's name."""
    bare, query = split_query(path)
    if not is_remote(path):
        return str(Path(path).parent), Path(path).name
    directory, _, name = bare.rstrip("/").rpartition("/")
    return (f"{directory}?{query}" if query else directory), name


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


def _filesystem(uri: str) -> tuple[Any, str]:
    from pyarrow import fs

    return fs.FileSystem.from_uri(uri)


def kind(path: str) -> str:
    """``"file"``, ``"dir"`` or ``"missing"`` for a local path or bucket URI.

    Raises:
        OSError, ValueError: the bucket cannot be asked (no access, bad URI).
    """
    if not is_remote(path):
        local = Path(path)
        return "file" if local.is_file() else "dir" if local.is_dir() else "missing"
    from pyarrow import fs

    filesystem, inner = _filesystem(path)
    info = filesystem.get_file_info(inner)
    if info.type == fs.FileType.File:
        return "file"
    if info.type == fs.FileType.Directory:
        return "dir"
    # Some object stores answer NotFound for a "directory" prefix: listing tells.
    if info.type == fs.FileType.NotFound:
        selector = fs.FileSelector(inner, allow_not_found=True)
        return "dir" if filesystem.get_file_info(selector) else "missing"
    return "missing"


def list_files(directory: str) -> list[str]:
    """Names of the files directly in ``directory`` (a local directory or a bucket prefix).

    Raises:
        OSError, ValueError: it cannot be listed.
    """
    if not is_remote(directory):
        return sorted(entry.name for entry in Path(directory).iterdir() if entry.is_file())
    from pyarrow import fs

    filesystem, inner = _filesystem(directory)
    infos = filesystem.get_file_info(fs.FileSelector(inner, recursive=False))
    return sorted(info.base_name for info in infos if info.type == fs.FileType.File)


def read_text(path: str) -> str:
    """A small text file (sizes.json, a _stats.json), local or in a bucket.

    Raises:
        OSError: it cannot be read.
    """
    return read_bytes(path).decode("utf-8")


def open_stream(path: str) -> IO[bytes]:
    """A file opened for reading once from start to end (a tar shard).

    Raises:
        OSError: it cannot be opened.
    """
    if not is_remote(path):
        return open(path, "rb")  # the caller closes it
    try:
        filesystem, inner = _filesystem(path)
        return filesystem.open_input_stream(inner)
    except ValueError as error:  # pyarrow's ArrowInvalid: a malformed URI
        raise OSError(str(error)) from error


def open_random(path: str) -> Any:
    """A file opened for random access (a Parquet file: footer first): a local path as is, a
    bucket object as pyarrow's input file.

    Raises:
        OSError: it cannot be opened.
    """
    if not is_remote(path):
        return path
    try:
        filesystem, inner = _filesystem(path)
        return filesystem.open_input_file(inner)
    except ValueError as error:
        raise OSError(str(error)) from error


__all__ = ["child", "expand_braces", "kind", "list_files", "open_random", "open_stream",
           "parent_and_name", "read_text", "split_query"]
