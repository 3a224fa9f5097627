"""What a stage's loader hands the epoch: :class:`TrainBatch`, from every loader of
:class:`TrainLoader`'s shape.

The loader's kind (memory, on-device, stream files, stream shards) is chosen once per trial by
:func:`raycl.worker.loader.trial_training_images` from the settled ``data.loader``; the epoch
(:mod:`raycl.worker.epoch`) and the stage (:mod:`raycl.worker.stage`) only see this protocol and
this record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class TrainBatch:
    """One rank's batch of training images, as every loader yields it.

    Attributes:
        images: uint8 (B, C, H, W): on the host (pinned when training on CUDA), or on the device
            with ``data.on_device``.
        index: int64 (B,): the batch's rows of the trial's training images (they pick the rows
            of the pseudo labels and of the caption tokens).
        captions: streamed shards read for an image-text method: the batch's captions, one per
            image; None otherwise (a set's captions, when it has them, are tokenised once per
            stage and taken by ``index``).
        tokens: int64 (B, L), the captions' tokens when stream mode's decoders tokenised them
            (:meth:`raycl.methods.base.Method.caption_tokenizer`); None otherwise.
    """

    images: Tensor
    index: Tensor
    captions: list[str] | None = None
    tokens: Tensor | None = None


class TrainLoader(Protocol):
    """One rank's batches of one stage, whatever reads them."""

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        ...

    def __iter__(self) -> Iterator[TrainBatch]:
        """The epoch's batches, in the order set by :meth:`set_epoch`."""
        ...

    def set_epoch(self, stage_epoch: int) -> None:
        """Reshuffle for ``stage_epoch`` (the epoch within the stage, over all its phases)."""
        ...

    def pop_metrics(self) -> dict[str, float]:
        """The epoch's loader figures (``train/sampler_*`` with MCL's sampler, ``data/skipped``
        in stream mode); counts restart for the next epoch."""
        ...


__all__ = ["TrainBatch", "TrainLoader"]
