"""``model.pretrained`` checked before launch: can the configured backbone start from the file?

Builds the configured backbone once per shape (:func:`expected_shapes`) and compares it with
the file through :mod:`raycl.models.weights`, which reads the formats and words the problem as
one line naming the config key to change. Loading itself happens when the backbone is built
(:func:`raycl.models.backbones.build_backbone` with ``pretrained``).
"""

from __future__ import annotations

from functools import cache

from raycl.models.backbones import BACKBONES, build_backbone
from raycl.models.weights import describe_backbone, read_backbone_state, state_problem


@cache
def expected_shapes(
    name: str, in_channels: int, width: int, stem: str
) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a freshly built backbone's state dict (built once per argument set)."""
    backbone, _ = build_backbone(name, in_channels, width, stem=stem)
    return {key: tuple(value.shape) for key, value in backbone.state_dict().items()}


def pretrained_problem(
    path: str, name: str, in_channels: int, width: int, stem: str
) -> str | None:
    """Why the configured backbone could not start from ``path``; None when it can.

    Args:
        path: the weights file (model.pretrained).
        name: model.backbone.
        in_channels: channels of the dataset's images.
        width: model.width.
        stem: "cifar" or "imagenet" (model.stem resolved).

    Returns:
        One line, or None.
    """
    try:
        state = read_backbone_state(path)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    expected = expected_shapes(name, in_channels, width, stem)
    return state_problem(state, expected, str(path), name, describe_backbone(name, stem, width),
                         BACKBONES)
