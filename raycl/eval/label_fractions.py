"""Which training images keep their label when the linear probe sees only a share of them.

The FGVR paper's Table 1 probes with 100 %, 50 % and 20 % of the labels; the probe of a share
is fit on a seeded subset stratified on the first attribute (``eval.label_fractions``).
"""

from __future__ import annotations

import numpy as np

from raycl.data import stratified_subset


def label_fraction_subset(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Seeded stratified subset of ``round(fraction × N)`` indices (at least one).

    The class proportions follow ``labels`` (:func:`raycl.data.stratified_subset`). When
    rounding would leave a small class out although the subset has room for every class,
    every class first gets one random member and the rest is drawn stratified from the
    remaining rows: a probe cannot learn a class it never sees.

    Args:
        labels: (N,) class labels (the first attribute).
        fraction: share of the rows to keep, in (0, 1].
        seed: seeds which rows are taken; the same labels and seed give the same subset.

    Returns:
        Sorted int64 array of distinct row indices.

    Example:
        >>> label_fraction_subset(np.repeat([0, 1], 10), 0.2, seed=0).size
        4
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {labels.shape}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    count = max(1, round(fraction * labels.size))
    subset = stratified_subset(labels, count, seed)
    classes = np.unique(labels)
    if count < classes.size or np.unique(labels[subset]).size == classes.size:
        return subset
    rng = np.random.default_rng(seed)
    order = rng.permutation(labels.size)
    # The first row of each class in a random order: one uniformly drawn member per class.
    _, first = np.unique(labels[order], return_index=True)
    one_each = order[first]
    rest = np.setdiff1d(np.arange(labels.size), one_each)
    extra = count - one_each.size
    if extra == 0:
        return np.sort(one_each).astype(np.int64)
    chosen = np.concatenate([one_each, rest[stratified_subset(labels[rest], extra, seed)]])
    return np.sort(chosen).astype(np.int64)
