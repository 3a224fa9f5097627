"""Features of one batch, as every evaluation computes them (torch only, no Ray).

:func:`batch_features` is the one forward of a frozen encoder that raycl's evaluations share:
the worker's embedding pass (:func:`raycl.worker.embed.embed_images`, which ``python -m
raycl.evaluate`` runs in one process too) and the papers' linear evaluation, whose batches are
augmented first (:mod:`raycl.eval.linear_sgd`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor


def batch_features(
    embed: Callable[[Tensor], Tensor],
    images: Tensor,
    autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> Tensor:
    """float32 features of a batch of normalised float images, without gradients.

    Args:
        embed: images -> (B, D) features (the frozen encoder, in eval mode).
        images: float (B, C, H, W), normalised (:func:`raycl.data.augment.to_float`).
        autocast: the forward's precision context (:func:`raycl.worker.optim.inference_autocast`:
            the trial's on CUDA, none on the CPU); the features are cast to float32 after it.

    Returns:
        float32 (B, D), on the images' device.
    """
    with torch.no_grad(), autocast():
        return embed(images).float()


__all__ = ["batch_features"]
