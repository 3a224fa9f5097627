"""Images from a folder a user points at, in the torchvision ImageFolder layout, or without labels.

Two layouts (``data.layout``):

    flat:        root/<class name>/<image>.png|jpg|jpeg|bmp|webp
                 one pool, split into train/val/test by data.val_fraction and data.test_fraction
                 (stratified by class); or root/<image> with no class folders: unlabelled
                 images, split at random, scored by the label-free figures (eval.label_free)
    train_test:  root/train/<class name>/<image>   root/test/<class name>/<image>
                 the split the dataset ships (CUB-200, Stanford Cars, FGVC-Aircraft): test is
                 exactly test/, validation is a stratified data.val_fraction share of train/

``auto`` (the default) picks train_test when root/train/ and root/test/ both hold class folders
(and no images of their own), flat otherwise. Class indices follow the sorted names of the class
folders that contain at least one image; in the train_test layout they are the sorted union of
both halves' class names, so an index means the same class in train and test. A class with test
images but no training images is an error: a probe fit on train could never predict it.

``root`` may be a bucket URI (``s3://bucket/prefix``, ``gs://...``; pyarrow's file systems,
:mod:`raycl.data.bucket_paths`): the same layouts are listed from the bucket, rows hold the
files' URIs, and the images are decoded from the bucket (stream mode: when a batch needs them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.bucket_paths import BucketPath, as_listed, is_remote, root_path
from raycl.data.cache.manifest import node_listed, node_remembered
from raycl.data.listed_once import remembered
from raycl.data.splits import counted_split_sizes, unlabelled_split_sizes
from raycl.data.types import ImageFiles
from raycl.data.unreadable import unreadable_images, unreadable_message

T = TypeVar("T")

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp"})
LAYOUTS: tuple[str, ...] = ("auto", "flat", "train_test")
# The halves of the train_test layout, in the order their images are stacked.
HALVES: tuple[str, ...] = ("train", "test")
# Folders a train_test root may not hold: a shipped validation split would be silently ignored.
_VALIDATION_DIRS: tuple[str, ...] = ("val", "valid", "validation")

# A local directory or file, or one in a bucket (listed through pyarrow's file systems).
Listed = Path | BucketPath
# (image path, class name) pairs, per part: "all" (flat) or "train" and "test" (train_test).
FileList = list[tuple[Listed, str]]
# The class name of every image of a root without class folders (its images are unlabelled).
UNLABELLED = ""


def _folder(root: str | Path | BucketPath) -> Listed:
    """``root`` as the listing walks it: a local Path (exactly as before), or a bucket folder."""
    if isinstance(root, BucketPath):
        return root
    return root_path(root)


def _is_image(path: Listed) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES


def list_image_files(root: str | Listed, classes: list[str] | None = None, *,
                     own_images: bool = False) -> FileList:
    """All (image path, class name) pairs under root, sorted by class then file name.

    Args:
        root: a directory (or bucket folder) with one sub-folder per class.
        classes: read only these class folders (ImageNet-100's subset of ImageNet's); one
            that does not exist is skipped (its caller checks for it). None: every folder.
        own_images: a root with its images directly in it and no class folder is read too:
            every image's class is then :data:`UNLABELLED` (a flat folder's root).

    Raises:
        FileNotFoundError: root does not exist or is not a directory.
        ValueError: root holds no image (in class folders or of its own), holds images of its
            own beside class folders with images, or a bucket folder cannot be listed.
    """
    root_path = _folder(root)
    if not root_path.is_dir():
        raise FileNotFoundError(f"image folder {str(root_path)!r} does not exist")
    children = sorted(root_path.iterdir()) if classes is None else []
    own = [(path, UNLABELLED) for path in children if own_images and _is_image(path)]
    class_dirs = ([child for child in children if child.is_dir()] if classes is None
                  else [root_path / name for name in sorted(classes)
                        if (root_path / name).is_dir()])
    files = [
        (path, class_dir.name)
        for class_dir in class_dirs
        for path in sorted(class_dir.iterdir())
        if _is_image(path)
    ]
    if own and files:
        raise ValueError(
            f"{str(root_path)!r} holds {len(own)} image(s) of its own beside class folders "
            f"with images: put every image in a class folder (root/<class>/*.jpg), or none "
            f"(root/*.jpg: unlabelled)")
    if not files and not own:
        unlabelled = ", or root/*.png|jpg (unlabelled)" if own_images else ""
        raise ValueError(
            f"no images in {str(root_path)!r}: expected root/<class>/*.png|jpg{unlabelled} "
            f"(suffixes {', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return files or own


def is_unlabelled_listing(parts: dict[str, FileList]) -> bool:
    """Whether a folder's listing (:func:`list_folder`) is of unlabelled images (no class
    folders: the images sit in the root itself)."""
    return all(name == UNLABELLED for files in parts.values() for _, name in files)


def _holds_class_folders(path: Listed) -> bool:
    """Whether ``path`` looks like one half of a train/test split: sub-folders, no own images.

    A flat dataset may have a class called "train" or "test"; its folder holds images directly.
    """
    if not path.is_dir():
        return False
    children = list(path.iterdir())
    return any(child.is_dir() for child in children) and not any(map(_is_image, children))


def resolve_layout(root: str | Listed, layout: str = "auto") -> str:
    """The layout ``root`` is read in: "flat" or "train_test".

    Args:
        root: the dataset directory or bucket URI (data.root).
        layout: "auto", "flat" or "train_test" (data.layout).

    Returns:
        "flat" or "train_test".

    Raises:
        FileNotFoundError: root does not exist, or train_test is asked for and a half is missing.
        ValueError: an unknown layout, auto finds only one half, or a train_test root also holds
            a validation folder (which would be ignored), or a bucket folder cannot be listed.
    """
    root_path = _folder(root)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown folder layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    if not root_path.is_dir():
        raise FileNotFoundError(f"image folder {str(root_path)!r} does not exist")
    if layout == "flat":
        return "flat"
    if layout == "train_test":
        for half in HALVES:
            if not (root_path / half).is_dir():
                raise FileNotFoundError(
                    f"layout train_test needs {root_path}/train/ and {root_path}/test/, but "
                    f"{root_path / half}/ does not exist")
    else:
        split_halves = [half for half in HALVES if _holds_class_folders(root_path / half)]
        if not split_halves:
            return "flat"
        if len(split_halves) == 1:
            present = split_halves[0]
            absent = next(half for half in HALVES if half != present)
            raise ValueError(
                f"{root_path} has {present}/<class>/ but no {absent}/<class>/: add "
                f"{root_path / absent}/ for the train/test layout, or set data.layout: flat if "
                f"{present!r} is a class")
    for name in _VALIDATION_DIRS:
        if (root_path / name).is_dir():
            raise ValueError(
                f"{root_path / name}/ is not read by the train/test layout (validation is "
                f"carved from train/ by data.val_fraction): merge it into train/")
    return "train_test"


def list_folder(root: str | Listed, layout: str = "auto",
                on_node: DataConfig | None = None) -> dict[str, FileList]:
    """The images of a folder dataset, per part, with the train_test halves' classes checked.

    Args:
        root: the dataset directory.
        layout: "auto", "flat" or "train_test".
        on_node: the data settings whose ``cache_dir`` keeps the node's listing of the root
            (:func:`raycl.data.cache.manifest.node_listed`); None: listed here.

    Returns:
        ``{"all": files}`` for the flat layout, ``{"train": files, "test": files}`` for
        train_test; files as :func:`list_image_files` gives them.

    Raises:
        FileNotFoundError, ValueError: see :func:`resolve_layout` and :func:`list_image_files`;
            also a class folder of test/ without images in train/.

    Inside a :func:`raycl.data.listed_once.listed_once` scope the root is listed once.
    """
    folder, scope = _folder(root), {"reader": "folder", "layout": layout}
    return remembered(("folder", str(root), layout), lambda: node_listed(
        on_node, folder, scope, lambda: _list_folder(folder, layout)))


def _list_folder(root: str | Listed, layout: str) -> dict[str, FileList]:
    root_path = _folder(root)
    if resolve_layout(root_path, layout) == "flat":
        return {"all": list_image_files(root_path, own_images=True)}
    parts = {half: list_image_files(root_path / half) for half in HALVES}
    require_trained_classes(parts["train"], parts["test"], root_path / "train",
                            root_path / "test")
    return parts


def require_trained_classes(train: FileList, test: FileList, train_dir: Listed,
                            test_dir: Listed) -> None:
    """Every class of the shipped test half has training images.

    Args:
        train, test: the halves' files (:func:`list_image_files`).
        train_dir, test_dir: the halves' directories, for the message.

    Raises:
        ValueError: a class folder of ``test_dir`` has no images in ``train_dir``.
    """
    train_classes = {name for _, name in train}
    test_only = sorted({name for _, name in test} - train_classes)
    if test_only:
        shown = ", ".join(repr(name) for name in test_only[:5])
        more = f" (+{len(test_only) - 5} more)" if len(test_only) > 5 else ""
        raise ValueError(
            f"class folder(s) {shown}{more} of {test_dir} have no images in "
            f"{train_dir}: a probe fit on train cannot predict them")


def class_names(parts: dict[str, FileList]) -> list[str]:
    """Sorted union of the class names of every part: index i is the same class everywhere."""
    return sorted({name for files in parts.values() for _, name in files})


def folder_class_counts(root: str | Listed, layout: str = "auto",
                        on_node: DataConfig | None = None) -> dict[str, list[int]]:
    """Images per class (in class-index order) of each part, without reading any image.

    Args:
        root, layout, on_node: as :func:`list_folder` takes them.

    Returns:
        ``{part: counts}`` with the parts of :func:`list_folder`; a class a part lacks counts 0.
    """
    parts = list_folder(root, layout, on_node)
    return count_classes(parts, {name: i for i, name in enumerate(class_names(parts))})


def count_classes(parts: dict[str, FileList], index: dict[str, int]) -> dict[str, list[int]]:
    """Images per class of each part, in the order of ``index`` (class name -> index); a class
    a part lacks counts 0."""
    counts: dict[str, list[int]] = {}
    for part, files in parts.items():
        part_counts = [0] * len(index)
        for _, name in files:
            part_counts[index[name]] += 1
        counts[part] = part_counts
    return counts


def folder_fingerprint(root: str | Listed, layout: str = "auto",
                       on_node: DataConfig | None = None) -> list[list[str | int]]:
    """(path relative to root, size, mtime in ns) of every image of every part.

    Changes whenever the content may; in the train_test layout the paths start with train/ or
    test/, so moving an image between the halves changes it too. In a bucket the sizes and
    modification times are the listing's (no object is read).
    """
    root_path = _folder(root)
    fingerprint: list[list[str | int]] = []
    for files in list_folder(root_path, layout, on_node).values():
        for path, _ in files:
            stat = path.stat()
            fingerprint.append([path.relative_to(root_path).as_posix(), stat.st_size,
                                stat.st_mtime_ns])
    return fingerprint


def folder_unreadable(root: str | Listed, layout: str = "auto") -> tuple[list[tuple[str, str]],
                                                                           str]:
    """:func:`unreadable_images` of every image of a folder dataset (its listing's order);
    inside a :func:`raycl.data.listed_once.listed_once` scope the files are read once (the
    launch's check and its notice)."""
    def check() -> tuple[list[tuple[str, str]], str]:
        parts = list_folder(root, layout)
        return unreadable_images([file for files in parts.values() for file, _ in files])

    return remembered(("unreadable", str(root), layout), check)


def skip_notice(cfg: DataConfig) -> str | None:
    """The launch's line counting the image files ``data.skip_unreadable`` leaves out of a
    folder dataset (the check's files: every local one, a sample of a bucket's); None when
    there are none, the key is off, or a bucket is streamed (there training replaces an
    undecodable file and evaluation leaves it out, file by file)."""
    if cfg.dataset != "folder" or not cfg.skip_unreadable or not cfg.root:
        return None
    root = str(cfg.root) if is_remote(str(cfg.root)) else root_path(str(cfg.root)).expanduser()
    if is_remote(str(root)) and cfg.loader == "stream":
        return None
    unreadable, counted = folder_unreadable(root, cfg.layout)
    if not unreadable:
        return None
    return (f"data.skip_unreadable: {len(unreadable)} of {counted} unreadable, left out of "
            f"every split (first {unreadable[0][0]!r}: {unreadable[0][1]}; counted as "
            f"data/skipped, listed in diagnostics/skipped_images.txt)")


def image_folder_files(root: str | Path, layout: str = "auto",
                       on_node: DataConfig | None = None) -> ImageFiles:
    """Every image file of an ImageFolder tree with its class, for the cache builder to decode
    (:mod:`raycl.data.cache.build`: RGB squares, centre-cropped and resized by
    :func:`raycl.data.decode.decode_square`).

    Args:
        root: directory with one sub-folder per class (flat), or train/ and test/ that each
            have one (train_test); or a bucket URI holding the same (the rows' paths are then
            the files' URIs, str).
        layout: "auto", "flat" or "train_test" (see the module docstring).
        on_node: see :func:`list_folder`.

    Returns:
        ImageFiles with label "class" (index into the sorted class names), or no label at all
        for a root without class folders. In the train_test layout the train/ images come
        first and ``test_mask`` marks the test/ ones.

    Raises:
        FileNotFoundError: root (or, for train_test, one of its halves) does not exist.
        ValueError: no images found, or a test-only class.
    """
    parts = list_folder(root, layout, on_node)
    class_index = {name: index for index, name in enumerate(class_names(parts))}
    files = [entry for part_files in parts.values() for entry in part_files]
    labels = {} if is_unlabelled_listing(parts) else {"class": np.array(
        [class_index[class_name] for _, class_name in files], dtype=np.int64)}
    test_mask = None
    if "test" in parts:
        test_mask = np.concatenate([np.full(len(part_files), part == "test")
                                    for part, part_files in parts.items()])
    return ImageFiles(paths=[as_listed(path) for path, _ in files], labels=labels,
                      test_mask=test_mask)


def _folder_root(cfg: DataConfig) -> str:
    if not cfg.root:
        raise ValueError("dataset 'folder' needs data.root (the ImageFolder directory)")
    return str(cfg.root)


def _on_node(cfg: DataConfig, name: str, compute: Callable[[], T]) -> T:
    """``compute()`` answered once per node while a local root is as listed (its listing
    manifest, :func:`raycl.data.cache.manifest.node_remembered`; a bucket's: from its listing)."""
    root = _folder_root(cfg)

    def files() -> list[Path]:
        return [Path(path) for part in list_folder(root, cfg.layout, cfg).values()
                for path, _ in part]

    return node_remembered(cfg, _folder(root), {"dataset": cfg.dataset, "layout": cfg.layout},
                           name, compute, files)


class FolderReader:
    """``data.dataset: folder``: ``data.root`` in ``data.layout`` (see the module docstring).
    A local root's content key and class counts are kept in its listing manifest, and every
    root's listing in the node's (:func:`raycl.data.cache.manifest.node_listed`)."""

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        return _on_node(cfg, "content_key", lambda: self._content_key(cfg))

    def _content_key(self, cfg: DataConfig) -> dict[str, Any]:
        root = _folder_root(cfg)
        # A URI is the key as given (its query names the endpoint); a local path is absolute.
        # Listed with the layout as set, as the pre-launch checks list it: one listing per
        # launch (raycl.data.listed_once) serves both; the files are the same either way.
        key: dict[str, Any] = {"root": root if is_remote(root) else str(Path(root).resolve()),
                               "files": folder_fingerprint(root, cfg.layout, cfg)}
        if "all" not in list_folder(root, cfg.layout, cfg):  # the layout as listed: no walk
            # Added only here: flat keys stay as they were, so existing caches remain valid.
            key.update(layout="train_test")
        return key

    def read(self, cfg: DataConfig, seed: int) -> ImageFiles:
        return image_folder_files(_folder_root(cfg), cfg.layout, cfg)

    def check(self, cfg: DataConfig) -> Problem | None:
        """The folder lists in its layout (both halves of a train/test layout, their classes
        aligned) and every image decodes: the first few bad ones named, with their count
        (:func:`folder_unreadable`). In stream mode the folder is listed but its files are not
        read (a bucket of a million images): training skips and counts an undecodable one.
        With ``data.skip_unreadable`` unreadable images are no problem: the trials leave them
        out (the launch's notice counts them, :func:`skip_notice`)."""
        remote = is_remote(str(cfg.root))
        path: Path | str = str(cfg.root) if remote else Path(str(cfg.root)).expanduser()
        if not remote and not Path(path).is_dir():
            return Problem("root", f"not a directory: {cfg.root}")
        try:
            list_folder(path, cfg.layout, cfg)
        except (OSError, ValueError) as error:
            return Problem("root", str(error))
        if cfg.loader == "stream" or cfg.skip_unreadable:
            return None
        unreadable, counted = folder_unreadable(path, cfg.layout)
        return Problem("root", unreadable_message(unreadable, counted)) if unreadable else None

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        name = "class_counts_readable" if cfg.skip_unreadable else "class_counts"
        return _on_node(cfg, name, lambda: self._class_counts(cfg))

    def _class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        root, layout = _folder_root(cfg), cfg.layout
        if not cfg.skip_unreadable or is_remote(root):
            return folder_class_counts(root, layout, cfg)
        # The files data.skip_unreadable leaves out are in no split: not counted (a bucket's
        # check is a sample, so there the counts are the listing's).
        parts = list_folder(root, layout, cfg)
        left_out = {name for name, _ in folder_unreadable(root, layout)[0]}
        kept = {part: [(path, name) for path, name in files if str(path) not in left_out]
                for part, files in parts.items()}
        return count_classes(kept, {name: i for i, name in enumerate(class_names(parts))})

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        counts = self.class_counts(cfg)
        if self.labelled(cfg):
            return counted_split_sizes(counts, cfg.val_fraction, cfg.test_fraction)
        return unlabelled_split_sizes(sum(counts["all"]), cfg.val_fraction, cfg.test_fraction)

    def labelled(self, cfg: DataConfig) -> bool:
        """Whether the images are in class folders (else they sit in the root: unlabelled)."""
        return not is_unlabelled_listing(list_folder(_folder_root(cfg), cfg.layout, cfg))


READER = FolderReader()
