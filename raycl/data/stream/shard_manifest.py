"""A shard dataset listed once per launch, and once per node for a launch's trials.

Listing img2dataset's output reads one ``<shard>_stats.json`` per shard (1 243 GETs for CC12M),
and the listing is asked for by several pre-launch checks, by each trial process and by each of
its workers. :func:`listed_shards` serves them all from one listing:

- within a :func:`raycl.data.listed_once.listed_once` scope (the launch's checks) a listing is
  made once;
- in a Ray job (a sweep's trial processes and workers are tasks and actors of the driver's job)
  the first process of a node to ask lists the shards and writes them to a small manifest under
  the node's cache directory (``data.cache_dir``), named by the listing's identity (root,
  format, ``data.samples_per_shard``) and the job's id; the node's other processes read it. A
  new launch is a new job, so it lists again: a dataset that changed between launches is seen
  as it is. Behind a lock file where the file system has locks (else each process may list,
  and the last complete manifest wins: it is written under a temporary name and renamed).

Outside both (a notebook, a unit test) every call lists.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from raycl.data.listed_once import remembered

logger = logging.getLogger(__name__)

Counts = list[tuple[str, int]]
MANIFEST_DIR = "listings"


def launch_id() -> str | None:
    """The Ray job this process belongs to (the launch: a sweep's driver, its trials and their
    workers share it), or None outside Ray. Ray is never imported here: a process that has not
    imported it is not in a job."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        return str(ray.get_runtime_context().get_job_id())
    except Exception:  # a runtime without a job id: no node manifest
        return None


def _cache_dir(cache_dir: str | None) -> Path:
    from raycl.data.cache.store import default_cache_dir

    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def manifest_path(identity: dict[str, object], job: str, cache_dir: str | None) -> Path:
    """Where the node's manifest of ``identity``'s listing in job ``job`` is kept."""
    text = json.dumps({**identity, "job": job}, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    return _cache_dir(cache_dir) / MANIFEST_DIR / f"shards-{digest}.json"


def _read(path: Path) -> Counts | None:
    """The manifest's listing, or None (no manifest yet, or one that cannot be read)."""
    try:
        rows = json.loads(path.read_text())
        return [(str(name), int(count)) for name, count in rows]
    except (OSError, ValueError, TypeError):
        return None


def _write(path: Path, counts: Counts) -> None:
    """``counts`` as the manifest, written whole (a temporary name renamed into place). A cache
    directory that cannot be written only costs the node's other processes a listing each."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps([[name, count] for name, count in counts]))
        os.replace(temporary, path)
    except OSError as error:
        logger.warning("could not write the shard listing's manifest %s: %s", path, error)
        with contextlib.suppress(OSError):
            temporary.unlink()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """``path``'s lock file held, so that one process of the node lists while the others wait;
    without a working lock (a file system without ``flock``: ENOLCK) the body runs unlocked."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(f"{path.name}.lock"), "a")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # ENOLCK and the like: list without the lock
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # releases the lock


def node_listing(identity: dict[str, object], cache_dir: str | None,
                 list_it: Callable[[], Counts]) -> Counts:
    """``list_it()``, or in a Ray job the node's manifest of it (see the module docstring)."""
    job = launch_id()
    if job is None:
        return list_it()
    path = manifest_path(identity, job, cache_dir)
    counts = _read(path)
    if counts is not None:
        return counts
    with locked(path):
        counts = _read(path)  # another process listed while this one waited
        if counts is None:
            counts = list_it()
            _write(path, counts)
    return counts


def listed_shards(root: str, fmt: str, per_shard: int | None, cache_dir: str | None,
                  list_it: Callable[[], Counts]) -> Counts:
    """``(shard path, samples)`` of ``root``'s shards from ``list_it``, listed once per
    :func:`~raycl.data.listed_once.listed_once` scope and once per node and launch."""
    from raycl.data.bucket_paths import is_remote

    # A local root by its absolute path: the node's processes need not share a working directory.
    where = root if is_remote(root) else str(Path(root).expanduser().resolve())
    identity: dict[str, object] = {"root": where, "format": fmt, "samples_per_shard": per_shard}
    return remembered(("shards", root, fmt, per_shard),
                      lambda: node_listing(identity, cache_dir, list_it))


__all__ = ["MANIFEST_DIR", "launch_id", "listed_shards", "locked", "manifest_path",
           "node_listing"]
