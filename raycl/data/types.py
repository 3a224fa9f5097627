"""The types every part of :mod:`raycl.data` shares: an image set, its splits, and what a reader
of one source provides (:class:`Reader`). Imports nothing of raycl, so every reader can."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass
class ImageSet:
    """Images and their labels.

    Attributes:
        images: uint8 array (N, C, H, W).
        labels: attribute name -> int64 array (N,), e.g. {"shape", "texture", "color"}; empty
            for an unlabelled set (an image-text corpus).
        test_mask: bool array (N,) marking a test split the source ships (a folder's test/),
            or None when the test split is drawn by ``test_fraction``.
        captions: str array (N,), one caption per image (a pairs file's, or Trifeature's
            synthetic ones when data.captions is set); None for a set without text.
        pretrain_only: bool array (N,) marking images without labels that only pretraining
            uses (STL-10's unlabeled split; their label values are -1), or None.
    """

    images: np.ndarray
    labels: dict[str, np.ndarray]
    test_mask: np.ndarray | None = None
    captions: np.ndarray | None = None
    pretrain_only: np.ndarray | None = None


@dataclass
class ImageFiles:
    """An image set whose images are still files, as a reader of image files returns it: the
    cache builder decodes them on all cores straight into the cache, never all in memory.

    Attributes:
        paths: one image file per row, in row order.
        labels, test_mask, captions, pretrain_only: as :class:`ImageSet`'s, one per path.
    """

    paths: list[Path]
    labels: dict[str, np.ndarray]
    test_mask: np.ndarray | None = None
    captions: np.ndarray | None = None
    pretrain_only: np.ndarray | None = None


SPLITS: tuple[str, ...] = ("train", "val", "test")


@dataclass
class DatasetSplits:
    """A dataset split into train, validation and test, with what a model needs to know.

    Probes are fit on ``train``; a sweep selects on ``val``; ``test`` is scored once per trial.
    """

    name: str
    train: ImageSet
    val: ImageSet
    test: ImageSet
    attributes: list[str]
    num_classes: dict[str, int]
    channels: int
    resolution: int
    # Unlabelled images that pretraining uses beside ``train`` (STL-10's unlabeled split);
    # never probed, never scored. None: pretraining sees ``train`` only.
    pretrain_extra: ImageSet | None = None

    def split(self, name: str) -> ImageSet:
        """The split called ``name`` (one of :data:`SPLITS`)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
        return getattr(self, name)


class Reader(Protocol):
    """What loading needs from one source (``data.dataset``), beyond its registry entry.

    ``cfg`` is a DataConfig-like object: a reader reads only the attributes its source uses.
    """

    def content_key(self, cfg: Any, seed: int) -> dict[str, Any]:
        """Every parameter besides the dataset name and resolution that changes the images
        read (and nothing that does not): it names the cached copy."""
        ...

    def read(self, cfg: Any, seed: int) -> ImageSet | ImageFiles:
        """The full image set, generated or read (no cache); a shipped test split marked by
        ``test_mask``. A reader of image files returns :class:`ImageFiles`: the cache builder
        decodes them."""
        ...

    def check(self, cfg: Any) -> None:
        """Raise ValueError (or OSError) with one line naming what is missing or unreadable,
        before anything is launched; cheap: no image is decoded."""
        ...

    def class_counts(self, cfg: Any) -> dict[str, list[int]]:
        """Images per class of the stratifying (first) attribute, known without decoding an
        image: ``{"all": counts}``, or ``{"train": counts, "test": counts}`` (same class
        order) when the source ships its test split. An unlabelled source counts as one class
        of all its images."""
        ...
