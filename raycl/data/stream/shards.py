"""Samples packed in shards, read in sequence: WebDataset tar shards (img2dataset's output, e.g.
CC12M) and Parquet files with an image-bytes column. Stream mode only (``data.loader: stream``).

Layout and counts (``data.root``):

- webdataset: a directory of ``*.tar`` shards, a single ``.tar``, or a brace pattern
  ``dir/{00000..00099}.tar`` (WebDataset's convention); local or ``s3://`` / ``gs://``. A sample
  is the members sharing a key: an image (``jpg``, ``jpeg``, ``png``, ``webp``) and a caption
  (``txt``, or ``caption`` in a ``json``). Sample counts come from ``sizes.json`` beside the
  shards (``{shard file name: count}``), else img2dataset's ``<shard>_stats.json``
  (``successes``), else ``data.samples_per_shard``.
- parquet: a directory of ``*.parquet`` files (or one file); the image column is ``image``,
  ``jpg`` or ``png`` (bytes, or a struct with a ``bytes`` field as Hugging Face datasets
  write it) and the caption column ``caption``, ``txt`` or ``text`` when there is one. Counts
  come from the files' metadata.

Splits: the shards sorted by name; validation and test are whole shards from the end (at least
one each, ``data.val_fraction`` / ``data.test_fraction`` of the shards), training the rest. A
sample's index is its position in its split (the shard's ``offset`` plus its position in the
shard), so MCL's pseudo labels and the embedding passes address samples by index as in memory
mode.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycl.data.decode import decode_square
from raycl.data.stream.files import Decoded, SquareImages
from raycl.data.stream.shard_captions import read_captions as read_shard_captions
from raycl.data.stream.shard_index import Shard, ShardFormat, list_shards, split_shards
from raycl.data.stream.shard_samples import Raw, parquet_samples, webdataset_samples
from raycl.data.types import rows_then_rest

logger = logging.getLogger(__name__)

# Samples per chunk a shard reader yields: a Ray Data block stays small, the buffer fills early.
CHUNK = 64
# Skipped samples named one by one in the log per shard; the rest are counted.
_NAMED_SKIPS = 5


@dataclass
class Chunk:
    """Consecutive samples of one shard, decoded.

    Attributes:
        images: uint8 (n, 3, R, R) of the samples that decoded.
        index: int64 (n,) their indices in the split.
        captions: their captions (None: the format or shard has none).
        skipped: ``"<shard>:<key>"`` of each sample skipped since the previous chunk.
        reasons: why each of ``skipped`` was skipped (undecodable image, no caption when one
            was required).
    """

    images: np.ndarray
    index: np.ndarray
    captions: list[str] | None
    skipped: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


def _raw_samples(shard: Shard, fmt: ShardFormat, images: bool = True,
                 captions: bool = True) -> Iterator[Raw]:
    """The stored samples of ``shard`` in order, at most ``shard.count`` of them (a shard
    holding more than listed would overlap the next one's indices)."""
    reader = webdataset_samples if fmt == "webdataset" else parquet_samples
    for raw in reader(shard.path, images, captions):
        if raw.position >= shard.count:
            logger.warning("shard %s holds more samples than the %d listed; the rest are not "
                           "read", shard.path, shard.count)
            return
        yield raw


class _SkipLog:
    """Names the first skipped samples of a shard in warnings, then counts the rest."""

    def __init__(self, shard: str) -> None:
        self.shard = shard
        self.count = 0

    def skip(self, name: str, reason: str) -> None:
        self.count += 1
        if self.count <= _NAMED_SKIPS:
            logger.warning("skipped %s: %s", name, reason)

    def close(self) -> None:
        if self.count > _NAMED_SKIPS:
            logger.warning("%d more samples of shard %s skipped (%d in all)",
                           self.count - _NAMED_SKIPS, self.shard, self.count)


def _decode(raw: Raw, resolution: int, need_captions: bool) -> tuple[np.ndarray | None, str]:
    """The decoded image of ``raw``, or None and why it is skipped."""
    if raw.image is None:
        return None, "no image"
    if need_captions and raw.caption is None:
        return None, "no caption"
    try:
        return decode_square(raw.image, resolution, raw.key), ""
    except ValueError as error:
        return None, str(error)


def read_shard(
    shard: Shard, fmt: ShardFormat, resolution: int, need_captions: bool
) -> Iterator[Chunk]:
    """The samples of ``shard`` in order, decoded (:func:`raycl.data.decode.decode_square`) in
    chunks of at most :data:`CHUNK`. Never raises for a bad sample: an undecodable image, or a
    missing caption when ``need_captions``, is skipped and reported in ``Chunk.skipped``.

    Args:
        shard: the shard; a sample's index is ``shard.offset`` plus its position in the shard.
        fmt: ``"webdataset"`` or ``"parquet"``.
        resolution: side of the decoded squares.
        need_captions: skip samples without a caption.

    Returns:
        Chunks in shard order (a chunk may hold only skipped samples: ``images`` empty).

    Raises:
        OSError: the shard itself cannot be opened or read.
    """
    log = _SkipLog(shard.path)
    images: list[np.ndarray] = []
    index: list[int] = []
    captions: list[str] = []
    skipped: list[str] = []
    reasons: list[str] = []
    has_captions = False
    for raw in _raw_samples(shard, fmt):
        name = f"{shard.path}:{raw.key}"
        image, reason = _decode(raw, resolution, need_captions)
        has_captions = has_captions or raw.caption is not None
        if image is None:
            log.skip(name, reason)
            skipped.append(name)
            reasons.append(reason)
        else:
            images.append(image)
            index.append(shard.offset + raw.position)
            captions.append(raw.caption or "")
        if len(images) + len(skipped) >= CHUNK:
            yield _chunk(images, index, captions if has_captions else None, skipped, reasons,
                         resolution)
            images, index, captions, skipped, reasons = [], [], [], [], []
    log.close()
    if images or skipped:
        yield _chunk(images, index, captions if has_captions else None, skipped, reasons,
                     resolution)


def _chunk(images: list[np.ndarray], index: list[int], captions: list[str] | None,
           skipped: list[str], reasons: list[str], resolution: int) -> Chunk:
    stacked = (np.stack(images) if images
               else np.zeros((0, 3, resolution, resolution), dtype=np.uint8))
    return Chunk(stacked, np.asarray(index, dtype=np.int64), captions, skipped, reasons)


def _columns(chunk: Chunk, previous: int, need_captions: bool,
             names: list[str]) -> dict[str, np.ndarray]:
    """A non-empty chunk as Ray Data columns. The samples skipped before a row are the gap
    between its index and the previous row's (``previous``: the index before the chunk's first
    row); ``names`` (of skipped samples, at most :data:`_NAMED_SKIPS`) go on its first row."""
    count = len(chunk.index)
    skipped = np.diff(chunk.index, prepend=previous) - 1
    skip_names = np.full(count, "[]", dtype=object)
    skip_names[0] = json.dumps(names)
    columns = {"images": chunk.images, "index": chunk.index, "skipped": skipped.astype(np.int64),
               "skip_names": skip_names}
    if need_captions:
        columns["caption"] = np.asarray(chunk.captions or [""] * count, dtype=object)
    return columns


def shard_chunks_as_columns(
    shard: Shard, fmt: ShardFormat, resolution: int, need_captions: bool
) -> Iterator[dict[str, np.ndarray]]:
    """The samples of ``shard`` as Ray Data batches of columns (for ``flat_map`` /
    ``map_batches`` over shards; picklable, as a module-level function).

    Args:
        shard, fmt, resolution, need_captions: as :func:`read_shard`'s.

    Returns:
        Per chunk with at least one good sample: ``images`` uint8 (n, 3, R, R), ``index`` int64
        (n,), ``caption`` object array of str (only when ``need_captions``), ``skipped``
        int64 (n,), the samples skipped before each row (the shard's trailing skips on its last
        row; :func:`read_shard` names them in warnings) and ``skip_names``, a JSON list per row
        naming some of them (the shard's first few, so the trial's error can name files). A
        shard without a good sample yields nothing (and is named in a warning); a shard that
        cannot be read on (truncated, gone) ends there, its remaining samples counted as
        skipped. Never raises.
    """
    held: dict[str, np.ndarray] | None = None  # kept back: trailing skips join its last row
    previous = shard.offset - 1  # index of the last good sample so far
    seen = 0  # samples of the shard read so far, good or skipped
    names: list[str] = []  # skipped samples not yet on a row (at most _NAMED_SKIPS a shard)
    named = 0
    try:
        for chunk in read_shard(shard, fmt, resolution, need_captions):
            seen += len(chunk.index) + len(chunk.skipped)
            taken = chunk.skipped[:max(0, _NAMED_SKIPS - named)]
            names.extend(taken)
            named += len(taken)
            if not len(chunk.index):
                continue
            if held is not None:
                yield held
            held, names = _columns(chunk, previous, need_captions, names), []
            previous = int(chunk.index[-1])
    except OSError as error:
        # A shard truncated or unreadable mid-epoch: the rest of it is skipped and counted,
        # never a crash of the trial (a shard missing at launch is refused before it).
        logger.warning("shard %s unreadable after %d of %d samples, the rest skipped: %s",
                       shard.path, seen, shard.count, error)
        names.append(f"{shard.path} (unreadable after sample {seen}: {error})")
        seen = max(seen, shard.count)
    trailing = shard.offset + seen - 1 - previous  # after the last good sample
    if held is None:
        logger.warning("shard %s has no sample that could be read (%d skipped)", shard.path,
                       trailing)
        return
    held["skipped"][-1] += trailing
    if names:  # skipped after the last good sample: named on its row too
        last = held["skip_names"]
        last[-1] = json.dumps(json.loads(str(last[-1])) + names)
    yield held


class ShardRows(SquareImages):
    """The samples of some shards, as the lazy images of a split in stream mode.

    Behaves like the uint8 array (N, 3, R, R) it stands for as far as the loop needs
    (``len``, ``shape``, ``dtype``, ``ndim``, ``nbytes``; small reads by slice or index array,
    e.g. diagnostics' first images), reading shards in sequence; undecodable samples' rows are
    blank and counted in :attr:`skipped` (:meth:`decode_rows` says which). Pickles as its shard
    list (and its selected rows).

    Args:
        shards, fmt, resolution: the split's shards, their format, the decoded side.
        selected: the split's rows this set stands for, in order (:meth:`subset`; None: all).
    """

    def __init__(self, shards: list[Shard], fmt: ShardFormat, resolution: int,
                 selected: np.ndarray | None = None) -> None:
        self.shards = shards
        self.fmt = fmt
        self.resolution = int(resolution)
        self.selected = None if selected is None else np.asarray(selected, dtype=np.int64)
        self.skipped: list[str] = []

    def __len__(self) -> int:
        if self.selected is not None:
            return len(self.selected)
        return sum(shard.count for shard in self.shards)

    def subset(self, rows: np.ndarray) -> ShardRows:
        """The rows ``rows`` (an index array) as a new ShardRows, nothing read (an evaluation's
        capped or decodable rows)."""
        rows = np.asarray(rows, dtype=np.int64)
        return ShardRows(self.shards, self.fmt, self.resolution,
                         rows if self.selected is None else self.selected[rows])

    def _range_images(self, start: int, stop: int) -> Iterator[np.ndarray | None]:
        """Images of rows ``start .. stop - 1`` in order; rows in increasing split order (all,
        or a sorted selection) are streamed, each shard read once."""
        split = (np.arange(start, stop, dtype=np.int64) if self.selected is None
                 else self.selected[start:stop])
        if len(split) < 2 or bool(np.all(np.diff(split) > 0)):
            yield from self._images(split)
            return
        unique, inverse = np.unique(split, return_inverse=True)
        images = list(self._images(unique))
        for row in inverse.reshape(-1):
            yield images[int(row)]

    def _starts(self) -> np.ndarray:
        """Index of each shard's first sample, and the total at the end."""
        return np.cumsum([0] + [shard.count for shard in self.shards])

    def _read(self, shard: Shard, positions: np.ndarray) -> Iterator[np.ndarray | None]:
        """The decoded images at the sorted ``positions`` of ``shard``, in order: None for a
        sample that is undecodable or that the shard does not hold (named, counted)."""
        log = _SkipLog(shard.path)
        wanted = iter(positions.tolist())
        target = next(wanted, None)
        samples = _raw_samples(shard, self.fmt, captions=False)
        try:
            for raw in samples:  # positions 0, 1, 2, ...: each wanted one is met in turn
                if target is None:
                    break
                if raw.position != target:
                    continue
                name = f"{shard.path}:{raw.key}"
                image, reason = _decode(raw, self.resolution, need_captions=False)
                if image is None:
                    log.skip(name, reason)
                    self.skipped.append(name)
                yield image
                target = next(wanted, None)
        finally:
            samples.close()  # a read that stops early closes the shard's stream now
        while target is not None:  # the shard holds fewer samples than listed
            name = f"{shard.path}:#{target}"
            log.skip(name, "the shard ends before it")
            self.skipped.append(name)
            yield None
            target = next(wanted, None)
        log.close()

    def _images(self, indices: np.ndarray) -> Iterator[np.ndarray | None]:
        """Images at the sorted unique ``indices`` (split indices), in order, each shard read
        once and only up to its last wanted sample."""
        starts = self._starts()
        for number, shard in enumerate(self.shards):
            low, high = np.searchsorted(indices, starts[number:number + 2])
            if high > low:
                yield from self._read(shard, indices[low:high] - starts[number])

    def rows(self, start: int, stop: int, batch_size: int) -> Iterator[np.ndarray]:
        """Samples ``start .. stop - 1`` in order as uint8 batches of ``batch_size`` (the last
        shorter), reading only the shards that hold them; an undecodable sample's row is blank
        (counted in :attr:`skipped`; :meth:`decode_rows` says which rows those are).

        Raises:
            ValueError: ``batch_size`` is below 1.
            OSError: a shard cannot be opened or read.
        """
        for decoded in self.decode_rows(start, stop, batch_size):
            yield decoded.images

    def decode_rows(self, start: int, stop: int, batch_size: int) -> Iterator[Decoded]:
        """As :meth:`rows`, each batch with the rows (counted from the batch's first) whose
        sample could not be read or decoded: what an embedding pass marks and its scoring
        leaves out, never scoring a blank image.

        Raises:
            ValueError: ``batch_size`` is below 1.
            OSError: a shard cannot be opened or read.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        start, stop = max(0, int(start)), min(len(self), int(stop))
        side = self.resolution

        def empty(count: int) -> Decoded:
            return Decoded(np.zeros((count, 3, side, side), dtype=np.uint8))

        batch, filled = empty(min(batch_size, max(0, stop - start))), 0
        for image in self._range_images(start, stop):
            if image is not None:
                batch.images[filled] = image
            else:
                batch.rows.append(filled)
                batch.skipped.append(self.skipped[-1])
            filled += 1
            if filled == len(batch.images):
                yield batch
                start += filled
                batch, filled = empty(min(batch_size, stop - start)), 0

    def _indices(self, key: Any) -> np.ndarray | int:
        """``key`` as non-negative row indices (an int stays an int)."""
        total = len(self)
        if isinstance(key, int | np.integer):
            index = int(key) + (total if key < 0 else 0)
            if not 0 <= index < total:
                raise IndexError(f"index {key} out of range for {total} rows")
            return index
        if isinstance(key, slice):
            return np.arange(*key.indices(total), dtype=np.int64)
        indices = np.asarray(key)
        if indices.dtype == bool:
            return np.flatnonzero(indices)
        indices = indices.astype(np.int64) + np.where(indices < 0, total, 0)
        if len(indices) and (indices.min() < 0 or indices.max() >= total):
            raise IndexError(f"an index of {key!r} is out of range for {total} rows")
        return indices

    def __getitem__(self, key: Any) -> np.ndarray:
        """The rows ``key`` names (int, slice, index array or mask), decoded; undecodable rows
        blank. A tuple indexes the rows by its first entry and the result by the rest."""
        if isinstance(key, tuple):
            return rows_then_rest(self, key)
        indices = self._indices(key)
        if isinstance(indices, int):
            return self[np.array([indices])][0]
        if self.selected is not None:
            indices = self.selected[indices]
        unique, inverse = np.unique(indices, return_inverse=True)
        side = self.resolution
        images = np.zeros((len(unique), 3, side, side), dtype=np.uint8)
        for row, image in enumerate(self._images(unique)):
            if image is not None:
                images[row] = image
        return images[inverse.reshape(-1)]

    def __repr__(self) -> str:
        return f"ShardRows({len(self.shards)} {self.fmt} shards, shape={self.shape})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return ShardRows, (self.shards, self.fmt, self.resolution, self.selected)


def read_captions(shards: list[Shard], fmt: ShardFormat) -> np.ndarray | None:
    """Every caption of ``shards`` (text only: no image is read; a tar's image members are
    seeked over), one per listed sample in index order; ``""`` for a sample without one (or
    that the shard does not hold): :func:`raycl.data.stream.shard_captions.read_captions`.

    Returns:
        object array (N,) of str, or None when no sample has a caption.

    Raises:
        OSError: a shard cannot be opened or read.
    """
    return read_shard_captions([(shard.path, shard.count) for shard in shards], fmt)


__all__ = ["CHUNK", "Chunk", "Shard", "ShardFormat", "ShardRows", "list_shards",
           "read_captions", "read_shard", "shard_chunks_as_columns", "split_shards"]
