"""The new data of ``python -m raycl.evaluate``, read once per trial and scored by several
encoders (the trial's, and its references: :mod:`raycl.results.references`), with the id of
each row for ``--features-out``.

Read as a transfer set is (:func:`raycl.eval.transfer.load_transfer_sets`: at the trial's
resolution, converted to its channels, split into a probe-training and a held-out share), and
kept as the splits :func:`raycl.eval.scoring.evaluate_features` scores. An image's id is what
finds it again in the source: for data read from image files (a folder, an ImageNet layout) the
file's path relative to ``data.root``; for packaged or generated data its row in the set as
raycl reads it (with the trial's data seed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raycl.config.schema import CoreConfig
from raycl.config.training import DataConfig
from raycl.data import DatasetSplits, ImageFiles, ImageRows, ImageSet, load_dataset
from raycl.data.listed_once import listed_once
from raycl.data.registry import reader, streamed_only, streams
from raycl.eval.transfer import match_channels, transfer_data_config


@dataclass(frozen=True)
class NewData:
    """The new data, ready to embed and score.

    Attributes:
        splits: ``train`` (the probe's share) and ``test`` (held out); ``val`` empty.
        ids: ``train``/``test`` -> (N,) ids of their rows (str paths or int64 rows).
    """

    splits: DatasetSplits
    ids: dict[str, np.ndarray]

    @property
    def name(self) -> str:
        """The transfer set's name, as in ``transfer/<name>/...``."""
        return self.splits.name


def _relative(path: Path | str, root: str) -> str:
    """``path`` relative to ``root`` (a bucket URI's prefix stripped); as given when outside."""
    text = str(path)
    if "://" in root:
        prefix = root.rstrip("/") + "/"
        return text.removeprefix(prefix)
    base = Path(root).expanduser()
    base = base if base.is_dir() else base.parent  # a listing file's (pairs) folder
    relative = os.path.relpath(Path(text).resolve(), base.resolve())
    return text if relative.startswith("..") else Path(relative).as_posix()


def source_ids(cfg: DataConfig, seed: int, count: int) -> np.ndarray:
    """The id of each row of the set ``cfg`` reads: file paths relative to ``cfg.root`` when
    it is read from image files, else the row indices.

    Args:
        cfg: the new data's settings (:func:`raycl.eval.transfer.transfer_data_config`).
        seed: the data seed it is read with.
        count: rows of the read set (the rows when no file names them).

    Returns:
        (count,) str or int64.
    """
    rows = np.arange(count, dtype=np.int64)
    if not streams(cfg.dataset) or streamed_only(cfg.dataset) or not cfg.root:
        return rows
    listed = reader(cfg.dataset).read(cfg, seed)  # the listing the cache was built from
    if not isinstance(listed, ImageFiles) or len(listed.paths) != count:
        return rows
    return np.array([_relative(path, str(cfg.root)) for path in listed.paths])


def _rows(images: object) -> np.ndarray:
    """The rows of the full set a split's images are (a split is a view into it)."""
    if isinstance(images, ImageRows):
        return images.rows
    return np.arange(len(images), dtype=np.int64)  # type: ignore[arg-type]


def load_new_data(config: CoreConfig, channels: int, with_ids: bool = False) -> NewData:
    """The config's one transfer set (the new data) as splits, and its rows' ids when asked.

    Args:
        config: :func:`raycl.results.reevaluate.evaluation_config`'s result.
        channels: the encoder's image channels (the new data is converted to them).
        with_ids: also find each row's id (``--features-out``: lists a folder once more).

    Returns:
        The :class:`NewData`.
    """
    (entry,) = config.eval.transfer
    cfg = transfer_data_config(config, entry)
    with listed_once():  # the ids' listing is the one the data was read with
        read = load_dataset(cfg, config.data_seed)
        ids: dict[str, np.ndarray] = {}
        if with_ids:
            full = len(read.train.images.base) if isinstance(read.train.images, ImageRows) \
                else len(read.train.images) + len(read.test.images)
            every = source_ids(cfg, config.data_seed, full)
            ids = {split: every[_rows(part.images)]
                   for split, part in (("train", read.train), ("test", read.test))}
    train, test = (ImageSet(match_channels(part.images, channels), part.labels)
                   for part in (read.train, read.test))
    attributes = list(train.labels)
    # No validation split: nothing is selected on the new data.
    empty = ImageSet(np.asarray(test.images[:0]),
                     {name: labels[:0] for name, labels in test.labels.items()})
    num_classes = {name: int(max(train.labels[name].max(), test.labels[name].max())) + 1
                   for name in attributes}
    splits = DatasetSplits(entry.label, train, empty, test, attributes, num_classes, channels,
                           config.data.resolution)
    return NewData(splits, ids)


__all__ = ["NewData", "load_new_data", "source_ids"]
