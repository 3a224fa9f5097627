"""The types every part of :mod:`raycl.data` shares: an image set, its splits, and what a reader
of one source provides (:class:`Reader`). Imports nothing of raycl.data (of raycl, only the
config's ground floor), so every reader can."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from raycl.config.section import Problem
from raycl.config.training import DataConfig

# An integer, a slice, an index array or a boolean mask: the row keys of an ImageRows.
RowKey = int | np.integer | slice | np.ndarray | list[int]


def rows_then_rest(images: Any, key: tuple[Any, ...]) -> np.ndarray:
    """``images[key]`` for a tuple ``key`` on an array-like whose own indexing takes row keys:
    the rows by the key's first entry, then the result by the rest (``images[:, 0]``)."""
    first, rest = (key[0], key[1:]) if key else (slice(None), ())
    picked = images[first]
    lead = () if isinstance(first, int | np.integer) else (slice(None),)
    return picked[(*lead, *rest)]


class ImageRows:
    """Some rows of a base image array (a memory-mapped cache), read only when indexed.

    A split is an index array into the full set, never a copy: reading ``view[i]``,
    ``view[a:b]`` or ``view[indices]`` copies just those rows out of ``base``, so every process
    of a node reads the one decoded copy in the OS page cache. ``np.asarray(view)`` copies all
    rows (for the rare consumer that needs the whole array).

    Args:
        base: uint8 array (M, C, H, W), typically ``np.load(..., mmap_mode="r")``.
        rows: int array (N,) of rows of ``base``, in the view's order.
    """

    def __init__(self, base: np.ndarray, rows: np.ndarray) -> None:
        self.base = base
        self.rows = np.asarray(rows, dtype=np.int64)
        if self.rows.ndim != 1:
            raise ValueError(f"rows must be one-dimensional, got shape {self.rows.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.base.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.base.dtype

    @property
    def ndim(self) -> int:
        return self.base.ndim

    @property
    def nbytes(self) -> int:
        """Bytes of the rows this view names (what a full copy would take)."""
        return len(self.rows) * int(np.prod(self.base.shape[1:])) * self.base.dtype.itemsize

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: RowKey | tuple[Any, ...]) -> np.ndarray:
        """The rows ``key`` names (int, slice, index array or boolean mask), as a fresh array;
        a tuple indexes the rows by its first entry and the result by the rest."""
        if isinstance(key, tuple):
            return rows_then_rest(self, key)
        if isinstance(key, int | np.integer):
            return np.array(self.base[self.rows[key]])
        return self._take(self.rows[key])

    def _take(self, rows: np.ndarray) -> np.ndarray:
        """Rows of ``base``: one slice read when they are consecutive, else a gather."""
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
            return np.array(self.base[int(rows[0]):int(rows[-1]) + 1])
        return np.asarray(self.base[rows])

    def __iter__(self) -> Iterator[np.ndarray]:
        chunk = 256  # rows per read: one gather per chunk rather than one per row
        for start in range(0, len(self.rows), chunk):
            yield from self._take(self.rows[start:start + chunk])

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        rows = self._take(self.rows)
        return rows if dtype is None else rows.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"ImageRows(shape={self.shape}, dtype={self.dtype})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled by file name when ``base`` is a whole memory-mapped file (a DataLoader
        worker, a Ray task), so the receiver maps the same pages instead of getting a copy."""
        base = self.base
        if isinstance(base, np.memmap) and isinstance(base.base, mmap.mmap) and base.filename:
            return _mapped_rows, (base.filename, base.offset, base.dtype.str, base.shape,
                                  self.rows)
        return ImageRows, (np.asarray(base), self.rows)

    def concat(self, other: ImageRows) -> ImageRows:
        """This view's rows followed by ``other``'s, both of the same base, as one view.

        Raises:
            ValueError: the views have different bases.
        """
        if other.base is not self.base:
            raise ValueError("ImageRows.concat needs views of the same base array")
        return ImageRows(self.base, np.concatenate([self.rows, other.rows]))


def _mapped_rows(
    filename: str, offset: int, dtype: str, shape: tuple[int, ...], rows: np.ndarray
) -> ImageRows:
    """An :class:`ImageRows` of a memory-mapped file, mapped again (unpickling)."""
    base = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
    return ImageRows(base, rows)


@dataclass
class ImageSet:
    """Images and their labels.

    Attributes:
        images: uint8 array (N, C, H, W): a reader's array, the cache's memory map, or (a
            split of :class:`DatasetSplits`) an :class:`ImageRows` view into the latter. A
            reader may return a lazy array-like instead (``shape``, ``dtype``, ``ndim``, row
            slices; CIFAR's and STL-10's resize rows as the cache builder copies them).
        labels: attribute name -> int64 array (N,), e.g. {"shape", "texture", "color"}; empty
            for an unlabelled set (an image-text corpus).
        test_mask: bool array (N,) marking a test split the source ships (a folder's test/),
            or None when the test split is drawn by ``test_fraction``.
        captions: str array (N,), one caption per image (a pairs file's, or Trifeature's
            synthetic ones when data.captions is set); None for a set without text.
        pretrain_only: bool array (N,) marking images without labels that only pretraining
            uses (STL-10's unlabeled split; their label values are -1), or None.
    """

    images: np.ndarray | ImageRows
    labels: dict[str, np.ndarray]
    test_mask: np.ndarray | None = None
    captions: np.ndarray | None = None
    pretrain_only: np.ndarray | None = None


@dataclass
class ImageFiles:
    """An image set whose images are still files, as a reader of image files returns it: the
    cache builder decodes them on all cores straight into the cache, never all in memory.

    Attributes:
        paths: one image file per row, in row order: a local path, or a bucket URI (str) when
            the reader listed a bucket.
        labels, test_mask, captions, pretrain_only: as :class:`ImageSet`'s, one per path.
    """

    paths: list[Path | str]
    labels: dict[str, np.ndarray]
    test_mask: np.ndarray | None = None
    captions: np.ndarray | None = None
    pretrain_only: np.ndarray | None = None


SPLITS: tuple[str, ...] = ("train", "val", "test")


@dataclass
class DatasetSplits:
    """A dataset split into train, validation and test, with what a model needs to know.

    Probes are fit on ``train``; a sweep selects on ``val``; ``test`` is scored once per trial.
    The splits' images are :class:`ImageRows` views into one full set (labels and captions are
    small copies), so a split costs its index array, not its pixels.
    """

    name: str
    train: ImageSet
    val: ImageSet
    test: ImageSet
    attributes: list[str]
    num_classes: dict[str, int]
    channels: int
    resolution: int
    # Unlabelled images that pretraining uses beside ``train`` (STL-10's unlabeled split);
    # never probed, never scored. None: pretraining sees ``train`` only.
    pretrain_extra: ImageSet | None = None
    # (file, why) of the unreadable image files left out of every split
    # (data.skip_unreadable); counted as data/skipped and listed as an MLflow artifact.
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def split(self, name: str) -> ImageSet:
        """The split called ``name`` (one of :data:`SPLITS`)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
        return getattr(self, name)


class Reader(Protocol):
    """What loading and the launch's checks need from one source (``data.dataset``), beyond its
    registry entry. Every reader implements all of it: :func:`raycl.data.load.split_sizes_for`
    and the pre-launch data check (:func:`raycl.launch.checks.check_data`) call each method
    without asking whether it is there.

    ``cfg`` is the data settings (:class:`~raycl.config.training.DataConfig`: the config's
    ``data`` section, or a transfer set's, :func:`raycl.eval.transfer.transfer_data_config`):
    a reader reads only the attributes its source uses.
    """

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        """Every parameter besides the dataset name and resolution that changes the images
        read (and nothing that does not): it names the cached copy."""
        ...

    def read(self, cfg: DataConfig, seed: int) -> ImageSet | ImageFiles:
        """The full image set, generated or read (no cache); a shipped test split marked by
        ``test_mask``. A reader of image files returns :class:`ImageFiles`: the cache builder
        decodes them."""
        ...

    def check(self, cfg: DataConfig) -> Problem | None:
        """What is missing or unreadable among the source's files, before anything is
        launched: ``Problem(key, why)`` with ``key`` a key of the data section (``root``,
        ``dataset``) and ``why`` one line; None when nothing is (a generated set has nothing
        to check). Cheap (no image is decoded beyond a folder's end-marker check) and never
        raises for a bad file."""
        ...

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        """Images per class of the stratifying (first) attribute, known without decoding an
        image: ``{"all": counts}``, or ``{"train": counts, "test": counts}`` (same class
        order) when the source ships its test split. An unlabelled source counts as one class
        of all its images."""
        ...

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        """Exact train/val/test sizes loading will produce, from the listing alone (most
        readers: :func:`raycl.data.splits.counted_split_sizes` of their class counts; shards:
        whole shards)."""
        ...


def root_problem(error: OSError | ValueError) -> Problem:
    """A reader's error, raised while it looked at ``data.root``, as the problem of that key
    (the message loses the ``data.root:`` a trial's error starts with: the key names it)."""
    return Problem("root", str(error).removeprefix("data.root: "))
