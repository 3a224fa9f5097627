"""Backbones (encoders ``f``): image batches (B, C, H, W) -> features (B, feature_dim).

No backbone ever downloads weights: they are randomly initialised, or read from a local file
the user names (``model.pretrained``, see :mod:`raycl.models.weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from raycl.models.timm_backbones import build_timm, is_timm
from raycl.models.weights import load_pretrained

BACKBONES: tuple[str, ...] = ("small_cnn", "resnet18", "resnet50")
STEMS: tuple[str, ...] = ("auto", "cifar", "imagenet")
# From this side up "auto" picks the ImageNet stem: its stride 4 then leaves layer1 at least
# 32x32 maps, which is what the CIFAR stem leaves at 32 px.
IMAGENET_STEM_MIN_RESOLUTION = 128


def _conv_bn_relu(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    # bias is redundant in front of BatchNorm
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def small_cnn(in_channels: int, width: int = 32) -> tuple[nn.Module, int]:
    """Four conv-BN-ReLU blocks (width, 2w, 4w, 8w; strides 1, 2, 2, 2) and global average pool.

    Cheap enough to train on a couple of CPU cores at 32 px.

    Args:
        in_channels: number of input channels.
        width: channels of the first block.

    Returns:
        (module, feature_dim) with feature_dim = 8 * width.
    """
    widths = [width, 2 * width, 4 * width, 8 * width]
    strides = [1, 2, 2, 2]
    layers: list[nn.Module] = []
    previous = in_channels
    for channels, stride in zip(widths, strides, strict=True):
        layers.append(_conv_bn_relu(previous, channels, stride))
        previous = channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers), widths[-1]


def resolve_stem(stem: str, resolution: int) -> str:
    """The ResNet stem ``model.stem`` names at this image size: "cifar" or "imagenet".

    Args:
        stem: "auto", "cifar" or "imagenet".
        resolution: square image side in pixels (data.resolution).

    Returns:
        ``stem`` itself, or for "auto" "imagenet" from :data:`IMAGENET_STEM_MIN_RESOLUTION` px
        up and "cifar" below.
    """
    if stem not in STEMS:
        raise ValueError(f"unknown stem {stem!r}; stems: {', '.join(STEMS)}")
    if stem != "auto":
        return stem
    return "imagenet" if resolution >= IMAGENET_STEM_MIN_RESOLUTION else "cifar"


def _resnet(
    factory: Callable[..., nn.Module], in_channels: int, stem: str
) -> tuple[nn.Module, int]:
    """A torchvision ResNet without fc, with the CIFAR or the ImageNet stem.

    Args:
        factory: torchvision's resnet18 or resnet50.
        in_channels: number of input image channels.
        stem: "cifar" (3x3 stride-1 conv, no max pool) or "imagenet" (torchvision's 7x7
            stride-2 conv and 3x3 stride-2 max pool).

    Returns:
        (module, feature_dim).
    """
    model = factory(weights=None)
    if stem == "cifar":
        # Small images: a 7x7 stride-2 stem plus max pool would shrink 32 px to 8 px before layer1.
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif stem == "imagenet":
        if in_channels != 3:  # torchvision's own conv1 is kept for RGB, as its weights expect
            model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3,
                                    bias=False)
    else:
        raise ValueError(f"stem must be 'cifar' or 'imagenet', got {stem!r}")
    feature_dim = model.fc.in_features
    model.fc = nn.Identity()
    return model, feature_dim


def build_backbone(
    name: str,
    in_channels: int,
    width: int = 32,
    *,
    stem: str = "cifar",
    pretrained: str | None = None,
    timm_kwargs: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, int]:
    """Builds a backbone, randomly initialised or from a local weights file.

    Args:
        name: one of ``BACKBONES``: "small_cnn", "resnet18", "resnet50", or ``timm/<name>``
            (any timm model: :mod:`raycl.models.timm_backbones`, with ``timm_kwargs``).
        in_channels: number of input image channels (1 for greyscale, 3 for RGB, ...).
        width: first-block width of "small_cnn"; the ResNets have fixed widths and ignore it.
        stem: the ResNets' stem, "cifar" or "imagenet" ("auto" is resolved by the caller with
            :func:`resolve_stem`); "small_cnn" and timm models ignore it.
        pretrained: path of a torchvision ResNet state dict or a raycl checkpoint's state.pt
            whose weights the backbone starts from (see :mod:`raycl.models.weights`); for a
            timm model a timm state dict (safetensors or .pth) or a raycl checkpoint.
        timm_kwargs: ``model.timm_kwargs``, passed to ``timm.create_model`` (timm only).

    Returns:
        (module mapping (B, C, H, W) -> (B, feature_dim), feature_dim).

    Raises:
        ValueError: on an unknown name or stem, non-positive in_channels / width, or weights
            that do not fit the backbone.
        FileNotFoundError: ``pretrained`` does not exist.
    """
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if is_timm(name):
        return build_timm(name, in_channels, timm_kwargs or {}, pretrained)
    if name == "small_cnn":
        model, feature_dim = small_cnn(in_channels, width)
    elif name in ("resnet18", "resnet50"):
        # Imported here: torchvision.models pulls in torch._dynamo (~1 s in every trial and
        # worker process), which small_cnn trials never need.
        from torchvision.models import resnet18, resnet50

        factory = resnet18 if name == "resnet18" else resnet50
        model, feature_dim = _resnet(factory, in_channels, stem)
    else:
        raise ValueError(f"unknown backbone {name!r}; valid backbones: {', '.join(BACKBONES)}")
    if pretrained is not None:
        load_pretrained(model, pretrained, name, stem, width, BACKBONES)
    return model, feature_dim
