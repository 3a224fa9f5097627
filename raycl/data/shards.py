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

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

ShardFormat = Literal["webdataset", "parquet"]
# Samples per chunk a shard reader yields: a Ray Data block stays small, the buffer fills early.
CHUNK = 64


@dataclass(frozen=True)
class Shard:
    """One shard file of a split.

    Attributes:
        path: local path or bucket URI.
        count: samples it holds (as listed; a sample that cannot be decoded is skipped).
        offset: index, in its split, of its first sample.
    """

    path: str
    count: int
    offset: int


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


def read_shard(
    shard: Shard, fmt: ShardFormat, resolution: int, need_captions: bool
) -> Iterator[Chunk]:
    """The samples of ``shard`` in order, decoded (:func:`raycl.data.streamed.decode_square_rgb`)
    in chunks of at most :data:`CHUNK`. Never raises for a bad sample: an undecodable image, or
    a missing caption when ``need_captions``, is skipped and reported in ``Chunk.skipped``.

    Raises:
        OSError: the shard itself cannot be opened or read.
    """
    raise NotImplementedError


class ShardRows:
    """The samples of some shards, as the lazy images of a split in stream mode.

    Behaves like the uint8 array (N, 3, R, R) it stands for as far as the loop needs
    (``len``, ``shape``, ``dtype``, ``ndim``, ``nbytes``; small reads by slice or index array,
    e.g. diagnostics' first images), reading shards in sequence; undecodable samples' rows are
    blank and counted in :attr:`skipped`. Pickles as its shard list.
    """

    def __init__(self, shards: list[Shard], fmt: ShardFormat, resolution: int) -> None:
        self.shards = shards
        self.fmt = fmt
        self.resolution = int(resolution)
        self.skipped: list[str] = []

    def __len__(self) -> int:
        return sum(shard.count for shard in self.shards)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), 3, self.resolution, self.resolution)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8)

    @property
    def ndim(self) -> int:
        return 4

    @property
    def nbytes(self) -> int:
        return len(self) * 3 * self.resolution * self.resolution

    def rows(self, start: int, stop: int, batch_size: int) -> Iterator[np.ndarray]:
        """Samples ``start .. stop - 1`` in order as uint8 batches of ``batch_size`` (the last
        shorter), reading only the shards that hold them; an undecodable sample's row is blank
        (counted in :attr:`skipped`). What an embedding pass reads for its rank's range."""
        raise NotImplementedError

    def __getitem__(self, key: Any) -> np.ndarray:
        raise NotImplementedError


def list_shards(cfg: Any, fmt: ShardFormat) -> list[Shard]:
    """Every shard of ``cfg.root`` sorted by name with its sample count (offsets over all of
    them; :func:`split_shards` re-bases them per split).

    Raises:
        ValueError: no shard found, a shard named by the brace pattern or by sizes.json missing,
            no sample count for a shard (neither sizes.json, a _stats.json nor
            ``data.samples_per_shard``), or the bucket cannot be listed: one line naming
            ``data.root`` and what is wrong.
    """
    raise NotImplementedError


def split_shards(
    shards: list[Shard], val_fraction: float, test_fraction: float
) -> dict[str, list[Shard]]:
    """``{"train", "val", "test"}`` shards (see the module docstring), offsets re-based per split.

    Raises:
        ValueError: fewer than three shards (each split needs one).
    """
    raise NotImplementedError


__all__ = ["CHUNK", "Chunk", "Shard", "ShardFormat", "ShardRows", "list_shards", "read_shard",
           "split_shards"]
