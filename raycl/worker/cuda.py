"""What a worker sets for its device: TF32 and cuDNN autotuning once per process on CUDA, and
the channels_last layout for convolutional models (on CUDA; on the CPU for ResNets).

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


# On the CPU, channels_last from this many convolutions on: the ResNets (20 and 53). Measured
# faster for the 4-convolution small_cnn too (1.4x, issue 37), but kept NCHW there for now: its
# recorded runs (tests/fixtures, rel 1e-4) predate NHWC's different summation order.
CPU_CHANNELS_LAST_MIN_CONVOLUTIONS = 8


def prefer_channels_last(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with its 4-D weights in channels_last (NHWC) when it is convolutional and runs
    on CUDA (at least two convolutions: cuDNN's tensor-core kernels want NHWC) or on the CPU (at
    least :data:`CPU_CHANNELS_LAST_MIN_CONVOLUTIONS`: oneDNN's convolutions want NHWC too; issue
    37, 2 cores, ResNet-18 at 32 px: a SimCLR step 1.2x faster, in NCHW oneDNN reorders every
    activation). With NHWC weights a convolution converts its NCHW input itself, so the batches
    need no change. Otherwise (a ViT's lone patch embedding would only add layout copies):
    ``module`` unchanged. Converts in place (``Module.to``) and returns it."""
    convolutions = sum(isinstance(m, nn.Conv2d | nn.ConvTranspose2d) for m in module.modules())
    needed = {"cuda": 2, "cpu": CPU_CHANNELS_LAST_MIN_CONVOLUTIONS}.get(device.type)
    if needed is None or convolutions < needed:
        return module
    return module.to(memory_format=torch.channels_last)


__all__ = ["CPU_CHANNELS_LAST_MIN_CONVOLUTIONS", "configure_cuda_backends",
           "prefer_channels_last"]
