"""SimCLR-style augmentation of a whole uint8 batch at once, on the batch's device.

Per-sample PIL/torchvision transforms in DataLoader workers are the bottleneck on a 2-core
machine, so every transform here is a batched tensor op with per-sample random parameters:

1. random resized crop + horizontal flip: one affine sampling grid per sample
   (`F.affine_grid` + `F.grid_sample`), output size = input size;
2. colour jitter (brightness, contrast, saturation 0.8 s, hue 0.2 s as in SimCLR), applied
   to each sample with probability `color_jitter_prob`, in a fixed order (torchvision
   shuffles the order; SimCLR does not depend on it);
3. random grayscale.

Colour operations run only on 3-channel images. `color_jitter=0` leaves colour untouched,
which matters on Trifeature where colour is one of the features being learned.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from raycl.config.training import AugmentConfig

# ITU-R 601 luma weights, as in torchvision's rgb_to_grayscale.
_LUMA = (0.299, 0.587, 0.114)
_RGB_TO_YIQ = torch.tensor([
    [0.299, 0.587, 0.114],
    [0.596, -0.274, -0.322],
    [0.211, -0.523, 0.312],
])


def to_float(images: Tensor) -> Tensor:
    """uint8 (B, C, H, W) -> float32 scaled to [0, 1], then normalised with mean 0.5, std 0.5.

    Args:
        images: uint8 batch.

    Returns:
        float32 batch in [-1, 1] on the same device.
    """
    if images.dtype != torch.uint8:
        raise ValueError(f"to_float expects uint8 images, got {images.dtype}")
    return images.float().div(255.0).sub(0.5).div(0.5)


def _normalise(images: Tensor) -> Tensor:
    return (images - 0.5) / 0.5


class _ColourConstants(NamedTuple):
    """The colour operations' constant tensors on one device."""

    luma: Tensor  # (1, 3, 1, 1) in the images' dtype
    to_yiq: Tensor  # (3, 3) float32
    from_yiq: Tensor  # (3, 3) float32, its inverse


@lru_cache(maxsize=16)
def _colour_constants(device: torch.device, dtype: torch.dtype) -> _ColourConstants:
    """Built once per (device, dtype): a tensor from Python numbers is a host-to-device copy,
    and ``linalg.inv`` on CUDA syncs with the host for its error check, so neither happens per
    batch. The values are those the per-call construction gave (same ops, same device)."""
    with torch.inference_mode(False), torch.no_grad():
        to_yiq = _RGB_TO_YIQ.to(device)
        return _ColourConstants(torch.tensor(_LUMA, dtype=dtype, device=device).view(1, 3, 1, 1),
                                to_yiq, torch.linalg.inv(to_yiq))


def _grayscale(images: Tensor) -> Tensor:
    """(B, 3, H, W) in [0, 1] -> luma (B, 1, H, W)."""
    weights = _colour_constants(images.device, images.dtype).luma
    return (images * weights).sum(dim=1, keepdim=True)


def _blend(images: Tensor, other: Tensor, factor: Tensor) -> Tensor:
    """factor * images + (1 - factor) * other, clamped to [0, 1] (torchvision's _blend)."""
    factor = factor.view(-1, 1, 1, 1)
    return (factor * images + (1.0 - factor) * other).clamp(0.0, 1.0)


def _rotate_hue(images: Tensor, turns: Tensor) -> Tensor:
    """Rotate the hue by `turns` (fractions of a full circle) in YIQ space, per sample.

    Cheaper than torchvision's RGB->HSV->RGB and close to it for moderate shifts.
    """
    constants = _colour_constants(images.device, images.dtype)
    to_yiq, from_yiq = constants.to_yiq, constants.from_yiq
    angle = 2.0 * math.pi * turns
    cos, sin = torch.cos(angle), torch.sin(angle)
    rotation = torch.zeros(len(turns), 3, 3, device=images.device)
    rotation[:, 0, 0] = 1.0
    rotation[:, 1, 1], rotation[:, 1, 2] = cos, -sin
    rotation[:, 2, 1], rotation[:, 2, 2] = sin, cos
    matrices = from_yiq @ rotation @ to_yiq  # (B, 3, 3)
    return torch.einsum("bij,bjhw->bihw", matrices, images).clamp(0.0, 1.0)


class BatchAugment:
    """Random resized crop, flip, colour jitter and grayscale for a uint8 batch.

    Args:
        cfg: the config's augment section: crop_scale (min, max area fraction), flip,
            color_jitter (strength s), color_jitter_prob and grayscale_prob.
        ratio: range of crop aspect ratios (width / height), sampled log-uniformly.
    """

    def __init__(self, cfg: AugmentConfig, ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        scale_min, scale_max = (float(value) for value in cfg.crop_scale)
        if not 0.0 < scale_min <= scale_max <= 1.0:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {cfg.crop_scale}")
        if not 0.0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio}")
        if cfg.color_jitter < 0:
            raise ValueError(f"color_jitter must be >= 0, got {cfg.color_jitter}")
        for name in ("color_jitter_prob", "grayscale_prob"):
            if not 0.0 <= getattr(cfg, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(cfg, name)}")
        self.scale = (scale_min, scale_max)
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.flip = bool(cfg.flip)
        self.color_jitter = float(cfg.color_jitter)
        self.color_jitter_prob = float(cfg.color_jitter_prob)
        self.grayscale_prob = float(cfg.grayscale_prob)

    def __call__(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Augment a batch.

        Args:
            images: uint8 (B, C, H, W) on any device.
            generator: seeds all random parameters (drawn on the generator's device, then
                moved to the images' device); the global RNG when None.

        Returns:
            float32 (B, C, H, W), normalised like `to_float`, on the images' device.
        """
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(
                f"expected uint8 images (B, C, H, W), got {images.dtype} {tuple(images.shape)}"
            )
        draw_device = generator.device if generator is not None else images.device

        def uniform(low: float, high: float, size: int) -> Tensor:
            values = torch.rand(size, generator=generator, device=draw_device)
            return (low + (high - low) * values).to(images.device)

        batch = images.float().div(255.0)
        batch = self._crop_and_flip(batch, uniform)
        if batch.shape[1] == 3:
            if self.color_jitter > 0:
                batch = self._jitter(batch, uniform)
            if self.grayscale_prob > 0:
                to_gray = uniform(0.0, 1.0, len(batch)) < self.grayscale_prob
                gray = _grayscale(batch).expand_as(batch)
                batch = torch.where(to_gray.view(-1, 1, 1, 1), gray, batch)
        return _normalise(batch)

    def _crop_and_flip(self, batch: Tensor, uniform: Any) -> Tensor:
        size, _, height, width = batch.shape
        area = uniform(*self.scale, size)
        aspect = torch.exp(uniform(*self.log_ratio, size))
        # torchvision redraws a crop that does not fit; batched, we instead clamp the aspect
        # ratio to the range in which a crop of this area fits, [a W/H, W/(a H)]. The area is
        # kept exactly, and area 1 gives the whole image.
        aspect = torch.minimum(torch.maximum(aspect, area * width / height),
                               width / (area * height))
        # Crop width/height as fractions of the image width/height (torchvision's formula).
        crop_w = torch.sqrt(area * aspect * height / width).clamp(max=1.0)
        crop_h = torch.sqrt(area / aspect * width / height).clamp(max=1.0)
        # In affine_grid's [-1, 1] coordinates a crop of fraction f has half-width f, so its
        # centre can move by at most 1 - f.
        shift_x = (2.0 * uniform(0.0, 1.0, size) - 1.0) * (1.0 - crop_w)
        shift_y = (2.0 * uniform(0.0, 1.0, size) - 1.0) * (1.0 - crop_h)
        mirror = torch.ones(size, device=batch.device)
        if self.flip:
            mirror = torch.where(uniform(0.0, 1.0, size) < 0.5, -1.0, 1.0)
        theta = torch.zeros(size, 2, 3, device=batch.device)
        theta[:, 0, 0] = crop_w * mirror
        theta[:, 0, 2] = shift_x
        theta[:, 1, 1] = crop_h
        theta[:, 1, 2] = shift_y
        grid = F.affine_grid(theta, list(batch.shape), align_corners=False)
        return F.grid_sample(batch, grid, mode="bilinear", padding_mode="border",
                             align_corners=False)

    def _jitter(self, batch: Tensor, uniform: Any) -> Tensor:
        size = len(batch)
        strength = 0.8 * self.color_jitter
        hue = min(0.2 * self.color_jitter, 0.5)
        apply = uniform(0.0, 1.0, size) < self.color_jitter_prob
        low = max(0.0, 1.0 - strength)
        jittered = batch * uniform(low, 1.0 + strength, size).view(-1, 1, 1, 1)
        jittered = jittered.clamp(0.0, 1.0)
        mean_gray = _grayscale(jittered).mean(dim=(1, 2, 3), keepdim=True)
        jittered = _blend(jittered, mean_gray, uniform(low, 1.0 + strength, size))
        jittered = _blend(jittered, _grayscale(jittered), uniform(low, 1.0 + strength, size))
        jittered = _rotate_hue(jittered, uniform(-hue, hue, size))
        return torch.where(apply.view(-1, 1, 1, 1), jittered, batch)
