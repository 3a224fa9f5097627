"""Image-text evaluation of a CLIP-style model: MMVP pairs, zero-shot accuracy, caption recall.

All metrics start from an image-text similarity (:func:`image_text_similarity`) that also
covers MCL's cross-stage integration: an image feature row may be the concatenation of N stage
embeddings (each block of the text width D), while the text features come from one frozen text
tower. The similarity is then the mean over stages of the cosine between each stage's block and
the text. (For unit blocks this equals the cosine between the L2-normalised concatenation and
the text row repeated N times, which is how the MCL code scores its concatenated models.)

Pure numpy/torch: no Ray needed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

# Rows per similarity chunk are chosen so one chunk holds about this many (row, column) pairs:
# a chunk's float32 similarities and bool masks stay at a few tens of MB even for N = 25k.
CHUNK_PAIRS = 1 << 22
# The two ways to score an MMVP pair (see :func:`mmvp_pair_correct`).
MMVP_DIRECTIONS: tuple[str, ...] = ("text_to_image", "image_to_text")


def _check_features(name: str, features: np.ndarray) -> np.ndarray:
    """Return ``features`` as a finite float32 (N, D) array with D >= 1, or raise ValueError."""
    array = np.asarray(features)
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D (N, D), got shape {array.shape}")
    if array.shape[1] < 1:
        raise ValueError(f"{name} must have at least one column, got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise ValueError(f"{name} must be numeric, got dtype {array.dtype}")
    array = array.astype(np.float32, copy=False)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite")
    return array


def _unit(rows: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm; all-zero rows stay zero (cosine 0 with everything)."""
    return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _stage_mean_unit(image_features: np.ndarray, text_dim: int) -> torch.Tensor:
    """Mean over stages of the unit stage blocks of each image row: (N, text_dim) float32.

    The mean of the per-stage cosines is linear in the image side, so averaging the unit
    blocks first turns N_stages matrix products into one.
    """
    image_dim = image_features.shape[1]
    if image_dim % text_dim != 0:
        raise ValueError(
            f"image feature width {image_dim} is not a multiple of the text feature width "
            f"{text_dim}: image rows must be a concatenation of whole stage blocks"
        )
    stages = image_dim // text_dim
    blocks = torch.from_numpy(np.ascontiguousarray(image_features))
    blocks = blocks.reshape(len(image_features), stages, text_dim)
    return _unit(blocks).mean(dim=1)


def image_text_similarity(image_features: np.ndarray, text_features: np.ndarray) -> np.ndarray:
    """Image-text similarity, averaged over the stage blocks of the image features.

    The image features are split into ``N = image_dim / text_dim`` blocks of the text width;
    each block and each text row is L2-normalised, and the N cosine matrices are averaged.
    One stage (``image_dim == text_dim``) gives the plain cosine. Any scale of the input rows
    is fine (each block is normalised here, so an already normalised concatenation works too).

    Args:
        image_features: (N, N_stages * D) image features.
        text_features: (M, D) text features of one text tower.

    Returns:
        (N, M) float32 similarities in [-1, 1].

    Raises:
        ValueError: inputs not 2-D, empty in width, not finite, or ``image_dim`` not a multiple
            of ``text_dim``.

    Example:
        >>> image = np.array([[1.0, 0.0, 0.0, 1.0]])  # two stages of width 2
        >>> image_text_similarity(image, np.array([[1.0, 0.0]]))  # (cos 1 + cos 0) / 2
        array([[0.5]], dtype=float32)
    """
    image = _check_features("image_features", image_features)
    text = _check_features("text_features", text_features)
    with torch.inference_mode():
        stage_mean = _stage_mean_unit(image, text.shape[1])
        text_unit = _unit(torch.from_numpy(np.ascontiguousarray(text)))
        return (stage_mean @ text_unit.T).numpy()


def _check_pair_similarity(similarity: np.ndarray) -> np.ndarray:
    sim = np.asarray(similarity)
    if sim.ndim != 2 or sim.shape[0] != sim.shape[1] or sim.shape[0] % 2 != 0 or sim.size == 0:
        raise ValueError(f"similarity must be a square (2P, 2P) matrix with P >= 1 (images as "
                         f"rows, statements as columns), got shape {sim.shape}")
    if not np.issubdtype(sim.dtype, np.number) or not np.all(np.isfinite(sim)):
        raise ValueError("similarity must be finite numbers")
    return sim


def mmvp_pair_correct(
    similarity: np.ndarray, direction: str = "text_to_image"
) -> np.ndarray:
    """Whether each MMVP pair is solved: both members of the pair must choose correctly.

    Images are the rows and statements the columns; pair p is images 2p and 2p+1, whose own
    statements are columns 2p and 2p+1. Only the pair's 2x2 block is looked at. Ties are wrong.

    - ``"text_to_image"`` (default; the official MMVP-VLM protocol, tsb0601/MMVP
      ``scripts/evaluate_vlm.py`` and the MCL notebook ``MMVP.ipynb``: each statement takes a
      softmax over the pair's two images): statement 2p picks image 2p and statement 2p+1 picks
      image 2p+1, i.e. ``sim[2p, 2p] > sim[2p+1, 2p]`` and ``sim[2p+1, 2p+1] > sim[2p, 2p+1]``.
    - ``"image_to_text"``: each image picks its own statement, i.e.
      ``sim[2p, 2p] > sim[2p, 2p+1]`` and ``sim[2p+1, 2p+1] > sim[2p+1, 2p]``.

    Args:
        similarity: (2P, 2P) image x statement similarities.
        direction: one of MMVP_DIRECTIONS.

    Returns:
        (P,) bool.

    Example:
        >>> mmvp_pair_correct(np.array([[0.9, 0.2], [0.1, 0.8]]))
        array([ True])
    """
    if direction not in MMVP_DIRECTIONS:
        raise ValueError(f"direction must be one of {MMVP_DIRECTIONS}, got {direction!r}")
    sim = _check_pair_similarity(similarity)
    first = np.arange(0, sim.shape[0], 2)
    second = first + 1
    own_first, own_second = sim[first, first], sim[second, second]
    if direction == "text_to_image":
        # Compare within a column: a statement against the other image of its pair.
        return (own_first > sim[second, first]) & (own_second > sim[first, second])
    # Compare within a row: an image against the other statement of its pair.
    return (own_first > sim[first, second]) & (own_second > sim[second, first])


def pattern_slug(name: str) -> str:
    """Metric key of a pattern name: lowercase, runs of non-alphanumerics -> "_", no edge "_".

    Example:
        >>> pattern_slug("Orientation and Direction")
        'orientation_and_direction'
    """
    slug = re.sub(r"[^0-9a-z]+", "_", str(name).lower()).strip("_")
    if not slug:
        raise ValueError(f"pattern name {name!r} has no letters or digits")
    return slug


def mmvp_scores(
    similarity: np.ndarray, pair_patterns: Sequence[str], direction: str = "text_to_image"
) -> dict[str, float]:
    """MMVP accuracy per visual pattern and their unweighted mean (as MMVP reports it).

    Args:
        similarity: (2P, 2P) image x statement similarities (see :func:`mmvp_pair_correct`).
        pair_patterns: (P,) the pattern of each pair.
        direction: see :func:`mmvp_pair_correct`.

    Returns:
        ``{pattern_slug(pattern): share of its pairs solved, ..., "mean": mean over patterns}``
        as fractions in [0, 1], patterns in order of first appearance.

    Raises:
        ValueError: bad similarity, ``pair_patterns`` not of length P, two patterns with the
            same slug, or a pattern whose slug is "mean".

    Example:
        >>> sim = np.array([[0.9, 0.2, 0, 0], [0.1, 0.8, 0, 0], [0, 0, 0.5, 0.5], [0, 0, 0.5, 0.6]])
        >>> mmvp_scores(sim, ["Color", "Shape"])
        {'color': 1.0, 'shape': 0.0, 'mean': 0.5}
    """
    correct = mmvp_pair_correct(similarity, direction)
    patterns = [str(pattern) for pattern in np.asarray(pair_patterns, dtype=object).reshape(-1)]
    if len(patterns) != len(correct):
        raise ValueError(f"pair_patterns must name the pattern of each of the {len(correct)} "
                         f"pairs, got {len(patterns)}")
    slugs: dict[str, str] = {}
    for pattern in dict.fromkeys(patterns):
        slug = pattern_slug(pattern)
        if slug == "mean":
            raise ValueError(f"pattern {pattern!r} would collide with the 'mean' key")
        if slug in slugs:
            raise ValueError(f"patterns {slugs[slug]!r} and {pattern!r} share the key {slug!r}")
        slugs[slug] = pattern
    names = np.array(patterns, dtype=object)
    scores = {slug: float(correct[names == pattern].mean()) for slug, pattern in slugs.items()}
    scores["mean"] = float(np.mean(list(scores.values())))
    return scores


def zero_shot_accuracy(
    image_features: np.ndarray,
    labels: Mapping[str, np.ndarray],
    class_text_features: Mapping[str, np.ndarray],
) -> dict[str, float]:
    """Zero-shot classification accuracy per attribute, and their mean.

    Each image is assigned the class whose prompt feature is most similar to it
    (:func:`image_text_similarity`, so stage-concatenated image features work); among equal
    similarities the lower class index wins.

    Args:
        image_features: (N, N_stages * D) image features.
        labels: attribute -> (N,) true class indices.
        class_text_features: attribute -> (C, D) text features of the class prompts, row c
            for class c (e.g. of ``raycl.data.sources.captions.class_prompts(attribute)``).
            Attributes
            not in ``labels`` are ignored.

    Returns:
        ``{attribute: accuracy, ..., "mean": mean over the attributes}`` in [0, 1].

    Raises:
        ValueError: no attributes, an attribute named "mean" or without prompt features,
            labels not (N,) integers in [0, C), or bad features.

    Example:
        >>> images = np.array([[1.0, 0.0], [0.0, 1.0]])
        >>> prompts = {"color": np.array([[1.0, 0.1], [0.1, 1.0]])}
        >>> zero_shot_accuracy(images, {"color": np.array([0, 0])}, prompts)
        {'color': 0.5, 'mean': 0.5}
    """
    if not labels:
        raise ValueError("labels must name at least one attribute")
    images = _check_features("image_features", image_features)
    scores: dict[str, float] = {}
    for attribute, values in labels.items():
        if attribute == "mean":
            raise ValueError("an attribute named 'mean' would collide with the 'mean' key")
        if attribute not in class_text_features:
            raise ValueError(f"no class prompt features for attribute {attribute!r}; have "
                             f"{sorted(class_text_features)}")
        truth = np.asarray(values)
        if truth.shape != (len(images),) or not np.issubdtype(truth.dtype, np.integer):
            raise ValueError(f"labels[{attribute!r}] must be ({len(images)},) integers, got "
                             f"shape {truth.shape} and dtype {truth.dtype}")
        prompts = np.asarray(class_text_features[attribute])
        if truth.size and (truth.min() < 0 or truth.max() >= len(prompts)):
            raise ValueError(f"labels[{attribute!r}] must lie in [0, {len(prompts)}) (one class "
                             f"per prompt feature row)")
        similarity = image_text_similarity(images, prompts)
        scores[attribute] = float(np.mean(similarity.argmax(axis=1) == truth))
    scores["mean"] = float(np.mean(list(scores.values())))
    return scores


def _hits(
    queries: torch.Tensor,
    items: torch.Tensor,
    query_codes: torch.Tensor,
    item_codes: torch.Tensor,
    ks: Sequence[int],
) -> dict[int, np.ndarray]:
    """Per query, whether an item with the query's code is among its top k, for each k.

    The top k holds a positive iff fewer than k items rank before the best-scoring positive.
    Ties with it are counted against the query (a non-positive of equal score ranks first), so
    no sort is needed and the result does not depend on a tie order.
    """
    num_queries, num_items = len(queries), len(items)
    chunk = max(1, CHUNK_PAIRS // max(num_items, 1))
    parts: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    for start in range(0, num_queries, chunk):
        stop = min(start + chunk, num_queries)
        scores = queries[start:stop] @ items.T
        positive = query_codes[start:stop, None] == item_codes[None, :]
        best = scores.masked_fill(~positive, float("-inf")).amax(dim=1, keepdim=True)
        before = ((scores >= best) & ~positive).sum(dim=1)
        for k in ks:
            parts[k].append((before < k).numpy())
    return {k: np.concatenate(parts[k]) for k in ks}


def caption_recall(
    image_features: np.ndarray,
    captions: Sequence[str],
    caption_features: np.ndarray,
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, float]:
    """Image-to-text and text-to-image recall@k with one caption per image, matched by text.

    Template captions repeat, so a hit is defined by caption *string*:

    - image -> text: each image ranks all N captions; hit@k if any of the top k has the same
      string as the image's own caption.
    - text -> image: each caption (all N, duplicates included) ranks the N images; hit@k if any
      of the top k images has the query's string as its caption.

    With unique captions this is the standard COCO/Flickr R@k. A k above N means all N.
    Similarities come from :func:`image_text_similarity` (stage-concatenated images work);
    items tied with the best match rank before it (ties count as misses). Queries are scored
    in chunks, so N = 25k never needs an N x N matrix.

    Args:
        image_features: (N, N_stages * D) image features.
        captions: (N,) caption of each image.
        caption_features: (N, D) text features of ``captions``, row-aligned.
        ks: distinct integers >= 1.

    Returns:
        ``{"i2t_r<k>": ..., "t2i_r<k>": ...}`` in [0, 1] for each k (i2t keys first).

    Raises:
        ValueError: mismatched lengths, no samples, bad ``ks`` or bad features.

    Example:
        >>> images = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
        >>> texts = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> caption_recall(images, ["a", "b", "a"], texts, ks=(1,))
        {'i2t_r1': 0.6666666666666666, 't2i_r1': 1.0}
    """
    images = _check_features("image_features", image_features)
    texts = _check_features("caption_features", caption_features)
    caption_array = np.asarray(captions, dtype=object).reshape(-1)
    num = len(images)
    if num == 0:
        raise ValueError("caption recall needs at least one image")
    if len(caption_array) != num or len(texts) != num:
        raise ValueError(f"captions ({len(caption_array)}) and caption_features ({len(texts)}) "
                         f"must have one row per image ({num})")
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1
                     for k in ks):
        raise ValueError(f"ks must be a non-empty sequence of integers >= 1, got {ks!r}")
    if len(set(ks)) != len(ks):
        raise ValueError(f"ks must be distinct, got {ks!r}")
    ks = [int(k) for k in ks]
    # Small int codes: comparing (B, N) codes is cheap whatever the caption strings are.
    _, codes_np = np.unique(caption_array.astype(str), return_inverse=True)
    with torch.inference_mode():
        image_side = _stage_mean_unit(images, texts.shape[1])
        text_side = _unit(torch.from_numpy(np.ascontiguousarray(texts)))
        codes = torch.from_numpy(codes_np.reshape(-1).astype(np.int64))
        i2t = _hits(image_side, text_side, codes, codes, ks)
        t2i = _hits(text_side, image_side, codes, codes, ks)
    results = {f"i2t_r{k}": float(i2t[k].mean()) for k in ks}
    results.update({f"t2i_r{k}": float(t2i[k].mean()) for k in ks})
    return results
