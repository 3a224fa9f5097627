"""The on-disk cache of full image sets: one directory per content, memory-mapped when read.

``<cache_dir>/<dataset>-<hash>/`` (the hash covers everything that changes the content) holds

- ``images.npy``: the decoded uint8 set (N, C, H, W), uncompressed, written through
  ``np.lib.format.open_memmap`` and read with ``np.load(..., mmap_mode="r")``;
- ``meta.npz``: labels, attribute names, ``test_mask``, captions and ``pretrain_only``, plain
  arrays only (read with ``allow_pickle=False``);
- ``key.json``: the cache key in words, for a person wondering what a directory holds.

Why a memory map rather than Ray's object store (issue 22): it works without Ray (the tests,
``benchmarks/gpu.py`` on a bare GPU box); it persists across trials, sweeps and Ray sessions;
the OS page cache holds one copy per node that every process mapping the file shares (Ray
Train workers, DataLoader workers, later trials); and under memory pressure the kernel evicts
clean pages and reads them again instead of killing a worker. Opening it costs a few page
faults, not a read of the set, so loading from the cache takes the same time at any size. An
``.npz`` cannot be mapped (it is a zip), which is why the images are a bare ``.npy``.

A cache directory appears whole or not at all: :mod:`raycl.data.cache.build` writes it under a
temporary name in ``cache_dir`` and renames it into place, behind a lock file, so two processes
building the same set at once neither both decode it nor read half of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from raycl.config.training import DataConfig
from raycl.data.types import ImageSet

# Bump when a generator or the cache layout changes, so stale caches are not reused.
# 2: a directory with a memory-mappable images.npy (1 was one .npz per set).
# 3: image files decoded by raycl.data.decode (a JPEG at reduced scale first, as streams are).
CACHE_VERSION = 3

IMAGES_FILE = "images.npy"
META_FILE = "meta.npz"
KEY_FILE = "key.json"


def default_cache_dir() -> Path:
    """$RAYCL_CACHE if set, else ~/.cache/raycl."""
    return Path(os.environ.get("RAYCL_CACHE") or Path.home() / ".cache" / "raycl")


def cache_key(cfg: DataConfig, content: dict[str, Any]) -> dict[str, Any]:
    """Everything that names one cached set: version, dataset, resolution and ``content``."""
    return {"version": CACHE_VERSION, "dataset": cfg.dataset, "resolution": int(cfg.resolution),
            **content}


def cache_path(cfg: DataConfig, content: dict[str, Any]) -> Path:
    """Where the full image set of ``cfg`` is cached: ``<cache_dir>/<dataset>-<hash>/``.

    Args:
        cfg: the data settings (dataset, resolution, cache_dir).
        content: the source's own part of the key (:meth:`Reader.content_key
            <raycl.data.types.Reader.content_key>`).

    Returns:
        The cache directory (it may not exist yet).
    """
    key = cache_key(cfg, content)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    return cache_dir / f"{cfg.dataset}-{digest}"


class CacheError(RuntimeError):
    """A data cache that cannot be built or opened here, for a reason the message names with
    ``data.cache_dir``: too little free disk, no working lock, a cache that exists but cannot
    be read (left in place)."""


# Free space a build keeps beyond its images: the labels, captions and key beside them.
FREE_MARGIN_BYTES = 64 * 2**20


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a cache_dir not created yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space_problem(cache_dir: Path, needed: int, what: str) -> str | None:
    """Why ``needed`` bytes of ``what`` cannot be written under ``cache_dir`` (which may not
    exist yet) on this machine, or None when its disk has room (``shutil.disk_usage``).

    A memory-mapped cache that outgrows its disk dies of SIGBUS midway, with no message (and
    its retry the same): the space is checked before a byte is written.
    """
    existing = _nearest_existing(cache_dir.expanduser())
    free = shutil.disk_usage(existing).free
    if free >= needed + FREE_MARGIN_BYTES:
        return None
    return (f"{what} takes {needed / 1e9:.1f} GB decoded and {existing} has "
            f"{free / 1e9:.1f} GB free: free space there, or set data.cache_dir (or "
            f"$RAYCL_CACHE) to a larger disk, or use data.loader: stream (no cache)")


def write_metadata(directory: Path, image_set: ImageSet | Any, key: dict[str, Any]) -> None:
    """Write ``meta.npz`` (labels, masks, captions) and ``key.json`` of a set into ``directory``.

    Args:
        directory: the (temporary) cache directory being built.
        image_set: an :class:`ImageSet` or :class:`~raycl.data.types.ImageFiles`: its labels,
            ``test_mask``, ``captions`` and ``pretrain_only`` are written, not its images.
        key: the cache key (:func:`cache_key`).
    """
    arrays = {f"label_{name}": np.asarray(values, dtype=np.int64)
              for name, values in image_set.labels.items()}
    # dtype str: an unlabelled set's empty list would otherwise be saved as float64.
    arrays["attributes"] = np.array(list(image_set.labels), dtype=np.str_)
    for name in ("test_mask", "pretrain_only"):
        values = getattr(image_set, name)
        if values is not None:
            arrays[name] = np.asarray(values, dtype=bool)
    if image_set.captions is not None:
        # A fixed-width unicode array, so loading needs no pickle.
        arrays["captions"] = np.asarray(image_set.captions, dtype=np.str_)
    np.savez(directory / META_FILE, **arrays)
    (directory / KEY_FILE).write_text(json.dumps(key, sort_keys=True, indent=1) + "\n")


class UnreadableCache(OSError):
    """A cache directory that exists but cannot be opened (why: the message).

    ``damaged``: its own files say so (one missing, not a saved array, rows that disagree): no
    process can be reading it. Otherwise (a permission, an I/O error, a file shorter than its
    header says: another node's write not yet whole in this node's view of a shared file
    system) the cache may be sound, and others may be reading it.
    """

    def __init__(self, message: str, damaged: bool) -> None:
        super().__init__(message)
        self.damaged = damaged


def open_cached(directory: Path) -> ImageSet | None:
    """The cached set with its images memory-mapped read-only, or None when the directory is
    missing, incomplete or unreadable (its rows disagreeing with its labels included).

    Args:
        directory: a cache directory (:func:`cache_path`).
    """
    try:
        return read_cached(directory)
    except (FileNotFoundError, UnreadableCache):
        return None


def read_cached(directory: Path) -> ImageSet:
    """The cached set with its images memory-mapped read-only.

    Raises:
        FileNotFoundError: the directory does not exist.
        UnreadableCache: it exists but cannot be opened; the message says which file and why,
            ``damaged`` whether the cache itself is (see :class:`UnreadableCache`).
    """
    if not directory.is_dir():
        raise FileNotFoundError(f"no cache directory {directory}")
    try:
        _require_whole(directory / IMAGES_FILE)
        images = np.load(directory / IMAGES_FILE, mmap_mode="r", allow_pickle=False)
        with np.load(directory / META_FILE, allow_pickle=False) as meta:
            attributes = [str(name) for name in meta["attributes"]]
            labels = {name: meta[f"label_{name}"] for name in attributes}
            optional = {name: meta[name] if name in meta.files else None
                        for name in ("test_mask", "captions", "pretrain_only")}
    except UnreadableCache:
        raise
    except (FileNotFoundError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise UnreadableCache(f"{type(error).__name__}: {error}", damaged=True) from error
    except OSError as error:  # this node's view: a permission, an I/O error, a stale handle
        raise UnreadableCache(f"{type(error).__name__}: {error}", damaged=False) from error
    rows = {len(values) for values in [*labels.values(), *optional.values()]
            if values is not None}
    if images.ndim != 4 or images.dtype != np.uint8 or rows - {len(images)}:
        raise UnreadableCache(f"{IMAGES_FILE} {images.dtype} {images.shape} disagrees with "
                              f"the labels' rows {sorted(rows)}", damaged=True)
    return ImageSet(images=images, labels=labels, **optional)


def _require_whole(path: Path) -> None:
    """Raise UnreadableCache (not damaged) when the .npy ``path`` is shorter than its header
    says; a bad header is left for ``np.load`` to report."""
    headers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    with open(path, "rb") as handle:
        try:
            read_header = headers.get(np.lib.format.read_magic(handle))
            if read_header is None:
                return
            shape, _, dtype = read_header(handle)
        except ValueError:
            return
        expected = handle.tell() + int(np.prod(shape)) * np.dtype(dtype).itemsize
        size = os.fstat(handle.fileno()).st_size
    if size < expected:
        raise UnreadableCache(f"{path.name} holds {size} of its {expected} bytes here",
                              damaged=False)


def stored_key(directory: Path) -> dict[str, Any] | None:
    """The key written beside a cached set (``key.json``), or None when it cannot be read."""
    try:
        key = json.loads((directory / KEY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return key if isinstance(key, dict) else None
