"""SimCLR-style augmentations, batched on the device.

Per-sample PIL/torchvision transforms in DataLoader workers are the bottleneck on a 2-core
machine; here a whole uint8 batch is augmented at once with tensor ops on whatever device it is
on (CPU or CUDA): random resized crop and horizontal flip as one per-sample affine
``grid_sample``, then colour jitter and random grayscale (3-channel images only).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

MEAN = 0.5
STD = 0.5


class AugmentSettings(Protocol):
    crop_scale: tuple[float, float]
    flip: bool
    color_jitter: float
    color_jitter_prob: float
    grayscale_prob: float


def to_float(images: Tensor) -> Tensor:
    """uint8 (B, C, H, W) -> float in [0, 1], normalised with mean 0.5 and std 0.5."""
    return (images.float() / 255.0 - MEAN) / STD


def _uniform(low: float, high: float, n: int, generator: torch.Generator | None,
             device: torch.device) -> Tensor:
    return torch.rand(n, generator=generator, device=device) * (high - low) + low


def _gray(x: Tensor) -> Tensor:
    weights = torch.tensor([0.299, 0.587, 0.114], device=x.device, dtype=x.dtype)
    return (x * weights.view(1, 3, 1, 1)).sum(dim=1, keepdim=True)


class BatchAugment:
    """Random resized crop, flip, colour jitter and grayscale for a batch at once.

    Args:
        settings: an ``AugmentConfig`` (crop_scale, flip, color_jitter, color_jitter_prob,
            grayscale_prob).
        ratio: aspect-ratio range of the crop (torchvision's default).

    Example:
        >>> augment = BatchAugment(AugmentConfig())
        >>> views = augment(images_uint8, generator)  # float, normalised, same shape
    """

    def __init__(self, settings: AugmentSettings,
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        low, high = settings.crop_scale
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {(low, high)}")
        if not 0.0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {ratio}")
        self.crop_scale = (low, high)
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.flip = settings.flip
        self.color_jitter = settings.color_jitter
        self.color_jitter_prob = settings.color_jitter_prob
        self.grayscale_prob = settings.grayscale_prob

    def __call__(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Augment a uint8 batch (B, C, H, W); returns a normalised float batch, same shape."""
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 (B, C, H, W), got {images.dtype} "
                             f"{tuple(images.shape)}")
        x = images.float() / 255.0
        x = self._crop_and_flip(x, generator)
        if x.shape[1] == 3:
            if self.color_jitter > 0 and self.color_jitter_prob > 0:
                x = self._jitter(x, generator)
            if self.grayscale_prob > 0:
                x = self._grayscale(x, generator)
        return (x - MEAN) / STD

    def _crop_and_flip(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        n, device = x.shape[0], x.device
        if self.crop_scale == (1.0, 1.0) and not self.flip:
            return x
        area = _uniform(*self.crop_scale, n, generator, device)
        log_ratio = _uniform(*self.log_ratio, n, generator, device)
        ratio = torch.exp(log_ratio)
        # Crop width/height as fractions of the side (clamped: a crop cannot exceed the image).
        width = torch.sqrt(area * ratio).clamp(max=1.0)
        height = torch.sqrt(area / ratio).clamp(max=1.0)
        # Centre in grid coordinates [-1, 1] so that the crop stays inside the image.
        cx = (torch.rand(n, generator=generator, device=device) * 2 - 1) * (1 - width)
        cy = (torch.rand(n, generator=generator, device=device) * 2 - 1) * (1 - height)
        sign = torch.ones(n, device=device)
        if self.flip:
            flips = torch.rand(n, generator=generator, device=device) < 0.5
            sign = torch.where(flips, -sign, sign)
        theta = torch.zeros(n, 2, 3, device=device)
        theta[:, 0, 0] = width * sign
        theta[:, 0, 2] = cx
        theta[:, 1, 1] = height
        theta[:, 1, 2] = cy
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection",
                             align_corners=False)

    def _jitter(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        n, device = x.shape[0], x.device
        s = self.color_jitter
        apply = (torch.rand(n, generator=generator, device=device)
                 < self.color_jitter_prob).view(n, 1, 1, 1)
        brightness = _uniform(max(0.0, 1 - 0.8 * s), 1 + 0.8 * s, n, generator, device)
        contrast = _uniform(max(0.0, 1 - 0.8 * s), 1 + 0.8 * s, n, generator, device)
        saturation = _uniform(max(0.0, 1 - 0.8 * s), 1 + 0.8 * s, n, generator, device)
        hue = _uniform(-min(0.5, 0.2 * s), min(0.5, 0.2 * s), n, generator, device)
        y = (x * brightness.view(n, 1, 1, 1)).clamp(0, 1)
        mean = _gray(y).mean(dim=(2, 3), keepdim=True)
        y = ((y - mean) * contrast.view(n, 1, 1, 1) + mean).clamp(0, 1)
        gray = _gray(y)
        y = ((y - gray) * saturation.view(n, 1, 1, 1) + gray).clamp(0, 1)
        y = self._rotate_hue(y, hue).clamp(0, 1)
        return torch.where(apply, y, x)

    @staticmethod
    def _rotate_hue(x: Tensor, hue: Tensor) -> Tensor:
        """Hue shift as a rotation of the chroma plane in YIQ space (hue in turns)."""
        to_yiq = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322],
                               [0.211, -0.523, 0.312]], device=x.device, dtype=x.dtype)
        from_yiq = torch.linalg.inv(to_yiq)
        angle = hue * 2 * math.pi
        cos, sin = torch.cos(angle), torch.sin(angle)
        rotation = torch.zeros(len(hue), 3, 3, device=x.device, dtype=x.dtype)
        rotation[:, 0, 0] = 1
        rotation[:, 1, 1], rotation[:, 1, 2] = cos, -sin
        rotation[:, 2, 1], rotation[:, 2, 2] = sin, cos
        transform = from_yiq @ rotation @ to_yiq  # (B, 3, 3)
        return torch.einsum("bij,bjhw->bihw", transform, x)

    def _grayscale(self, x: Tensor, generator: torch.Generator | None) -> Tensor:
        n = x.shape[0]
        apply = (torch.rand(n, generator=generator, device=x.device)
                 < self.grayscale_prob).view(n, 1, 1, 1)
        return torch.where(apply, _gray(x).expand_as(x), x)
