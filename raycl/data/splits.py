"""Splitting an image set into train, validation and test: stratified by class, at random for
an unlabelled set, or around a test split the source ships; and the exact sizes each makes.

Pure functions of labels, counts and a seed: nothing here reads a dataset.
"""

from __future__ import annotations

import numpy as np

from raycl.data.types import ImageSet


def class_split_counts(
    size: int, val_fraction: float, test_fraction: float
) -> tuple[int, int]:
    """(val, test) counts of one class of ``size`` samples; at least one sample stays in train."""
    test = min(round(test_fraction * size), size - 1)
    val = min(round(val_fraction * size), size - 1 - test)
    return val, test


def _check_fractions(val_fraction: float, test_fraction: float) -> None:
    """Raise ValueError unless 0 < test_fraction < 1 and 0 <= val_fraction < 1 - test_fraction."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if not 0.0 <= val_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1) with val_fraction + test_fraction < 1, "
                         f"got {val_fraction} and {test_fraction}")


def split_sizes(
    class_counts: list[int], val_fraction: float, test_fraction: float
) -> dict[str, int]:
    """Exact sizes of the splits :func:`stratified_split` makes for these class sizes.

    Args:
        class_counts: samples per class of the stratifying attribute.
        val_fraction: share of each class put in the validation split.
        test_fraction: share of each class put in the test split.

    Returns:
        ``{"train": n, "val": n, "test": n}``.
    """
    _check_fractions(val_fraction, test_fraction)
    sizes = {"train": 0, "val": 0, "test": 0}
    for count in class_counts:
        val, test = class_split_counts(count, val_fraction, test_fraction)
        sizes["train"] += count - val - test
        sizes["val"] += val
        sizes["test"] += test
    return sizes


def counted_split_sizes(
    parts: dict[str, list[int]], val_fraction: float, test_fraction: float
) -> dict[str, int]:
    """Exact split sizes of a labelled source from its class counts
    (:meth:`Reader.class_counts <raycl.data.types.Reader.class_counts>`).

    Args:
        parts: ``{"all": counts}``: split stratified (:func:`split_sizes`); or
            ``{"train": counts, "test": counts}``: the shipped test split is whole and
            validation is carved out of train (:func:`carve_validation`; ``test_fraction``
            unused).
        val_fraction, test_fraction: the data section's shares.

    Returns:
        ``{"train": n, "val": n, "test": n}``.
    """
    if "test" in parts:
        val = sum(class_split_counts(count, val_fraction, 0.0)[0] for count in parts["train"])
        return {"train": sum(parts["train"]) - val, "val": val, "test": sum(parts["test"])}
    counts = [sum(part) for part in zip(*parts.values(), strict=True)]
    return split_sizes(counts, val_fraction, test_fraction)


def unlabelled_split_sizes(
    count: int, val_fraction: float, test_fraction: float
) -> dict[str, int]:
    """Sizes of the splits :func:`random_split` makes of ``count`` unlabelled images.

    Each held-out split gets ``round(fraction * count)`` images, at least one (none for
    validation when ``val_fraction`` is 0), and train keeps at least one. Test always leaves room
    for one validation image, so its size does not depend on ``val_fraction``.

    Args:
        count: images in the set.
        val_fraction: share put in the validation split, in [0, 1).
        test_fraction: share put in the test split, in (0, 1).

    Returns:
        ``{"train": n, "val": n, "test": n}``.

    Raises:
        ValueError: fractions out of range, or too few images for a split each.
    """
    _check_fractions(val_fraction, test_fraction)
    if count < 3:
        raise ValueError(f"{count} image(s) are too few for a train, validation and test split")
    min_val = 1 if val_fraction > 0 else 0
    test = min(max(1, round(test_fraction * count)), count - 2)
    val = min(max(min_val, round(val_fraction * count)), count - 1 - test)
    return {"train": count - val - test, "val": val, "test": test}


def random_split(
    count: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``count`` unlabelled images at random into train, validation and test.

    Args:
        count: images in the set.
        val_fraction: share put in the validation split, in [0, 1).
        test_fraction: share put in the test split, in (0, 1).
        seed: seeds the permutation; same seed -> same split.

    Returns:
        (train_indices, val_indices, test_indices), each sorted, pairwise disjoint, covering
        range(count), sized as :func:`unlabelled_split_sizes` says. As in
        :func:`stratified_split`, test is taken first, so it does not depend on
        ``val_fraction``.

    Raises:
        ValueError: see :func:`unlabelled_split_sizes`.
    """
    sizes = unlabelled_split_sizes(count, val_fraction, test_fraction)
    order = np.random.default_rng(seed).permutation(count).astype(np.int64)
    test, val = sizes["test"], sizes["val"]
    return (np.sort(order[test + val:]), np.sort(order[test:test + val]),
            np.sort(order[:test]))


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int, val_fraction: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split indices so that every class keeps (about) the same share in each split.

    Args:
        labels: int array (N,) of class labels.
        test_fraction: share of each class put in the test split, in (0, 1).
        seed: seeds the choice of held-out samples.
        val_fraction: share of each class put in the validation split, in [0, 1).

    Returns:
        (train_indices, val_indices, test_indices), each sorted, pairwise disjoint, covering
        range(N). A class always keeps at least one training sample. The test split does not
        depend on ``val_fraction``: validation samples are taken from what test leaves.
    """
    _check_fractions(val_fraction, test_fraction)
    rng = np.random.default_rng(seed)
    val_parts, test_parts = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        val_count, test_count = class_split_counts(len(members), val_fraction, test_fraction)
        test_parts.append(members[:test_count])
        val_parts.append(members[test_count:test_count + val_count])
    test_indices = np.sort(np.concatenate(test_parts)).astype(np.int64)
    val_indices = np.sort(np.concatenate(val_parts)).astype(np.int64)
    held_out = np.concatenate([val_indices, test_indices])
    train_indices = np.setdiff1d(np.arange(len(labels)), held_out).astype(np.int64)
    return train_indices, val_indices, test_indices


def carve_validation(
    labels: np.ndarray, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Take a stratified validation share out of a training set whose test split is given.

    Args:
        labels: int array (N,) of class labels of the training images.
        val_fraction: share of each class moved to validation, in [0, 1).
        seed: seeds the choice of validation samples.

    Returns:
        (train_indices, val_indices), sorted, disjoint, covering range(N). A class always keeps
        at least one training sample; per-class counts round as in :func:`stratified_split`.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    rng = np.random.default_rng(seed)
    val_parts = [np.zeros(0, np.int64)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        val_count, _ = class_split_counts(len(members), val_fraction, 0.0)
        val_parts.append(members[:val_count])
    val_indices = np.sort(np.concatenate(val_parts)).astype(np.int64)
    train_indices = np.setdiff1d(np.arange(len(labels)), val_indices).astype(np.int64)
    return train_indices, val_indices


def stratified_subset(labels: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``count`` indices whose class proportions follow ``labels`` (largest remainders).

    Used to cap the linear probe's training set: taking the first rows instead would, for a
    folder dataset sorted by class, show the probe only the first classes.

    Args:
        labels: int array (N,) of class labels.
        count: how many indices to return; ``count >= N`` returns every index.
        seed: seeds which members of each class are taken.

    Returns:
        Sorted int64 array of ``min(count, N)`` distinct indices.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if count >= len(labels):
        return np.arange(len(labels), dtype=np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * (count / len(labels))
    quota = np.floor(exact).astype(np.int64)
    # Hand the remaining places to the classes with the largest fractional parts.
    remainder = count - int(quota.sum())
    quota[np.argsort(-(exact - quota), kind="stable")[:remainder]] += 1
    rng = np.random.default_rng(seed)
    chosen = [rng.permutation(np.flatnonzero(labels == label))[:take]
              for label, take in zip(classes, quota, strict=True)]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def split_indices(
    image_set: ImageSet, val_fraction: float, test_fraction: float, seed: int,
    leave_out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, test, pretrain_extra) indices of ``image_set``.

    The rows marked ``pretrain_only`` (unlabelled images only pretraining uses) are
    ``pretrain_extra`` and in no other split; the others are split by fractions (stratified on
    the first attribute, at random when there is none), or around the test split the source
    ships (``test_mask``; ``test_fraction`` unused, validation carved from the rest). The rows
    ``leave_out`` (unreadable files, ``data.skip_unreadable``) are in no split at all: the
    split is made of the others, so it stays stratified and the same for the same files and
    seed. Without ``pretrain_only`` or left-out rows the split is what it always was.
    """
    count = len(image_set.images)
    dropped = np.zeros(count, dtype=bool)
    if leave_out is not None:
        dropped[np.asarray(leave_out, dtype=np.int64)] = True
    pretrain = (np.asarray(image_set.pretrain_only, dtype=bool)
                if image_set.pretrain_only is not None else np.zeros(count, dtype=bool))
    extra = np.flatnonzero(pretrain & ~dropped).astype(np.int64)
    if not len(extra) and not dropped.any():
        return (*_split_rows(image_set.labels, image_set.test_mask, count, val_fraction,
                             test_fraction, seed), extra)
    pool = np.flatnonzero(~pretrain & ~dropped)
    labels = {name: values[pool] for name, values in image_set.labels.items()}
    test_mask = None if image_set.test_mask is None else image_set.test_mask[pool]
    train, val, test = _split_rows(labels, test_mask, len(pool), val_fraction, test_fraction,
                                   seed)
    return pool[train], pool[val], pool[test], extra


def _split_rows(
    labels: dict[str, np.ndarray], test_mask: np.ndarray | None, count: int,
    val_fraction: float, test_fraction: float, seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, test) indices of ``count`` rows with these labels and shipped test mask
    (see :func:`split_indices`)."""
    if labels:
        stratify = next(iter(labels.values()))
    elif test_mask is None:
        return random_split(count, val_fraction, test_fraction, seed)
    else:
        # Unlabelled with a shipped test split: validation is a random share of the rest.
        stratify = np.zeros(count, dtype=np.int64)
    if test_mask is None:
        return stratified_split(stratify, test_fraction, seed, val_fraction=val_fraction)
    pool = np.flatnonzero(~test_mask)
    train_of_pool, val_of_pool = carve_validation(stratify[pool], val_fraction, seed)
    return (pool[train_of_pool], pool[val_of_pool],
            np.flatnonzero(test_mask).astype(np.int64))
