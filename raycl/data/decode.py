"""The one image decode of raycl: an encoded image (a file, a bucket URI or bytes) to a uint8
RGB square.

Every path that turns an image file into pixels calls :func:`decode_square`: the cache builder
(memory mode, :mod:`raycl.data.cache.build`), stream mode's files and shards
(:mod:`raycl.data.stream.files`, :mod:`raycl.data.stream.shards`) and evaluation sets read
from disk (:mod:`raycl.eval.mmvp`). The same file therefore gives the same pixels whichever
way a trial reads it: a model trained on streamed batches is scored on the pixels the cache
holds.

A JPEG of more than twice the target side is decoded at a reduced scale first (Pillow's
``draft``: the DCT scaled by 1/2, 1/4 or 1/8, never below twice the side), which is several
times cheaper than a whole decode followed by the resize, for the cache's first build as for
every streamed batch. Memory mode's caches built before this decode was shared held whole
decodes: :data:`raycl.data.cache.store.CACHE_VERSION` 3 rebuilds them once. Imports nothing of
raycl besides :mod:`raycl.data.bucket_paths`.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from raycl.data.bucket_paths import is_remote, read_bytes

# What a file Pillow cannot identify is, in the words of the launch's check
# (raycl.data.unreadable.image_problem): its own message names a BytesIO, not the file.
NOT_AN_IMAGE = "not an image Pillow can decode"


def decode_square(source: bytes | Path | str, resolution: int,
                  name: str | None = None) -> np.ndarray:
    """Decode one image, centre-crop it to a square and resize it (bicubic).

    Args:
        source: the encoded bytes, a local file, or a bucket URI (``s3://``, ``gs://``: read
            through :mod:`raycl.data.bucket_paths`).
        resolution: side of the square in pixels.
        name: what an error calls the image (default: ``source`` when it is a path, else
            ``"image"``).

    Returns:
        uint8 (3, resolution, resolution).

    Raises:
        ValueError: ``cannot read image '<name>': <why>``: the file cannot be read, or its
            bytes are not an image Pillow can decode.

    Example:
        >>> decode_square(Path("cat.jpg"), 32).shape  # doctest: +SKIP
        (3, 32, 32)
    """
    label = name if name is not None else "image" if isinstance(source, bytes) else str(source)
    try:
        if isinstance(source, bytes):
            opened: io.BytesIO | Path | str = io.BytesIO(source)
        else:
            opened = io.BytesIO(read_bytes(str(source))) if is_remote(str(source)) else source
        with Image.open(opened) as image:
            if image.format == "JPEG":  # decoded at >= twice the side: see the module docstring
                image.draft("RGB", (2 * resolution, 2 * resolution))
            rgb = image.convert("RGB")
    except UnidentifiedImageError as error:
        raise ValueError(f"cannot read image {label!r}: {NOT_AN_IMAGE}") from error
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"cannot read image {label!r}: {error}") from error
    return square_rgb(rgb, resolution)


def square_rgb(rgb: Image.Image, resolution: int) -> np.ndarray:
    """An RGB image centre-cropped to a square and resized (bicubic): uint8 (3, resolution,
    resolution)."""
    width, height = rgb.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    square = rgb.crop((left, top, left + side, top + side))
    resized = square.resize((resolution, resolution), Image.Resampling.BICUBIC)
    return np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)


__all__ = ["NOT_AN_IMAGE", "decode_square", "square_rgb"]
