"""What a worker sets for a CUDA device: TF32 and cuDNN autotuning once per process, and the
channels_last layout for convolutional models. Nothing here changes a CPU run.

Needs torch only (no Ray), so ``benchmarks/gpu.py`` measures exactly what the loop does.
"""

from __future__ import annotations

import torch
from torch import nn


def configure_cuda_backends(device: torch.device) -> bool:
    """On CUDA: float32 matmuls and convolutions on TF32 tensor cores (float32 storage, a 10-bit
    mantissa in the products; evaluation passes and float32 loss blocks get it too) and cuDNN's
    autotuner (a worker sees few input shapes: the batch, the last batch, the eval chunks).

    Process-wide settings, idempotent; called once at the start of every worker loop.

    Returns:
        Whether anything was set (False on a CPU device).
    """
    if device.type != "cuda":
        return False
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    return True


def prefer_channels_last(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with its 4-D weights in channels_last (NHWC) when it runs on CUDA and is
    convolutional: cuDNN's tensor-core kernels want NHWC, and with NHWC weights a convolution
    converts its NCHW input itself, so the batches need no change. CPU, or a model with fewer
    than two convolutions (a ViT's lone patch embedding would only add layout copies):
    ``module`` unchanged. Converts in place (``Module.to``) and returns it."""
    convolutions = sum(isinstance(m, nn.Conv2d | nn.ConvTranspose2d) for m in module.modules())
    if device.type != "cuda" or convolutions < 2:
        return module
    return module.to(memory_format=torch.channels_last)


__all__ = ["configure_cuda_backends", "prefer_channels_last"]
