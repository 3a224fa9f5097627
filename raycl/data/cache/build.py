"""Building a cache directory (:mod:`raycl.data.cache.store`) once per node: atomic, locked,
parallel.

- Atomic: the set is written into a temporary directory beside the cache
  (``<name>.tmp-<pid>@<host>.XXXX``) and renamed into place, so a build that crashes halfway
  leaves no half cache; the next build on that host removes what its dead builders left (a
  temporary directory of another host only once nothing in it changed for a day: on a shared
  file system that host's builder may be alive). Where two builders still meet (a lock that
  is not cluster-wide), the second rename finds the first one's cache and opens it.
- Never deleted under a reader: a cache directory that exists but cannot be opened here (a
  permission, an I/O error, a file another node's write has not made whole in this node's view)
  is tried again, then left in place and named in a :class:`~raycl.data.cache.store
  .CacheError`; only one that proves itself stale (its ``key.json`` names another content) or
  damaged (a file missing or not an array: nobody can be reading it) is removed and rebuilt.
- Once: a builder holds an exclusive ``fcntl.flock`` on ``<name>.lock``; another process
  building the same set waits on it, then memory-maps what the first one built. The lock dies
  with its process, so a crashed builder never blocks the next one. A file system without
  locks (``ENOLCK``, e.g. NFS without its lock daemon) is a CacheError naming
  ``data.cache_dir``, not a crash.
- Checked first: the disk's free space is compared with the set's decoded size before a byte
  is written (a full disk would kill the build with SIGBUS midway).
- Parallel: image files (:class:`~raycl.data.types.ImageFiles`) are decoded by a pool of
  ``data.decode_workers`` threads (0: the CPUs the Ray worker reserved, ``scaling.
  cpus_per_worker``; outside Ray every core this process may run on) straight into the
  open memory map, chunk by chunk, never all in memory. Threads, not processes: Pillow
  releases the GIL while it decodes and resizes, so threads scale with the cores and share the
  memory map without pickling a row. A set generated in memory (Trifeature, digits, CIFAR) is
  copied into the map.

An unreadable image does not stop the others: every file is tried, then one ValueError names
the first few unreadable files and how many were unreadable; or, when the caller keeps them
(``data.skip_unreadable``), their rows stay blank and are listed in ``unreadable.json`` beside
the set (:func:`read_unreadable`), for loading to leave out of every split. The cache stays one
per content either way: a later run without skipping refuses the same rows by that list.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from raycl.data.cache.store import (
    IMAGES_FILE,
    CacheError,
    UnreadableCache,
    free_space_problem,
    read_cached,
    stored_key,
    write_metadata,
)
from raycl.data.decode import decode_square
from raycl.data.progress import Progress
from raycl.data.types import ImageFiles, ImageSet
from raycl.data.unreadable import image_problem, unreadable_message

# Images one decoding task handles: large enough to amortise the pool's overhead, small enough
# that the progress line moves and every worker gets work to the end.
DECODE_CHUNK = 64
# Rows copied per step from an in-memory set into the map.
COPY_CHUNK = 4096
# Beside a set built with unreadable files kept: their rows, files and reasons.
UNREADABLE_FILE = "unreadable.json"
# An unreadable file: its row in the set, its path, why it cannot be decoded.
Unreadable = tuple[int, str, str]


# Tries at opening a cache directory that exists but cannot be read, this far apart: a file
# another node just renamed into place may take a moment to show whole on a shared file system.
OPEN_ATTEMPTS = 3
OPEN_RETRY_SECONDS = 5.0
# A temporary directory of another host is removed once nothing in it changed for this long.
STALE_TEMPORARY_SECONDS = 24 * 3600
# flock's errors on a file system that has no (working) locks.
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def reserved_cpus() -> int | None:
    """The CPUs Ray reserved for this process (a Ray Train worker's ``scaling.cpus_per_worker``,
    at least one), or None outside a Ray worker (a script, a test, the driver)."""
    ray = sys.modules.get("ray")  # never imported here: a process without Ray has no reservation
    if ray is None or not ray.is_initialized():
        return None
    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except (AssertionError, RuntimeError):  # the driver asserts it is not a worker
        return None
    return max(1, int(cpus)) if cpus else None


def decode_workers(setting: int | None) -> int:
    """Threads that decode: ``setting`` (``data.decode_workers``); when it is 0 or None, the
    CPUs the Ray worker reserved (:func:`reserved_cpus`: a node's other trials use the rest),
    outside Ray every core this process may run on."""
    if setting:
        return int(setting)
    reserved = reserved_cpus()
    if reserved is not None:
        return reserved
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_cache(
    directory: Path,
    read: Callable[[], ImageSet | ImageFiles],
    key: dict[str, Any],
    resolution: int,
    workers: int = 0,
    stream: TextIO | None = None,
    keep_unreadable: bool = False,
) -> ImageSet:
    """Build the cache directory ``directory`` unless another process has, and open it.

    Args:
        directory: the cache directory (:func:`raycl.data.cache.store.cache_path`).
        read: returns the full set (a reader's ``read``); called only by the one process that
            builds.
        key: the cache key, written beside the set (:func:`raycl.data.cache.store.cache_key`).
        resolution: image side of decoded files.
        workers: decoding threads (:func:`decode_workers`: 0 is every core).
        stream: where the decoding progress goes (default: stderr).
        keep_unreadable: build the set when image files cannot be decoded: their rows stay
            blank and are listed (:func:`read_unreadable`) instead of failing the build.

    Returns:
        The cached set, its images memory-mapped read-only.

    Raises:
        ValueError: unreadable images unless kept (the first few named, with their count), or
            a reader whose labels disagree with its images.
        CacheError: too little free disk for the set, a file system without locks, or a
            cache directory that exists but cannot be opened (left in place).
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory, stream):
        cached = _open_existing(directory, key)
        if cached is not None:  # built by another process while this one waited
            return cached
        _remove_dead_temporaries(directory)
        temporary = Path(tempfile.mkdtemp(
            dir=directory.parent, prefix=f"{directory.name}.tmp-{os.getpid()}@{_host()}."))
        try:
            source = read()
            problem = free_space_problem(directory.parent, set_bytes(source, resolution),
                                         f"the data cache {directory.name}")
            if problem:
                raise CacheError(f"data.cache_dir: {problem} (on {_host()})")
            write_set(temporary, source, key, resolution, decode_workers(workers), stream,
                      keep_unreadable)
            _publish(temporary, directory)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
    cached = _open_existing(directory, key)
    if cached is None:
        raise CacheError(f"data.cache_dir: the cache {directory} was written but is gone")
    return cached


def remove_cache(directory: Path) -> bool:
    """Remove the cache directory ``directory``, a set nothing will read again (a finished
    confirmation seed's generated data: :mod:`raycl.sweep.confirm_caches`).

    Under its build lock, so never one a process is building; renamed aside first, so a process
    opening it finds all of it or none (one that has it memory-mapped keeps reading its files).
    The lock file stays, as a build leaves it.

    Returns:
        Whether there was one to remove.
    """
    if not directory.is_dir():
        return False
    with _build_lock(directory, None):
        # Named as a dead builder's temporary: a removal cut short is cleaned by the next build.
        aside = directory.with_name(f"{directory.name}.tmp-{os.getpid()}@{_host()}.removed")
        shutil.rmtree(aside, ignore_errors=True)  # an earlier removal's, cut short
        try:
            os.rename(directory, aside)
        except FileNotFoundError:
            return False  # removed by another process while this one waited
        shutil.rmtree(aside, ignore_errors=True)
    return True


def set_bytes(source: ImageSet | ImageFiles, resolution: int) -> int:
    """Bytes the images of ``source`` take in the cache (decoded files: 3 x resolution^2)."""
    if isinstance(source, ImageFiles):
        return len(source.paths) * 3 * int(resolution) ** 2
    return int(np.prod(source.images.shape)) * np.dtype(source.images.dtype).itemsize


def _host() -> str:
    return socket.gethostname() or "host"


def _open_existing(directory: Path, key: dict[str, Any]) -> ImageSet | None:
    """The cached set in ``directory``; None when there is none, or when it proves itself
    stale (its ``key.json`` names another content) or damaged (a file missing, not an array:
    no process can be reading it); such a one is removed, with the lock held.

    Raises:
        CacheError: it exists and cannot be opened after :data:`OPEN_ATTEMPTS` tries (a
            permission, an I/O error, a file not yet whole in this node's view): left in
            place, since on a shared file system other nodes may be reading it.
    """
    expected = json.loads(json.dumps(key, sort_keys=True))  # as key.json holds it
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return read_cached(directory)
        except FileNotFoundError:
            return None
        except UnreadableCache as error:
            stored = stored_key(directory)
            if error.damaged or (stored is not None and stored != expected):
                shutil.rmtree(directory, ignore_errors=True)
                return None
            problem = error
        if attempt + 1 < OPEN_ATTEMPTS:
            time.sleep(OPEN_RETRY_SECONDS)
    raise CacheError(f"data.cache_dir: the data cache {directory} exists but cannot be "
                     f"opened on {_host()} ({problem}); it is left in place (other nodes may "
                     f"be reading it): fix it, or remove it to have it rebuilt")


def _publish(temporary: Path, directory: Path) -> None:
    """Rename the built ``temporary`` into place; where another builder's cache got there first
    (their lock was not cluster-wide), keep that one and discard this one."""
    try:
        os.rename(temporary, directory)
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not directory.is_dir():
            raise
        shutil.rmtree(temporary, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(directory: Path, stream: TextIO | None) -> Iterator[None]:
    """Hold the exclusive lock of ``directory``'s build; say so when waiting for another.

    Raises:
        CacheError: the file system has no working locks (``ENOLCK`` and the like).
    """
    lock_path = directory.with_name(directory.name + ".lock")
    # The lock file stays: removing it would let a third process lock a new file while a
    # second still waits on the old one.
    with open(lock_path, "a+b") as lock:
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                (stream or sys.stderr).write(
                    f"waiting for another process building the data cache {directory}\n")
                fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                raise
            raise CacheError(
                f"data.cache_dir: {directory.parent} has no working file locks "
                f"(flock: {os.strerror(error.errno)}), which keep the processes of a node from "
                f"building the data cache at once: set data.cache_dir (or $RAYCL_CACHE) to a "
                f"local disk of each node, or enable locking on that file system") from error
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_dead_temporaries(directory: Path) -> None:
    """Remove the temporary directories of dead builders (with the lock held): this host's
    whose process is gone; another host's (or an unnamed one) only when nothing in it changed
    for :data:`STALE_TEMPORARY_SECONDS` (a lock that is not cluster-wide may let that host's
    builder run now)."""
    for leftover in directory.parent.glob(f"{directory.name}.tmp-*"):
        if not leftover.is_dir():
            continue
        owner = leftover.name.removeprefix(f"{directory.name}.tmp-").rsplit(".", 1)[0]
        pid, _, host = owner.partition("@")
        if host == _host() and pid.isdigit():
            dead = not _alive(int(pid))
        else:
            dead = time.time() - _last_change(leftover) > STALE_TEMPORARY_SECONDS
        if dead:
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _last_change(folder: Path) -> float:
    """The newest modification time of ``folder`` and its files (a live build writes them)."""
    try:
        return max([folder.stat().st_mtime, *(entry.stat().st_mtime
                                              for entry in folder.iterdir())])
    except OSError:
        return time.time()


def write_set(
    directory: Path,
    source: ImageSet | ImageFiles,
    key: dict[str, Any],
    resolution: int,
    workers: int,
    stream: TextIO | None = None,
    keep_unreadable: bool = False,
) -> None:
    """Write ``source`` into ``directory`` (:mod:`raycl.data.cache.store`'s layout): its images into
    a new memory map (decoded there when they are files), its labels beside them.

    Args:
        directory: an existing, empty directory (the build's temporary one).
        source: what the reader returned: files to decode, or images as an array or any
            array-like with ``shape``, ``dtype``, ``ndim`` and row slices (read
            :data:`COPY_CHUNK` rows at a time, so a reader may decode lazily).
        key: the cache key, written as ``key.json``.
        resolution: image side of decoded files (an in-memory set keeps its own).
        workers: decoding threads, >= 1.
        stream: where the decoding progress goes (default: stderr).
        keep_unreadable: see :func:`build_cache`.

    Raises:
        ValueError: unreadable images (unless kept), or labels, masks or captions of another
            length than the images.
    """
    count = len(source.paths) if isinstance(source, ImageFiles) else len(source.images)
    _check_lengths(source, count)
    if isinstance(source, ImageFiles):
        shape: tuple[int, ...] = (count, 3, resolution, resolution)
    else:
        if source.images.dtype != np.uint8 or source.images.ndim != 4:
            raise ValueError(f"a reader returned images of dtype {source.images.dtype} and "
                             f"shape {source.images.shape}; expected uint8 (N, C, H, W)")
        shape = tuple(source.images.shape)
    images = np.lib.format.open_memmap(directory / IMAGES_FILE, mode="w+", dtype=np.uint8,
                                       shape=shape)
    unreadable: list[Unreadable] = []
    try:
        if isinstance(source, ImageFiles):
            unreadable = decode_files(
                source.paths, resolution, images, workers,
                Progress(f"decoding {directory.name.split('.tmp-')[0]}", count, stream),
                keep_unreadable)
        else:
            for start in range(0, count, COPY_CHUNK):
                images[start:start + COPY_CHUNK] = source.images[start:start + COPY_CHUNK]
        images.flush()
    finally:
        del images  # unmapped before the directory is renamed or removed
    write_metadata(directory, source, key)
    if unreadable:
        (directory / UNREADABLE_FILE).write_text(json.dumps(
            [list(entry) for entry in unreadable], indent=0) + "\n")


def read_unreadable(directory: Path) -> list[Unreadable]:
    """The rows of the cached set in ``directory`` whose files could not be decoded (built with
    ``keep_unreadable``), in row order; empty when every row was decoded."""
    path = directory / UNREADABLE_FILE
    if not path.is_file():
        return []
    return [(int(row), str(name), str(why)) for row, name, why in json.loads(path.read_text())]


def _check_lengths(source: ImageSet | ImageFiles, count: int) -> None:
    """Raise ValueError when a per-image array of ``source`` does not have ``count`` rows."""
    arrays = {**{f"labels[{name!r}]": values for name, values in source.labels.items()},
              "test_mask": source.test_mask, "captions": source.captions,
              "pretrain_only": source.pretrain_only}
    for name, values in arrays.items():
        if values is not None and len(values) != count:
            raise ValueError(f"a reader returned {len(values)} {name} for {count} images")


def decode_files(
    paths: list[Path | str], resolution: int, out: np.ndarray, workers: int, progress: Progress,
    keep_unreadable: bool = False,
) -> list[Unreadable]:
    """Decode ``paths[i]`` into ``out[i]`` on ``workers`` threads; a file named by several rows
    is decoded once and copied to the others.

    Args:
        paths: one image file per row.
        resolution: side of the decoded squares (:func:`~raycl.data.decode.decode_square`).
        out: uint8 (len(paths), 3, resolution, resolution), typically a writable memory map.
        workers: threads, >= 1.
        progress: counts the decoded files.
        keep_unreadable: return the unreadable files instead of raising (their rows blank).

    Returns:
        (row, file, why) of every row whose file cannot be decoded, in row order (every row of
        a file named by several); empty when all were decoded.

    Raises:
        ValueError: unless ``keep_unreadable``, one or more files cannot be read: the first few
            (in row order) are named, with how many were unreadable.
    """
    first_row: dict[Path | str, int] = {}
    copies: list[tuple[int, int]] = []  # (row, the earlier row holding its file)
    for row, path in enumerate(paths):
        if path in first_row:
            copies.append((row, first_row[path]))
        else:
            first_row[path] = row
    unique = list(first_row.values())
    chunks = [unique[start:start + DECODE_CHUNK] for start in range(0, len(unique), DECODE_CHUNK)]
    errors = _run_chunks(chunks, workers, progress,
                         lambda rows: _decode_chunk(paths, rows, resolution, out))
    progress.close()
    errors.sort()
    if errors and not keep_unreadable:
        raise ValueError(unreadable_message([(str(paths[row]), why) for row, why in errors],
                                            f"{len(unique)} image files"))
    for row, source_row in copies:
        out[row] = out[source_row]
    why_of = {str(paths[row]): why for row, why in errors}
    return [(row, str(path), why_of[str(path)]) for row, path in enumerate(paths)
            if str(path) in why_of]


def _run_chunks(
    chunks: list[list[int]],
    workers: int,
    progress: Progress,
    decode: Callable[[list[int]], list[tuple[int, str]]],
) -> list[tuple[int, str]]:
    """Run ``decode`` on every chunk on a pool of ``workers`` threads, counting progress as
    chunks finish; the (row, message) of every unreadable file."""
    errors: list[tuple[int, str]] = []
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="raycl-decode")
    # At most a few chunks per thread in flight: an interrupted build stops soon, and the
    # queue of futures stays small for a million files.
    pending: dict[Future[list[tuple[int, str]]], int] = {}
    queue = iter(chunks)
    try:
        while True:
            while len(pending) < 4 * max(1, workers):
                chunk = next(queue, None)
                if chunk is None:
                    break
                pending[pool.submit(decode, chunk)] = len(chunk)
            if not pending:
                return errors
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                errors.extend(future.result())
                progress.update(pending.pop(future))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _decode_chunk(
    paths: list[Path | str], rows: list[int], resolution: int, out: np.ndarray
) -> list[tuple[int, str]]:
    """Decode the files of ``rows`` into ``out``; (row, why) of each one that fails."""
    errors = []
    for row in rows:
        try:
            out[row] = decode_square(paths[row], resolution)
        except ValueError as error:
            # In the words of the launch's check; the decoder's own when that check passes.
            prefix = f"cannot read image {str(paths[row])!r}: "
            errors.append((row, image_problem(paths[row]) or str(error).removeprefix(prefix)))
    return errors
