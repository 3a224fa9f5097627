"""Tests for raycl.models: backbones and MLP heads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raycl.models import BACKBONES, build_backbone, projection_mlp


@pytest.mark.parametrize("channels", [1, 2, 3])
def test_small_cnn_output_shape(channels: int) -> None:
    backbone, feature_dim = build_backbone("small_cnn", channels, width=8)
    assert feature_dim == 64  # 8 * width
    out = backbone(torch.randn(2, channels, 32, 32))
    assert out.shape == (2, feature_dim)


def test_small_cnn_structure() -> None:
    backbone, _ = build_backbone("small_cnn", 3, width=4)
    convs = [module for module in backbone.modules() if isinstance(module, nn.Conv2d)]
    assert [conv.out_channels for conv in convs] == [4, 8, 16, 32]
    assert [conv.stride[0] for conv in convs] == [1, 2, 2, 2]
    assert sum(isinstance(module, nn.BatchNorm2d) for module in backbone.modules()) == 4


@pytest.mark.parametrize("channels", [1, 3])
def test_resnet18_cifar_variant(channels: int) -> None:
    backbone, feature_dim = build_backbone("resnet18", channels)
    assert feature_dim == 512
    assert backbone.conv1.in_channels == channels
    assert backbone.conv1.kernel_size == (3, 3) and backbone.conv1.stride == (1, 1)
    assert isinstance(backbone.maxpool, nn.Identity) and isinstance(backbone.fc, nn.Identity)
    backbone.eval()  # inference path only: the test checks shapes, not training
    with torch.no_grad():
        out = backbone(torch.randn(2, channels, 8, 8))
    assert out.shape == (2, 512)


def test_resnet50_builds_with_cifar_stem() -> None:
    backbone, feature_dim = build_backbone("resnet50", 2)
    assert feature_dim == 2048
    assert backbone.conv1.in_channels == 2 and backbone.conv1.stride == (1, 1)
    assert isinstance(backbone.fc, nn.Identity)


def test_unknown_backbone_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown backbone 'vit'") as error:
        build_backbone("vit", 3)
    for name in BACKBONES:
        assert name in str(error.value)


def test_backbone_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="in_channels"):
        build_backbone("small_cnn", 0)
    with pytest.raises(ValueError, match="width"):
        build_backbone("small_cnn", 3, width=0)


def test_projection_mlp_layout() -> None:
    two_layer = projection_mlp(16, 32, 8)
    assert [type(layer) for layer in two_layer] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert two_layer(torch.randn(4, 16)).shape == (4, 8)

    three_layer = projection_mlp(16, 32, 8, num_layers=3, last_bn=True)
    assert [type(layer) for layer in three_layer] == [
        nn.Linear, nn.BatchNorm1d, nn.ReLU,
        nn.Linear, nn.BatchNorm1d, nn.ReLU,
        nn.Linear, nn.BatchNorm1d,
    ]  # fmt: skip
    assert three_layer(torch.randn(4, 16)).shape == (4, 8)

    no_bn = projection_mlp(16, 32, 8, batch_norm=False)
    assert [type(layer) for layer in no_bn] == [nn.Linear, nn.ReLU, nn.Linear]
    assert no_bn[0].bias is not None

    single = projection_mlp(16, 32, 8, num_layers=1)
    assert len(single) == 1 and single[0].in_features == 16 and single[0].out_features == 8


def test_projection_mlp_validates() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        projection_mlp(16, 32, 8, num_layers=0)
    with pytest.raises(ValueError, match="hidden_dim"):
        projection_mlp(16, 0, 8)
