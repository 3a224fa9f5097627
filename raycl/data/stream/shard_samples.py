"""The samples of one shard as stored, read in sequence without decoding: WebDataset tar
members grouped by key, Parquet rows a batch at a time. For :mod:`raycl.data.stream.shards`."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from raycl.data.bucket_paths import open_random, open_stream

# Samples per Parquet batch read (the row groups are read a batch at a time).
BATCH_ROWS = 64
IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
IMAGE_COLUMNS: tuple[str, ...] = ("image", "jpg", "png")
CAPTION_COLUMNS: tuple[str, ...] = ("caption", "txt", "text")


@dataclass
class Raw:
    """One sample of a shard as stored.

    Attributes:
        position: its place in the shard (0, 1, ...).
        key: its name in the shard (a WebDataset key, a Parquet row number).
        image: the encoded image (None: the sample has none, or images were not asked for).
        caption: its caption, stripped (None: none, empty, or not asked for).
    """

    position: int
    key: str
    image: bytes | None
    caption: str | None


def _text(data: bytes) -> str | None:
    text = data.decode("utf-8", errors="replace").strip()
    return text or None


def caption_of(members: dict[str, bytes]) -> str | None:
    """A webdataset sample's caption: its ``txt`` member, else ``caption`` in its ``json``."""
    if "txt" in members and (text := _text(members["txt"])) is not None:
        return text
    if "json" in members:
        try:
            caption = json.loads(members["json"].decode("utf-8", errors="replace")).get("caption")
        except (ValueError, AttributeError):  # not JSON, or not an object
            return None
        if isinstance(caption, str) and caption.strip():
            return caption.strip()
    return None


def tar_groups(path: str, wanted: frozenset[str]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` per sample of a tar shard read as a stream: the members
    sharing a key (the name up to the first dot of its last part) and following each other.
    Only members whose extension is in ``wanted`` are read (the others are passed over)."""
    try:
        stream = open_stream(path)
    except (OSError, ValueError) as error:
        raise OSError(f"cannot open shard {path!r}: {error}") from error
    with stream:
        try:
            # "r|*": a stream read once, front to back (a bucket object), any compression.
            archive = tarfile.open(fileobj=stream, mode="r|*")  # noqa: SIM115
            key: str | None = None
            members: dict[str, bytes] = {}
            for member in archive:
                if not member.isfile():
                    continue
                member_key, extension = sample_key(member.name)
                if member_key != key:
                    if key is not None:
                        yield key, members
                    key, members = member_key, {}
                if extension in wanted:
                    handle = archive.extractfile(member)
                    members[extension] = handle.read() if handle is not None else b""
            if key is not None:
                yield key, members
        except tarfile.TarError as error:
            raise OSError(f"shard {path!r} is not a readable tar file: {error}") from error


def sample_key(name: str) -> tuple[str, str | None]:
    """A tar member's WebDataset key and extension, lower case (None without one):
    ``"a/000001.jpg"`` -> ``("a/000001", "jpg")``; the key is everything before the first dot
    of the file name."""
    directory, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), (extension.lower() if dot else None)


def webdataset_samples(path: str, images: bool, captions: bool) -> Iterator[Raw]:
    """The samples of a tar shard in order (``key`` its WebDataset key).

    Args:
        path: local path or bucket URI.
        images: read the image members (``jpg``, ``jpeg``, ``png``, ``webp``, first found).
        captions: read the caption (``txt``, else ``caption`` of the ``json``).

    Raises:
        OSError: the shard cannot be opened, or is not a (complete) tar file.
    """
    wanted = frozenset((IMAGE_EXTENSIONS if images else ()) + (("txt", "json") if captions
                                                               else ()))
    for position, (key, members) in enumerate(tar_groups(path, wanted)):
        image = next((members[ext] for ext in IMAGE_EXTENSIONS if ext in members), None)
        yield Raw(position, key, image, caption_of(members) if captions else None)


def _column(names: list[str], choices: tuple[str, ...]) -> str | None:
    lowered = {name.lower(): name for name in names}
    return next((lowered[choice] for choice in choices if choice in lowered), None)


def parquet_columns(schema_names: list[str]) -> tuple[str | None, str | None]:
    """The image and caption columns of a Parquet file with these column names (None: none)."""
    return _column(schema_names, IMAGE_COLUMNS), _column(schema_names, CAPTION_COLUMNS)


def parquet_samples(path: str, images: bool, captions: bool) -> Iterator[Raw]:
    """The rows of a Parquet shard in order (``key`` the row number), a batch of row-group rows
    at a time (never the whole file).

    Args:
        path: local path or bucket URI.
        images: read the image column (bytes, or a struct's ``bytes`` field).
        captions: read the caption column when the file has one.

    Raises:
        OSError: the file cannot be opened or read, or has no image column.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(open_random(path))
    except (OSError, ValueError, pa.ArrowException) as error:
        raise OSError(f"cannot open shard {path!r}: {error}") from error
    image_column, caption_column = parquet_columns(parquet.schema_arrow.names)
    if images and image_column is None:
        raise OSError(f"shard {path!r} has no image column ({', '.join(IMAGE_COLUMNS)})")
    columns = [name for name, use in ((image_column, images), (caption_column, captions))
               if use and name is not None]
    position = 0
    try:
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            count = batch.num_rows
            image_values: list[Any] = [None] * count
            caption_values: list[Any] = [None] * count
            if images:
                values = batch.column(image_column)
                if pa.types.is_struct(values.type):  # Hugging Face's {"bytes", "path"}
                    values = values.field("bytes")
                image_values = values.to_pylist()
            if captions and caption_column is not None:
                caption_values = batch.column(caption_column).to_pylist()
            for row in range(count):
                caption = caption_values[row]
                yield Raw(position, str(position), image_values[row],
                           caption.strip() or None if isinstance(caption, str) else None)
                position += 1
    except (OSError, ValueError, pa.ArrowException) as error:
        raise OSError(f"cannot read shard {path!r}: {error}") from error
