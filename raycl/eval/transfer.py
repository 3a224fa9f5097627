"""Transfer evaluation: a linear probe on the frozen encoder's features of *other* datasets.

The HSCL paper's question (Table 4: CIFAR-10 -> CIFAR-100) is not how well an encoder separates
its own classes but what else it kept. ``eval.transfer`` lists labelled datasets; each is loaded
at the pretraining set's resolution, converted to its channels, split into a probe-training
share and a held-out share (stratified, seeded), embedded by the encoder after its last epoch,
and probed: ``transfer/<name>/linear/<attribute>`` on the held-out share. Transfer metrics are
reported once per trial, like ``test/``, and never optimised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from raycl.config.evaluation import TransferConfig
from raycl.config.training import DataConfig
from raycl.data import ImageRows, ImageSet, load_dataset

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig

# Features of a transfer set live beside the split features under these keys.
FEATURE_PREFIX = "transfer:"


@dataclass
class TransferSet:
    """A transfer dataset ready to embed: probe-training and held-out shares."""

    name: str
    train: ImageSet
    test: ImageSet

    @property
    def train_key(self) -> str:
        return f"{FEATURE_PREFIX}{self.name}:train"

    @property
    def test_key(self) -> str:
        return f"{FEATURE_PREFIX}{self.name}:test"


def match_channels(images: np.ndarray | ImageRows, channels: int) -> np.ndarray | ImageRows:
    """Convert uint8 (N, C, H, W) images to ``channels`` channels.

    One channel is repeated; several are averaged to grey first when the counts differ (so an
    RGB set fed to a 1-channel encoder, or MNIST⊕Fashion's 2 channels to an RGB one, keeps its
    luminance rather than an arbitrary channel).

    Args:
        images: uint8 (N, C, H, W): an array or a split's view into the cached set.
        channels: the encoder's input channels, >= 1.

    Returns:
        uint8 (N, channels, H, W); ``images`` itself when C == channels (a view stays a view:
        nothing is copied), else a converted copy.
    """
    if images.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W), got shape {images.shape}")
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    have = images.shape[1]
    if have == channels:
        return images
    images = np.asarray(images)  # converting needs every pixel: the one full copy
    grey = images if have == 1 else np.round(images.mean(axis=1, keepdims=True)).astype(np.uint8)
    return np.repeat(grey, channels, axis=1)


def load_transfer_sets(config: CoreConfig, channels: int) -> list[TransferSet]:
    """Every ``eval.transfer`` dataset at ``data.resolution`` with ``channels`` channels.

    Args:
        config: the trial's configuration.
        channels: channels of the pretraining images (the encoder's input).

    Returns:
        One :class:`TransferSet` per entry, in config order.
    """
    sets = []
    for entry in config.eval.transfer:
        splits = load_dataset(transfer_data_config(config, entry), config.data_seed)
        converted = [ImageSet(match_channels(part.images, channels), part.labels)
                     for part in (splits.train, splits.test)]
        sets.append(TransferSet(entry.label, *converted))
    return sets


def transfer_data_config(config: CoreConfig, entry: TransferConfig) -> DataConfig:
    """The data settings a transfer ``entry`` (of ``config.eval.transfer``) is read with: the
    pretraining set's resolution and cache, the probe trained on everything outside the
    held-out share (no validation split), no unlabelled images (a probe fits on labels), read
    whole into the cache; every other key the schema's default (no captions, layout auto, no
    skipping: a transfer set has no such keys)."""
    # Built without validation: val_fraction 0 (no validation split) is below what the schema
    # lets a user set for the pretraining data, and is what a transfer probe wants.
    return DataConfig.model_construct(
        dataset=entry.dataset, resolution=config.data.resolution,
        samples_per_combination=entry.samples_per_combination,
        num_samples=entry.num_samples, root=entry.root, val_fraction=0.0,
        test_fraction=entry.test_fraction, cache_dir=config.data.cache_dir,
        decode_workers=config.data.decode_workers, download=False, pretrain_unlabeled=False,
        loader="memory")


__all__ = ["FEATURE_PREFIX", "TransferSet", "load_transfer_sets", "match_channels",
           "transfer_data_config"]
