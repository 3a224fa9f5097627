"""One listing manifest per dataset and node: what a folder's listing told, kept beside the cache.

Naming a folder's cache takes its listing and a stat of every file (the content key), and so do
its split sizes (the class counts): for ImageNet, 1.28 M files per question, asked by every
trial process and every worker of every trial. :func:`node_remembered` answers such a question
from ``<cache_dir>/<dataset>-listing-<hash>.json`` instead, as long as the folder is as it was
listed: the manifest holds the modification time of every directory the listing walked (the
root, its halves, every class folder and their sibling folders), and a file added, removed or
renamed changes its directory's. Checking them is a stat per directory (about 2 000 for
ImageNet), no listing. A file rewritten in place under the same name keeps its directory's
time: touch that directory (or remove the manifest) to have the folder listed again.

A manifest is written only from a listing that nothing changed under: when a watched directory
changed within :data:`SETTLE_NS` of the listing's start (or after it), the next call lists
again (this takes the file server's clock to be within that of the node's). A root in a bucket
has no directory times: its answers are computed each time, from its kept listing (below).

The listing itself (:func:`node_listed`: every file with its class, per part) is kept the same
way in ``<cache_dir>/<dataset>-files-<hash>.json``, so that what needs the files (stream mode's
workers, a cache build, a bucket's split sizes) does not list them either. For a local root it
holds while the watched directories keep their times, as above. A bucket has none: its listing
is kept per node and launch (the Ray job: a sweep's driver, trials, PBT restarts and workers
share it, :func:`raycl.data.stream.shard_manifest.launch_id`), so a new launch lists the bucket
as it is now, and outside a Ray job a bucket is listed as asked. The first process of a node to
need it lists behind a lock file (``.lock`` beside it); the others wait and read it. Removing the
``*-files-*.json`` and ``*-listing-*.json`` files of ``cache_dir`` forces a new listing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from raycl.config.training import DataConfig
from raycl.data.bucket_paths import BucketPath
from raycl.data.cache.store import default_cache_dir
from raycl.data.listed_once import listed_once
from raycl.data.stream import shard_manifest

T = TypeVar("T")
# A folder's listing as its reader gives it: part -> (file, class name) pairs, each file a
# local Path or a BucketPath under the listed root.
Parts = dict[str, list[tuple[Any, str]]]

MANIFEST_VERSION = 1
# A directory changed this recently before the listing began may have changed during it (file
# systems with coarse timestamps): its listing is used but not kept.
SETTLE_NS = 2_000_000_000


def manifest_path(cfg: DataConfig, scope: dict[str, Any], kind: str = "listing") -> Path:
    """``<cache_dir>/<dataset>-<kind>-<hash of scope>.json`` (kind: ``listing``, the answers;
    ``files``, the listing itself)."""
    digest = hashlib.sha256(json.dumps(scope, sort_keys=True).encode()).hexdigest()[:16]
    setting = getattr(cfg, "cache_dir", None)  # a transfer set's settings may not name one
    cache_dir = Path(setting) if setting else default_cache_dir()
    return cache_dir / f"{cfg.dataset}-{kind}-{digest}.json"


def watched_dirs(root: Path, files: Iterable[Path]) -> list[Path]:
    """The directories whose times tell that a listing of ``root`` holding ``files`` changed:
    every folder holding a file, every folder between them and ``root`` (``root`` included),
    and every sub-folder of those (an empty class folder that may get images)."""
    parents = {Path(path).parent for path in files}
    above = {root}
    for parent in parents:
        for folder in parent.parents:
            if folder != root and root not in folder.parents:
                break
            above.add(folder)
    watched = parents | above
    for folder in above:
        watched.update(child for child in folder.iterdir() if child.is_dir())
    return sorted(watched)


def _times(root: Path | BucketPath, dirs: Iterable[Path]) -> dict[str, int] | None:
    """Relative path -> modification time (ns) of each directory; None when one is gone."""
    times = {}
    for folder in dirs:
        try:
            times[folder.relative_to(root).as_posix()] = os.stat(folder).st_mtime_ns
        except (OSError, ValueError):  # gone, or not under the root
            return None
    return times


def _read(path: Path, scope: dict[str, Any], root: Path | BucketPath) -> dict[str, Any] | None:
    """The manifest at ``path`` when it is this scope's and every directory is as listed (a
    bucket's watches none)."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION
            or manifest.get("scope") != scope or not isinstance(manifest.get("dirs"), dict)):
        return None
    dirs = manifest["dirs"]
    if _times(root, (root / name for name in dirs)) != dirs:
        return None
    return manifest


def _write(path: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a concurrent reader sees the old manifest or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(manifest))
    os.replace(temporary, path)


def node_remembered(
    cfg: DataConfig,
    root: Path | BucketPath,
    scope: dict[str, Any],
    name: str,
    compute: Callable[[], T],
    listed_files: Callable[[], Iterable[Path]],
) -> T:
    """``compute()``, or what it returned on this node while the folder is as it was listed.

    Args:
        cfg: the data settings (``cache_dir`` holds the manifest).
        root: the local dataset folder, as the listing walks it; a bucket folder has no
            directory times: ``compute()`` is answered from its listing (:func:`node_listed`
            keeps that), once per :func:`~raycl.data.listed_once.listed_once` scope.
        scope: what names the listing besides the root (dataset, layout, class list).
        name: which answer (``content_key``, ``class_counts``); JSON-serialisable.
        compute: lists the folder (once per :func:`~raycl.data.listed_once.listed_once`
            scope) and answers.
        listed_files: the files of that listing (called after ``compute``, so it reuses it).
    """
    if isinstance(root, BucketPath):
        with listed_once():  # e.g. the content key: its layout and its files, one listing
            return compute()
    scope = {"root": str(root.resolve()), **scope}
    path = manifest_path(cfg, scope)
    manifest = _read(path, scope, root)
    if manifest is not None and name in manifest["values"]:
        return manifest["values"][name]  # type: ignore[no-any-return]
    started = time.time_ns()
    with listed_once():  # the answer and the directories it watches: one listing
        # As the manifest gives it back (tuples as lists): the same answer listed or remembered.
        value = json.loads(json.dumps(compute()))
        try:
            watched = watched_dirs(root, listed_files())
        except OSError:
            return value
    times = _times(root, watched)
    try:
        if times is None or max(times.values()) >= started - SETTLE_NS:
            return value  # changing while listed: not kept
        if manifest is None or manifest["dirs"] != times:
            manifest = {"version": MANIFEST_VERSION, "scope": scope, "dirs": times,
                        "values": {}}
        manifest["values"][name] = value
        _write(path, manifest)
    except OSError:
        pass  # an unwritable cache_dir: answered, not kept (the build reports that one)
    return value


def node_listed(cfg: DataConfig | None, root: Path | BucketPath, scope: dict[str, Any],
                list_it: Callable[[], Parts]) -> Parts:
    """``list_it()``, or the listing of ``root`` an earlier process of this node kept (see the
    module docstring): the same files, as the same paths, with no directory listed.

    Args:
        cfg: the data settings whose ``cache_dir`` keeps the listing; None: listed, not kept.
        root: the folder ``list_it`` lists, as it walks it: kept files are rebuilt under it.
        scope: what names the listing besides the root (dataset, layout, class list).
        list_it: lists the folder.
    """
    remote = isinstance(root, BucketPath)
    job = shard_manifest.launch_id() if remote else None
    if cfg is None or (remote and job is None):
        return list_it()  # a bucket outside a launch: nothing says when a kept one is stale
    where = str(root) if remote else str(Path(root).resolve())
    scope = {"version": MANIFEST_VERSION, "root": where, **scope,
             **({"job": job} if remote else {})}
    path = manifest_path(cfg, scope, "files")
    kept = _read(path, scope, root)
    if kept is None:
        # One process of the node lists (minutes for ImageNet in a bucket); the node's others
        # start at the same moment (a trial's workers) and wait for its manifest.
        with shard_manifest.locked(path):
            kept = _read(path, scope, root)
            if kept is None:
                return _list_and_keep(path, scope, root, list_it)
    try:
        return _decoded(root, kept["files"])
    except (KeyError, TypeError, ValueError):  # a manifest of another shape: listed again
        return list_it()


def _list_and_keep(path: Path, scope: dict[str, Any], root: Path | BucketPath,
                   list_it: Callable[[], Parts]) -> Parts:
    """``list_it()``, kept at ``path`` unless a local root changed while it was listed."""
    started = time.time_ns()
    parts = list_it()
    try:
        dirs: dict[str, int] | None = {}
        if isinstance(root, Path):
            dirs = _times(root, watched_dirs(root, (file for files in parts.values()
                                                    for file, _ in files)))
            if dirs is None or max(dirs.values()) >= started - SETTLE_NS:
                return parts  # changing while listed: not kept
        _write(path, {"version": MANIFEST_VERSION, "scope": scope, "dirs": dirs,
                      "files": _encoded(root, parts)})
    except OSError:
        pass  # an unwritable cache_dir: listed, not kept
    return parts


def _encoded(root: Path | BucketPath, parts: Parts) -> dict[str, list[list[Any]]]:
    """Per part, the runs of files of one folder and class in listing order: ``[folder relative
    to root, class, names]``; a bucket's names come with the size and time its listing gave
    (``[name, size, mtime_ns]``), so the files' stats cost no request either."""
    encoded: dict[str, list[list[Any]]] = {}
    for part, files in parts.items():
        runs: list[list[Any]] = []
        for file, label in files:
            folder, _, name = _relative(root, file).rpartition("/")
            entry: Any = name
            if isinstance(file, BucketPath):
                stat = file.stat()
                entry = [name, stat.st_size, stat.st_mtime_ns]
            if not runs or runs[-1][0] != folder or runs[-1][1] != label:
                runs.append([folder, label, []])
            runs[-1][2].append(entry)
        encoded[part] = runs
    return encoded


def _relative(root: Path | BucketPath, file: Any) -> str:
    """``file``'s path below ``root`` (``a/b.jpg``), by its text where it starts with the
    root's (a million files: ``relative_to`` would take seconds)."""
    inner, below = ((root.inner, file.inner) if isinstance(root, BucketPath)
                    else (str(root), str(file)))
    if below.startswith(f"{inner}/"):
        return below[len(inner) + 1:]
    if inner == "." and isinstance(root, Path):  # Path(".") / "a" is "a"
        return below
    return PurePosixPath(file.relative_to(root)).as_posix()


def _decoded(root: Path | BucketPath, encoded: dict[str, list[list[Any]]]) -> Parts:
    """The listing :func:`_encoded` kept, its files rebuilt under ``root``."""
    parts: Parts = {}
    for part, runs in encoded.items():
        files: list[tuple[Any, str]] = []
        for folder, label, entries in runs:
            base, label = (root / folder if folder else root), str(label)
            if isinstance(base, BucketPath):
                files += [(base.listed_file(name, size, mtime), label)
                          for name, size, mtime in entries]
            else:
                files += [(base / name, label) for name in entries]
        parts[str(part)] = files
    return parts


__all__ = ["MANIFEST_VERSION", "Parts", "manifest_path", "node_listed", "node_remembered",
           "watched_dirs"]
