"""Batched on-device augmentation: crop/flip geometry, colour ops, blur and solarization against
torchvision's functional ops, per-view probabilities, determinism, validation."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raycl.data.augment import BatchAugment, to_float


def augment_cfg(**overrides: Any) -> SimpleNamespace:
    """Stand-in for raycl.config.AugmentConfig with the same field names and defaults."""
    fields = dict(crop_scale=(0.2, 1.0), flip=True, color_jitter=0.0, color_jitter_prob=0.8,
                  grayscale_prob=0.0, blur_prob=0.0, blur_sigma=(0.1, 2.0), solarize_prob=0.0)
    fields.update(overrides)
    return SimpleNamespace(**fields)


def random_images(batch: int = 8, channels: int = 3, side: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, channels, side, side), generator=generator,
                         dtype=torch.uint8)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_to_float_hand_computed() -> None:
    images = torch.tensor([0, 255, 51], dtype=torch.uint8).view(1, 3, 1, 1)
    expected = torch.tensor([-1.0, 1.0, -0.6]).view(1, 3, 1, 1)
    torch.testing.assert_close(to_float(images), expected)
    with pytest.raises(ValueError, match="uint8"):
        to_float(images.float())


@pytest.mark.parametrize("channels", [1, 2, 3])
def test_shape_dtype_device_preserved(channels: int) -> None:
    images = random_images(channels=channels)
    out = BatchAugment(augment_cfg(color_jitter=1.0, grayscale_prob=0.5))(images, seeded(0))
    assert out.shape == images.shape and out.dtype == torch.float32
    assert out.device == images.device
    assert out.min() >= -1.0 and out.max() <= 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_images_with_cpu_generator_match_cpu() -> None:
    images = random_images()
    augment = BatchAugment(augment_cfg(color_jitter=1.0, grayscale_prob=0.5, blur_prob=0.5,
                                       solarize_prob=(0.0, 0.5)))
    for view in (0, 1):
        on_gpu = augment(images.cuda(), seeded(3), view=view)
        assert on_gpu.device.type == "cuda"
        torch.testing.assert_close(on_gpu.cpu(), augment(images, seeded(3), view=view),
                                   atol=1e-4, rtol=0)


def test_deterministic_with_seeded_generator() -> None:
    images = random_images()
    augment = BatchAugment(augment_cfg(color_jitter=0.5, grayscale_prob=0.2))
    torch.testing.assert_close(augment(images, seeded(7)), augment(images, seeded(7)),
                               atol=0, rtol=0)
    assert not torch.equal(augment(images, seeded(7)), augment(images, seeded(8)))


def test_full_crop_without_flip_is_identity() -> None:
    images = random_images(side=13)
    out = BatchAugment(augment_cfg(crop_scale=(1.0, 1.0), flip=False))(images, seeded(0))
    torch.testing.assert_close(out, to_float(images), atol=1e-5, rtol=0)


def test_flip_only_mirrors_exactly() -> None:
    images = random_images(batch=64)
    out = BatchAugment(augment_cfg(crop_scale=(1.0, 1.0), flip=True))(images, seeded(0))
    plain, mirrored = to_float(images), to_float(images.flip(-1))
    is_plain = (out - plain).abs().amax(dim=(1, 2, 3)) < 1e-5
    is_mirrored = (out - mirrored).abs().amax(dim=(1, 2, 3)) < 1e-5
    assert torch.all(is_plain | is_mirrored)
    assert 10 < int(is_mirrored.sum()) < 54  # about half are flipped


def test_crop_zooms_in_by_the_side_fraction() -> None:
    # Horizontal ramp: value 8 * column. A crop of area 1/4 (side 1/2, square) stretches it
    # to twice the width, so neighbouring output columns differ by 4 instead of 8.
    ramp = (8 * torch.arange(32)).to(torch.uint8).expand(4, 3, 32, 32).contiguous()
    augment = BatchAugment(augment_cfg(crop_scale=(0.25, 0.25), flip=False), ratio=(1.0, 1.0))
    out = augment(ramp, seeded(0)) * 0.5 + 0.5  # back to [0, 1]
    steps = (out[..., 1:] - out[..., :-1]) * 255
    torch.testing.assert_close(steps, torch.full_like(steps, 4.0), atol=1e-3, rtol=0)


def _tinted(batch: int = 16, side: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose every pixel is one colour times a random intensity."""
    color = torch.tensor([0.9, 0.5, 0.2]).view(1, 3, 1, 1)
    intensity = torch.rand(batch, 1, side, side, generator=seeded(1)) * 0.8 + 0.2
    return (intensity * color * 255).round().to(torch.uint8), color.flatten()


def test_jitter_off_keeps_colour_ratios() -> None:
    images, color = _tinted()
    source = images.float()
    expected = source[:, 1] / source[:, 0]  # per pixel ratio green / red (= 5/9 up to rounding)
    augment = BatchAugment(augment_cfg(crop_scale=(0.3, 1.0), color_jitter=0.0))
    out = augment(images, seeded(2)) * 0.5 + 0.5
    ratio = out[:, 1] / out[:, 0]
    # Bilinear mixing of pixels with (almost) the same ratio keeps that ratio.
    assert (ratio - color[1] / color[0]).abs().max() < 0.03
    assert (expected - color[1] / color[0]).abs().max() < 0.03
    jittered = BatchAugment(augment_cfg(crop_scale=(0.3, 1.0), color_jitter=1.0,
                                        color_jitter_prob=1.0))(images, seeded(2)) * 0.5 + 0.5
    changed = (jittered[:, 1] / jittered[:, 0].clamp(min=1e-3) - color[1] / color[0]).abs()
    assert changed.amax(dim=(1, 2)).min() > 0.03, "jitter on must change colour"


def test_jitter_probability_zero_is_identity_and_grey_stays_grey() -> None:
    images = random_images()
    identity = augment_cfg(crop_scale=(1.0, 1.0), flip=False)
    out = BatchAugment(augment_cfg(**{**vars(identity), "color_jitter": 1.0,
                                      "color_jitter_prob": 0.0}))(images, seeded(0))
    torch.testing.assert_close(out, to_float(images), atol=1e-5, rtol=0)
    # Brightness, contrast, saturation and hue all map grey pixels to grey pixels.
    grey = random_images(channels=1).expand(-1, 3, -1, -1).contiguous()
    jittered = BatchAugment(augment_cfg(**{**vars(identity), "color_jitter": 1.0,
                                           "color_jitter_prob": 1.0}))(grey, seeded(0))
    assert (jittered[:, 0] - jittered[:, 1]).abs().max() < 1e-4
    assert (jittered[:, 0] - jittered[:, 2]).abs().max() < 1e-4
    assert not torch.allclose(jittered, to_float(grey), atol=1e-2)


def test_grayscale_makes_channels_equal_luma() -> None:
    images = random_images()
    out = BatchAugment(augment_cfg(crop_scale=(1.0, 1.0), flip=False, grayscale_prob=1.0))(
        images, seeded(0))
    torch.testing.assert_close(out[:, 0], out[:, 1], atol=0, rtol=0)
    torch.testing.assert_close(out[:, 0], out[:, 2], atol=0, rtol=0)
    pixels = images.float() / 255
    luma = 0.299 * pixels[:, 0] + 0.587 * pixels[:, 1] + 0.114 * pixels[:, 2]
    torch.testing.assert_close(out[:, 0], (luma - 0.5) / 0.5, atol=1e-5, rtol=0)


def test_colour_ops_skipped_for_other_channel_counts() -> None:
    images = random_images(channels=2)
    augment = BatchAugment(augment_cfg(crop_scale=(1.0, 1.0), flip=False, color_jitter=1.0,
                                       color_jitter_prob=1.0, grayscale_prob=1.0))
    torch.testing.assert_close(augment(images, seeded(0)), to_float(images), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"crop_scale": (0.9, 0.2)}, "crop_scale"),
        ({"crop_scale": (0.0, 1.0)}, "crop_scale"),
        ({"color_jitter": -0.1}, "color_jitter"),
        ({"color_jitter_prob": 1.5}, "color_jitter_prob"),
        ({"grayscale_prob": -0.5}, "grayscale_prob"),
    ],
)
def test_invalid_settings_are_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchAugment(augment_cfg(**overrides))


def test_rejects_non_uint8_batches() -> None:
    with pytest.raises(ValueError, match="uint8"):
        BatchAugment(augment_cfg())(torch.zeros(2, 3, 8, 8))
    with pytest.raises(ValueError, match="uint8"):
        BatchAugment(augment_cfg())(torch.zeros(3, 8, 8, dtype=torch.uint8))


def _uncached_grayscale(images: torch.Tensor) -> torch.Tensor:
    """The colour math as it was, building its constants on every call (the reference)."""
    weights = images.new_tensor((0.299, 0.587, 0.114)).view(1, 3, 1, 1)
    return (images * weights).sum(dim=1, keepdim=True)


def _uncached_rotate_hue(images: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    import math

    from raycl.data.augment import _RGB_TO_YIQ

    to_yiq = _RGB_TO_YIQ.to(images.device)
    from_yiq = torch.linalg.inv(to_yiq)
    angle = 2.0 * math.pi * turns
    cos, sin = torch.cos(angle), torch.sin(angle)
    rotation = torch.zeros(len(turns), 3, 3, device=images.device)
    rotation[:, 0, 0] = 1.0
    rotation[:, 1, 1], rotation[:, 1, 2] = cos, -sin
    rotation[:, 2, 1], rotation[:, 2, 2] = sin, cos
    matrices = from_yiq @ rotation @ to_yiq
    return torch.einsum("bij,bjhw->bihw", matrices, images).clamp(0.0, 1.0)


def test_colour_constants_are_built_once_per_device_and_match_the_uncached_math() -> None:
    """Colour jitter and grayscale build their constant tensors (and invert the YIQ matrix) once
    per (device, dtype), not per batch (on CUDA each was a copy or a host sync), and the cached
    constants give bit-identical results."""
    from raycl.data import augment as module

    module._colour_constants.cache_clear()
    images = random_images(batch=16).float().div(255.0)
    turns = torch.linspace(-0.2, 0.2, 16)
    gray, rotated = module._grayscale(images), module._rotate_hue(images, turns)
    assert module._colour_constants.cache_info().currsize == 1
    misses = module._colour_constants.cache_info().misses
    augment = BatchAugment(augment_cfg(color_jitter=1.0, grayscale_prob=0.5))
    for seed in range(3):
        augment(random_images(batch=16, seed=seed), seeded(seed))
    info = module._colour_constants.cache_info()
    assert info.misses == misses and info.currsize == 1 and info.hits > 3  # nothing rebuilt
    assert torch.equal(gray, _uncached_grayscale(images))
    assert torch.equal(rotated, _uncached_rotate_hue(images, turns))
    module._grayscale(images.double())  # another dtype: one more entry
    assert module._colour_constants.cache_info().currsize == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_augment_does_not_sync_with_the_host_on_cuda() -> None:
    """After the first batch (which builds the colour constants) a batch queues GPU work only."""
    augment = BatchAugment(augment_cfg(color_jitter=1.0, grayscale_prob=0.5, blur_prob=(1.0, 0.1),
                                       solarize_prob=(0.0, 0.2)))
    images = random_images(batch=16).cuda()
    generator = torch.Generator(device="cuda").manual_seed(0)
    augment(images, generator)
    torch.cuda.set_sync_debug_mode("error")
    try:
        augment(images, generator, view=0)
        augment(images, generator, view=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- Gaussian blur and solarization (BYOL's recipe), per view --------------------------------

IDENTITY_GEOMETRY = {"crop_scale": (1.0, 1.0), "flip": False}


def unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 images as the [0, 1] floats the colour/blur/solarize ops see."""
    return images.float() / 255


def test_blur_matches_torchvision_gaussian_blur() -> None:
    """The separable grouped convolution equals torchvision's 2-D ``gaussian_blur`` (same
    kernel size and sigma, reflect padding), to float32 rounding: 1e-5 on [0, 1] values."""
    from torchvision.transforms.v2 import functional as tvf

    from raycl.data.augment import gaussian_blur

    images = unit(random_images(batch=4, side=20))
    expected = tvf.gaussian_blur(images, kernel_size=[7, 7], sigma=[1.3, 1.3])
    torch.testing.assert_close(gaussian_blur(images, torch.full((4,), 1.3), radius=3), expected,
                               atol=1e-5, rtol=0)
    # Each sample its own sigma, in one call.
    sigmas = torch.tensor([0.1, 0.7, 1.5, 3.0])
    blurred = gaussian_blur(images, sigmas, radius=3)
    for index, sigma in enumerate(sigmas.tolist()):
        reference = tvf.gaussian_blur(images[index], kernel_size=[7, 7], sigma=[sigma, sigma])
        torch.testing.assert_close(blurred[index], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("side", "radius", "sigma"), [(112, 6, 0.5), (224, 11, 1.0)])
def test_augment_blur_scales_sigma_and_kernel_with_the_side(side: int, radius: int,
                                                            sigma: float) -> None:
    """blur_sigma is in pixels at 224 px, and the kernel is ~10 % of the side (BYOL's 23 px at
    224): at 112 px, sigma 1.0 blurs with sigma 0.5 and a 13 px kernel."""
    from torchvision.transforms.v2 import functional as tvf

    from raycl.data.augment import blur_radius

    assert blur_radius(side) == radius
    images = random_images(batch=2, side=side)
    augment = BatchAugment(augment_cfg(**IDENTITY_GEOMETRY, blur_prob=1.0, blur_sigma=(1.0, 1.0)))
    size = 2 * radius + 1
    expected = tvf.gaussian_blur(unit(images), kernel_size=[size, size], sigma=[sigma, sigma])
    torch.testing.assert_close(augment(images, seeded(0)) * 0.5 + 0.5, expected, atol=1e-5,
                               rtol=0)


def _impulse_sigmas(out: torch.Tensor) -> torch.Tensor:
    """Per sample, the standard deviation (pixels) of a blurred centred impulse."""
    weights = out[:, 0] * 0.5 + 0.5
    weights = weights / weights.sum(dim=(1, 2), keepdim=True)
    side = out.shape[-1]
    offsets = torch.arange(side, dtype=torch.float32) - side // 2
    variance = (weights.sum(dim=1) * offsets ** 2).sum(dim=1)  # along the columns
    return variance.sqrt()


@pytest.mark.parametrize("side", [112, 224])
def test_blur_sigma_is_drawn_per_sample_from_the_scaled_range(side: int) -> None:
    impulse = torch.zeros(32, 1, side, side, dtype=torch.uint8)
    impulse[:, :, side // 2, side // 2] = 255
    augment = BatchAugment(augment_cfg(**IDENTITY_GEOMETRY, blur_prob=1.0, blur_sigma=(0.1, 2.0)))
    sigmas = _impulse_sigmas(augment(impulse, seeded(4)))
    high = 2.0 * side / 224
    assert sigmas.max() <= high + 1e-3
    assert sigmas.max() > 0.8 * high and sigmas.min() < 0.3 * high  # spread over the range


def test_solarize_matches_torchvision_solarize() -> None:
    """Values >= 0.5 are inverted (BYOL): torchvision's ``solarize`` at 0.5 on [0, 1] floats,
    which on uint8 pixels is its threshold 128; to 1e-5 (the identity crop's rounding)."""
    from torchvision.transforms.v2 import functional as tvf

    images = random_images(batch=4, channels=1)  # any channel count
    augment = BatchAugment(augment_cfg(**IDENTITY_GEOMETRY, solarize_prob=1.0))
    out = augment(images, seeded(0)) * 0.5 + 0.5
    torch.testing.assert_close(out, tvf.solarize(unit(images), threshold=0.5), atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(out, unit(tvf.solarize(images, threshold=128)), atol=1e-5,
                               rtol=0)


def test_each_view_uses_its_own_probabilities() -> None:
    """BYOL's asymmetry: blur [1, 0] and solarize [0, 1] blur every first view and no second
    one, and solarize every second view and no first one."""
    from raycl.data.augment import blur_radius, gaussian_blur, solarize

    images = random_images(batch=8, side=64)
    augment = BatchAugment(augment_cfg(**IDENTITY_GEOMETRY, blur_prob=(1.0, 0.0),
                                       blur_sigma=(2.0, 2.0), solarize_prob=(0.0, 1.0)))
    generator = seeded(0)
    first = augment(images, generator, view=0) * 0.5 + 0.5
    second = augment(images, generator, view=1) * 0.5 + 0.5
    blurred = gaussian_blur(unit(images), torch.full((8,), 2.0 * 64 / 224), blur_radius(64))
    # 1e-5: the identity crop's grid_sample rounding (as in the geometry tests above).
    torch.testing.assert_close(first, blurred, atol=1e-5, rtol=0)
    torch.testing.assert_close(second, solarize(unit(images)), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="view"):
        augment(images, generator, view=2)


@pytest.mark.parametrize("key", ["blur_prob", "solarize_prob"])
def test_probability_is_per_sample(key: str) -> None:
    from raycl.data.augment import blur_radius, gaussian_blur, solarize

    images = random_images(batch=64, side=64)
    out = BatchAugment(augment_cfg(**IDENTITY_GEOMETRY, **{key: 0.5}, blur_sigma=(2.0, 2.0)))(
        images, seeded(0)) * 0.5 + 0.5
    changed = (solarize(unit(images)) if key == "solarize_prob"
               else gaussian_blur(unit(images), torch.full((64,), 2.0 * 64 / 224),
                                  blur_radius(64)))
    is_plain = (out - unit(images)).abs().amax(dim=(1, 2, 3)) < 1e-5
    is_changed = (out - changed).abs().amax(dim=(1, 2, 3)) < 1e-5
    assert not torch.any(is_plain & is_changed)
    assert torch.all(is_plain | is_changed)
    assert 10 < int(is_changed.sum()) < 54  # about half


@pytest.mark.parametrize("view", [0, 1])
def test_blur_and_solarize_come_last_and_leave_earlier_draws_alone(view: int) -> None:
    """Order crop+flip, jitter, grayscale, blur, solarize (BYOL, solo-learn), and an op that is
    off draws nothing: with the same seed, blur then solarization on equals those ops applied
    to the output with them off (so configs without them augment exactly as before)."""
    from raycl.data.augment import blur_radius, gaussian_blur, solarize

    images = random_images(batch=16, side=32)
    common = dict(crop_scale=(0.2, 1.0), color_jitter=1.0, grayscale_prob=0.3)
    plain = BatchAugment(augment_cfg(**common))(images, seeded(5), view=view) * 0.5 + 0.5
    both = BatchAugment(augment_cfg(**common, blur_prob=1.0, blur_sigma=(6.0, 6.0),
                                    solarize_prob=1.0))(images, seeded(5), view=view)
    expected = solarize(gaussian_blur(plain, torch.full((16,), 6.0 * 32 / 224),
                                      blur_radius(32)))
    torch.testing.assert_close(both * 0.5 + 0.5, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"blur_prob": (1.0, 1.5)}, "blur_prob"),
        ({"solarize_prob": -0.1}, "solarize_prob"),
        ({"color_jitter": (1.0, -0.5)}, "color_jitter"),
        ({"blur_sigma": (2.0, 0.1)}, "blur_sigma"),
        ({"blur_sigma": (0.0, 1.0)}, "blur_sigma"),
    ],
)
def test_invalid_per_view_settings_are_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchAugment(augment_cfg(**overrides))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[1.0, 0.1, 0.5]", "expected one number (both views) or a pair [view 1, view 2], got 3"),
        ("[1.0]", "expected one number (both views) or a pair [view 1, view 2], got 1"),
        ("[0.0, 1.2]", "must be in [0, 1], got 1.2"),
        ("-0.5", "must be in [0, 1], got -0.5"),
    ],
)
@pytest.mark.parametrize("key", ["blur_prob", "solarize_prob", "grayscale_prob"])
def test_config_rejects_bad_pairs_in_one_line_naming_the_key(tmp_path: Any, key: str, value: str,
                                                              message: str) -> None:
    from raycl.config.schema import ConfigError
    from raycl.launch.load import load_search

    path = tmp_path / "search.yaml"
    path.write_text("name: t\nmethod: simclr\ndata: {dataset: trifeature, resolution: 32}\n"
                    f"augment: {{{key}: {value}}}\n")
    with pytest.raises(ConfigError) as info:
        load_search(path)
    assert str(info.value).startswith(f"{path}: augment.{key}: {message}")
    assert "\n" not in str(info.value)
    config = load_search(path, [f"augment.{key}=[0.0, 0.2]"])
    assert getattr(config.augment, key) == (0.0, 0.2)


def test_config_pairs_reach_the_views() -> None:
    from raycl.config.training import AugmentConfig

    augment = BatchAugment(AugmentConfig(blur_prob=[1.0, 0.1], solarize_prob=[0.0, 0.2],
                                         color_jitter=0.5))
    first, second = augment.views
    assert (first.blur_prob, second.blur_prob) == (1.0, 0.1)
    assert (first.solarize_prob, second.solarize_prob) == (0.0, 0.2)
    assert first.color_jitter == second.color_jitter == 0.5
