"""Procedural Trifeature images: 10 shapes x 10 textures x 10 colours.

In the spirit of Hermann & Lampinen (2020), "What shapes feature representations?", the
three-feature set the MCL paper evaluates on. Every image shows one object on a black
background: a shape, filled with a texture (rotated with the object), tinted with a colour,
at a random rotation and position. Nothing is downloaded; the images are drawn here.

How an image is made (all in numpy except the polygon fill):

1. Work at `supersample` x the target resolution (4x up to 64 px, 2x above).
2. Fill the shape's polygons with PIL -> a binary mask.
3. Evaluate the texture as a function of the object's own (rotated) coordinates, measured in
   units of the object radius, so the pattern turns and scales with the object.
4. Pixel = mask * colour * (TEXTURE_OFF + (1 - TEXTURE_OFF) * pattern). The "off" parts of a
   texture stay dimly lit rather than black so the silhouette (the shape) is always visible.
5. Box-filter down to the target resolution (block mean = antialiasing), round to uint8.

The object's circumscribed circle has a diameter of 70% of the image side, so a square's side
is ~50% of the image and shapes stay recognisable at 32 px.

Speed (one core of this 2-core machine, shared): 5 000 images at 32 px
(samples_per_combination=5) take 2.7-3.4 s; 1 000 images at 128 px take about 8 s. Measured with
`.venv/bin/python -c "import time; from raycl.data.sources.trifeature import
generate_trifeature as g; t=time.perf_counter(); g(5, 32, 0); print(time.perf_counter()-t)"`.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from raycl.config.section import Problem
from raycl.config.training import DataConfig
from raycl.data.splits import counted_split_sizes
from raycl.data.types import ImageSet

# Diameter of the object's circumscribed circle is 2 * RADIUS_FRACTION of the image side.
RADIUS_FRACTION = 0.35
# Brightness of the "off" part of a texture, relative to the "on" part.
TEXTURE_OFF = 0.3


def _regular_polygon(corners: int, phase_deg: float = 90.0) -> np.ndarray:
    angles = np.deg2rad(phase_deg) + 2 * np.pi * np.arange(corners) / corners
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def _star(points: int = 5, inner: float = 0.45) -> np.ndarray:
    outer = _regular_polygon(2 * points)
    radii = np.where(np.arange(2 * points) % 2 == 0, 1.0, inner)
    return outer * radii[:, None]


def _square(cx: float, cy: float, half: float) -> np.ndarray:
    return np.array([[cx - half, cy - half], [cx + half, cy - half],
                     [cx + half, cy + half], [cx - half, cy + half]])


def _normalised(polygons: list[np.ndarray]) -> list[np.ndarray]:
    """Centre the polygons on their bounding box and scale the farthest vertex to radius 1."""
    points = np.concatenate(polygons)
    centre = (points.min(axis=0) + points.max(axis=0)) / 2
    radius = np.linalg.norm(points - centre, axis=1).max()
    return [(polygon - centre) / radius for polygon in polygons]


_THIRD = 1.0 / 3.0
# Each shape is a list of polygons in object coordinates (x right, y up), farthest vertex at 1.
SHAPES: dict[str, list[np.ndarray]] = {
    name: _normalised(polygons)
    for name, polygons in {
        "triangle": [_regular_polygon(3)],
        "square": [_regular_polygon(4, phase_deg=45.0)],
        "plus": [np.array([
            [-_THIRD, -1], [_THIRD, -1], [_THIRD, -_THIRD], [1, -_THIRD], [1, _THIRD],
            [_THIRD, _THIRD], [_THIRD, 1], [-_THIRD, 1], [-_THIRD, _THIRD], [-1, _THIRD],
            [-1, -_THIRD], [-_THIRD, -_THIRD]])],
        "circle": [_regular_polygon(48)],
        "tee": [np.array([
            [-1, 1], [1, 1], [1, _THIRD], [_THIRD, _THIRD], [_THIRD, -1], [-_THIRD, -1],
            [-_THIRD, _THIRD], [-1, _THIRD]])],
        "rhombus": [np.array([[0, 1], [0.55, 0], [0, -1], [-0.55, 0]])],
        "pentagon": [_regular_polygon(5)],
        "star": [_star()],
        # Five small squares in the dice-five layout, touching at their corners.
        "fivesquare": [_square(x, y, 0.3) for x, y in
                       [(0, 0), (0.6, 0.6), (0.6, -0.6), (-0.6, 0.6), (-0.6, -0.6)]],
        "trapezoid": [np.array([[-1, -0.55], [1, -0.55], [0.5, 0.55], [-0.5, 0.55]])],
    }.items()
}

TEXTURES: tuple[str, ...] = (
    "solid", "stripes", "grid", "hexgrid", "dots", "noise", "triangles", "zigzag", "rain",
    "pluses",
)

# Ten well-separated RGB colours (hue circle plus white and brown).
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "orange": (255, 140, 0),
    "yellow": (240, 230, 20),
    "green": (30, 190, 40),
    "cyan": (20, 220, 230),
    "blue": (30, 70, 240),
    "purple": (140, 40, 210),
    "pink": (255, 120, 200),
    "white": (245, 245, 245),
    "brown": (140, 85, 35),
}

SHAPE_NAMES: tuple[str, ...] = tuple(SHAPES)
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
_COLOR_TABLE = np.array(list(COLORS.values()), dtype=np.float64) / 255.0
# Side (in object radii) of the random cells of the "noise" texture, and cells per table side.
_NOISE_CELL = 0.3
NOISE_TABLE_SIZE = 16


def _frac(values: np.ndarray) -> np.ndarray:
    return values - np.floor(values)


def texture_pattern(
    texture: int, u: np.ndarray, v: np.ndarray, noise_table: np.ndarray
) -> np.ndarray:
    """Evaluate one texture at object coordinates.

    Args:
        texture: index into TEXTURES.
        u: horizontal object coordinate of each pixel, in units of the object radius.
        v: vertical object coordinate, same shape as `u`.
        noise_table: (NOISE_TABLE_SIZE, NOISE_TABLE_SIZE) values in [0, 1], used by "noise".

    Returns:
        Pattern intensity in [0, 1], same shape as `u` (1 = full colour).
    """
    name = TEXTURES[texture]
    if name == "solid":
        pattern = np.ones_like(u)
    elif name == "stripes":
        pattern = _frac(v / 0.5) < 0.5
    elif name == "grid":
        pattern = (_frac(u / 0.6) < _THIRD) | (_frac(v / 0.6) < _THIRD)
    elif name in ("hexgrid", "triangles"):
        # Three plane waves 120 degrees apart: their sum peaks on a triangular lattice.
        angles = np.deg2rad([90.0, 210.0, 330.0])
        phases = [(np.cos(a) * u + np.sin(a) * v) for a in angles]
        if name == "hexgrid":
            wave = sum(np.cos(2 * np.pi * phase / 0.55) for phase in phases)
            pattern = wave < -0.6  # the honeycomb of low values between the lattice peaks
        else:
            # Three families of thin lines at 0/60/120 degrees cut the plane into triangles.
            pattern = np.zeros(u.shape, dtype=bool)
            for phase in phases:
                pattern |= _frac(phase / 0.7) < 0.25
    elif name == "dots":
        du, dv = _frac(u / 0.6) - 0.5, _frac(v / 0.6) - 0.5
        pattern = du**2 + dv**2 < 0.3**2
    elif name == "noise":
        size = noise_table.shape[0]
        rows = np.floor(v / _NOISE_CELL).astype(np.int64) % size
        cols = np.floor(u / _NOISE_CELL).astype(np.int64) % size
        pattern = noise_table[rows, cols]
    elif name == "zigzag":
        triangle_wave = np.abs(_frac(u / 0.5) - 0.5)  # in [0, 0.5]
        pattern = _frac((v + 0.6 * triangle_wave) / 0.5) < 0.5
    elif name == "rain":
        # Short vertical dashes in columns, every other column shifted by half a dash period.
        column = np.floor(u / 0.35)
        pattern = (_frac(u / 0.35) < 0.4) & (_frac(v / 0.5 + 0.5 * (column % 2)) < 0.55)
    elif name == "pluses":
        du, dv = np.abs(_frac(u / 0.8) - 0.5) * 0.8, np.abs(_frac(v / 0.8) - 0.5) * 0.8
        pattern = ((du < 0.1) & (dv < 0.28)) | ((dv < 0.1) & (du < 0.28))
    else:  # pragma: no cover - TEXTURES and this function are kept in sync
        raise ValueError(f"unknown texture {name!r}")
    return np.asarray(pattern, dtype=np.float64)


def _supersample(resolution: int) -> int:
    return 4 if resolution <= 64 else 2


def render_object(
    shape: int,
    texture: int,
    color: int,
    angle: float,
    center: tuple[float, float],
    resolution: int,
    texture_offset: tuple[float, float] = (0.0, 0.0),
    noise_table: np.ndarray | None = None,
) -> np.ndarray:
    """Render one Trifeature image.

    Args:
        shape: index into SHAPE_NAMES.
        texture: index into TEXTURES.
        color: index into COLOR_NAMES.
        angle: rotation of the object (and its texture) in radians, counter-clockwise.
        center: object centre (x, y) as fractions of the image side; keep it within
            [RADIUS_FRACTION, 1 - RADIUS_FRACTION] so the object is not cut off.
        resolution: output side length in pixels.
        texture_offset: shift of the texture in object radii, so patterns are not pinned to
            the object centre.
        noise_table: cell values for the "noise" texture (NOISE_TABLE_SIZE squared); zeros
            when omitted.

    Returns:
        uint8 image of shape (3, resolution, resolution).
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    factor = _supersample(resolution)
    side = resolution * factor
    radius = RADIUS_FRACTION * side
    cx, cy = center[0] * side, center[1] * side
    cos_a, sin_a = np.cos(angle), np.sin(angle)

    # Shape mask: object coordinates (x right, y up) -> image pixels (row index grows down).
    canvas = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(canvas)
    for polygon in SHAPES[SHAPE_NAMES[shape]]:
        xs = cx + radius * (cos_a * polygon[:, 0] - sin_a * polygon[:, 1])
        ys = cy - radius * (sin_a * polygon[:, 0] + cos_a * polygon[:, 1])
        draw.polygon(list(zip(xs.tolist(), ys.tolist(), strict=True)), fill=255)
    mask = np.asarray(canvas, dtype=np.float64) / 255.0

    # Inverse rotation of each pixel centre gives its object coordinates (u, v) in radii.
    pixel = np.arange(side) + 0.5
    dx = (pixel[None, :] - cx) / radius
    dy = (cy - pixel[:, None]) / radius
    u = cos_a * dx + sin_a * dy + texture_offset[0]
    v = -sin_a * dx + cos_a * dy + texture_offset[1]
    if noise_table is None:
        noise_table = np.zeros((NOISE_TABLE_SIZE, NOISE_TABLE_SIZE))
    pattern = texture_pattern(texture, u, v, noise_table)

    intensity = mask * (TEXTURE_OFF + (1.0 - TEXTURE_OFF) * pattern)
    image = intensity[None, :, :] * _COLOR_TABLE[color][:, None, None]
    # Box filter: the mean of each factor x factor block antialiases the downsampling.
    image = image.reshape(3, resolution, factor, resolution, factor).mean(axis=(2, 4))
    return np.rint(image * 255.0).astype(np.uint8)


def generate_trifeature(samples_per_combination: int, resolution: int, seed: int) -> ImageSet:
    """Generate the full Trifeature set: every (shape, texture, colour) combination equally often.

    Args:
        samples_per_combination: images per combination (1000 combinations in all).
        resolution: side length of the square images in pixels.
        seed: seeds rotation, position, texture offset, noise cells and the image order;
            the same seed gives byte-identical arrays.

    Returns:
        ImageSet of 1000 * samples_per_combination RGB images, labels "shape", "texture",
        "color" (indices into SHAPE_NAMES, TEXTURES, COLOR_NAMES), in shuffled order.
    """
    if samples_per_combination < 1:
        raise ValueError(
            f"samples_per_combination must be >= 1, got {samples_per_combination}"
        )
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    combinations = np.array(
        list(itertools.product(range(len(SHAPES)), range(len(TEXTURES)), range(len(COLORS)))),
        dtype=np.int64,
    )
    rng = np.random.default_rng(seed)
    # Shuffled so that any prefix of the set is a fair mix of all combinations.
    order = rng.permutation(np.repeat(combinations, samples_per_combination, axis=0))
    count = len(order)
    angles = rng.uniform(0.0, 2 * np.pi, size=count)
    centers = rng.uniform(RADIUS_FRACTION, 1.0 - RADIUS_FRACTION, size=(count, 2))
    offsets = rng.uniform(0.0, 1.0, size=(count, 2))
    noise_tables = rng.random((count, NOISE_TABLE_SIZE, NOISE_TABLE_SIZE)) < 0.5

    images = np.empty((count, 3, resolution, resolution), dtype=np.uint8)
    for index, (shape, texture, color) in enumerate(order):
        images[index] = render_object(
            int(shape), int(texture), int(color), float(angles[index]),
            (float(centers[index, 0]), float(centers[index, 1])), resolution,
            texture_offset=(float(offsets[index, 0]), float(offsets[index, 1])),
            noise_table=noise_tables[index],
        )
    labels = {"shape": order[:, 0].copy(), "texture": order[:, 1].copy(),
              "color": order[:, 2].copy()}
    return ImageSet(images=images, labels=labels)


class TrifeatureReader:
    """``data.dataset: trifeature``: generated, ``data.samples_per_combination`` images of every
    (shape, texture, colour), seeded by the data seed."""

    def content_key(self, cfg: DataConfig, seed: int) -> dict[str, Any]:
        return {"samples_per_combination": int(cfg.samples_per_combination), "seed": int(seed)}

    def read(self, cfg: DataConfig, seed: int) -> ImageSet:
        return generate_trifeature(cfg.samples_per_combination, cfg.resolution, seed)

    def check(self, cfg: DataConfig) -> Problem | None:
        return None  # generated: no file to miss

    def class_counts(self, cfg: DataConfig) -> dict[str, list[int]]:
        # Every (shape, texture, colour) combination appears samples_per_combination times.
        return {"all": [100 * int(cfg.samples_per_combination)] * 10}

    def split_sizes(self, cfg: DataConfig) -> dict[str, int]:
        return counted_split_sizes(self.class_counts(cfg), cfg.val_fraction, cfg.test_fraction)


READER = TrifeatureReader()
