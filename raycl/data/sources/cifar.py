"""CIFAR-10 and CIFAR-100 read from the "python version" their authors distribute.

    cifar-10-batches-py/   data_batch_1 .. data_batch_5, test_batch (and batches.meta)
    cifar-100-python/      train, test (and meta)

``data.root`` is that directory or its parent (where torchvision puts it). Each file is a
Python 2 pickle of a dict: ``data``, uint8 (N, 3072), each row an image's red, green and blue
32x32 planes row by row; ``labels`` (CIFAR-10), or ``fine_labels`` and ``coarse_labels``
(CIFAR-100: attributes "fine", 100 classes, then "coarse", 20 superclasses). The images of the
test file are the test split (``test_mask``); validation is carved from the training files.

The papers train and evaluate at 32x32 (``data.resolution: 32``, no resize); another resolution
is resized bicubic with antialiasing. ``data.download: true`` lets torchvision fetch the files
into ``data.root`` when they are missing.

The pickles are read by an unpickler that builds numpy arrays and plain Python values only, so
a tampered file cannot run code.
"""

from __future__ import annotations

import codecs
import functools
import importlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.sources.shipped import (
    StackedImages,
    dataset_directory,
    dataset_root,
    download_if_missing,
    files_key,
    missing_files_problem,
)
from raycl.data.splits import counted_split_sizes
from raycl.data.types import ImageSet, root_problem

SIDE = 32
ROW_BYTES = 3 * SIDE * SIDE


def _numpy_reconstruct() -> Any:
    # numpy 2 moved numpy.core to numpy._core; files written by either name the old place.
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return importlib.import_module(module)._reconstruct
        except (ImportError, AttributeError):
            continue
    raise ImportError("numpy's array reconstructor was not found")


# The only objects a CIFAR pickle may name besides numpy's array reconstructor.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,  # how Python 3's protocol 2 writes bytes
}


class _ArrayUnpickler(pickle.Unpickler):
    """Builds only what the CIFAR pickles hold: dicts, lists, str/bytes, ints, numpy arrays."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "_reconstruct" and module in ("numpy.core.multiarray",
                                                 "numpy._core.multiarray"):
            return _numpy_reconstruct()
        if (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[(module, name)]
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR pickle")


def load_pickle(path: Path) -> dict[str, Any]:
    """One CIFAR pickle as a dict with str keys.

    Python 2 str values load as bytes (``encoding="bytes"``, as the CIFAR page advises); keys
    are decoded so files written by Python 2 or 3 read alike.

    Raises:
        ValueError: the file is not a pickled dict (named in the message).
    """
    try:
        with open(path, "rb") as handle:
            content = _ArrayUnpickler(handle, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as error:
        raise ValueError(f"{path} is not a CIFAR python pickle: {error}") from error
    if not isinstance(content, dict):
        raise ValueError(f"{path} is not a CIFAR python pickle: it holds a "
                         f"{type(content).__name__}, not a dict")
    return {key.decode("latin1") if isinstance(key, bytes) else str(key): value
            for key, value in content.items()}


@dataclass(frozen=True)
class CifarFormat:
    """One CIFAR variant's files and label keys.

    Attributes:
        title: its name in messages.
        folder: the directory its archive unpacks to.
        train_files, test_file: the files of the training and test images.
        label_keys: attribute -> the pickle key of its labels (first: the stratifying one).
        num_classes: attribute -> its classes (labels must be below).
        torchvision_class: the ``torchvision.datasets`` class that downloads it.
    """

    title: str
    folder: str
    train_files: tuple[str, ...]
    test_file: str
    label_keys: dict[str, str]
    num_classes: dict[str, int]
    torchvision_class: str

    @property
    def files(self) -> list[str]:
        """Every file read, training files first."""
        return [*self.train_files, self.test_file]


CIFAR10 = CifarFormat("CIFAR-10", "cifar-10-batches-py",
                      tuple(f"data_batch_{number}" for number in range(1, 6)), "test_batch",
                      {"class": "labels"}, {"class": 10}, "CIFAR10")
CIFAR100 = CifarFormat("CIFAR-100", "cifar-100-python", ("train",), "test",
                       {"fine": "fine_labels", "coarse": "coarse_labels"},
                       {"fine": 100, "coarse": 20}, "CIFAR100")


def read_labels(fmt: CifarFormat, path: Path, batch: dict[str, Any],
                rows: int) -> dict[str, np.ndarray]:
    """The label arrays of one loaded file, checked against its row count and class counts.

    Raises:
        ValueError: a label key is missing, of the wrong length, or out of range.
    """
    labels: dict[str, np.ndarray] = {}
    for attribute, key in fmt.label_keys.items():
        if key not in batch:
            raise ValueError(f"{path} has no {key!r} (keys: {', '.join(sorted(batch))}): not a "
                             f"{fmt.title} file")
        values = np.asarray(batch[key], dtype=np.int64)
        if values.shape != (rows,):
            raise ValueError(f"{path}: {len(values)} {key} for {rows} images")
        if rows and not 0 <= values.min() <= values.max() < fmt.num_classes[attribute]:
            raise ValueError(f"{path}: {key} outside 0..{fmt.num_classes[attribute] - 1}")
        labels[attribute] = values
    return labels


def read_batch(fmt: CifarFormat, path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One file's images, uint8 (N, 3, 32, 32), and labels per attribute.

    Raises:
        ValueError: the file is not a batch of this format (named in the message).
    """
    batch = load_pickle(path)
    data = batch.get("data")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != ROW_BYTES:
        shape = getattr(data, "shape", None)
        raise ValueError(f"{path}: 'data' is not uint8 rows of {ROW_BYTES} bytes (got "
                         f"{type(data).__name__} {shape}): not a {fmt.title} file")
    # Each row is three 32x32 planes (R, G, B), each row-major: exactly (3, 32, 32) in C order.
    images = data.reshape(len(data), 3, SIDE, SIDE)
    return images, read_labels(fmt, path, batch, len(data))


def read_cifar(fmt: CifarFormat, directory: Path, resolution: int) -> ImageSet:
    """The training files then the test file as one ImageSet, the test images marked.

    Args:
        fmt: :data:`CIFAR10` or :data:`CIFAR100`.
        directory: the directory holding ``fmt.files``.
        resolution: image side of the result (32: as stored).

    Returns:
        ImageSet, images (N, 3, resolution, resolution) uint8 when read (a
        :class:`~raycl.data.sources.shipped.StackedImages` of the files' arrays: resized chunk by
        chunk
        as the cache builder copies them, never all at once), labels per attribute of ``fmt``,
        ``test_mask`` marking the test file's images.
    """
    batches = [read_batch(fmt, directory / name) for name in fmt.files]
    labels = {attribute: np.concatenate([batch_labels[attribute] for _, batch_labels in batches])
              for attribute in fmt.label_keys}
    test_mask = np.concatenate([np.full(len(images), name == fmt.test_file)
                                for (images, _), name in zip(batches, fmt.files, strict=True)])
    return ImageSet(images=StackedImages([images for images, _ in batches], resolution),
                    labels=labels, test_mask=test_mask)


class CifarReader:
    """``data.dataset: cifar10`` / ``cifar100``: the python batches in ``data.root``."""

    def __init__(self, fmt: CifarFormat) -> None:
        self.fmt = fmt

    def _download(self, parent: Path) -> None:
        import torchvision.datasets

        # One call fetches and unpacks the whole archive (training and test files).
        getattr(torchvision.datasets, self.fmt.torchvision_class)(
            root=str(parent), train=True, download=True)

    def _problem(self, cfg: DataConfig) -> str | None:
        """One line naming the directory and the files it lacks, or None."""
        root = dataset_root(cfg)
        return missing_files_problem(dataset_directory(root, self.fmt.folder), self.fmt.folder,
                                     self.fmt.files, f"{self.fmt.title} python batches")

    def _directory(self, cfg: DataConfig) -> Path:
        """The directory of the files, downloaded first if asked for.

        Raises:
            ValueError: files are missing (after the download, if any).
        """
        download_if_missing(cfg, self.fmt.folder, self.fmt.files, self._download)
        problem = self._problem(cfg)
        if problem:
            raise ValueError(problem)
        return dataset_directory(dataset_root(cfg), self.fmt.folder)

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        return files_key(self._directory(cfg), self.fmt.files)

    def read(self, cfg: DataConfig, seed: int) -> ImageSet:
        return read_cifar(self.fmt, self._directory(cfg), int(cfg.resolution))

    def check(self, cfg: DataConfig) -> Problem | None:
        """The directory and the files it lacks; nothing is missing yet while
        ``data.download`` will fetch it."""
        try:
            problem = self._problem(cfg)
        except (OSError, ValueError) as error:
            return root_problem(error)
        return Problem("root", problem) if problem and not cfg.download else None

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        directory = self._directory(cfg)
        first, key = next(iter(self.fmt.label_keys.items()))
        minlength = self.fmt.num_classes[first]
        counts: dict[str, list[int]] = {}
        for part, names in (("train", self.fmt.train_files), ("test", (self.fmt.test_file,))):
            per_file = [file_label_counts(directory / name, key, minlength) for name in names]
            counts[part] = np.sum(per_file, axis=0).tolist()
        return counts

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        return counted_split_sizes(self.class_counts(cfg), cfg.val_fraction, cfg.test_fraction)


def file_label_counts(path: Path, key: str, num_classes: int) -> tuple[int, ...]:
    """Images per class of one file's ``key`` labels; remembered per (file, size, mtime), as a
    search's checks ask for split sizes several times and a file is unpickled whole."""
    stat = path.stat()
    return _label_counts(str(path), stat.st_size, stat.st_mtime_ns, key, num_classes)


@functools.lru_cache(maxsize=64)
def _label_counts(path: str, size: int, mtime_ns: int, key: str,
                  num_classes: int) -> tuple[int, ...]:
    labels = np.asarray(load_pickle(Path(path)).get(key, []), dtype=np.int64)
    if len(labels) and not 0 <= labels.min() <= labels.max() < num_classes:
        raise ValueError(f"{path}: {key} outside 0..{num_classes - 1}")
    return tuple(np.bincount(labels, minlength=num_classes).tolist())


CIFAR10_READER = CifarReader(CIFAR10)
CIFAR100_READER = CifarReader(CIFAR100)
