"""What the readers of datasets in their distributed files share (:mod:`~raycl.data.sources.cifar`,
:mod:`~raycl.data.sources.stl10`): finding the dataset's directory (``data.root`` may be it or its
parent), naming missing files in one line, a fingerprint of the files for the cache key,
torchvision's download on request, a chunked resize of uint8 images, and
:class:`StackedImages`: a reader's images read (and resized) only when the cache builder copies
them, so no reader holds a decoded copy of the whole set.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from raycl.config.training import DataConfig
from raycl.data.stream.files import SquareImages

# Images resized per call to torch: bounds the float copy (512 x 3 x 96 x 96 x 4 B = 57 MB).
RESIZE_CHUNK = 512


def dataset_root(cfg: DataConfig) -> Path:
    """``data.root``, with ``~`` expanded.

    Raises:
        ValueError: data.root is not set.
    """
    if not cfg.root:
        raise ValueError(f"dataset {cfg.dataset!r} needs data.root (the directory its files "
                         f"are in, or its parent)")
    return Path(str(cfg.root)).expanduser()


def dataset_directory(root: Path, folder: str) -> Path:
    """The directory holding the files: ``root/folder`` when it exists (``root`` is the parent,
    as torchvision lays it out), else ``root`` itself."""
    return root / folder if (root / folder).is_dir() else root


def missing_files_problem(directory: Path, folder: str, names: list[str],
                          description: str) -> str | None:
    """One line naming the files of ``names`` that ``directory`` lacks, or None.

    Args:
        directory: where the files were looked for (:func:`dataset_directory`).
        folder: the dataset's own directory name (``cifar-10-batches-py``), for the hint.
        names: the files it must hold.
        description: what they are ("CIFAR-10 python batches").
    """
    missing = [name for name in names if not (directory / name).is_file()]
    if not missing:
        return None
    if not directory.is_dir():
        return f"{directory} does not exist (expected the {description}: {', '.join(names)})"
    if len(missing) == len(names) and directory.name != folder:
        return (f"{directory} holds no {description}: neither it nor {directory / folder}/ has "
                f"{', '.join(names)}")
    return f"{directory} lacks {', '.join(missing)} of the {description}"


def files_key(directory: Path, names: list[str]) -> dict[str, Any]:
    """The cache key part of a dataset read from ``names`` in ``directory``: its resolved path
    and each file's (name, size, mtime in ns), so a replaced file makes a new cache."""
    stats = [(name, (directory / name).stat()) for name in names]
    return {"root": str(directory.resolve()),
            "files": [[name, stat.st_size, stat.st_mtime_ns] for name, stat in stats]}


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (processes of one node downloading together)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download_if_missing(cfg: DataConfig, folder: str, names: list[str],
                        download: Callable[[Path], None]) -> None:
    """With ``data.download: true``, call ``download(parent)`` when files of ``names`` are
    missing; otherwise do nothing (a missing file is reported by the reader's check).

    Args:
        cfg: the data settings (root, download).
        folder: the dataset's own directory name; torchvision creates it inside ``parent``.
        names: the files the dataset needs.
        download: fetches the dataset into the given parent directory (torchvision's class
            with ``download=True``).
    """
    if not cfg.download:
        return
    root = dataset_root(cfg)
    if all((dataset_directory(root, folder) / name).is_file() for name in names):
        return
    # data.root may name the dataset's own directory: torchvision wants its parent.
    parent = root.parent if root.name == folder else root
    with _exclusive(parent / f".{folder}.download.lock"):
        # Another process may have finished the download while this one waited.
        if not all((parent / folder / name).is_file() for name in names):
            download(parent)


def resize_into(images: np.ndarray, out: np.ndarray) -> None:
    """Write uint8 ``images`` (n, C, H, W) into ``out`` (n, C, R, R), resized bicubic with
    antialiasing in chunks of :data:`RESIZE_CHUNK` (a plain copy when the sizes match).

    ``images`` may be a non-contiguous view (of a memory map): only one chunk is copied at once.
    """
    if images.shape[2:] == out.shape[2:]:
        for start in range(0, len(images), RESIZE_CHUNK):
            out[start:start + RESIZE_CHUNK] = images[start:start + RESIZE_CHUNK]
        return
    import torch
    import torch.nn.functional as F

    size = tuple(out.shape[2:])
    for start in range(0, len(images), RESIZE_CHUNK):
        chunk = torch.from_numpy(np.ascontiguousarray(images[start:start + RESIZE_CHUNK]))
        resized = F.interpolate(chunk.float(), size=size, mode="bicubic", align_corners=False,
                                antialias=True)
        out[start:start + RESIZE_CHUNK] = resized.round().clamp(0, 255).to(torch.uint8).numpy()


class StackedImages(SquareImages):
    """Several uint8 image arrays (n_i, C, H, W) stacked, resized to (C, R, R) only when rows
    are read: a reader returns it as ``ImageSet.images`` (over memory maps of STL-10's files,
    over CIFAR's unpickled arrays), so no copy of the whole set is made, whatever the
    resolution; the cache builder copies it into the cache chunk by chunk.

    It offers what that copy reads of an array: ``shape``, ``dtype``, ``ndim``, ``len()`` and
    indexing by an int, a slice or an index array; ``np.asarray`` reads every row.

    Args:
        parts: the arrays, in row order (e.g. views of ``np.memmap``\\ s).
        resolution: R, the side of the rows read.
    """

    def __init__(self, parts: list[np.ndarray], resolution: int) -> None:
        self.parts = parts
        self.resolution = int(resolution)
        self.starts = np.cumsum([0, *(len(part) for part in parts)])

    @property
    def channels(self) -> int:
        return int(self.parts[0].shape[1]) if self.parts else 3

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: int | slice | np.ndarray) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            index = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= index < len(self):
                raise IndexError(f"row {key} out of range for {len(self)} images")
            return self[index:index + 1][0]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            out = np.empty((max(0, stop - start), *self.shape[1:]), dtype=np.uint8)
            for part, first in zip(self.parts, self.starts[:-1], strict=True):
                low, high = max(start, first), min(stop, first + len(part))
                if low < high:
                    resize_into(part[low - first:high - first], out[low - start:high - start])
            return out
        indices = np.asarray(key)
        if indices.dtype == bool:
            indices = np.flatnonzero(indices)
        indices = np.where(indices < 0, indices + len(self), indices).astype(np.int64)
        out = np.empty((len(indices), *self.shape[1:]), dtype=np.uint8)
        for part, first in zip(self.parts, self.starts[:-1], strict=True):
            inside = np.flatnonzero((indices >= first) & (indices < first + len(part)))
            if len(inside):
                rows = np.empty((len(inside), *self.shape[1:]), dtype=np.uint8)
                resize_into(part[indices[inside] - first], rows)
                out[inside] = rows
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype)
