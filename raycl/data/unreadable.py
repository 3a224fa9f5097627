"""Which image files cannot be decoded, found before launch: each file's header and end marker
read (a bucket's files: an even sample), and the one line that names the first few.

Used by every reader of image files (a folder, ImageNet, the cache build and the stream
loader's replacement of a bad file).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from raycl.data.bucket_paths import BucketPath, is_remote, read_bytes
from raycl.data.decode import NOT_AN_IMAGE

# A local path, a bucket folder's file, or a file's URI.
ImagePath = Path | BucketPath | str
# The headers read before launch from a folder in a bucket (each a request): a sample.
REMOTE_HEADER_SAMPLE = 64


def _header_sample(paths: Sequence[ImagePath]) -> tuple[list[ImagePath], str]:
    """The files whose headers are checked, and how the message counts them: every local file;
    of files in a bucket, :data:`REMOTE_HEADER_SAMPLE` spread evenly through the (class-sorted)
    list, so every part of the listing is represented and the pick is the same every run."""
    if not paths or not is_remote(str(paths[0])) or len(paths) <= REMOTE_HEADER_SAMPLE:
        return list(paths), f"{len(paths)} image files"
    picks = np.linspace(0, len(paths) - 1, REMOTE_HEADER_SAMPLE).round().astype(int)
    return [paths[i] for i in picks], f"{REMOTE_HEADER_SAMPLE} sampled of {len(paths)} image files"


def unreadable_images(paths: Sequence[ImagePath]) -> tuple[list[tuple[str, str]], str]:
    """The files of ``paths`` that are not images Pillow can decode, each with why, in the
    order given; and how the check counts the files (``"602 image files"``).

    Reads each file's header (thousands of files a second) and its last bytes: a JPEG or PNG
    whose end marker is missing (a file cut short, the usual way a sound header hides bad data)
    is decoded whole to confirm it, so both an unopenable and a truncated file are found before
    launch. Files in a bucket (URIs) cost a request each: at most :data:`REMOTE_HEADER_SAMPLE`
    (64) of them are read, evenly spread, so that a wrong prefix or a folder of non-images is
    caught before launch; a bad file the sample misses is replaced and counted when training
    reads it in stream mode (:mod:`raycl.data.stream.files`), and found by the cache build in
    memory mode.
    """
    checked, counted = _header_sample(paths)
    unreadable = [(str(path), why) for path in checked
                  if (why := image_problem(path)) is not None]
    return unreadable, counted


def image_problem(path: ImagePath) -> str | None:
    """Why the image file ``path`` cannot be decoded, in a few words; None when it can (see
    :func:`unreadable_images`)."""
    try:
        data = read_bytes(str(path)) if is_remote(str(path)) else None
        if (len(data) if data is not None else Path(str(path)).stat().st_size) == 0:
            return "empty file"
        with Image.open(io.BytesIO(data) if data is not None else path) as image:
            if not _ends_whole(image.format, data if data is not None else path):
                image.load()  # decoded whole: a missing end marker alone is not an error
    except UnidentifiedImageError:
        return NOT_AN_IMAGE
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        return str(error)
    return None


# The bytes a file of these formats ends with (possibly followed by a little padding).
_END_MARKERS: dict[str, bytes] = {"JPEG": b"\xff\xd9", "PNG": b"IEND"}


def _ends_whole(image_format: str | None, source: bytes | ImagePath) -> bool:
    """Whether a JPEG or PNG ends with its end marker within its last 64 bytes (other formats:
    True, nothing known to check)."""
    marker = _END_MARKERS.get(image_format or "")
    if marker is None:
        return True
    if isinstance(source, bytes):
        return marker in source[-64:]
    with open(str(source), "rb") as handle:
        handle.seek(0, io.SEEK_END)
        handle.seek(max(0, handle.tell() - 64))
        return marker in handle.read()


# Unreadable files a message names before "and N more".
SHOWN_UNREADABLE = 3
SKIP_HINT = "set data.skip_unreadable: true to leave them out"


def unreadable_message(unreadable: Sequence[tuple[str, str]], counted: str,
                       hint: bool = True) -> str:
    """One line naming the first :data:`SHOWN_UNREADABLE` of ``unreadable`` ((file, why)
    pairs) with why, how many there are of ``counted``, and (``hint``: the training data, not
    a transfer set) how to leave them out."""
    shown = "; ".join(f"{name!r}: {why}" for name, why in unreadable[:SHOWN_UNREADABLE])
    more = len(unreadable) - SHOWN_UNREADABLE
    return (f"cannot read image {shown}{f' and {more} more' if more > 0 else ''} "
            f"({len(unreadable)} of {counted} unreadable){f': {SKIP_HINT}' if hint else ''}")


def unreadable_images_problem(paths: Sequence[ImagePath]) -> str | None:
    """One line naming the first few of ``paths`` that are not images Pillow can decode, with
    why, and how many are not (:func:`unreadable_message`); None when every file decodes. See
    :func:`unreadable_images` for what is read."""
    unreadable, counted = unreadable_images(paths)
    return unreadable_message(unreadable, counted) if unreadable else None


__all__ = ["REMOTE_HEADER_SAMPLE", "SHOWN_UNREADABLE", "SKIP_HINT", "image_problem",
           "unreadable_images", "unreadable_images_problem", "unreadable_message"]
