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

An image that cannot be decoded never stops a trial: when training its row is filled by a copy
of another image of the same batch, counted, and the file named in a warning (``data/skipped``
in MLflow); an evaluation pass reads :meth:`FileRows.decode` and leaves the row out of what it
scores (:mod:`raycl.worker.evaluate`; ``data/eval_skipped``), never scoring a blank image.
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


def decode_paths(
    paths: Sequence[str], resolution: int, threads: int = 1, fill: str = "copy"
) -> Decoded:
    """Decode image files (local or bucket URIs) into uint8 squares, on ``threads`` threads.

    Args:
        paths: the files, one per row.
        resolution: side of the squares.
        threads: decoding threads (Pillow releases the GIL while decoding).
        fill: what an undecodable file's row gets: ``"copy"`` a copy of another decoded row of
            the batch (training: the batch keeps its size and its pseudo-label group),
            ``"blank"`` zeros (evaluation: the rows stay aligned with their labels).
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
    if bad and fill == "copy":
        good = [row for row, error in enumerate(errors) if error is None]
        for position, row in enumerate(bad):
            if good:  # every file bad: the rows stay blank (and are all counted)
                out[row] = out[good[position % len(good)]]
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
        decoded = decode_paths(paths, self.resolution, self.threads, fill="blank")
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


def decoded_bytes(count: int, resolution: int, channels: int = 3) -> int:
    """What ``count`` decoded uint8 images of side ``resolution`` take in memory mode."""
    return int(count) * int(channels) * int(resolution) ** 2


__all__ = ["Decoded", "FileRows", "SquareImages", "decode_paths", "decoded_bytes"]
