"""Datasets that exist offline, a stratified train/validation/test split, and an on-disk cache.

`load_dataset(cfg, seed)` is the one entry point the training code needs. It reads only
attributes of `cfg` (a `DataConfig` or anything with the same field names):

- dataset: one of DATASETS
- resolution: image side in pixels
- samples_per_combination (trifeature), num_samples (mnist_fashion), root and layout (folder;
  ``layout`` may be absent: "auto"), root (pairs: the CSV/TSV file)
- captions (trifeature; may be absent: None): attribute -> probability that an image's caption
  names it; when set, every image gets a synthetic caption (:mod:`raycl.data.captions`)
- val_fraction, test_fraction: share of each class (of the first attribute) held out for
  validation (model selection) and for the final test. A folder in the train/test layout ships
  its test split (root/test/): test_fraction is ignored and validation is carved from train/.
  An unlabelled set (pairs) has no classes: its shares are drawn at random (:func:`random_split`).
- cache_dir: where the generated arrays are kept (None -> $RAYCL_CACHE or ~/.cache/raycl)

The full image set is cached as one .npz named by a hash of everything that changes its
content, so Ray workers and later trials load it instead of generating it again. The split is
recomputed from the seed on every call (it is cheap). :func:`split_sizes_for` gives the exact
split sizes from the config alone, so a search can be checked before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Bump when a generator changes its output, so stale caches are not reused.
CACHE_VERSION = 1
# Class counts fixed by the source, so a small sample missing a class does not shrink them.
_FIXED_NUM_CLASSES: dict[str, dict[str, int]] = {
    "trifeature": {"shape": 10, "texture": 10, "color": 10},
    "mnist_fashion": {"digit": 10, "garment": 10},
    "digits": {"digit": 10},
}
# The attributes each dataset labels, the first one stratifying the splits.
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    **{name: tuple(classes) for name, classes in _FIXED_NUM_CLASSES.items()},
    "folder": ("class",),
    # An image-text corpus has captions, not classes: nothing to stratify or probe.
    "pairs": (),
}
# Image channels of each dataset (what the encoder's first layer takes).
CHANNELS: dict[str, int] = {"trifeature": 3, "mnist_fashion": 2, "digits": 1, "folder": 3,
                            "pairs": 3}
# Keeps the synthetic captions' draws apart from the Trifeature generator's, which is seeded
# with the same data seed: otherwise whether a caption names the colour would follow the
# generator's first random numbers (e.g. the objects' positions).
_CAPTION_STREAM = 0xCA9


@dataclass
class ImageSet:
    """Images and their labels.

    Attributes:
        images: uint8 array (N, C, H, W).
        labels: attribute name -> int64 array (N,), e.g. {"shape", "texture", "color"}; empty
            for an unlabelled set (an image-text corpus).
        test_mask: bool array (N,) marking a test split the source ships (a folder's test/),
            or None when the test split is drawn by ``test_fraction``.
        captions: str array (N,), one caption per image (a pairs file's, or Trifeature's
            synthetic ones when data.captions is set); None for a set without text.
    """

    images: np.ndarray
    labels: dict[str, np.ndarray]
    test_mask: np.ndarray | None = None
    captions: np.ndarray | None = None


SPLITS: tuple[str, ...] = ("train", "val", "test")


@dataclass
class DatasetSplits:
    """A dataset split into train, validation and test, with what a model needs to know.

    Probes are fit on ``train``; a sweep selects on ``val``; ``test`` is scored once per trial.
    """

    name: str
    train: ImageSet
    val: ImageSet
    test: ImageSet
    attributes: list[str]
    num_classes: dict[str, int]
    channels: int
    resolution: int

    def split(self, name: str) -> ImageSet:
        """The split called ``name`` (one of :data:`SPLITS`)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
        return getattr(self, name)


DATASETS: dict[str, str] = {
    "trifeature": "generated shapes x textures x colours (10 each), RGB; attributes shape, "
    "texture, color; size set by samples_per_combination",
    "mnist_fashion": "MNIST digit (channel 0) + independent Fashion-MNIST garment (channel 1); "
    "attributes digit, garment; needs Debian package dataset-fashion-mnist",
    "digits": "scikit-learn 8x8 digits (1 797 images), 1 channel; attribute digit",
    "folder": "ImageFolder layout root/<class>/*.png|jpg, or root/train/<class>/ and "
    "root/test/<class>/ (the shipped test split), RGB; attribute class; needs root",
    "pairs": "image-caption pairs listed in a CSV/TSV file (root; columns image|filepath|path "
    "and caption|title|text, image paths relative to the file), RGB; no labels, one caption "
    "per image; split at random",
}


def describe_datasets() -> str:
    """One line per dataset name with what it is, for error messages and `--help` texts."""
    return "\n".join(f"  {name}: {text}" for name, text in DATASETS.items())


def default_cache_dir() -> Path:
    """$RAYCL_CACHE if set, else ~/.cache/raycl."""
    return Path(os.environ.get("RAYCL_CACHE") or Path.home() / ".cache" / "raycl")


def _content_key(cfg: Any, seed: int) -> dict[str, Any]:
    """Every parameter that changes the cached arrays (and nothing that does not)."""
    name = cfg.dataset
    key: dict[str, Any] = {"version": CACHE_VERSION, "dataset": name,
                           "resolution": int(cfg.resolution)}
    if name == "trifeature":
        key.update(samples_per_combination=int(cfg.samples_per_combination), seed=int(seed))
    elif name == "mnist_fashion":
        num_samples = cfg.num_samples
        key.update(num_samples=None if num_samples is None else int(num_samples),
                   seed=int(seed))
    elif name == "digits":
        key.update(seed=int(seed))
    elif name == "folder":
        from raycl.data.folders import folder_fingerprint, resolve_layout

        root = _folder_root(cfg)
        layout = resolve_layout(root, _folder_layout(cfg))
        key.update(root=str(Path(root).resolve()), files=folder_fingerprint(root, layout))
        if layout != "flat":
            # Added only here: flat keys stay as they were, so existing caches remain valid.
            key.update(layout=layout)
    elif name == "pairs":
        from raycl.data.image_text import pairs_fingerprint

        path = _pairs_file(cfg)
        key.update(root=str(Path(path).resolve()), files=pairs_fingerprint(path))
    # data.captions is not part of the key: Trifeature's captions are drawn after the cache is
    # read (see load_image_set), so every caption setting shares one copy of the images.
    return key


def _folder_root(cfg: Any) -> str:
    if not cfg.root:
        raise ValueError("dataset 'folder' needs data.root (the ImageFolder directory)")
    return str(cfg.root)


def _pairs_file(cfg: Any) -> str:
    if not cfg.root:
        raise ValueError("dataset 'pairs' needs data.root (the CSV or TSV file of image, "
                         "caption rows)")
    return str(cfg.root)


def _folder_layout(cfg: Any) -> str:
    """``cfg.layout``; "auto" for config-like objects without it (transfer entries)."""
    return str(getattr(cfg, "layout", None) or "auto")


def _build_image_set(cfg: Any, seed: int) -> ImageSet:
    """Generate or read the full image set (no cache). Imports lazily: each source is optional."""
    name = cfg.dataset
    if name == "trifeature":
        from raycl.data import trifeature

        return trifeature.generate_trifeature(cfg.samples_per_combination, cfg.resolution, seed)
    if name == "mnist_fashion":
        from raycl.data import pairs

        return pairs.make_mnist_fashion(cfg.num_samples, cfg.resolution, seed)
    if name == "digits":
        from raycl.data import pairs

        return pairs.load_digits_set(cfg.resolution, seed)
    if name == "folder":
        from raycl.data import folders

        return folders.load_image_folder(_folder_root(cfg), cfg.resolution, _folder_layout(cfg))
    if name == "pairs":
        from raycl.data import image_text

        return image_text.load_image_text_pairs(_pairs_file(cfg), cfg.resolution)
    raise ValueError(f"unknown dataset {name!r}; choose one of:\n{describe_datasets()}")


def _save_atomically(path: Path, image_set: ImageSet) -> None:
    """Write to a temporary file in the same directory, then rename over `path`.

    Several Ray workers may build the same set at once; os.replace is atomic, so a reader sees
    either no file or a complete one, and the last writer wins with identical content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"label_{name}": values for name, values in image_set.labels.items()}
    # dtype str: an unlabelled set's empty list would otherwise be saved as float64.
    arrays["attributes"] = np.array(list(image_set.labels), dtype=np.str_)
    if image_set.test_mask is not None:
        arrays["test_mask"] = image_set.test_mask
    if image_set.captions is not None:
        # A fixed-width unicode array, so loading needs no pickle.
        arrays["captions"] = np.asarray(image_set.captions, dtype=np.str_)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as tmp_file:
            np.savez(tmp_file, images=image_set.images, **arrays)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _load_cached(path: Path) -> ImageSet | None:
    """The cached set, or None when the file is missing or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            attributes = [str(name) for name in archive["attributes"]]
            labels = {name: archive[f"label_{name}"] for name in attributes}
            test_mask = archive["test_mask"] if "test_mask" in archive.files else None
            captions = archive["captions"] if "captions" in archive.files else None
            return ImageSet(images=archive["images"], labels=labels, test_mask=test_mask,
                            captions=captions)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None


def caption_rates(cfg: Any) -> dict[str, float] | None:
    """``cfg.captions`` checked against the dataset: None when absent or unset.

    Raises:
        ValueError: captions are set for a dataset other than trifeature.
    """
    rates = getattr(cfg, "captions", None)
    if rates is None:
        return None
    if cfg.dataset != "trifeature":
        raise ValueError(f"data.captions is only for dataset trifeature (its captions are "
                         f"made from its labels), not {cfg.dataset!r}")
    return {str(name): float(rate) for name, rate in rates.items()}


def caption_seed(seed: int) -> int:
    """The seed of the synthetic captions drawn for data seed ``seed`` (see _CAPTION_STREAM)."""
    return int(np.random.SeedSequence([int(seed), _CAPTION_STREAM]).generate_state(1)[0])


def load_image_set(cfg: Any, seed: int) -> ImageSet:
    """The full (unsplit) image set, from the cache when it is there.

    Args:
        cfg: DataConfig-like object (see the module docstring).
        seed: seeds generation, subsampling and synthetic captions (ignored by "folder" and
            "pairs").

    Returns:
        ImageSet with all images of the dataset (both halves of a train/test folder, the test
        ones marked by ``test_mask``), and captions for "pairs" or when data.captions is set.
    """
    if cfg.dataset not in DATASETS:
        raise ValueError(
            f"unknown dataset {cfg.dataset!r}; choose one of:\n{describe_datasets()}"
        )
    if int(cfg.resolution) < 1:
        raise ValueError(f"data.resolution must be >= 1, got {cfg.resolution}")
    rates = caption_rates(cfg)  # before any work: a bad combination fails at once
    key = _content_key(cfg, seed)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    path = cache_dir / f"{cfg.dataset}-{digest}.npz"
    image_set = _load_cached(path) if path.exists() else None
    if image_set is None:
        image_set = _build_image_set(cfg, seed)
        _save_atomically(path, image_set)
    if rates is not None:
        # Drawn here rather than cached: a cache keyed by the rates would store one copy of the
        # images per caption setting a sweep tries, and the captions take well under a second.
        from raycl.data.captions import caption_corpus

        captions = caption_corpus(image_set.labels, rates, caption_seed(seed))
        image_set = dataclasses.replace(image_set, captions=captions)
    return image_set


def _class_split_counts(size: int, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """(val, test) counts of one class of ``size`` samples; at least one sample stays in train."""
    test = min(round(test_fraction * size), size - 1)
    val = min(round(val_fraction * size), size - 1 - test)
    return val, test


def _check_fractions(val_fraction: float, test_fraction: float) -> None:
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
        val, test = _class_split_counts(count, val_fraction, test_fraction)
        sizes["train"] += count - val - test
        sizes["val"] += val
        sizes["test"] += test
    return sizes


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
        val_count, test_count = _class_split_counts(len(members), val_fraction, test_fraction)
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
        val_count, _ = _class_split_counts(len(members), val_fraction, 0.0)
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


def class_counts(cfg: Any) -> list[int]:
    """Samples per class of the stratifying (first) attribute, known without loading images.

    Generated and packaged sets know their counts from the config; a folder is listed (both
    halves together in the train/test layout: :func:`split_sizes_for` tells them apart). An
    unlabelled set (pairs) counts as one class of all its images: ``[N]``, its rows counted
    without opening an image.
    """
    name = cfg.dataset
    if name == "trifeature":
        # Every (shape, texture, colour) combination appears samples_per_combination times.
        return [100 * int(cfg.samples_per_combination)] * 10
    if name == "mnist_fashion":
        from raycl.data.pairs import MNIST_SIZE

        total = MNIST_SIZE if cfg.num_samples is None else int(cfg.num_samples)
        # balanced_subset: class counts differ by at most one.
        return [total // 10 + (1 if digit < total % 10 else 0) for digit in range(10)]
    if name == "digits":
        from sklearn.datasets import load_digits

        return np.bincount(load_digits().target).tolist()
    if name == "folder":
        from raycl.data.folders import folder_class_counts

        parts = folder_class_counts(_folder_root(cfg), _folder_layout(cfg))
        return [sum(counts) for counts in zip(*parts.values(), strict=True)]
    if name == "pairs":
        from raycl.data.image_text import count_pairs

        return [count_pairs(_pairs_file(cfg))]
    raise ValueError(f"unknown dataset {name!r}; choose one of:\n{describe_datasets()}")


def is_unlabelled(dataset: str) -> bool:
    """Whether ``dataset`` has no class labels (its splits are random, it cannot be probed)."""
    return ATTRIBUTES.get(dataset) == ()


def split_sizes_for(cfg: Any) -> dict[str, int]:
    """Exact train/val/test sizes :func:`load_dataset` will produce for this config."""
    if is_unlabelled(cfg.dataset):
        (total,) = class_counts(cfg)
        return unlabelled_split_sizes(total, float(cfg.val_fraction), float(cfg.test_fraction))
    if cfg.dataset == "folder":
        from raycl.data.folders import folder_class_counts

        parts = folder_class_counts(_folder_root(cfg), _folder_layout(cfg))
        if "test" in parts:
            # The shipped test split is whole; validation comes out of train/ (carve_validation).
            val = sum(_class_split_counts(count, float(cfg.val_fraction), 0.0)[0]
                      for count in parts["train"])
            return {"train": sum(parts["train"]) - val, "val": val, "test": sum(parts["test"])}
    return split_sizes(class_counts(cfg), float(cfg.val_fraction), float(cfg.test_fraction))


def _subset(image_set: ImageSet, indices: np.ndarray) -> ImageSet:
    return ImageSet(images=image_set.images[indices],
                    labels={name: values[indices] for name, values in image_set.labels.items()},
                    captions=None if image_set.captions is None
                    else image_set.captions[indices])


def _split_indices(
    image_set: ImageSet, cfg: Any, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, test) indices: by fractions (stratified on the first attribute, at random
    when there is none), or around the test split the source ships."""
    if image_set.labels:
        stratify = next(iter(image_set.labels.values()))
    elif image_set.test_mask is None:
        return random_split(len(image_set.images), float(cfg.val_fraction),
                            float(cfg.test_fraction), seed)
    else:
        # Unlabelled with a shipped test split: validation is a random share of the rest.
        stratify = np.zeros(len(image_set.images), dtype=np.int64)
    if image_set.test_mask is None:
        return stratified_split(stratify, float(cfg.test_fraction), seed,
                                val_fraction=float(cfg.val_fraction))
    pool = np.flatnonzero(~image_set.test_mask)
    train_of_pool, val_of_pool = carve_validation(stratify[pool], float(cfg.val_fraction), seed)
    return (pool[train_of_pool], pool[val_of_pool],
            np.flatnonzero(image_set.test_mask).astype(np.int64))


def load_dataset(cfg: Any, seed: int) -> DatasetSplits:
    """Load (or generate) a dataset and split it into train, validation and test.

    Args:
        cfg: DataConfig-like object (see the module docstring); only its attributes are read.
        seed: seeds generation, subsampling and the split; same seed -> same splits.

    Returns:
        DatasetSplits; the split is stratified on the first attribute. A folder in the
        train/test layout keeps its test/ images as the test split and carves validation
        from train/. An unlabelled set (pairs) is split at random (:func:`random_split`) and
        has ``attributes == []`` and ``num_classes == {}``. Captions, when the set has them,
        follow their images into every split.
    """
    image_set = load_image_set(cfg, seed)
    attributes = list(image_set.labels)
    train_indices, val_indices, test_indices = _split_indices(image_set, cfg, seed)
    return DatasetSplits(
        name=cfg.dataset,
        train=_subset(image_set, train_indices),
        val=_subset(image_set, val_indices),
        test=_subset(image_set, test_indices),
        attributes=attributes,
        num_classes=_FIXED_NUM_CLASSES.get(cfg.dataset)
        or {name: int(values.max()) + 1 for name, values in image_set.labels.items()},
        channels=int(image_set.images.shape[1]),
        resolution=int(image_set.images.shape[2]),
    )
