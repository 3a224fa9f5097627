"""A decoder from backbone feature vectors back to images (FGVR's ``h``).

The feature vector is mapped by a linear layer to a small ``(C0, s, s)`` map, then upsampled by
transposed convolutions (x2 each, BatchNorm + ReLU) to the dataset's resolution and projected
to its channels by a 3x3 convolution. No output activation: the targets are the normalised
images the encoder sees (``raycl.data.augment.to_float``: [-1, 1]).
"""

from __future__ import annotations

import itertools

from torch import Tensor, nn


def upsampling_plan(
    resolution: int, min_size: int = 4, max_upsamplings: int = 5
) -> tuple[int, int]:
    """How a decoder reaches ``resolution``: ``(start size s, number of x2 upsamplings k)``
    with ``s * 2**k == resolution``, ``s >= min_size`` and k as large as allowed.

    Examples: 32 -> (4, 3); 64 -> (4, 4); 224 -> (7, 5); 28 -> (7, 2).
    """
    if resolution < 1:
        raise ValueError(f"resolution must be >= 1, got {resolution}")
    size, upsamplings = resolution, 0
    while upsamplings < max_upsamplings and size % 2 == 0 and size // 2 >= min_size:
        size, upsamplings = size // 2, upsamplings + 1
    return size, upsamplings


class FeatureDecoder(nn.Module):
    """Maps (B, feature_dim) features to (B, channels, resolution, resolution) images.

    Args:
        feature_dim: width of the backbone's feature vector.
        channels: image channels of the dataset.
        resolution: image side of the dataset.
        width: channels of the last upsampling block; each earlier block has twice as many,
            capped at ``8 * width`` (ResNet-50 at 224 px, width 32: 256 -> 128 -> 64 -> 32).

    Example:
        >>> decoder = FeatureDecoder(feature_dim=512, channels=3, resolution=32)
        >>> decoder(torch.randn(8, 512)).shape
        torch.Size([8, 3, 32, 32])
    """

    def __init__(self, feature_dim: int, channels: int, resolution: int, width: int = 32) -> None:
        super().__init__()
        if min(feature_dim, channels, width) < 1:
            raise ValueError(f"feature_dim, channels and width must be >= 1, got {feature_dim}, "
                             f"{channels}, {width}")
        size, upsamplings = upsampling_plan(resolution)
        widths = [min(width * 2 ** (upsamplings - i), 8 * width) for i in range(upsamplings + 1)]
        self.start_shape = (widths[0], size, size)
        self.expand = nn.Sequential(nn.Linear(feature_dim, widths[0] * size * size),
                                    nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        for in_width, out_width in itertools.pairwise(widths):
            blocks += [nn.ConvTranspose2d(in_width, out_width, kernel_size=4, stride=2, padding=1,
                                          bias=False),
                       nn.BatchNorm2d(out_width), nn.ReLU(inplace=True)]
        self.upsample = nn.Sequential(*blocks)
        self.to_image = nn.Conv2d(widths[-1], channels, kernel_size=3, padding=1)

    def forward(self, features: Tensor) -> Tensor:
        maps = self.expand(features).view(features.shape[0], *self.start_shape)
        return self.to_image(self.upsample(maps))


__all__ = ["FeatureDecoder", "upsampling_plan"]
