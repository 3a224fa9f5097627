"""Fashion-MNIST as its authors ship it (``data.dataset: fashion_mnist``): 70 000 real 28x28 grey
images of 10 garment classes, read from the Debian package dataset-fashion-mnist
(``/usr/share/datasets/fashion-mnist/``, the four IDX files).

The package's ``train`` files (60 000 images) are training, and validation is carved from them
(``data.val_fraction``, stratified); its ``t10k`` files (10 000) are the test split
(``test_mask``; ``data.test_fraction`` unused), as CIFAR's test batch is. One channel, attribute
``garment``. ``data.num_samples`` keeps CPU runs small: that many images, class-balanced, drawn
from the two files in the package's 6:1 proportion (seeded); None reads all 70 000, one cache
for every seed. Unlike ``mnist_fashion`` (MNIST⊕Fashion-MNIST: a digit and a garment as two
channels, at most 5 000 pairs), nothing is paired or generated here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.sources import packaged
from raycl.data.sources.shipped import StackedImages
from raycl.data.splits import counted_split_sizes
from raycl.data.types import ImageSet

NUM_CLASSES = 10
# Images per garment class in the package's files: Fashion-MNIST is exactly balanced, so split
# sizes are known without reading a file (the check runs before the package is looked at).
TRAIN_PER_CLASS, TEST_PER_CLASS = 6000, 1000
TOTAL = NUM_CLASSES * (TRAIN_PER_CLASS + TEST_PER_CLASS)


def drawn_counts(num_samples: int | None) -> tuple[int | None, int | None]:
    """(train, test) images drawn for ``data.num_samples``: None for all of a file, else the
    package's 6:1 proportion with at least one test image.

    Raises:
        ValueError: ``num_samples`` outside [2, 70 000].
    """
    if num_samples is None:
        return None, None
    if not 2 <= num_samples <= TOTAL:
        raise ValueError(f"num_samples must be in [2, {TOTAL}] (Fashion-MNIST's images), got "
                         f"{num_samples}")
    test = max(1, round(num_samples * TEST_PER_CLASS / (TRAIN_PER_CLASS + TEST_PER_CLASS)))
    return num_samples - test, test


def balanced_counts(total: int) -> list[int]:
    """Images per class of a :func:`~raycl.data.sources.packaged.balanced_subset` of ``total``
    (counts differ by at most one; which classes get one more does not change split sizes)."""
    return [total // NUM_CLASSES + (1 if label < total % NUM_CLASSES else 0)
            for label in range(NUM_CLASSES)]


def make_fashion_mnist(num_samples: int | None, resolution: int, seed: int) -> ImageSet:
    """The package's training images then its test images, one channel, the test ones marked.

    Args:
        num_samples: images to draw, class-balanced within each file (:func:`drawn_counts`);
            None: all 70 000, in the files' order.
        resolution: side of the images (28: as stored; else resized as the cache copies them).
        seed: seeds which images are drawn (unused when ``num_samples`` is None).

    Returns:
        ImageSet, images (N, 1, resolution, resolution) uint8, label "garment", ``test_mask``
        marking the rows of the ``t10k`` files.

    Raises:
        FileNotFoundError: the Debian package dataset-fashion-mnist is not installed.
    """
    rng = np.random.default_rng(seed)
    images, labels, test = [], [], []
    for split, count in zip(packaged.FASHION_SPLITS, drawn_counts(num_samples), strict=True):
        split_images, split_labels = packaged.read_fashion_split(split)
        if count is not None:
            # Sorted: the drawn rows keep the file's order.
            rows = np.sort(packaged.balanced_subset(split_labels, count, rng))
            split_images, split_labels = split_images[rows], split_labels[rows]
        images.append(split_images[:, None])
        labels.append(split_labels)
        test.append(np.full(len(split_labels), split == "t10k"))
    return ImageSet(images=StackedImages(images, resolution),
                    labels={"garment": np.concatenate(labels)}, test_mask=np.concatenate(test))


class FashionMnistReader:
    """``data.dataset: fashion_mnist``: :func:`make_fashion_mnist` of ``data.num_samples``."""

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        if cfg.num_samples is None:
            return {"num_samples": None}  # the whole package: the same images for every seed
        return {"num_samples": int(cfg.num_samples), "seed": int(seed)}

    def read(self, cfg: DataConfig, seed: int) -> ImageSet:
        return make_fashion_mnist(cfg.num_samples, int(cfg.resolution), seed)

    def check(self, cfg: DataConfig) -> Problem | None:
        """The Debian package's four files are there."""
        files = [path for split in packaged.FASHION_SPLITS
                 for path in packaged.fashion_mnist_files(split)]
        if all(path.is_file() for path in files):
            return None
        return Problem("dataset", f"fashion_mnist needs Fashion-MNIST in "
                                  f"{packaged.FASHION_MNIST_DIR} (Debian package "
                                  f"{packaged.FASHION_MNIST_PACKAGE})")

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        train, test = drawn_counts(cfg.num_samples)
        if train is None or test is None:
            return {"train": [TRAIN_PER_CLASS] * NUM_CLASSES,
                    "test": [TEST_PER_CLASS] * NUM_CLASSES}
        return {"train": balanced_counts(train), "test": balanced_counts(test)}

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        return counted_split_sizes(self.class_counts(cfg), cfg.val_fraction, cfg.test_fraction)


READER = FashionMnistReader()
