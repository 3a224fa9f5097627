"""SimCLR/BYOL-style augmentation of a whole uint8 batch at once, on the batch's device.

Per-sample PIL/torchvision transforms in DataLoader workers are the bottleneck on a 2-core
machine, so every transform here is a batched tensor op with per-sample random parameters,
in BYOL's (and solo-learn's) order:

1. random resized crop + horizontal flip: one affine sampling grid per sample
   (`F.affine_grid` + `F.grid_sample`), output size = input size;
2. colour jitter (brightness, contrast, saturation 0.8 s, hue 0.2 s as in SimCLR), applied
   to each sample with probability `color_jitter_prob`, in a fixed order (torchvision
   shuffles the order; SimCLR does not depend on it);
3. random grayscale;
4. Gaussian blur with a per-sample sigma (a separable convolution whose per-sample kernels
   are the groups of one grouped `conv2d`, reflect padding as torchvision's `gaussian_blur`);
5. solarization (values >= 0.5 inverted, BYOL's definition).

Each probability and the jitter strength may differ between the two views (BYOL's asymmetric
recipe: blur [1.0, 0.1], solarize [0.0, 0.2]); a call says which view it makes. Colour
operations run only on 3-channel images; blur and solarization on any. `color_jitter=0`
leaves colour untouched, which matters on Trifeature where colour is one of the features being
learned. An operation that is off for a view draws no random numbers, so turning blur or
solarization on changes nothing else that is drawn before it.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from raycl.config.training import AugmentConfig, per_view

# ITU-R 601 luma weights, as in torchvision's rgb_to_grayscale.
_LUMA = (0.299, 0.587, 0.114)
_RGB_TO_YIQ = torch.tensor([
    [0.299, 0.587, 0.114],
    [0.596, -0.274, -0.322],
    [0.211, -0.523, 0.312],
])
# SimCLR and BYOL state the blur at 224 px: sigma in [0.1, 2.0] px and a kernel of ~10 % of the
# image side (BYOL: 23 px). Both scale with the image side here, so a recipe run at another
# resolution blurs the same fraction of the image (the papers' definition, followed). solo-learn
# keeps sigma in pixels at any size (PIL's radius) but turns blur off for 32 px CIFAR, so its
# recipes (all blur at 224 px) come out the same either way.
_BLUR_REFERENCE_SIDE = 224
_BLUR_RADIUS_FRACTION = 0.05  # kernel half-width / side: 11 px at 224 px, a 23 px kernel
# BYOL's solarization threshold on [0, 1] values (torchvision/PIL use 128 on uint8).
_SOLARIZE_THRESHOLD = 0.5


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


def blur_radius(side: int) -> int:
    """Half-width of the blur kernel for images of this side (at most side - 1, which reflect
    padding needs).

    Args:
        side: the images' shorter side in pixels.

    Returns:
        round(0.05 side), at least 1 (0 only for 1-pixel images): 11 at 224 px (BYOL's 23 px
        kernel), 2 at 32 px.
    """
    return min(max(1, int(_BLUR_RADIUS_FRACTION * side + 0.5)), side - 1)


def gaussian_kernels(sigma: Tensor, radius: int) -> Tensor:
    """One normalised 1-D Gaussian kernel per sigma (torchvision's ``_get_gaussian_kernel1d``).

    Args:
        sigma: (B,) standard deviations in pixels, > 0.
        radius: kernel half-width; each kernel has 2 radius + 1 taps.

    Returns:
        (B, 2 radius + 1) kernels, each summing to 1, in sigma's dtype and device.
    """
    offsets = torch.arange(-radius, radius + 1, device=sigma.device, dtype=sigma.dtype)
    return torch.softmax(-0.5 * (offsets.view(1, -1) / sigma.view(-1, 1)) ** 2, dim=1)


def gaussian_blur(images: Tensor, sigma: Tensor, radius: int) -> Tensor:
    """Blur each sample with its own isotropic Gaussian, reflect-padded like torchvision.

    The 2-D kernel is separable, so the blur is a horizontal then a vertical 1-D pass; each
    (sample, channel) plane is one group of a grouped convolution, so the whole batch is two
    ``conv2d`` calls whatever the sigmas.

    Args:
        images: float (B, C, H, W).
        sigma: (B,) standard deviations in pixels, on the images' device.
        radius: kernel half-width, < H and < W (reflect padding).

    Returns:
        float (B, C, H, W): the blurred images.
    """
    size, channels, height, width = images.shape
    taps = 2 * radius + 1
    kernels = gaussian_kernels(sigma.to(images.dtype), radius).repeat_interleave(channels, dim=0)
    planes = images.reshape(1, size * channels, height, width)
    planes = F.conv2d(F.pad(planes, (radius, radius, 0, 0), mode="reflect"),
                      kernels.view(-1, 1, 1, taps), groups=size * channels)
    planes = F.conv2d(F.pad(planes, (0, 0, radius, radius), mode="reflect"),
                      kernels.view(-1, 1, taps, 1), groups=size * channels)
    return planes.view(size, channels, height, width)


def solarize(images: Tensor, chosen: Tensor | None = None) -> Tensor:
    """BYOL's solarization of [0, 1] images: x if x < 0.5 else 1 - x.

    Args:
        images: float images in [0, 1].
        chosen: optional bool mask broadcastable to the images (e.g. (B, 1, 1, 1)): only
            these are solarized, in the same single pass.

    Returns:
        the (chosen) images solarized.
    """
    invert = images >= _SOLARIZE_THRESHOLD
    if chosen is not None:
        invert = invert & chosen
    return torch.where(invert, 1.0 - images, images)


class ViewSettings(NamedTuple):
    """One view's strengths and probabilities (a :data:`PerView` key's value for that view)."""

    color_jitter: float
    color_jitter_prob: float
    grayscale_prob: float
    blur_prob: float
    solarize_prob: float


_PROBABILITIES = ("color_jitter_prob", "grayscale_prob", "blur_prob", "solarize_prob")


def view_settings(cfg: AugmentConfig) -> tuple[ViewSettings, ViewSettings]:
    """The two views' settings, checked.

    Args:
        cfg: the augment section (each per-view key a number or a pair).

    Returns:
        (view 1, view 2) settings.

    Raises:
        ValueError: a negative jitter strength or a probability outside [0, 1], naming the key.
    """
    pairs = {name: per_view(getattr(cfg, name)) for name in ViewSettings._fields}
    if min(pairs["color_jitter"]) < 0:
        raise ValueError(f"color_jitter must be >= 0, got {cfg.color_jitter}")
    for name in _PROBABILITIES:
        if not all(0.0 <= value <= 1.0 for value in pairs[name]):
            raise ValueError(f"{name} must be in [0, 1], got {getattr(cfg, name)}")
    first, second = (ViewSettings(**{name: pair[view] for name, pair in pairs.items()})
                     for view in (0, 1))
    return first, second


class BatchAugment:
    """Random resized crop, flip, colour jitter, grayscale, blur and solarization for a uint8
    batch, each view with its own probabilities.

    Args:
        cfg: the config's augment section: crop_scale (min, max area fraction), flip,
            color_jitter (strength s), color_jitter_prob, grayscale_prob, blur_prob,
            blur_sigma (range at 224 px) and solarize_prob; the per-view keys a number (both
            views) or a pair [view 1, view 2].
        ratio: range of crop aspect ratios (width / height), sampled log-uniformly.
    """

    def __init__(self, cfg: AugmentConfig, ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        scale_min, scale_max = (float(value) for value in cfg.crop_scale)
        if not 0.0 < scale_min <= scale_max <= 1.0:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {cfg.crop_scale}")
        if not 0.0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio}")
        sigma_min, sigma_max = (float(value) for value in cfg.blur_sigma)
        if not 0.0 < sigma_min <= sigma_max:
            raise ValueError(f"blur_sigma must satisfy 0 < min <= max, got {cfg.blur_sigma}")
        self.scale = (scale_min, scale_max)
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.flip = bool(cfg.flip)
        self.blur_sigma = (sigma_min, sigma_max)
        self.views = view_settings(cfg)

    def __call__(self, images: Tensor, generator: torch.Generator | None = None,
                 view: int = 0) -> Tensor:
        """Augment a batch as one view.

        Args:
            images: uint8 (B, C, H, W) on any device.
            generator: seeds all random parameters (drawn on the generator's device, then
                moved to the images' device); the global RNG when None.
            view: 0 for the first view, 1 for the second: whose probabilities apply.

        Returns:
            float32 (B, C, H, W), normalised like `to_float`, on the images' device.
        """
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(
                f"expected uint8 images (B, C, H, W), got {images.dtype} {tuple(images.shape)}"
            )
        if view not in (0, 1):
            raise ValueError(f"view must be 0 or 1, got {view}")
        settings = self.views[view]
        draw_device = generator.device if generator is not None else images.device

        def uniform(low: float, high: float, size: int) -> Tensor:
            values = torch.rand(size, generator=generator, device=draw_device)
            return (low + (high - low) * values).to(images.device)

        def chosen(probability: float, size: int) -> Tensor:
            return (uniform(0.0, 1.0, size) < probability).view(-1, 1, 1, 1)

        batch = images.float().div(255.0)
        batch = self._crop_and_flip(batch, uniform)
        if batch.shape[1] == 3:
            if settings.color_jitter > 0:
                batch = self._jitter(batch, uniform, settings)
            if settings.grayscale_prob > 0:
                to_gray = chosen(settings.grayscale_prob, len(batch))
                batch = torch.where(to_gray, _grayscale(batch).expand_as(batch), batch)
        if settings.blur_prob > 0:
            batch = self._blur(batch, uniform, settings.blur_prob)
        if settings.solarize_prob > 0:
            batch = solarize(batch, chosen(settings.solarize_prob, len(batch)))
        return _normalise(batch)

    def _blur(self, batch: Tensor, uniform: Any, probability: float) -> Tensor:
        """Blur each sample with probability ``probability``, its sigma drawn from blur_sigma
        scaled from 224 px to the images' shorter side. Every sample is convolved and the
        chosen ones kept: selecting them first would sync with the host on CUDA."""
        size, side = len(batch), min(batch.shape[-2:])
        apply = uniform(0.0, 1.0, size) < probability
        sigma = uniform(*self.blur_sigma, size) * (side / _BLUR_REFERENCE_SIDE)
        blurred = gaussian_blur(batch, sigma, blur_radius(side))
        return torch.where(apply.view(-1, 1, 1, 1), blurred, batch)

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

    def _jitter(self, batch: Tensor, uniform: Any, settings: ViewSettings) -> Tensor:
        size = len(batch)
        strength = 0.8 * settings.color_jitter
        hue = min(0.2 * settings.color_jitter, 0.5)
        apply = uniform(0.0, 1.0, size) < settings.color_jitter_prob
        low = max(0.0, 1.0 - strength)
        jittered = batch * uniform(low, 1.0 + strength, size).view(-1, 1, 1, 1)
        jittered = jittered.clamp(0.0, 1.0)
        mean_gray = _grayscale(jittered).mean(dim=(1, 2, 3), keepdim=True)
        jittered = _blend(jittered, mean_gray, uniform(low, 1.0 + strength, size))
        jittered = _blend(jittered, _grayscale(jittered), uniform(low, 1.0 + strength, size))
        jittered = _rotate_hue(jittered, uniform(-hue, hue, size))
        return torch.where(apply.view(-1, 1, 1, 1), jittered, batch)
