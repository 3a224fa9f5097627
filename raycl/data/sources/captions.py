"""Template captions for Trifeature images: the offline image-text corpus.

A caption names some of an image's attributes, in the fixed order colour, texture, shape:
"a red striped triangle", "a red object", "a triangle", "a striped object". Which attributes a
training caption names is drawn per image (:func:`caption_corpus`): a corpus that names the colour
always and the texture rarely is a small model of the web captions CLIP learns from, where some
visual features are seldom described and so are suppressed. The MMVP-style statements and the
zero-shot prompts use the same words (:func:`describe`, :func:`class_prompts`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from raycl.data.sources.trifeature import COLOR_NAMES, SHAPE_NAMES, TEXTURES

# Attribute order in a caption, and the words for each class index.
CAPTION_ORDER: tuple[str, ...] = ("color", "texture", "shape")
TEXTURE_WORDS: dict[str, str] = {
    "solid": "plain", "stripes": "striped", "grid": "checkered", "hexgrid": "honeycomb",
    "dots": "dotted", "noise": "speckled", "triangles": "triangle-patterned",
    "zigzag": "zigzag", "rain": "rainy", "pluses": "plus-patterned",
}
SHAPE_WORDS: dict[str, str] = {name: name.replace("_", " ") for name in SHAPE_NAMES}
WORDS: dict[str, tuple[str, ...]] = {
    "color": tuple(COLOR_NAMES),
    "texture": tuple(TEXTURE_WORDS[name] for name in TEXTURES),
    "shape": tuple(SHAPE_WORDS[name] for name in SHAPE_NAMES),
}


def describe(labels: Mapping[str, int], named: tuple[str, ...] | list[str] | set[str]) -> str:
    """The caption of one image naming the attributes in ``named``.

    Args:
        labels: class index of each attribute ("shape", "texture", "color").
        named: attributes the caption mentions; the others are left out (an unnamed shape is
            "object"). Empty: "an object".

    Returns:
        e.g. ``describe({"shape": 0, "texture": 1, "color": 0}, ("color", "shape"))`` ->
        "a red triangle" (with the first shape being a triangle).
    """
    unknown = set(named) - set(CAPTION_ORDER)
    if unknown:
        raise ValueError(f"unknown caption attributes {sorted(unknown)}; "
                         f"known: {', '.join(CAPTION_ORDER)}")
    words = [WORDS[name][int(labels[name])] for name in CAPTION_ORDER[:2] if name in named]
    words.append(WORDS["shape"][int(labels["shape"])] if "shape" in named else "object")
    article = "an" if words[0][0] in "aeiou" else "a"
    return f"{article} {' '.join(words)}"


def caption_corpus(
    labels: Mapping[str, np.ndarray], rates: Mapping[str, float], seed: int
) -> np.ndarray:
    """One caption per image, each attribute named with its own probability.

    Args:
        labels: attribute -> (N,) class indices ("shape", "texture", "color").
        rates: attribute -> probability that a caption names it (1.0: always; an attribute
            left out is never named).
        seed: seeds the draws; the same seed gives the same captions.

    Returns:
        (N,) array of str.
    """
    for name, rate in rates.items():
        if name not in CAPTION_ORDER:
            raise ValueError(f"unknown caption attribute {name!r}; known: "
                             f"{', '.join(CAPTION_ORDER)}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"caption rate of {name!r} must be in [0, 1], got {rate}")
    count = len(next(iter(labels.values())))
    rng = np.random.default_rng(seed)
    draws = {name: rng.random(count) < rates.get(name, 0.0) for name in CAPTION_ORDER}
    return np.array([
        describe({name: labels[name][i] for name in CAPTION_ORDER},
                 [name for name in CAPTION_ORDER if draws[name][i]])
        for i in range(count)
    ])


def class_prompts(attribute: str) -> list[str]:
    """Zero-shot prompts for one attribute, one per class in class-index order:
    "a red object", "a striped object", "a triangle"."""
    if attribute not in WORDS:
        raise ValueError(f"no prompts for attribute {attribute!r}; known: "
                         f"{', '.join(CAPTION_ORDER)}")
    return [describe({"shape": index, "texture": index, "color": index}, (attribute,))
            for index in range(len(WORDS[attribute]))]
