"""The one place that reads "a local path or a bucket URI" (``s3://``, ``gs://``, ``hdfs://``):
:func:`is_remote` tells them apart, :func:`root_path` opens a root as a :class:`pathlib.Path` or a
:class:`BucketPath`, and :func:`read_bytes`, :func:`open_stream` and :func:`open_random` read a
file of either kind. The folder and ImageNet readers (:mod:`raycl.data.sources.folders`,
:mod:`raycl.data.sources.imagenet`) and the shard listing (:mod:`raycl.data.stream.shard_listing`)
walk a
bucket through the same code as a directory.

:class:`BucketPath` has the few methods of :class:`pathlib.Path` those readers use (``is_dir``,
``is_file``, ``iterdir``, ``/``, ``name``, ``parent``, ``suffix``, ``stat``, ``relative_to``),
backed by :mod:`pyarrow.fs`. A folder is listed once (one ``ListObjects`` per 1000 entries on
S3) and what the listing says of each entry (folder or file, size, modification time) is kept:
asking ``is_dir`` of a listed entry, or the size of a listed file, makes no request.
``str(path)`` is the entry's URI with the root's query (``?endpoint_override=...&scheme=http``),
so that :func:`read_bytes` opens it as the root was opened; credentials come from the
environment as the AWS/GCS SDKs read them (``AWS_ENDPOINT_URL`` is honoured too).

One file system client per bucket and process (:func:`bucket_filesystem`): opening one
(``fs.FileSystem.from_uri``) costs about 10 ms of CPU, a connection and a credential lookup, so
every object of a bucket is read through the client its first URI opened. Reads and listings
are retried with exponential back-off while the store says the failure is transient
(:func:`is_transient`: a connection refused, reset or timed out, HTTP 5xx, S3's ``SlowDown``);
anything else (missing, denied, corrupt) is raised at once.
"""

from __future__ import annotations

import logging
import os
import posixpath
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO, Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

from pyarrow import fs

logger = logging.getLogger(__name__)

T = TypeVar("T")

# URI schemes read through pyarrow's file systems (local paths are opened directly).
REMOTE_SCHEMES: tuple[str, ...] = ("s3://", "gs://", "gcs://", "hdfs://")
# Attempts of a bucket read or listing that fails transiently, and the first back-off (doubled
# after each failure, with up to 25 % jitter so that many readers do not retry in step).
READ_ATTEMPTS = 5
FIRST_BACKOFF_S = 0.5
# What pyarrow (AWS/GCS SDKs, curl) says of a failure that waiting may cure: throttling,
# server errors, connections refused, reset or timed out.
_TRANSIENT = re.compile(
    r"AWS Error (SLOW_DOWN|INTERNAL_FAILURE|SERVICE_UNAVAILABLE|NETWORK_CONNECTION|"
    r"REQUEST_TIMEOUT|THROTTLING)|HTTP status (5\d\d|408|429)|SlowDown|Service Unavailable|"
    r"Connection refused|Could not connect|Connection reset|Broken pipe|timed out|"
    r"Timeout was reached|curlCode: (6|7|28|35|52|55|56)\b", re.IGNORECASE)


def is_remote(path: str | Path | BucketPath) -> bool:
    """Whether ``path`` is a bucket URI (or a :class:`BucketPath`) rather than a local path."""
    return str(path).startswith(REMOTE_SCHEMES)


class BucketStat(NamedTuple):
    """What a listing says of a file: the fields of ``os.stat_result`` the readers use."""

    st_size: int
    st_mtime_ns: int


def _cannot_list(uri: str, error: Exception) -> ValueError:
    """The one-line error for a bucket folder that cannot be read (no bucket, no permission,
    no connection): the first line of the storage library's message says why. The config key
    is not in it: the pre-launch check names the key that holds the root (``data.root``, or a
    transfer entry's), as for every reader's error."""
    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ValueError(f"cannot list {uri!r}: {why}")


class BucketPath:
    """A folder or file in a bucket, as the readers of image folders walk it.

    Args:
        filesystem: the pyarrow file system the root URI opened.
        prefix: what the root URI has before ``inner`` (``s3://``; ``hdfs://host:port``).
        inner: the path inside the file system (``bucket/key``), without a trailing slash.
        query: the root URI's query (without ``?``), repeated on every entry's URI.
        info: what a listing found about this entry, or None (asked when needed).
        listings: folder listings already made, shared by every entry under one root.
    """

    def __init__(self, filesystem: fs.FileSystem, prefix: str, inner: str, query: str = "",
                 info: fs.FileInfo | None = None,
                 listings: dict[str, list[fs.FileInfo] | None] | None = None) -> None:
        self.filesystem = filesystem
        self.prefix = prefix
        self.inner = inner.rstrip("/")
        self.query = query
        self._info = info
        self._listings = {} if listings is None else listings

    @classmethod
    def open(cls, uri: str) -> BucketPath:
        """The folder (or file) ``uri`` names.

        Raises:
            ValueError: the URI names no file system pyarrow can open (one line).
        """
        location, _, query = uri.partition("?")
        try:
            filesystem, inner = bucket_filesystem(uri)
        except (OSError, ValueError) as error:
            raise _cannot_list(uri, error) from error
        location, inner = location.rstrip("/"), inner.rstrip("/")
        # The URI's text before the inner path: entries' URIs keep the root's host and port.
        prefix = (location[:-len(inner)] if inner and location.endswith(inner)
                  else f"{location.partition('://')[0]}://")
        return cls(filesystem, prefix, inner, query)

    def __str__(self) -> str:
        return f"{self.prefix}{self.inner}" + (f"?{self.query}" if self.query else "")

    def __repr__(self) -> str:
        return f"BucketPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketPath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: BucketPath) -> bool:
        return self.inner < other.inner

    def __truediv__(self, name: str) -> BucketPath:
        return BucketPath(self.filesystem, self.prefix, f"{self.inner}/{name}", self.query,
                          listings=self._listings)

    @property
    def name(self) -> str:
        return posixpath.basename(self.inner)

    @property
    def parent(self) -> BucketPath:
        """The folder holding this entry, under the same root (its query, its listings)."""
        return BucketPath(self.filesystem, self.prefix, posixpath.dirname(self.inner),
                          self.query, listings=self._listings)

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.inner).suffix

    def _listing(self) -> list[fs.FileInfo] | None:
        """This folder's entries (listed once per root), or None when it is not a folder.

        Raises:
            ValueError: the folder cannot be listed for another reason than not existing.
        """
        if self.inner not in self._listings:
            try:
                infos = with_read_retries(lambda: self.filesystem.get_file_info(
                    fs.FileSelector(self.inner, recursive=False)), str(self))
            except (FileNotFoundError, NotADirectoryError):
                infos = None
            except OSError as error:
                raise _cannot_list(str(self), error) from error
            self._listings[self.inner] = sorted(infos, key=lambda info: info.path) \
                if infos is not None else None
        return self._listings[self.inner]

    def _file_info(self) -> fs.FileInfo:
        if self._info is None:
            try:
                self._info = with_read_retries(
                    lambda: self.filesystem.get_file_info(self.inner), str(self))
            except OSError as error:
                raise _cannot_list(str(self), error) from error
        return self._info

    def is_dir(self) -> bool:
        """Whether this is a folder with something in it (a bucket has no empty folders).

        Raises:
            ValueError: it cannot be listed (:func:`_cannot_list`).
        """
        # Some object stores answer NotFound for a folder (a key prefix): only a listing tells.
        if self._info is not None and self._info.type != fs.FileType.NotFound:
            return bool(self._info.type == fs.FileType.Directory)
        return self._listing() is not None

    def is_file(self) -> bool:
        return bool(self._file_info().type == fs.FileType.File)

    def iterdir(self) -> list[BucketPath]:
        """The folder's entries, sorted by name.

        Raises:
            FileNotFoundError: it is not a folder.
            ValueError: it cannot be listed (:func:`_cannot_list`).
        """
        infos = self._listing()
        if infos is None:
            raise FileNotFoundError(f"{self} is not a folder")
        return [BucketPath(self.filesystem, self.prefix, info.path, self.query, info,
                           self._listings) for info in infos]

    def listed_file(self, name: str, size: int, mtime_ns: int) -> BucketPath:
        """The file ``name`` of this folder as a listing found it (a node's kept listing,
        :func:`raycl.data.cache.manifest.node_listed`): asking its size or time makes no
        request."""
        inner = f"{self.inner}/{name}"
        info = fs.FileInfo(inner, fs.FileType.File, size=size, mtime_ns=mtime_ns)
        return BucketPath(self.filesystem, self.prefix, inner, self.query, info, self._listings)

    def stat(self) -> BucketStat:
        """Size and modification time (ns; 0 when the store gives none) of a file."""
        info = self._file_info()
        return BucketStat(int(info.size or 0), int(info.mtime_ns or 0))

    def relative_to(self, other: BucketPath) -> PurePosixPath:
        return PurePosixPath(self.inner).relative_to(other.inner)

    def resolve(self) -> BucketPath:
        """Itself: a URI is already absolute."""
        return self

    def expanduser(self) -> BucketPath:
        return self


def root_path(root: str | Path) -> Path | BucketPath:
    """``root`` as the readers walk it: a bucket URI as a :class:`BucketPath`, a local path as a
    :class:`pathlib.Path` (as given: ``~`` is the caller's to expand).

    Raises:
        ValueError: the URI names no file system pyarrow can open (one line).
    """
    return BucketPath.open(str(root)) if is_remote(root) else Path(root)


def is_transient(error: BaseException) -> bool:
    """Whether a failed bucket read may succeed if tried again: an OSError that is not a missing
    file or a denied permission and that says the store was unreachable, overloaded or slow
    (:data:`_TRANSIENT`; Python's own ConnectionError and TimeoutError too)."""
    if not isinstance(error, OSError) or isinstance(error, FileNotFoundError | PermissionError):
        return False
    return isinstance(error, ConnectionError | TimeoutError) or bool(
        _TRANSIENT.search(str(error)))


def _sleep(seconds: float) -> None:
    time.sleep(seconds)  # a module function: tests replace it to count the back-off


def with_read_retries(action: Callable[[], T], what: str,
                      attempts: int = READ_ATTEMPTS) -> T:
    """``action()`` (a read or listing of ``what``), tried up to ``attempts`` times while it
    fails transiently (:func:`is_transient`), sleeping :data:`FIRST_BACKOFF_S`, doubled after
    each failure (plus up to 25 % jitter), between tries. Any other error, or the last
    transient one, is raised as it came. ``action`` must be safe to repeat (a read)."""
    delay = FIRST_BACKOFF_S
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except OSError as error:
            if attempt == attempts or not is_transient(error):
                raise
            logger.warning("reading %s failed (attempt %d of %d), retrying in %.1f s: %s",
                           what, attempt, attempts, delay, str(error).splitlines()[0][:300])
            _sleep(delay * (1.0 + 0.25 * random.random()))
            delay *= 2
    raise AssertionError("unreachable")  # the loop returns or raises


# This process's file system clients: (pid, scheme, bucket or host, query) -> (client, the
# URI text before an object's inner path). The pid: a forked child opens its own.
_CLIENTS: dict[tuple[int, str, str, str], tuple[fs.FileSystem, str]] = {}
_CLIENTS_LOCK = threading.Lock()


def bucket_filesystem(uri: str) -> tuple[fs.FileSystem, str]:
    """``fs.FileSystem.from_uri(uri)``, with one client per bucket (or HDFS host), URI options
    and process: the first URI of a bucket opens it, the others reuse it (their inner path is
    their location past the same prefix). A transient failure to open it is retried.

    Raises:
        OSError, ValueError: as ``from_uri`` (a malformed URI; the store unreachable).
    """
    parts = urlsplit(uri)
    location = uri.partition("?")[0]
    key = (os.getpid(), parts.scheme, parts.netloc, parts.query)
    with _CLIENTS_LOCK:
        known = _CLIENTS.get(key)
    if known is not None and location.startswith(known[1]):
        return known[0], location[len(known[1]):]
    filesystem, inner = with_read_retries(lambda: fs.FileSystem.from_uri(uri), uri)
    # Only a URI whose inner path is its location's tail can be reused by prefix (pyarrow
    # percent-decodes some; those are opened each time, as before).
    if inner and location.endswith(inner):
        with _CLIENTS_LOCK:
            _CLIENTS.setdefault(key, (filesystem, location[:-len(inner)]))
    return filesystem, inner


def _bucket_file(path: str | Path | BucketPath) -> tuple[fs.FileSystem, str]:
    """The file system and inner path of a bucket object: a :class:`BucketPath` knows its own,
    a URI is parsed and read with its bucket's client (:func:`bucket_filesystem`).

    Raises:
        OSError: the URI is malformed (pyarrow's ArrowInvalid, a ValueError, said as OSError).
    """
    if isinstance(path, BucketPath):
        return path.filesystem, path.inner
    try:
        return bucket_filesystem(str(path))
    except ValueError as error:  # pyarrow's ArrowInvalid: a malformed URI
        raise OSError(str(error)) from error


def _opened(path: str | Path | BucketPath, how: Callable[[fs.FileSystem, str], T]) -> T:
    """``how(filesystem, inner)`` for a bucket object, retried while it fails transiently."""
    filesystem, inner = _bucket_file(path)

    def attempt() -> T:
        try:
            return how(filesystem, inner)
        except ValueError as error:
            raise OSError(str(error)) from error

    return with_read_retries(attempt, str(path))


def open_stream(path: str | Path | BucketPath) -> IO[bytes]:
    """A local file or bucket object opened for reading once from start to end (a tar shard,
    an image); the caller closes it. Opening is retried while it fails transiently.

    Raises:
        OSError: it cannot be opened (a malformed URI included).
    """
    if not is_remote(path):
        return open(str(path), "rb")  # the caller closes it
    stream: IO[bytes] = _opened(path, lambda filesystem, inner:
                                filesystem.open_input_stream(inner))
    return stream


def open_random(path: str | Path | BucketPath) -> Any:
    """A file opened for random access (a Parquet file: footer first): a local path as a string,
    a bucket object as pyarrow's input file. Opening is retried while it fails transiently.

    Raises:
        OSError: it cannot be opened (a malformed URI included).
    """
    if not is_remote(path):
        return str(path)
    return _opened(path, lambda filesystem, inner: filesystem.open_input_file(inner))


def read_bytes(path: str | Path | BucketPath) -> bytes:
    """The bytes of a local file or of a bucket object, opened and read again while that fails
    transiently (:func:`with_read_retries`).

    Raises:
        OSError: the file or object cannot be read (a malformed URI included).
    """
    if not is_remote(path):
        return Path(str(path)).read_bytes()

    def read(filesystem: fs.FileSystem, inner: str) -> bytes:
        with filesystem.open_input_stream(inner) as stream:
            data: bytes = stream.read()
        return data

    return _opened(path, read)


def as_listed(path: Path | BucketPath) -> Path | str:
    """A listed file as an image set's row holds it: a bucket entry as its URI (str), a local
    path unchanged."""
    return str(path) if isinstance(path, BucketPath) else path


__all__ = ["FIRST_BACKOFF_S", "READ_ATTEMPTS", "REMOTE_SCHEMES", "BucketPath", "BucketStat",
           "as_listed", "bucket_filesystem", "is_remote", "is_transient", "open_random",
           "open_stream", "read_bytes", "root_path", "with_read_retries"]
