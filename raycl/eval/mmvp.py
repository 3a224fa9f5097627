"""MMVP-style image pairs: a synthetic Trifeature version and a loader for the real MMVP-VLM.

MMVP-VLM (Tong et al. 2024, "Eyes Wide Shut?") holds pairs of images that CLIP embeds alike
but that differ in one visual pattern; each image has its own statement, and a pair counts only
if both are matched (:func:`raycl.eval.image_text.mmvp_scores`). An :class:`MMVPSet` keeps pair
p in rows 2p and 2p+1 of both ``images`` and ``statements``, so the (2P, 2P) image x statement
similarity of the whole set has each pair's 2x2 block on the diagonal.

:func:`synthetic_mmvp` builds such pairs from Trifeature objects that differ in exactly one of
colour, texture and shape; :func:`load_mmvp_vlm` reads the published benchmark from disk.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raycl.data.decode import decode_square
from raycl.data.sources.captions import CAPTION_ORDER, WORDS, describe
from raycl.data.sources.trifeature import NOISE_TABLE_SIZE, RADIUS_FRACTION, render_object

# Patterns of the synthetic set: the attribute in which a pair's two images differ.
SYNTHETIC_PATTERNS: tuple[str, ...] = CAPTION_ORDER
# Layout of the MMVP-VLM download (huggingface.co/datasets/MMVP/MMVP_VLM), as read by
# tsb0601/MMVP scripts/evaluate_vlm.py: <root>/Questions.csv and <root>/MLLM_VLM Images/<Type>/.
MMVP_VLM_CSV = "Questions.csv"
MMVP_VLM_IMAGE_DIR = "MLLM_VLM Images"
# What evaluate_vlm.py puts in front of every statement before tokenising it.
MMVP_VLM_PROMPT_PREFIX = "a photo of "
# evaluate_vlm.py's names of the 9 patterns, in the order of the CSV's blocks of 15 pairs.
MMVP_VLM_CATEGORIES: tuple[str, ...] = (
    "Orientation and Direction", "Presence of Specific Features", "State and Condition",
    "Quantity and Count", "Positional and Relational Context", "Color and Appearance",
    "Structural Characteristics", "Texts", "Viewpoint and Perspective",
)


@dataclass
class MMVPSet:
    """Image pairs with one statement per image.

    Attributes:
        images: (2P, C, H, W) uint8; pair p is rows 2p and 2p+1.
        statements: (2P,) str; statement i describes image i.
        patterns: (P,) str; the visual pattern in which pair p differs.
    """

    images: np.ndarray
    statements: np.ndarray
    patterns: np.ndarray

    def __post_init__(self) -> None:
        self.images = np.asarray(self.images)
        self.statements = np.asarray(self.statements)
        self.patterns = np.asarray(self.patterns)
        if self.images.ndim != 4 or self.images.dtype != np.uint8:
            raise ValueError(f"images must be uint8 (2P, C, H, W), got dtype "
                             f"{self.images.dtype} and shape {self.images.shape}")
        count = len(self.images)
        if count == 0 or count % 2 or len(self.statements) != count:
            raise ValueError(f"need an even, non-zero number of images with one statement "
                             f"each, got {count} images and {len(self.statements)} statements")
        if len(self.patterns) != count // 2:
            raise ValueError(f"need one pattern per pair ({count // 2}), got "
                             f"{len(self.patterns)}")

    @property
    def num_pairs(self) -> int:
        """P, the number of image pairs."""
        return len(self.patterns)


def synthetic_mmvp(pairs_per_attribute: int, resolution: int, seed: int) -> MMVPSet:
    """Trifeature image pairs that differ in exactly one attribute: an MMVP with known causes.

    For each pattern in ("color", "texture", "shape"), ``pairs_per_attribute`` pairs: the first
    image's shape, texture and colour are drawn uniformly; the second image takes a different
    value of the pattern's attribute (uniform among the other classes) and keeps the other two.
    Both images share one pose (rotation, centre, texture offset, noise cells, drawn as in
    :func:`raycl.data.sources.trifeature.generate_trifeature`), so the named attribute is the only
    difference. Statements are full captions, ``describe(labels, CAPTION_ORDER)``: e.g.
    "a red striped triangle" and "a blue striped triangle".

    Args:
        pairs_per_attribute: pairs per pattern (P = 3 * pairs_per_attribute).
        resolution: image side in pixels.
        seed: seeds every draw; the same seed gives identical arrays, other seeds other pairs
            (e.g. one seed for validation and another for test).

    Returns:
        MMVPSet with patterns in blocks: "color" pairs, then "texture", then "shape".

    Example:
        >>> mmvp = synthetic_mmvp(pairs_per_attribute=2, resolution=32, seed=0)
        >>> mmvp.images.shape, mmvp.patterns.tolist()[::2]
        ((12, 3, 32, 32), ['color', 'texture', 'shape'])
    """
    if isinstance(pairs_per_attribute, bool) or pairs_per_attribute < 1:
        raise ValueError(f"pairs_per_attribute must be >= 1, got {pairs_per_attribute}")
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    rng = np.random.default_rng(seed)
    patterns = np.repeat(np.array(SYNTHETIC_PATTERNS), pairs_per_attribute)
    num_pairs = len(patterns)
    sizes = {name: len(WORDS[name]) for name in CAPTION_ORDER}
    base = {name: rng.integers(0, sizes[name], size=num_pairs) for name in CAPTION_ORDER}
    # A shift in [1, n) modulo n is uniform over the n - 1 other classes.
    shift = {name: rng.integers(1, sizes[name], size=num_pairs) for name in CAPTION_ORDER}
    angles = rng.uniform(0.0, 2 * np.pi, size=num_pairs)
    centers = rng.uniform(RADIUS_FRACTION, 1.0 - RADIUS_FRACTION, size=(num_pairs, 2))
    offsets = rng.uniform(0.0, 1.0, size=(num_pairs, 2))
    noise_tables = rng.random((num_pairs, NOISE_TABLE_SIZE, NOISE_TABLE_SIZE)) < 0.5

    images = np.empty((2 * num_pairs, 3, resolution, resolution), dtype=np.uint8)
    statements: list[str] = []
    for pair, pattern in enumerate(patterns):
        first = {name: int(base[name][pair]) for name in CAPTION_ORDER}
        second = dict(first)
        second[pattern] = (first[pattern] + int(shift[pattern][pair])) % sizes[pattern]
        for offset, labels in enumerate((first, second)):
            images[2 * pair + offset] = render_object(
                labels["shape"], labels["texture"], labels["color"], float(angles[pair]),
                (float(centers[pair, 0]), float(centers[pair, 1])), resolution,
                texture_offset=(float(offsets[pair, 0]), float(offsets[pair, 1])),
                noise_table=noise_tables[pair],
            )
            statements.append(describe(labels, CAPTION_ORDER))
    return MMVPSet(images=images, statements=np.array(statements), patterns=patterns)


def load_mmvp_vlm(
    root: str | Path,
    resolution: int,
    prompt_prefix: str = MMVP_VLM_PROMPT_PREFIX,
    check_only: bool = False,
) -> MMVPSet | None:
    """The MMVP-VLM benchmark (huggingface.co/datasets/MMVP/MMVP_VLM) from its download folder.

    Reads the layout that the benchmark's own script, tsb0601/MMVP ``scripts/evaluate_vlm.py``
    (also used by the MCL authors' ``MMVP.ipynb``), reads::

        root/
          Questions.csv          # header, then rows: Question ID, Type, Statement
          MLLM_VLM Images/
            <Type>/<Question ID>.jpg

    As in that script, the CSV columns are taken by position (header skipped), consecutive rows
    form a pair, both images of a pair are looked up under the first row's Type folder, and the
    statement of Question ID q belongs to image q.jpg (the script's ground truth: statement 1
    picks image 1 iff its id is odd). The real set has 9 Types x 15 pairs, ids 1..270 in blocks
    of 30 per Type (the repository README's tree); pairs must be an odd id and then the next.

    Images are centre-cropped to a square and then resized (bicubic): this keeps the aspect
    ratio and matches CLIP's own preprocessing (resize the short side, centre crop), which the
    benchmark script applies.

    Args:
        root: the downloaded dataset folder.
        resolution: output image side in pixels.
        prompt_prefix: put before each statement, as the script does ("a photo of "); "" keeps
            the raw statements.
        check_only: only check the CSV and that every image file exists (no image is decoded),
            e.g. when a configuration is validated; returns None.

    Returns:
        MMVPSet (None with ``check_only``); ``patterns`` holds each pair's Type (the image
        folder name, e.g. "Orientation"; the script names these blocks MMVP_VLM_CATEGORIES, in
        CSV order).

    Raises:
        ValueError: root, CSV, image folder or an image missing or unreadable (the path is
            named), a malformed row, an odd number of rows, or a pair that is not (odd id, id
            + 1) of one Type.
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    csv_path, image_dir = _mmvp_vlm_layout(Path(root))
    rows = _read_mmvp_vlm_rows(csv_path)
    paths, statements, patterns = _mmvp_vlm_pairs(rows, csv_path, image_dir, prompt_prefix)
    # Every path is checked before any image is decoded: a broken download fails fast.
    for path in paths:
        if not path.is_file():
            raise ValueError(f"MMVP-VLM image {path} does not exist")
    if check_only:
        return None
    images = np.stack([decode_square(path, resolution) for path in paths])
    return MMVPSet(images=images, statements=np.array(statements), patterns=np.array(patterns))


def _mmvp_vlm_layout(root: Path) -> tuple[Path, Path]:
    """The question file and the image folder of the download at ``root``, both checked."""
    if not root.is_dir():
        raise ValueError(f"MMVP-VLM root {root} is not a directory")
    csv_path = root / MMVP_VLM_CSV
    if not csv_path.is_file():
        raise ValueError(f"MMVP-VLM question file {csv_path} does not exist")
    image_dir = root / MMVP_VLM_IMAGE_DIR
    if not image_dir.is_dir():
        raise ValueError(f"MMVP-VLM image folder {image_dir} does not exist")
    return csv_path, image_dir


def _read_mmvp_vlm_rows(csv_path: Path) -> list[tuple[int, str, str]]:
    """(Question ID, Type, Statement) of every row after the header, columns by position; an
    even, non-zero number of them."""
    rows: list[tuple[int, str, str]] = []
    # utf-8-sig: a byte-order mark would otherwise end up in the first header cell.
    with csv_path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        next(reader, None)  # the header
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 3:
                raise ValueError(f"{csv_path} line {line}: expected 3 columns (Question ID, "
                                 f"Type, Statement), got {len(row)}")
            try:
                qid = int(row[0])
            except ValueError as error:
                raise ValueError(f"{csv_path} line {line}: Question ID {row[0]!r} is not an "
                                 f"integer") from error
            rows.append((qid, row[1], row[2]))
    if not rows or len(rows) % 2:
        raise ValueError(f"{csv_path} must hold an even, non-zero number of statements (two "
                         f"per pair), got {len(rows)}")
    return rows


def _mmvp_vlm_pairs(
    rows: list[tuple[int, str, str]], csv_path: Path, image_dir: Path, prompt_prefix: str
) -> tuple[list[Path], list[str], list[str]]:
    """Consecutive rows as pairs (an odd Question ID then the next, of one Type): each image's
    path and prefixed statement, and each pair's Type."""
    paths: list[Path] = []
    statements: list[str] = []
    patterns: list[str] = []
    for (qid1, type1, statement1), (qid2, type2, statement2) in zip(
        rows[::2], rows[1::2], strict=True
    ):
        if qid1 % 2 != 1 or qid2 != qid1 + 1 or type1 != type2:
            raise ValueError(f"{csv_path}: rows {qid1} ({type1}) and {qid2} ({type2}) are not "
                             f"a pair (an odd Question ID then the next one, of one Type)")
        # Both images under the first row's Type folder, as evaluate_vlm.py looks them up.
        paths.extend(image_dir / type1 / f"{qid}.jpg" for qid in (qid1, qid2))
        statements.extend([prompt_prefix + statement1, prompt_prefix + statement2])
        patterns.append(type1)
    return paths, statements, patterns
