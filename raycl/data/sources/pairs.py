"""Image–caption pairs listed in a CSV or TSV file: the real corpus of the ``pairs`` dataset.

The file has a header row; the image column is called ``image``, ``filepath`` or ``path`` and the
caption column ``caption``, ``title`` or ``text`` (the names open_clip's CSV loader and COCO-style
exports use; matched without regard to case, the first present in that order wins). One row is
one pair. Image paths are relative to the file's directory (absolute paths are kept). The
delimiter is a tab for ``.tsv``/``.tab``, a comma for ``.csv``, and sniffed otherwise.

A corpus has no class labels: :func:`image_text_files` returns the rows' image files with
``labels == {}`` and one caption per row; the cache builder (:mod:`raycl.data.cache.build`) decodes
them. An image named by several rows (COCO has five captions per image) is decoded once and
copied to each of its rows.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.splits import unlabelled_split_sizes
from raycl.data.types import ImageFiles, root_problem

IMAGE_COLUMNS: tuple[str, ...] = ("image", "filepath", "path")
CAPTION_COLUMNS: tuple[str, ...] = ("caption", "title", "text")
_TAB_SUFFIXES = frozenset({".tsv", ".tab"})
# Enough text for csv.Sniffer to see a few rows of a file with an unknown suffix.
_SNIFF_BYTES = 64 * 1024


class Pair(NamedTuple):
    """One row of a pairs file.

    Attributes:
        row: 1-based index among the data rows (the header is not counted).
        line: line of the file the row ends on (csv counts quoted line breaks).
        image: the image's absolute path (a relative one is resolved against the file's
            directory).
        caption: the caption, surrounding whitespace removed.
    """

    row: int
    line: int
    image: Path
    caption: str


def _where(path: Path, pair: Pair) -> str:
    """The ``FILE: row R (line L)`` prefix of an error about one row."""
    return f"{path}: row {pair.row} (line {pair.line})"


def _delimiter(path: Path, sample: str) -> str:
    """Tab or comma by suffix; for any other suffix the delimiter csv.Sniffer finds (or comma)."""
    suffix = path.suffix.lower()
    if suffix in _TAB_SUFFIXES:
        return "\t"
    if suffix == ".csv":
        return ","
    try:
        return csv.Sniffer().sniff(sample, delimiters=",\t;|").delimiter
    except csv.Error:
        return ","


def _column(path: Path, header: list[str], names: tuple[str, ...], what: str) -> int:
    """Index of the first of ``names`` in ``header`` (case-insensitive)."""
    normalised = [name.strip().lower() for name in header]
    for name in names:
        if name in normalised:
            return normalised.index(name)
    raise ValueError(f"{path}: no {what} column: expected one of {', '.join(names)}; the header "
                     f"has {', '.join(repr(name) for name in header)}")


def read_pairs(path: str | Path) -> list[Pair]:
    """The rows of a pairs file, without opening any image.

    Args:
        path: the CSV or TSV file (data.root).

    Returns:
        One :class:`Pair` per non-blank data row, in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is empty, not UTF-8 or not valid CSV, lacks the image or caption
            column, has no rows, or a row is short or has an empty image path or caption. The
            message is one line naming the file (and the row).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"image-caption file {str(file)!r} does not exist")
    # Images resolve against the file's absolute directory, so a path means the same image (and
    # the cache key the same thing) whatever directory the run starts in.
    base = file.resolve().parent
    pairs: list[Pair] = []
    try:
        # utf-8-sig: spreadsheet exports often start with a byte-order mark, which would
        # otherwise become part of the first column's name.
        with file.open(encoding="utf-8-sig", newline="") as handle:
            delimiter = _delimiter(file, handle.read(_SNIFF_BYTES))
            handle.seek(0)
            reader = csv.reader(handle, delimiter=delimiter)
            header = next(reader, None)
            if not header or not any(name.strip() for name in header):
                raise ValueError(
                    f"{file}: empty file: expected a header naming an image column "
                    f"({', '.join(IMAGE_COLUMNS)}) and a caption column "
                    f"({', '.join(CAPTION_COLUMNS)})")
            image_index = _column(file, header, IMAGE_COLUMNS, "image")
            caption_index = _column(file, header, CAPTION_COLUMNS, "caption")
            for fields in reader:
                if not any(field.strip() for field in fields):
                    continue  # a blank line (e.g. at the end of the file) is no pair
                where = f"{file}: row {len(pairs) + 1} (line {reader.line_num})"
                if len(fields) <= max(image_index, caption_index):
                    raise ValueError(f"{where}: {len(fields)} field(s), but the header has "
                                     f"{len(header)}")
                image, caption = fields[image_index].strip(), fields[caption_index].strip()
                if not image:
                    raise ValueError(f"{where}: empty {header[image_index]!r}")
                if not caption:
                    raise ValueError(f"{where}: empty {header[caption_index]!r}")
                pairs.append(Pair(len(pairs) + 1, reader.line_num, base / image,
                                  caption))
    except UnicodeDecodeError as error:
        raise ValueError(f"{file}: not UTF-8 text ({error})") from error
    except csv.Error as error:
        raise ValueError(f"{file}: not valid CSV: {error}") from error
    if not pairs:
        raise ValueError(f"{file}: no image-caption rows after the header")
    return pairs


def count_pairs(path: str | Path) -> int:
    """Number of pairs (data rows) of a pairs file, without opening any image."""
    return len(read_pairs(path))


def _unique_images(path: Path, pairs: list[Pair]) -> dict[Path, Pair]:
    """Each distinct image path with the first row naming it; a missing image is an error."""
    first: dict[Path, Pair] = {}
    for pair in pairs:
        if pair.image not in first:
            if not pair.image.is_file():
                raise ValueError(f"{_where(path, pair)}: image {str(pair.image)!r} not found")
            first[pair.image] = pair
    return first


def pairs_fingerprint(path: str | Path) -> list[list[str | int]]:
    """(path, size, mtime in ns) of the pairs file and of every distinct image it names.

    Changes whenever the cached content may: a caption edit changes the file's size or mtime,
    an image edit the image's.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_pairs`; also an image that does not
            exist (the message names the file, the row and the image).
    """
    file = Path(path)
    pairs = read_pairs(file)
    stat = file.stat()
    fingerprint: list[list[str | int]] = [[file.name, stat.st_size, stat.st_mtime_ns]]
    for image in _unique_images(file, pairs):
        image_stat = image.stat()
        fingerprint.append([str(image), image_stat.st_size, image_stat.st_mtime_ns])
    return fingerprint


def image_text_files(path: str | Path) -> ImageFiles:
    """Every pair of a pairs file: its image file and caption, for the cache builder to decode
    (RGB, centre-cropped and resized as folders are; an image named by several rows is decoded
    once and copied to each).

    Args:
        path: the CSV or TSV file (see the module docstring).

    Returns:
        ImageFiles with one path per row (repeated when rows share an image), ``labels == {}``
        and ``captions`` a (N,) str array, in row order.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: see :func:`read_pairs`; also a missing image (the message names the file,
            the row and the image).
    """
    file = Path(path)
    pairs = read_pairs(file)
    _unique_images(file, pairs)  # a missing image is named with its row before any decoding
    captions = np.array([pair.caption for pair in pairs], dtype=np.str_)
    return ImageFiles(paths=[pair.image for pair in pairs], labels={}, captions=captions)


def _pairs_file(cfg: DataConfig) -> str:
    if not cfg.root:
        raise ValueError("dataset 'pairs' needs data.root (the CSV or TSV file of image, "
                         "caption rows)")
    return str(cfg.root)


class PairsReader:
    """``data.dataset: pairs``: the image-caption rows of the CSV/TSV file ``data.root``;
    unlabelled, so its one "class" holds every image."""

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        path = _pairs_file(cfg)
        return {"root": str(Path(path).resolve()), "files": pairs_fingerprint(path)}

    def read(self, cfg: DataConfig, seed: int) -> ImageFiles:
        return image_text_files(_pairs_file(cfg))

    def check(self, cfg: DataConfig) -> Problem | None:
        """The file exists and its header and rows are well formed (:func:`read_pairs`; the
        images are found and decoded when the cache is built)."""
        try:
            read_pairs(Path(str(cfg.root)).expanduser())
        except (OSError, ValueError) as error:
            return root_problem(error)
        return None

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        return {"all": [count_pairs(_pairs_file(cfg))]}

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        """At random (unlabelled): :func:`~raycl.data.splits.unlabelled_split_sizes`."""
        return unlabelled_split_sizes(count_pairs(_pairs_file(cfg)), cfg.val_fraction,
                                      cfg.test_fraction)


READER = PairsReader()
