"""Backbones (encoders ``f``): image batches (B, C, H, W) -> features (B, feature_dim).

No backbone ever downloads weights; all are randomly initialised.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torchvision.models import resnet18, resnet50

BACKBONES: tuple[str, ...] = ("small_cnn", "resnet18", "resnet50")


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


def _cifar_resnet(factory: Callable[..., nn.Module], in_channels: int) -> tuple[nn.Module, int]:
    """A torchvision ResNet in the usual CIFAR variant: 3x3 stride-1 stem, no max pool, no fc."""
    model = factory(weights=None)
    # Small images: a 7x7 stride-2 stem plus max pool would shrink 32 px to 8 px before layer1.
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    feature_dim = model.fc.in_features
    model.fc = nn.Identity()
    return model, feature_dim


def build_backbone(name: str, in_channels: int, width: int = 32) -> tuple[nn.Module, int]:
    """Builds a randomly initialised backbone.

    Args:
        name: one of ``BACKBONES``: "small_cnn", "resnet18", "resnet50".
        in_channels: number of input image channels (1 for greyscale, 3 for RGB, ...).
        width: first-block width of "small_cnn"; the ResNets have fixed widths and ignore it.

    Returns:
        (module mapping (B, C, H, W) -> (B, feature_dim), feature_dim).

    Raises:
        ValueError: on an unknown name or non-positive in_channels / width.
    """
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if name == "small_cnn":
        return small_cnn(in_channels, width)
    if name == "resnet18":
        return _cifar_resnet(resnet18, in_channels)
    if name == "resnet50":
        return _cifar_resnet(resnet50, in_channels)
    raise ValueError(f"unknown backbone {name!r}; valid backbones: {', '.join(BACKBONES)}")
