"""Datasets that exist offline, a stratified train/validation/test split, and an on-disk cache.

`load_dataset(cfg, seed)` is the one entry point the training code needs
(:mod:`raycl.data.load`, whose docstring lists what it reads of ``cfg``). The package is layered
one way; no module imports this face:

- :mod:`~raycl.data.types`: :class:`ImageSet`, :class:`ImageFiles` (files a reader lists,
  decoded by the builder), :class:`ImageRows` (a split: rows of the cached set, not a copy),
  :class:`DatasetSplits`, the reader contract (:class:`Reader`: content key, read, the
  pre-launch check, class counts, split sizes; every reader implements all of it). Every
  function takes the data settings as the schema's
  :class:`~raycl.config.training.DataConfig`, whose defaults are the only ones;
- :mod:`~raycl.data.decode`: the one image decode (file, bucket URI or bytes to a uint8 RGB
  square) that the cache builder, stream mode's files and shards, and evaluation sets call, so
  a file gives the same pixels whichever way it is read;
- one reader per source (:mod:`~raycl.data.sources.trifeature`, :mod:`~raycl.data.sources.packaged`,
  :mod:`~raycl.data.sources.folders`, :mod:`~raycl.data.sources.pairs`), on types only;
- :mod:`~raycl.data.registry`: every dataset name, what it is and its reader (imported when
  the source is read); a new dataset is one reader module and one entry there;
- :mod:`~raycl.data.splits` (stratified, random, around a shipped test split; their sizes),
  :mod:`~raycl.data.cache.store` (one memory-mapped directory per content: one decoded copy per
  node, shared by every process through the page cache) and :mod:`~raycl.data.cache.build` (its
  first build: atomic, locked against a second builder, decoded on every core with
  :mod:`~raycl.data.progress`);
- :mod:`~raycl.data.load`: loading by name, splitting, split sizes from the config alone.

Beside them: :mod:`~raycl.data.augment` (batched, on device), :mod:`~raycl.worker.resident`
(whether a trial keeps its training images on the GPU, ``data.on_device``),
:mod:`~raycl.worker.samplers` (MCL's batches) and :mod:`~raycl.data.sources.captions` (Trifeature's
synthetic captions). This face
re-exports the names ``raycl.data`` has always offered.
"""

from raycl.data.cache.store import CACHE_VERSION, default_cache_dir
from raycl.data.load import (
    caption_rates,
    caption_seed,
    class_counts,
    load_dataset,
    load_image_set,
    split_sizes_for,
)
from raycl.data.registry import (
    ATTRIBUTES,
    CHANNELS,
    DATASETS,
    SOURCES,
    Source,
    attributes_of,
    describe_datasets,
    is_unlabelled,
)
from raycl.data.splits import (
    carve_validation,
    random_split,
    split_sizes,
    stratified_split,
    stratified_subset,
    unlabelled_split_sizes,
)
from raycl.data.types import SPLITS, DatasetSplits, ImageFiles, ImageRows, ImageSet, Reader

__all__ = [
    "ATTRIBUTES",
    "CACHE_VERSION",
    "CHANNELS",
    "DATASETS",
    "SOURCES",
    "SPLITS",
    "DatasetSplits",
    "ImageFiles",
    "ImageRows",
    "ImageSet",
    "Reader",
    "Source",
    "attributes_of",
    "caption_rates",
    "caption_seed",
    "carve_validation",
    "class_counts",
    "default_cache_dir",
    "describe_datasets",
    "is_unlabelled",
    "load_dataset",
    "load_image_set",
    "random_split",
    "split_sizes",
    "split_sizes_for",
    "stratified_split",
    "stratified_subset",
    "unlabelled_split_sizes",
]
