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
has no directory times: it is listed as before. The processes of a node that start at once
before any manifest exists each list once; every later one lists nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from raycl.config.training import DataConfig
from raycl.data.cache.store import default_cache_dir
from raycl.data.listed_once import listed_once

T = TypeVar("T")

MANIFEST_VERSION = 1
# A directory changed this recently before the listing began may have changed during it (file
# systems with coarse timestamps): its listing is used but not kept.
SETTLE_NS = 2_000_000_000


def manifest_path(cfg: DataConfig, scope: dict[str, Any]) -> Path:
    """``<cache_dir>/<dataset>-listing-<hash of scope>.json``."""
    digest = hashlib.sha256(json.dumps(scope, sort_keys=True).encode()).hexdigest()[:16]
    setting = getattr(cfg, "cache_dir", None)  # a transfer set's settings may not name one
    cache_dir = Path(setting) if setting else default_cache_dir()
    return cache_dir / f"{cfg.dataset}-listing-{digest}.json"


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


def _times(root: Path, dirs: Iterable[Path]) -> dict[str, int] | None:
    """Relative path -> modification time (ns) of each directory; None when one is gone."""
    times = {}
    for folder in dirs:
        try:
            times[folder.relative_to(root).as_posix()] = os.stat(folder).st_mtime_ns
        except (OSError, ValueError):  # gone, or not under the root
            return None
    return times


def _read(path: Path, scope: dict[str, Any], root: Path) -> dict[str, Any] | None:
    """The manifest at ``path`` when it is this scope's and every directory is as listed."""
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
    root: Path,
    scope: dict[str, Any],
    name: str,
    compute: Callable[[], T],
    listed_files: Callable[[], Iterable[Path]],
) -> T:
    """``compute()``, or what it returned on this node while the folder is as it was listed.

    Args:
        cfg: the data settings (``cache_dir`` holds the manifest).
        root: the local dataset folder, as the listing walks it.
        scope: what names the listing besides the root (dataset, layout, class list).
        name: which answer (``content_key``, ``class_counts``); JSON-serialisable.
        compute: lists the folder (once per :func:`~raycl.data.listed_once.listed_once`
            scope) and answers.
        listed_files: the files of that listing (called after ``compute``, so it reuses it).
    """
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


__all__ = ["MANIFEST_VERSION", "manifest_path", "node_remembered", "watched_dirs"]
