"""Images from a folder a user points at, in the torchvision ImageFolder layout.

    root/<class name>/<image>.png|jpg|jpeg|bmp|webp

This is how data that cannot be shipped (CIFAR, CUB, Cars, ImageNet subsets) comes in. Class
indices follow the sorted names of the class folders that contain at least one image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from raycl.data import ImageSet

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp"})


def list_image_files(root: str | Path) -> list[tuple[Path, str]]:
    """All (image path, class name) pairs under root, sorted by class then file name.

    Raises:
        FileNotFoundError: root does not exist or is not a directory.
        ValueError: root holds no class folder with an image in it.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        raise FileNotFoundError(f"image folder {str(root_path)!r} does not exist")
    files = [
        (path, class_dir.name)
        for class_dir in sorted(p for p in root_path.iterdir() if p.is_dir())
        for path in sorted(class_dir.iterdir())
        if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise ValueError(
            f"no images in {str(root_path)!r}: expected root/<class>/*.png|jpg "
            f"(suffixes {', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return files


def folder_fingerprint(root: str | Path) -> list[list[str | int]]:
    """(relative path, size, mtime in ns) of every image: changes whenever the content may."""
    root_path = Path(root)
    fingerprint: list[list[str | int]] = []
    for path, _ in list_image_files(root_path):
        stat = path.stat()
        fingerprint.append([path.relative_to(root_path).as_posix(), stat.st_size,
                            stat.st_mtime_ns])
    return fingerprint


def load_square_rgb(path: Path, resolution: int) -> np.ndarray:
    """Read one image, centre-crop it to a square, resize it; uint8 (3, resolution, resolution)."""
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
    except OSError as error:  # includes PIL.UnidentifiedImageError
        raise ValueError(f"cannot read image {str(path)!r}: {error}") from error
    width, height = rgb.size
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    square = rgb.crop((left, top, left + side, top + side))
    resized = square.resize((resolution, resolution), Image.Resampling.BICUBIC)
    return np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1)


def load_image_folder(root: str, resolution: int) -> ImageSet:
    """Load every image of an ImageFolder tree as RGB uint8 squares.

    Args:
        root: directory with one sub-folder per class.
        resolution: side length of the output images.

    Returns:
        ImageSet with images (N, 3, resolution, resolution) and label "class" (index into the
        sorted class-folder names).

    Raises:
        FileNotFoundError: root does not exist.
        ValueError: no images found, or resolution < 1.
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    files = list_image_files(root)
    class_names = sorted({class_name for _, class_name in files})
    class_index = {name: index for index, name in enumerate(class_names)}
    images = np.stack([load_square_rgb(path, resolution) for path, _ in files])
    labels = np.array([class_index[class_name] for _, class_name in files], dtype=np.int64)
    return ImageSet(images=images, labels={"class": labels})
