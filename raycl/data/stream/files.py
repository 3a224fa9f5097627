"""Images that stay where they are until a batch needs them: the stream path (``data.loader:
stream``) for datasets larger than a node's memory.

In memory mode a dataset is decoded once per node into a memory-mapped cache
(:mod:`raycl.data.cache.store`). In stream mode nothing is decoded up front: a split's ``images``
is a lazy array-like that decodes the rows it is asked for, with the cache builder's decode
(:func:`raycl.data.decode.decode_square`: a file gives the same pixels in both modes).

- :class:`FileRows`: one image file per row (a folder, ImageNet's wnid folders, a pairs file;
  local paths or ``s3://`` / ``gs://`` URIs, read by :mod:`raycl.data.bucket_paths`). Random
  access: indexing decodes exactly those files, so training batches are the same samplers'
  batches as in memory mode (a global shuffle per epoch, MCL's pseudo-label batches), decoded
  by Ray Data tasks (:mod:`raycl.worker.stream_loader`).
- :class:`~raycl.data.stream.shards.ShardRows`: samples packed in shards read in sequence
  (WebDataset tar files, Parquet files with an image-bytes column). Shards are shuffled per
  epoch and samples pass through a seeded shuffle buffer.

An image that cannot be read or decoded (a failed bucket read, a corrupt file) never becomes a
copy of another image of its batch (a false negative pair) nor a blank image scored: when
training its row is filled by a spare, another sample of the training split from a neighbouring
step of the epoch (so never one of the same global batch), its index with it
(:func:`decode_batch`), counted, and the file named in a warning (``data/skipped`` in MLflow);
an evaluation pass reads :meth:`FileRows.decode` and leaves the row out of what it scores
(:mod:`raycl.worker.evaluate`; ``data/eval_skipped``). Past ``data.max_skipped_share`` of an
epoch's samples the trial fails with an error naming the files (:class:`SkipBudget`).
With ``data.skip_unreadable`` the files that fail the launch's check are not in any split at
all (:func:`raycl.data.load.streamed_unreadable`). Imports nothing of Ray: a bare GPU box can
use it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycl.data.decode import decode_square
from raycl.data.types import rows_then_rest

logger = logging.getLogger(__name__)


class SquareImages:
    """The array face of a lazy set of uint8 squares (``len`` rows of ``channels`` x
    ``resolution`` x ``resolution``): what the loop and the cache builder read of an image
    array besides its rows."""

    resolution: int

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def channels(self) -> int:
        return 3  # RGB: every image file is decoded to RGB

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), self.channels, self.resolution, self.resolution)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def nbytes(self) -> int:
        """Bytes the decoded rows would take (what memory mode would hold)."""
        return len(self) * self.channels * self.resolution * self.resolution


@dataclass
class Decoded:
    """Decoded rows: the images, and the files that could not be decoded (their rows filled).

    Attributes:
        images: uint8 (n, 3, R, R).
        skipped: the files (or shard members) whose rows were filled instead of decoded.
        reasons: why each of ``skipped`` failed, in the same order.
        rows: the rows of ``skipped`` in ``images``, in the same order.
    """

    images: np.ndarray
    skipped: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)


def decode_paths(paths: Sequence[str], resolution: int, threads: int = 1) -> Decoded:
    """Decode image files (local or bucket URIs) into uint8 squares, on ``threads`` threads; an
    undecodable file's row stays blank (zeros) and is listed in ``Decoded.rows``: never a copy
    of another row (:func:`decode_batch` fills a training batch's from spares).

    Args:
        paths: the files, one per row.
        resolution: side of the squares.
        threads: decoding threads (Pillow releases the GIL while decoding).
    """
    out = np.zeros((len(paths), 3, resolution, resolution), dtype=np.uint8)

    def one(row: int) -> str | None:
        try:
            out[row] = decode_square(paths[row], resolution)
        except (OSError, ValueError) as error:
            return str(error)
        return None

    if threads > 1 and len(paths) > 1:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raycl-stream") as pool:
            errors = list(pool.map(one, range(len(paths))))
    else:
        errors = [one(row) for row in range(len(paths))]
    bad = [row for row, error in enumerate(errors) if error is not None]
    return Decoded(out, [str(paths[row]) for row in bad], [str(errors[row]) for row in bad],
                   bad)


class FileRows(SquareImages):
    """Image files decoded when indexed: a split's images in stream mode.

    Behaves like the uint8 array (N, 3, R, R) it stands for (``len``, ``shape``, ``dtype``,
    ``ndim``, ``nbytes``, indexing by int, slice, index array or mask), but holds only the file
    names: ``rows[a:b]`` decodes those files (``fill="blank"`` for the undecodable ones, which
    :attr:`skipped` counts); :meth:`decode` also says which rows those are, so an evaluation
    pass leaves them out instead of scoring a blank image. Pickles as its file names.

    Args:
        paths: one image file per row (local paths or bucket URIs), as an object array of str.
        resolution: side of the decoded squares.
        threads: decoding threads for an indexing call.
    """

    def __init__(self, paths: Sequence[str] | np.ndarray, resolution: int, threads: int = 1):
        self.paths = np.asarray([str(path) for path in paths], dtype=object)
        self.resolution = int(resolution)
        self.threads = max(1, int(threads))
        self.skipped: list[str] = []  # files filled blank by indexing, in order met

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):
            return rows_then_rest(self, key)
        if isinstance(key, int | np.integer):
            return self._decode([self.paths[key]])[0]
        return self._decode(list(self.paths[key]))

    def _decode(self, paths: list[str]) -> np.ndarray:
        return self._decoded(paths).images

    def _decoded(self, paths: list[str]) -> Decoded:
        decoded = decode_paths(paths, self.resolution, self.threads)
        if decoded.skipped:
            self.skipped.extend(decoded.skipped)
            logger.warning("%d image(s) could not be decoded and were left blank, first %s",
                           len(decoded.skipped), decoded.reasons[0])
        return decoded

    def decode(self, start: int, stop: int) -> Decoded:
        """Rows ``start .. stop - 1`` decoded, with which of them (``rows``, counted from
        ``start``) could not be and are blank: what an evaluation pass must leave out."""
        return self._decoded(list(self.paths[start:stop]))

    def __iter__(self) -> Iterator[np.ndarray]:
        chunk = 64
        for start in range(0, len(self), chunk):
            yield from self[start:start + chunk]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype, copy=False)

    def subset(self, rows: np.ndarray) -> FileRows:
        """The rows ``rows`` (an index array) as a new FileRows."""
        return FileRows(self.paths[np.asarray(rows, dtype=np.int64)], self.resolution,
                        self.threads)

    def concat(self, other: FileRows) -> FileRows:
        """This set's rows followed by ``other``'s."""
        return FileRows(np.concatenate([self.paths, other.paths]), self.resolution, self.threads)

    def __repr__(self) -> str:
        return f"FileRows(shape={self.shape})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return FileRows, (self.paths, self.resolution, self.threads)


@dataclass
class FileBatch:
    """A training batch of files decoded: every row a distinct sample.

    Attributes:
        images: uint8 (n, 3, R, R).
        index: int64 (n,) the split index of each row's sample (a spare's where one stood in).
        skipped: the files that could not be read or decoded (the batch's and failed spares).
        reasons: why, in the same order.
    """

    images: np.ndarray
    index: np.ndarray
    skipped: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


def decode_batch(paths: Sequence[str], index: np.ndarray, spare_paths: Sequence[str],
                 spare_index: np.ndarray, resolution: int) -> FileBatch:
    """A training batch's files decoded, each undecodable one replaced by the next decodable
    spare (a sample of the split outside the batch's global step: :func:`spare_batches`), its
    row's index becoming the spare's, so captions and pseudo labels follow the pixels. No row
    is ever a copy of another.

    Raises:
        RuntimeError: more of the batch's files failed than spares could replace (naming them).
    """
    decoded = decode_paths(paths, resolution)
    index = np.array(index, dtype=np.int64)
    skipped, reasons = list(decoded.skipped), list(decoded.reasons)
    spares = iter(range(len(spare_paths)))
    for row in decoded.rows:
        for spare in spares:
            try:
                decoded.images[row] = decode_square(spare_paths[spare], resolution)
            except (OSError, ValueError) as error:
                skipped.append(str(spare_paths[spare]))
                reasons.append(str(error))
                continue
            index[row] = int(spare_index[spare])
            break
        else:
            raise RuntimeError(
                f"data: {len(skipped)} files of one batch of {len(paths)} could not be read or "
                f"decoded, more than its {len(spare_paths)} spares replace (no batch holds a "
                f"copy standing in for a failed read); first: {', '.join(skipped[:5])}")
    return FileBatch(decoded.images, index, skipped, reasons)


def spare_batches(batches: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The spares of each of an epoch's batches (one rank's, in order): the rows of the next
    batch (the last batch: the previous one's). The sampler draws an epoch without replacement,
    so another step's rows are never in this step's global batch (no rank's share of it): a
    spare never pairs a sample with itself. A single batch has none."""
    if len(batches) < 2:
        return [np.zeros(0, dtype=np.int64) for _ in batches]
    return [np.asarray(batches[number + 1 if number + 1 < len(batches) else number - 1],
                       dtype=np.int64) for number in range(len(batches))]


class TooManyUnreadable(RuntimeError):
    """More of an epoch's samples were unreadable than ``data.max_skipped_share`` allows."""


class SkipBudget:
    """An epoch's allowance of unreadable samples: ``data.max_skipped_share`` of the samples the
    epoch reads (on one rank). Past it, :meth:`add` raises :class:`TooManyUnreadable` naming
    the files, as soon as the epoch's allowance is spent (not at its end: the trial would train
    on what it skipped meanwhile)."""

    NAMED = 10  # files named in the error; the rest counted

    def __init__(self, share: float, where: str = "") -> None:
        self.share = float(share)
        self.where = where
        self.samples = 0
        self.count = 0
        self.names: list[str] = []

    def start(self, samples: int) -> None:
        """A new epoch of ``samples`` samples: nothing skipped yet."""
        self.samples, self.count, self.names = int(samples), 0, []

    def add(self, names: Sequence[str], count: int | None = None) -> None:
        """``count`` (default: ``len(names)``) more unreadable samples, ``names`` of them known.

        Raises:
            TooManyUnreadable: the epoch's allowance is spent.
        """
        self.count += len(names) if count is None else int(count)
        self.names.extend(str(name) for name in names[:max(0, self.NAMED - len(self.names))])
        allowed = self.share * self.samples
        if self.count > allowed:
            named = ", ".join(self.names) or "(not named: see the decoders' warnings)"
            raise TooManyUnreadable(
                f"data.max_skipped_share: {self.count} of the {self.samples} samples of this "
                f"epoch{self.where} could not be read or decoded, more than the {self.share:.2%} "
                f"allowed; first: {named}. Fix or remove those files (or raise "
                f"data.max_skipped_share)")


def decoded_bytes(count: int, resolution: int, channels: int = 3) -> int:
    """What ``count`` decoded uint8 images of side ``resolution`` take in memory mode."""
    return int(count) * int(channels) * int(resolution) ** 2


__all__ = ["Decoded", "FileBatch", "FileRows", "SkipBudget", "SquareImages", "TooManyUnreadable",
           "decode_batch", "decode_paths", "decoded_bytes", "spare_batches"]
