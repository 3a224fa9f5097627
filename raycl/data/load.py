"""Loading a dataset by name: the full image set (from the cache when it is there), its split
into train, validation and test, and the split sizes known from the config alone.

`load_dataset(cfg, seed)` is the one entry point the training code needs. ``cfg`` is the data
settings, a :class:`~raycl.config.training.DataConfig` (the config's ``data`` section, or a
transfer set's, :func:`raycl.eval.transfer.transfer_data_config`); its defaults are the
schema's, never repeated here. It reads:

- dataset: one of DATASETS (:mod:`raycl.data.registry`)
- resolution: image side in pixels
- samples_per_combination (trifeature), num_samples (mnist_fashion), root and layout (folder),
  root (pairs: the CSV/TSV file)
- captions (trifeature): attribute -> probability that an image's caption names it; when
  set, every image gets a synthetic caption (:mod:`raycl.data.sources.captions`)
- val_fraction, test_fraction: share of each class (of the first attribute) held out for
  validation (model selection) and for the final test. A folder in the train/test layout ships
  its test split (root/test/): test_fraction is ignored and validation is carved from train/.
  An unlabelled set (pairs) has no classes: its shares are drawn at random
  (:func:`raycl.data.splits.random_split`).
- cache_dir: where the decoded arrays are kept (None -> $RAYCL_CACHE or ~/.cache/raycl)
- decode_workers: threads that decode image files on the first build (0: the CPUs the Ray
  worker reserved; every core outside Ray)
- skip_unreadable: leave image files that cannot be decoded out of every
  split (before the split is made; listed in ``DatasetSplits.skipped``) instead of raising

The full image set is cached once per content as an uncompressed memory-mapped array
(:mod:`raycl.data.cache.store`), built once per node (:mod:`raycl.data.cache.build`: atomic,
locked, its free disk checked first, decoded on the CPUs the worker reserved), and found again
through the node's listing manifest of the folder (:mod:`raycl.data.cache.manifest`: no
listing once a node has listed it), so Ray workers and later trials map it instead of
generating it again, and every process on a node reads the one copy in the page cache. The
split is recomputed from the seed on every call (it is cheap) as index arrays: each split's
images are an :class:`~raycl.data.types.ImageRows` view into the mapped set, never a copy.
:func:`split_sizes_for` gives the exact split sizes from the config alone, so a search can be
checked before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from raycl.config.training import DataConfig
from raycl.data.bucket_paths import is_remote
from raycl.data.cache.build import Unreadable, build_cache, decode_workers, read_unreadable
from raycl.data.cache.store import cache_key, cache_path, open_cached
from raycl.data.listed_once import listed_once
from raycl.data.registry import (
    CHANNELS,
    FIXED_NUM_CLASSES,
    SOURCES,
    reader,
    streamed_only,
    streams,
    unknown_dataset,
)
from raycl.data.splits import split_indices
from raycl.data.stream.files import FileRows, decoded_bytes
from raycl.data.types import DatasetSplits, ImageFiles, ImageRows, ImageSet
from raycl.data.unreadable import image_problem, unreadable_message

# Keeps the synthetic captions' draws apart from the Trifeature generator's, which is seeded
# with the same data seed: otherwise whether a caption names the colour would follow the
# generator's first random numbers (e.g. the objects' positions).
_CAPTION_STREAM = 0xCA9


def caption_rates(cfg: DataConfig) -> dict[str, float] | None:
    """``cfg.captions`` checked against the dataset: None when unset.

    Raises:
        ValueError: captions are set for a dataset other than trifeature.
    """
    rates = cfg.captions
    if rates is None:
        return None
    if cfg.dataset != "trifeature":
        raise ValueError(f"data.captions is only for dataset trifeature (its captions are "
                         f"made from its labels), not {cfg.dataset!r}")
    return {str(name): float(rate) for name, rate in rates.items()}


def caption_seed(seed: int) -> int:
    """The seed of the synthetic captions drawn for data seed ``seed`` (see _CAPTION_STREAM)."""
    return int(np.random.SeedSequence([int(seed), _CAPTION_STREAM]).generate_state(1)[0])


def load_image_set(cfg: DataConfig, seed: int) -> ImageSet:
    """The full (unsplit) image set, from the cache when it is there (see
    :func:`load_marked_set`; with ``skip_unreadable`` the rows of unreadable files are blank).
    """
    return load_marked_set(cfg, seed)[0]


def load_marked_set(cfg: DataConfig, seed: int) -> tuple[ImageSet, list[Unreadable]]:
    """The full (unsplit) image set, from the cache when it is there, and its rows whose files
    cannot be decoded (kept, blank, only with ``cfg.skip_unreadable``; else an error).

    Args:
        cfg: the data settings (see the module docstring).
        seed: seeds generation, subsampling and synthetic captions (ignored by "folder" and
            "pairs").

    Returns:
        ImageSet with all images of the dataset (both halves of a train/test folder, the test
        ones marked by ``test_mask``), memory-mapped read-only from the cache, and captions
        for "pairs" or when data.captions is set; and (row, file, why) of each unreadable file.

    Raises:
        ValueError: an unknown dataset, a bad resolution or caption setting, or what the
            reader raises (unreadable image files without ``skip_unreadable``: the first few
            named, with how many were unreadable; also when a cache built with skipping holds
            them).
    """
    if cfg.dataset not in SOURCES:
        raise unknown_dataset(cfg.dataset)
    if int(cfg.resolution) < 1:
        raise ValueError(f"data.resolution must be >= 1, got {cfg.resolution}")
    rates = caption_rates(cfg)  # before any work: a bad combination fails at once
    with listed_once():  # the key and the build: one listing
        image_set, unreadable = _cached_set(cfg, seed)
    if rates is not None:
        # Drawn here rather than cached: a cache keyed by the rates would store one copy of the
        # images per caption setting a sweep tries, and the captions take well under a second.
        from raycl.data.sources.captions import caption_corpus

        captions = caption_corpus(image_set.labels, rates, caption_seed(seed))
        image_set = dataclasses.replace(image_set, captions=captions)
    return image_set, unreadable


def _cached_set(cfg: DataConfig, seed: int) -> tuple[ImageSet, list[Unreadable]]:
    """The full set from its cache (built first when missing) and its unreadable rows."""
    source = reader(cfg.dataset)
    # data.captions is not part of the key: Trifeature's captions are drawn after the cache is
    # read (load_marked_set), so every caption setting shares one copy of the images.
    content = source.content_key(cfg, seed)
    directory = cache_path(cfg, content)
    skip = cfg.skip_unreadable
    image_set = open_cached(directory)
    if image_set is None:
        # Skipping or not, one cache per content: unreadable rows are listed beside the set.
        image_set = build_cache(directory, lambda: source.read(cfg, seed),
                                cache_key(cfg, content), int(cfg.resolution),
                                cfg.decode_workers,
                                keep_unreadable=skip)
    unreadable = read_unreadable(directory)
    if unreadable and not skip:  # a cache a skipping run built
        raise ValueError(unreadable_message([(name, why) for _, name, why in unreadable],
                                            f"{len(image_set.images)} image files"))
    return image_set, unreadable


def class_counts(cfg: DataConfig) -> list[int]:
    """Samples per class of the stratifying (first) attribute, known without loading images.

    Generated and packaged sets know their counts from the config; a folder is listed (both
    halves together in the train/test layout: :func:`split_sizes_for` tells them apart). An
    unlabelled set (pairs) counts as one class of all its images: ``[N]``, its rows counted
    without opening an image.
    """
    parts = reader(cfg.dataset).class_counts(cfg)
    return [sum(counts) for counts in zip(*parts.values(), strict=True)]


def split_sizes_for(cfg: DataConfig) -> dict[str, int]:
    """Exact train/val/test sizes :func:`load_dataset` will produce for this config (its
    reader's :meth:`~raycl.data.types.Reader.split_sizes`: nothing is decoded)."""
    return reader(cfg.dataset).split_sizes(cfg)


# How training reads the images once ``data.loader: auto`` is settled.
LoaderChoice = Literal["memory", "stream"]


def choose_loader(cfg: DataConfig, node_memory: float | None) -> tuple[LoaderChoice, str]:
    """What ``data.loader: auto`` means for this dataset on nodes of ``node_memory`` bytes (the
    smallest node that runs trials: :func:`raycl.launch.ray_nodes.trial_node_memory`):
    ``("memory" | "stream", why)``; the one rule for ``auto``. Memory when the decoded set
    (images x channels x resolution^2) takes at most ``data.memory_share`` of a node's memory;
    shards always stream, array sources never do. ``node_memory`` None (no cluster measured: a
    config that never went through a launch) streams only what must. An explicit choice is
    returned as it is.
    """
    if cfg.loader != "auto":
        return cfg.loader, "set in the config"
    if streamed_only(cfg.dataset):
        return "stream", f"{cfg.dataset} is streamed only"
    if not streams(cfg.dataset):
        return "memory", f"{cfg.dataset} is read whole"
    if node_memory is None:
        return "memory", "no node's memory to compare with (not launched)"
    count = sum(class_counts(cfg))
    size = decoded_bytes(count, int(cfg.resolution), CHANNELS.get(cfg.dataset, 3))
    limit = float(cfg.memory_share) * node_memory
    choice = "memory" if size <= limit else "stream"
    return choice, (f"{count} images decoded at {cfg.resolution} px take {size / 1e9:.1f} GB, "
                    f"{'within' if choice == 'memory' else 'over'} data.memory_share "
                    f"({cfg.memory_share:g}) of the smallest node that runs trials "
                    f"({node_memory / 1e9:.1f} GB)")


def settled_loader(cfg: DataConfig) -> LoaderChoice:
    """``data.loader`` as every reader after the launch takes it: the launch's settled choice
    (:func:`raycl.sweep.run.settle_loader` wrote it into the trials' config); a config that never
    went through a launch (a test, a benchmark) still saying ``auto`` gets :func:`choose_loader`
    with no node measured."""
    return choose_loader(cfg, None)[0]


def _subset(image_set: ImageSet, indices: np.ndarray) -> ImageSet:
    """The rows ``indices`` of ``image_set``: its images a view (nothing is read; stream mode's
    files: the files of those rows), labels and captions small copies."""
    images = (image_set.images.subset(indices) if isinstance(image_set.images, FileRows)
              else ImageRows(image_set.images, indices))
    return ImageSet(images=images,
                    labels={name: values[indices] for name, values in image_set.labels.items()},
                    captions=None if image_set.captions is None
                    else image_set.captions[indices])


def load_dataset(cfg: DataConfig, seed: int) -> DatasetSplits:
    """Load (or generate) a dataset and split it into train, validation and test.

    Args:
        cfg: the data settings (see the module docstring).
        seed: seeds generation, subsampling and the split; same seed -> same splits.

    Returns:
        DatasetSplits; the split is stratified on the first attribute. A folder in the
        train/test layout keeps its test/ images as the test split and carves validation
        from train/. An unlabelled set (pairs) is split at random
        (:func:`raycl.data.splits.random_split`) and has ``attributes == []`` and
        ``num_classes == {}``. Captions, when the set has them, follow their images into every
        split. Each split's images are an :class:`~raycl.data.types.ImageRows` view into the
        memory-mapped set. Images marked ``pretrain_only`` are in no split but in
        ``pretrain_extra`` (None when there are none).
    """
    # One listing serves the cache's name, its build and stream mode's files; once the node's
    # listing manifest knows the folder, a built cache is found without any.
    with listed_once():
        if settled_loader(cfg) == "stream":
            return load_streamed(cfg, seed)
        return split_image_set(cfg, *load_marked_set(cfg, seed), seed=seed)


def load_streamed(cfg: DataConfig, seed: int) -> DatasetSplits:
    """The dataset's splits with lazy images (see the module docstring). Every worker of a
    trial asks: the files come from the listing its node keeps
    (:func:`raycl.data.cache.manifest.node_listed`), so only a node's first process lists them.

    Raises:
        ValueError: the dataset is not one that streams, or what its reader raises.
    """
    if streamed_only(cfg.dataset):
        from raycl.data.sources.sharded import shard_splits  # pyarrow, tarfile: when used

        return shard_splits(cfg, seed)
    listed = reader(cfg.dataset).read(cfg, seed)
    if not isinstance(listed, ImageFiles) or not streams(cfg.dataset):
        raise ValueError(f"data.loader: stream reads image files or shards; dataset "
                         f"{cfg.dataset!r} is read whole from its files: use data.loader: memory")
    threads = decode_workers(cfg.decode_workers)
    images = FileRows(listed.paths, int(cfg.resolution), threads)
    image_set = ImageSet(images=images, labels=listed.labels, test_mask=listed.test_mask,
                         captions=listed.captions, pretrain_only=listed.pretrain_only)
    unreadable = (streamed_unreadable(cfg, seed, listed.paths, threads)
                  if cfg.skip_unreadable else [])
    return split_image_set(cfg, image_set, unreadable, seed=seed)


def split_image_set(cfg: DataConfig, image_set: ImageSet, unreadable: Sequence[Unreadable] = (),
                    *, seed: int) -> DatasetSplits:
    """``image_set`` split into train, validation and test as :func:`load_dataset` describes
    (its images decoded in the cache, or stream mode's files); the ``unreadable`` rows left
    out of every split before it is made, and listed in ``skipped``."""
    attributes = list(image_set.labels)
    train_indices, val_indices, test_indices, extra_indices = split_indices(
        image_set, float(cfg.val_fraction), float(cfg.test_fraction), seed,
        leave_out=np.array([row for row, _, _ in unreadable], dtype=np.int64))
    return DatasetSplits(
        name=cfg.dataset,
        train=_subset(image_set, train_indices),
        val=_subset(image_set, val_indices),
        test=_subset(image_set, test_indices),
        attributes=attributes,
        num_classes=FIXED_NUM_CLASSES.get(cfg.dataset)
        or {name: int(values.max()) + 1 for name, values in image_set.labels.items()},
        channels=int(image_set.images.shape[1]),
        resolution=int(image_set.images.shape[2]),
        pretrain_extra=_subset(image_set, extra_indices) if len(extra_indices) else None,
        skipped=[(name, why) for _, name, why in unreadable],
    )


def streamed_unreadable(cfg: DataConfig, seed: int, paths: Sequence[Any],
                        threads: int = 1) -> list[Unreadable]:
    """(row, file, why) of the local image files of ``paths`` that cannot be decoded
    (:func:`raycl.data.unreadable.image_problem`: header, end marker, a full decode when that
    is
    missing), for stream mode to leave out before the split. Checked once per content and node:
    the result is kept beside the cache (``<cache>.unreadable.json``), so the trials of a sweep
    do not read a million headers each. Files in a bucket are not read here (a request each):
    training replaces and counts one that fails (``data/skipped``)."""
    if not paths or is_remote(str(paths[0])):
        return []
    directory = cache_path(cfg, reader(cfg.dataset).content_key(cfg, seed))
    memo = directory.with_name(directory.name + ".unreadable.json")
    try:
        return [(int(row), str(name), str(why))
                for row, name, why in json.loads(memo.read_text())]
    except (OSError, ValueError, TypeError):
        pass  # not checked yet on this node (or a torn file): check now
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        reasons = list(pool.map(image_problem, paths))
    found = [(row, str(path), why) for row, (path, why) in enumerate(zip(paths, reasons,
                                                                          strict=True))
             if why is not None]
    memo.parent.mkdir(parents=True, exist_ok=True)
    temporary = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps([list(entry) for entry in found]))
    os.replace(temporary, memo)  # atomic: a concurrent trial reads all of it or nothing
    return found
