"""The images a trial pretrains on, and whether they stay on the GPU for the whole trial.

``data.on_device`` keeps the decoded training images (train, then ``pretrain_extra``) on the
trial's CUDA device as one uint8 tensor, copied once per trial, so an epoch's batches are
gathered on the device and never touch host memory or a DataLoader worker (a CIFAR or STL
epoch). ``auto`` does so when they take at most a quarter of this trial's share of the device's
memory (all of it, or ``scaling.gpus_per_worker`` of it where trials share a GPU), leaving the
rest to the model, its activations and the optimizer. On CPU the setting is ignored: host
memory is where the images are anyway (the memory-mapped cache). Whether a trial's images stay
on the device is asked once per trial, by :func:`raycl.worker.loader.trial_training_images`.

Imports no Ray: ``benchmarks/gpu.py`` and the tests use it bare.
"""

from __future__ import annotations

import numpy as np
import torch

from raycl.data.types import DatasetSplits, ImageRows

# "auto" keeps the images on the device when they take at most 1/AUTO_SHARE of its memory.
AUTO_SHARE = 4
# Rows copied to the device per transfer: the host never holds more than this many at once.
COPY_ROWS = 4096


def keep_on_device(
    setting: bool | str, nbytes: int, device: torch.device, gpu_share: float = 1.0
) -> bool:
    """Whether training images of ``nbytes`` bytes stay on ``device`` for the trial.

    Args:
        setting: ``data.on_device``: True, False or "auto".
        nbytes: bytes of the training images (uint8: one per pixel and channel).
        device: the trial's (this rank's) device.
        gpu_share: the share of the device this rank reserved (``scaling.gpus_per_worker``):
            at 0.5 two trials hold the same GPU, each with its own copy of its images.

    Returns:
        False on a non-CUDA device whatever the setting; ``setting`` when it is a bool; for
        "auto", whether ``nbytes`` is at most a quarter of this rank's share of the device's
        total memory.
    """
    if device.type != "cuda":
        return False
    if setting == "auto":
        total = torch.cuda.get_device_properties(device).total_memory
        return nbytes <= total * min(1.0, gpu_share) / AUTO_SHARE
    return bool(setting)


def pretraining_images(data: DatasetSplits) -> np.ndarray | ImageRows:
    """The images pretraining sees: ``train``, followed by ``pretrain_extra`` when the set has
    one (pretraining index i < len(train) is train's row i, beyond it an extra row)."""
    train = data.train.images
    if data.pretrain_extra is None:
        return train
    extra = data.pretrain_extra.images
    if isinstance(train, ImageRows) and isinstance(extra, ImageRows) and train.base is extra.base:
        return train.concat(extra)
    return np.concatenate([np.asarray(train), np.asarray(extra)])


def copy_to_device(images: np.ndarray | ImageRows, device: torch.device) -> torch.Tensor:
    """``images`` as one uint8 tensor on ``device``, copied :data:`COPY_ROWS` rows at a time
    (never the whole set in host memory at once)."""
    resident = torch.empty(tuple(images.shape), dtype=torch.uint8, device=device)
    for start in range(0, len(images), COPY_ROWS):
        rows = np.array(images[start:start + COPY_ROWS])  # a writable copy of a few rows
        resident[start:start + len(rows)] = torch.from_numpy(rows).to(device)
    return resident


__all__ = ["AUTO_SHARE", "copy_to_device", "keep_on_device", "pretraining_images"]
