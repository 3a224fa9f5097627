"""ImageNet and ImageNet-100 read from the class folders ImageNet is used in:

    root/train/<wnid>/*.JPEG    root/val/<wnid>/*.JPEG

val/ is the test split (``test_mask``; the papers report on it); validation is carved from
train/ by ``data.val_fraction``. Class indices follow the sorted wnids. ``imagenet100`` reads
the 100 classes of CMC's list (``imagenet100.txt`` beside this module, the subset solo-learn and
the All4One paper use) from a full ImageNet root, or from a root holding only those classes.

``data.root`` may be a bucket URI (``s3://bucket/imagenet``): the wnid folders are listed from
the bucket (:mod:`raycl.data.bucket_paths`) and the rows hold the files' URIs.

The readers list files, never decode them: :meth:`read` returns :class:`ImageFiles` that the
cache builder decodes (centre crop to a square, resize to ``data.resolution``). A local root's
content key and class counts are kept in its listing manifest (:mod:`raycl.data.cache
.manifest`): once a node has listed it, a trial finds its cache and its split sizes without
listing 1.28 M files again. The listing itself is kept there too (:func:`raycl.data.cache
.manifest.node_listed`): stream mode's workers and a cache build read it instead of listing (a
bucket's: once per node and launch).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.bucket_paths import as_listed, root_path
from raycl.data.cache.manifest import node_listed, node_remembered
from raycl.data.listed_once import remembered
from raycl.data.sources.folders import (
    FileList,
    Listed,
    count_classes,
    list_image_files,
    require_trained_classes,
)
from raycl.data.splits import counted_split_sizes
from raycl.data.types import ImageFiles, root_problem

T = TypeVar("T")

# The halves of an ImageNet root, as read: val is the shipped test split.
HALVES: tuple[str, ...] = ("train", "val")
IMAGENET100_FILE = Path(__file__).with_name("imagenet100.txt")
# Missing wnids named in a message before "(+N more)".
SHOWN_MISSING = 5


def imagenet100_class_list() -> list[str]:
    """CMC's 100 wnids in the file's order (``#`` lines are comments)."""
    lines = IMAGENET100_FILE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _root(cfg: DataConfig) -> Listed:
    """``data.root``: a local directory, or a bucket folder (a URI)."""
    if not cfg.root:
        raise ValueError(f"dataset {cfg.dataset!r} needs data.root (the ImageNet directory "
                         f"holding train/<wnid>/ and val/<wnid>/)")
    root = str(cfg.root)
    return root_path(root).expanduser()


def _require_halves(root: Listed) -> None:
    """train/ and val/ exist and hold class folders (a flat val/ needs sorting first)."""
    for half in HALVES:
        folder = root / half
        if not folder.is_dir():
            raise ValueError(f"{root} has no {half}/: an ImageNet root holds train/<wnid>/ and "
                             f"val/<wnid>/")
        if half == "val" and not any(child.is_dir() for child in folder.iterdir()):
            raise ValueError(f"{folder}/ holds no <wnid>/ folders: sort the validation images "
                             f"into class folders (as ImageNet's valprep.sh does)")


def _missing_classes(root: Listed, parts: dict[str, FileList], wnids: list[str]) -> None:
    """Every wnid of ``wnids`` has images in both halves.

    Raises:
        ValueError: one line with how many are missing per half and the first few.
    """
    problems = []
    for half, files in zip(HALVES, parts.values(), strict=True):
        present = {name for _, name in files}
        missing = sorted(wnid for wnid in wnids if wnid not in present)
        if missing:
            more = (f" (+{len(missing) - SHOWN_MISSING} more)"
                    if len(missing) > SHOWN_MISSING else "")
            problems.append(f"{len(missing)} in {half}/: "
                            f"{', '.join(missing[:SHOWN_MISSING])}{more}")
    if problems:
        raise ValueError(f"{root} lacks classes of ImageNet-100's list "
                         f"({IMAGENET100_FILE.name}): {'; '.join(problems)}")


def _list_half(folder: Listed, wnids: list[str] | None) -> FileList:
    """The images of one half; for a class list, none at all is an empty list (the missing
    classes are then named, not the empty folder)."""
    try:
        return list_image_files(folder, wnids)
    except ValueError:
        if wnids is None:
            raise
        return []


def list_imagenet(root: Listed, wnids: list[str] | None,
                  on_node: DataConfig | None = None) -> dict[str, FileList]:
    """The images of each half, keyed "train" and "test" (val/), classes checked.

    Args:
        root: the ImageNet directory, or a bucket folder.
        wnids: read only these classes (ImageNet-100), each required with images in both
            halves; None: every class folder of train/.
        on_node: the data settings whose ``cache_dir`` keeps the node's listing of the root
            (:func:`raycl.data.cache.manifest.node_listed`); None: listed here.

    Raises:
        ValueError: a half is missing or empty, a listed class has no images in a half, or a
            class of val/ has no training images; a bucket folder cannot be listed.

    Inside a :func:`raycl.data.listed_once.listed_once` scope the root is listed once.
    """
    key = ("imagenet", str(root), tuple(wnids) if wnids is not None else None)
    scope = {"reader": "imagenet", "classes": wnids}
    return remembered(key, lambda: node_listed(on_node, root, scope,
                                               lambda: _list_imagenet(root, wnids)))


def _list_imagenet(root: Listed, wnids: list[str] | None) -> dict[str, FileList]:
    _require_halves(root)
    parts = {part: _list_half(root / half, wnids)
             for part, half in zip(("train", "test"), HALVES, strict=True)}
    if wnids is not None:
        _missing_classes(root, parts, wnids)
    require_trained_classes(parts["train"], parts["test"], root / "train", root / "val")
    return parts


class ImageNetReader:
    """``data.dataset: imagenet`` (every class of train/) or ``imagenet100`` (CMC's list)."""

    def __init__(self, subset: bool) -> None:
        self.subset = subset

    def _list(self, cfg: DataConfig) -> dict[str, FileList]:
        return list_imagenet(_root(cfg), imagenet100_class_list() if self.subset else None, cfg)

    def _class_index(self, parts: dict[str, FileList]) -> dict[str, int]:
        """wnid -> class index: position among the sorted wnids (of the list for a subset)."""
        names = (imagenet100_class_list() if self.subset
                 else {name for _, name in parts["train"]})
        return {name: i for i, name in enumerate(sorted(names))}

    def _on_node(self, cfg: DataConfig, name: str, compute: Callable[[], T]) -> T:
        """``compute()`` answered once per node while the root is as listed (its listing
        manifest, :mod:`raycl.data.cache.manifest`); a bucket's is computed each time, from
        the listing the node keeps for the launch (no request)."""
        root = _root(cfg)

        def files() -> list[Path]:
            return [path for part in self._list(cfg).values() for path, _ in part
                    if isinstance(path, Path)]

        return node_remembered(cfg, root, {"dataset": cfg.dataset}, name, compute, files)

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        return self._on_node(cfg, "content_key", lambda: self._content_key(cfg))

    def _content_key(self, cfg: DataConfig) -> dict[str, Any]:
        root = _root(cfg)
        # One digest of every file's (path, size, mtime): a 1.3 M-file list would make the
        # key (hashed as JSON on every load) tens of MB.
        digest = hashlib.sha256()
        for files in self._list(cfg).values():
            for path, _ in files:
                stat = path.stat()
                digest.update(json.dumps([path.relative_to(root).as_posix(), stat.st_size,
                                          stat.st_mtime_ns]).encode())
        return {"root": str(root.resolve()), "files": digest.hexdigest()}

    def read(self, cfg: DataConfig, seed: int) -> ImageFiles:
        parts = self._list(cfg)
        index = self._class_index(parts)
        files = parts["train"] + parts["test"]
        labels = np.array([index[name] for _, name in files], dtype=np.int64)
        test_mask = np.zeros(len(files), dtype=bool)
        test_mask[len(parts["train"]):] = True
        return ImageFiles(paths=[as_listed(path) for path, _ in files], labels={"class": labels},
                          test_mask=test_mask)

    def check(self, cfg: DataConfig) -> Problem | None:
        """The root lists as ImageNet's halves of wnid folders (no image is read)."""
        try:
            self._list(cfg)
        except (OSError, ValueError) as error:
            return root_problem(error)
        return None

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        def count() -> dict[str, list[int]]:
            parts = self._list(cfg)
            return count_classes(parts, self._class_index(parts))

        return self._on_node(cfg, "class_counts", count)

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        return counted_split_sizes(self.class_counts(cfg), cfg.val_fraction, cfg.test_fraction)


IMAGENET_READER = ImageNetReader(subset=False)
IMAGENET100_READER = ImageNetReader(subset=True)
