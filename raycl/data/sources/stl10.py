"""STL-10 read from the binary files its authors distribute:

    stl10_binary/   train_X.bin train_y.bin   test_X.bin test_y.bin   unlabeled_X.bin
                    (and class_names.txt, fold_indices.txt)

``data.root`` is that directory or its parent (where torchvision puts it). A ``*_X.bin`` is raw
uint8, 3 x 96 x 96 bytes per image: its red, green and blue planes, each stored column by column
(so a plane read in C order is the image transposed). A ``*_y.bin`` holds one uint8 label per
image, 1..10; read as 0..9.

As the papers use it: pretraining sees unlabeled (100 000 images) and train (5 000), probes are
fit on train and scored on test (8 000, the ``test_mask``). The unlabeled images are marked
``pretrain_only`` with label -1; ``data.pretrain_unlabeled: false`` leaves them out (and the
file need not exist). The papers train at 96x96 (``data.resolution: 96``, no resize); another
resolution is resized bicubic with antialiasing. ``data.download: true`` lets torchvision fetch
the files into ``data.root`` when they are missing.

The images are never all in memory: :meth:`Stl10Reader.read` returns them as a view over memory
maps of the files (3.1 GB at 96 px with the unlabeled split), transposed and resized only as
the cache builder copies them into the cache, chunk by chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.sources.shipped import (
    StackedImages,
    dataset_directory,
    dataset_root,
    download_if_missing,
    files_key,
    missing_files_problem,
)
from raycl.data.splits import counted_split_sizes
from raycl.data.types import ImageSet, root_problem

FOLDER = "stl10_binary"
SIDE = 96
IMAGE_BYTES = 3 * SIDE * SIDE
NUM_CLASSES = 10
# The labelled halves, in the order their images are stacked (unlabeled last).
LABELLED: tuple[str, ...] = ("train", "test")


def required_files(pretrain_unlabeled: bool) -> list[str]:
    """The files read: both labelled halves, and unlabeled_X.bin when it is pretrained on."""
    names = [f"{split}_{kind}.bin" for split in LABELLED for kind in ("X", "y")]
    return [*names, "unlabeled_X.bin"] if pretrain_unlabeled else names


def image_count(path: Path) -> int:
    """Images in a ``*_X.bin``, from its size.

    Raises:
        ValueError: the size is not a whole number of 96x96 RGB images.
    """
    size = path.stat().st_size
    if size % IMAGE_BYTES:
        raise ValueError(f"{path} is {size} bytes, not a whole number of 3x96x96 images "
                         f"({IMAGE_BYTES} bytes each): a truncated or foreign file")
    return size // IMAGE_BYTES


def read_labels(directory: Path, split: str) -> np.ndarray:
    """``<split>_y.bin`` as int64 labels 0..9, one per image of ``<split>_X.bin``.

    Raises:
        ValueError: a label outside 1..10, or a count that differs from the images'.
    """
    path = directory / f"{split}_y.bin"
    labels = np.fromfile(path, dtype=np.uint8).astype(np.int64) - 1
    if len(labels) and not 0 <= labels.min() <= labels.max() < NUM_CLASSES:
        raise ValueError(f"{path} holds labels outside 1..{NUM_CLASSES}")
    images = image_count(directory / f"{split}_X.bin")
    if len(labels) != images:
        raise ValueError(f"{path} has {len(labels)} labels for the {images} images of "
                         f"{split}_X.bin")
    return labels


def upright_images(path: Path) -> np.ndarray:
    """A read-only memory map of a ``*_X.bin`` as (N, 3, 96, 96) upright images: a view with
    the last two axes swapped, nothing read until indexed."""
    count = image_count(path)
    if count == 0:
        return np.zeros((0, 3, SIDE, SIDE), dtype=np.uint8)
    stored = np.memmap(path, dtype=np.uint8, mode="r", shape=(count, 3, SIDE, SIDE))
    return stored.transpose(0, 1, 3, 2)


def read_stl10(directory: Path, resolution: int, pretrain_unlabeled: bool) -> ImageSet:
    """train, then test, then (if asked) unlabeled, as one ImageSet whose images are read from
    the files only when indexed (:class:`~raycl.data.sources.shipped.StackedImages` over memory
    maps).

    Args:
        directory: the ``stl10_binary`` directory.
        resolution: image side of the result (96: as stored).
        pretrain_unlabeled: include unlabeled_X.bin, marked ``pretrain_only``, label -1.

    Returns:
        ImageSet with images (N, 3, resolution, resolution) uint8 when read, label "class",
        ``test_mask`` on test's images and ``pretrain_only`` on unlabeled's.

    Raises:
        ValueError: a file of the wrong size, or labels that do not fit the images.
    """
    splits = [*LABELLED, "unlabeled"] if pretrain_unlabeled else list(LABELLED)
    sources = {split: upright_images(directory / f"{split}_X.bin") for split in splits}
    labels = {split: read_labels(directory, split) for split in LABELLED}
    labels["unlabeled"] = np.full(len(sources.get("unlabeled", ())), -1, dtype=np.int64)
    part_of_row = np.concatenate([np.full(len(images), index)
                                  for index, images in enumerate(sources.values())])
    return ImageSet(images=StackedImages(list(sources.values()), resolution),
                    labels={"class": np.concatenate([labels[split] for split in sources])},
                    test_mask=part_of_row == splits.index("test"),
                    pretrain_only=(part_of_row == splits.index("unlabeled")
                                   if pretrain_unlabeled else None))


class Stl10Reader:
    """``data.dataset: stl10``: the binary files in ``data.root``."""

    def _download(self, parent: Path) -> None:
        import torchvision.datasets

        # Each split downloads the whole archive once (torchvision skips a verified copy).
        torchvision.datasets.STL10(root=str(parent), split="train+unlabeled", download=True)
        torchvision.datasets.STL10(root=str(parent), split="test", download=True)

    def _problem(self, cfg: DataConfig) -> str | None:
        """One line naming the directory and the file(s) it lacks, or None."""
        names = required_files(cfg.pretrain_unlabeled)
        directory = dataset_directory(dataset_root(cfg), FOLDER)
        missing = [name for name in names if not (directory / name).is_file()]
        if missing == ["unlabeled_X.bin"]:
            return (f"{directory} lacks unlabeled_X.bin, which pretraining on STL-10's "
                    f"unlabeled split reads: add it, or set data.pretrain_unlabeled: false")
        return missing_files_problem(directory, FOLDER, names, "STL-10 binary files")

    def _directory(self, cfg: DataConfig) -> Path:
        """The directory of the files, downloaded first if asked for.

        Raises:
            ValueError: files are missing (after the download, if any).
        """
        names = required_files(cfg.pretrain_unlabeled)
        download_if_missing(cfg, FOLDER, names, self._download)
        problem = self._problem(cfg)
        if problem:
            raise ValueError(problem)
        return dataset_directory(dataset_root(cfg), FOLDER)

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        unlabeled = cfg.pretrain_unlabeled
        return {**files_key(self._directory(cfg), required_files(unlabeled)),
                "pretrain_unlabeled": unlabeled}

    def read(self, cfg: DataConfig, seed: int) -> ImageSet:
        return read_stl10(self._directory(cfg), int(cfg.resolution), cfg.pretrain_unlabeled)

    def check(self, cfg: DataConfig) -> Problem | None:
        """The directory and the file(s) it lacks (unlabeled_X.bin with
        data.pretrain_unlabeled: false as the other way out); nothing is missing yet while
        ``data.download`` will fetch it. File sizes are checked too (no image is read)."""
        try:
            problem = self._problem(cfg)
            if problem:
                return None if cfg.download else Problem("root", problem)
            self._check_sizes(cfg)
        except (OSError, ValueError) as error:
            return root_problem(error)
        return None

    def _check_sizes(self, cfg: DataConfig) -> None:
        """Raise ValueError when a file's size does not fit its images (or labels)."""
        directory = dataset_directory(dataset_root(cfg), FOLDER)
        for split in LABELLED:
            read_labels(directory, split)
        if cfg.pretrain_unlabeled:
            image_count(directory / "unlabeled_X.bin")

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        directory = self._directory(cfg)
        return {split: np.bincount(read_labels(directory, split),
                                   minlength=NUM_CLASSES).tolist()
                for split in LABELLED}

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        return counted_split_sizes(self.class_counts(cfg), cfg.val_fraction, cfg.test_fraction)


READER = Stl10Reader()
