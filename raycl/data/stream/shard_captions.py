"""The captions of held-out shards (validation, test), read when scored and nothing else.

Only the rank that scores image-text retrieval reads a held-out split's captions, and only when
it does: :class:`ShardCaptions` stands for the split's captions and reads them on first use
(every other rank, and a method without text, never opens a held-out shard for them). A tar
shard is read by its headers: a member's header gives its size, so the image members are
seeked over and only the caption members (``txt``, else ``json``) are read. A local file is read
a small block at a time; a bucket object (pyarrow's random-access input file, one ranged GET per
block) a larger block at a time, so a member smaller than a block costs no extra request and a
larger one is skipped. A compressed tar cannot be seeked: it is read front to back as before.
Parquet files read their caption column only.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raycl.data.bucket_paths import is_remote, open_random
from raycl.data.stream.shard_samples import (
    caption_of,
    parquet_samples,
    sample_key,
    webdataset_samples,
)

# Bytes read at once from a local file / a bucket object when reading a tar shard's headers.
LOCAL_BLOCK = 4 * 2**10
REMOTE_BLOCK = 2**20
# Shard members that may hold a caption, in the order they are asked (caption_of's order).
CAPTION_MEMBERS: tuple[str, ...] = ("txt", "json")


@dataclass
class ReadStats:
    """What reading captions cost: shards opened and bytes read from them."""

    opened: int = 0
    bytes_read: int = 0


class _ReadAhead:
    """A seekable file read ``block`` bytes at a time (what ``tarfile`` asks of its file: ``read``,
    ``seek``, ``tell``), counting the bytes read from the file in ``stats``."""

    def __init__(self, raw: Any, block: int, stats: ReadStats) -> None:
        self.raw, self.block, self.stats = raw, block, stats
        self.position = 0
        self.start, self.data = 0, b""  # the block held: its offset and bytes

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1:
            offset += self.position
        elif whence == 2:
            offset += int(self.raw.seek(0, 2))
        self.position = int(offset)
        return self.position

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while size < 0 or len(out) < size:
            within = self.position - self.start
            if not 0 <= within < len(self.data):
                self.raw.seek(self.position)
                wanted = self.block if size < 0 else max(self.block, size - len(out))
                self.start, self.data = self.position, bytes(self.raw.read(wanted))
                self.stats.bytes_read += len(self.data)
                within = 0
                if not self.data:  # the end of the file
                    break
            piece = self.data[within:] if size < 0 else self.data[within:within + size - len(out)]
            out += piece
            self.position += len(piece)
        return bytes(out)

    def close(self) -> None:
        self.raw.close()


def _open_seekable(path: str) -> tuple[Any, int]:
    """``path`` opened for random access, and the block to read it by.

    Raises:
        OSError: it cannot be opened.
    """
    if is_remote(path):
        return open_random(path), REMOTE_BLOCK
    return open(path, "rb"), LOCAL_BLOCK  # the caller closes it


def _group_caption(archive: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> str | None:
    """The caption of one sample from its members' headers: ``txt`` read first, ``json`` only
    when that gives none."""
    read: dict[str, bytes] = {}
    for extension in CAPTION_MEMBERS:
        if extension in members:
            handle = archive.extractfile(members[extension])
            read[extension] = handle.read() if handle is not None else b""
            caption = caption_of(read)
            if caption is not None:
                return caption
    return None


def _seeked_captions(archive: tarfile.TarFile) -> Iterator[str | None]:
    """The caption of each sample of an uncompressed tar, in order (samples grouped by key as
    :func:`raycl.data.stream.shard_samples.tar_groups` groups them)."""
    key: str | None = None
    members: dict[str, tarfile.TarInfo] = {}
    for member in archive:
        if not member.isfile():
            continue
        member_key, extension = sample_key(member.name)
        if member_key != key:
            if key is not None:
                yield _group_caption(archive, members)
            key, members = member_key, {}
        if extension in CAPTION_MEMBERS:
            members[extension] = member
    if key is not None:
        yield _group_caption(archive, members)


def webdataset_captions(path: str, stats: ReadStats) -> Iterator[str | None]:
    """The caption of each sample of a tar shard, in order, read by seeking over the other
    members (a compressed tar: read front to back).

    Raises:
        OSError: the shard cannot be opened, or is not a (complete) tar file.
    """
    try:
        raw, block = _open_seekable(path)
    except (OSError, ValueError) as error:
        raise OSError(f"cannot open shard {path!r}: {error}") from error
    stats.opened += 1
    reader = _ReadAhead(raw, block, stats)
    try:
        try:
            archive = tarfile.open(fileobj=reader, mode="r:")  # type: ignore[call-overload]  # noqa: SIM115
        except tarfile.ReadError:  # compressed: no seeking; the stream reader's way
            for sample in webdataset_samples(path, images=False, captions=True):
                yield sample.caption
            return
        try:
            yield from _seeked_captions(archive)
        except tarfile.TarError as error:
            raise OSError(f"shard {path!r} is not a readable tar file: {error}") from error
    finally:
        reader.close()


def read_captions(shards: Sequence[tuple[str, int]], fmt: str,
                  stats: ReadStats | None = None) -> np.ndarray | None:
    """Every caption of ``shards`` (``(path, listed count)``; text only, no image is read), one
    per listed sample in index order; ``""`` for a sample without one (or that the shard does
    not hold).

    Returns:
        object array (N,) of str, or None when no sample has a caption.

    Raises:
        OSError: a shard cannot be opened or read.
    """
    stats = stats if stats is not None else ReadStats()
    captions = np.full(sum(count for _, count in shards), "", dtype=object)
    found, start = False, 0
    for path, count in shards:
        if fmt == "webdataset":
            texts: Iterator[str | None] = webdataset_captions(path, stats)
        else:
            stats.opened += 1
            texts = (sample.caption for sample in parquet_samples(path, False, True))
        for position, caption in enumerate(texts):
            if position >= count:  # more than listed: the next shard's indices
                break
            if caption is not None:
                captions[start + position] = caption
                found = True
        start += count
    return captions if found else None


@dataclass
class _Read:
    """The captions of a split once read, shared by its views (None: not read yet)."""

    values: np.ndarray | None = None
    done: bool = False
    stats: ReadStats = field(default_factory=ReadStats)


class ShardCaptions:
    """A held-out split's captions, read on first use (see the module docstring).

    Stands where :attr:`raycl.data.types.ImageSet.captions` holds an array: ``len``, an int
    index (a caption), a slice, index array or mask (a view, still unread), iteration,
    ``np.asarray`` and ``tolist`` (these read). A split none of whose samples has a caption
    reads as all ``""``: :func:`present_captions` tells it from one that has captions. Pickles
    as its shard list (unread).

    Args:
        shards: ``(path, listed count)`` of the split's shards, in index order.
        fmt: ``"webdataset"`` or ``"parquet"``.
    """

    def __init__(self, shards: Sequence[tuple[str, int]], fmt: str,
                 rows: np.ndarray | None = None, read: _Read | None = None) -> None:
        self.shards = [(str(path), int(count)) for path, count in shards]
        self.fmt = fmt
        self.rows = rows
        self._read = read if read is not None else _Read()

    @property
    def stats(self) -> ReadStats:
        """Shards opened and bytes read for these captions so far."""
        return self._read.stats

    def loaded(self) -> np.ndarray | None:
        """The captions (read now, the first time), or None when the split has none.

        Raises:
            OSError: a shard cannot be opened or read.
        """
        if not self._read.done:
            self._read.values = read_captions(self.shards, self.fmt, self._read.stats)
            self._read.done = True
        values = self._read.values
        if values is None or self.rows is None:
            return values
        return values[self.rows]

    def _array(self) -> np.ndarray:
        values = self.loaded()
        return values if values is not None else np.full(len(self), "", dtype=object)

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else sum(c for _, c in self.shards)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int | np.integer):
            return self._array()[int(key)]
        rows = np.arange(len(self))[key]
        if self.rows is not None:
            rows = self.rows[rows]
        return ShardCaptions(self.shards, self.fmt, np.asarray(rows, dtype=np.int64),
                             self._read)

    def __iter__(self) -> Iterator[str]:
        return iter(self._array().tolist())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        values = self._array()
        return values if dtype is None else values.astype(dtype)

    def tolist(self) -> list[str]:
        return list(self._array().tolist())

    def __repr__(self) -> str:
        return f"ShardCaptions({len(self.shards)} {self.fmt} shards, {len(self)} rows)"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return ShardCaptions, (self.shards, self.fmt, self.rows)


def present_captions(captions: Any) -> Any:
    """``captions`` as a scorer uses them: a :class:`ShardCaptions` read now (None when its
    split has none); anything else as it is."""
    return captions.loaded() if isinstance(captions, ShardCaptions) else captions


__all__ = ["LOCAL_BLOCK", "REMOTE_BLOCK", "ReadStats", "ShardCaptions", "present_captions",
           "read_captions", "webdataset_captions"]
