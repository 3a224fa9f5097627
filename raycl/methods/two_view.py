"""The shape SimCLR, Spectral CL and HSCL share: backbone + projector, a loss between the
projections of two augmented views. A subclass supplies :meth:`TwoViewMethod.loss` and its
``from_config``; forward, ``project`` and the encoder's construction live here once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raycl.methods.base import Batch, Method
from raycl.models import build_backbone, projection_mlp, resolve_stem

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


class TwoViewMethod(Method):
    """Backbone + 2-layer projector; the loss compares the two views' projections.

    Args:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output dimension of ``backbone``.
        projector_hidden_dim: hidden width of the projector.
        projector_dim: output dimension of the projector.
    """

    accepts_negative_mask = True

    def __init__(
        self, backbone: nn.Module, feature_dim: int, projector_hidden_dim: int, projector_dim: int
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.projector = projection_mlp(feature_dim, projector_hidden_dim, projector_dim)

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        """The objective between the projections of view 1 and view 2 (rows pair up).

        Args:
            z1: (B, projector_dim) projections of the first view.
            z2: (B, projector_dim) projections of the second view.
            negative_mask: MCL's (B_local, B_global) mask of allowed negatives, or None.

        Returns:
            The scalar loss.
        """
        raise NotImplementedError

    def project(self, images: Tensor) -> Tensor:
        return self.projector(self.backbone(images))

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """The loss between the two views' projections.

        Args:
            batch: a batch with exactly two views.

        Returns:
            ``{"loss", "pos_sim"}``; pos_sim is the mean cosine similarity of the positive
            pairs (detached).

        Raises:
            ValueError: if the batch does not have exactly two views.
        """
        z1, z2 = encode_views(self.project, batch)
        loss = self.loss(z1, z2, batch.negative_mask())
        with torch.no_grad():
            pos_sim = F.cosine_similarity(z1, z2, dim=1).mean()
        return {"loss": loss, "pos_sim": pos_sim.detach()}


def encoder_kwargs(cfg: CoreConfig, in_channels: int) -> dict[str, Any]:
    """``backbone``, ``feature_dim``, ``projector_hidden_dim``, ``projector_dim`` from
    ``cfg.model``: the constructor arguments every backbone + projector method starts with.
    The backbone gets ``model.stem`` (``auto`` resolved at ``data.resolution``) and starts from
    ``model.pretrained`` when it is set."""
    backbone, feature_dim = build_backbone(
        cfg.model.backbone, in_channels, cfg.model.width,
        stem=resolve_stem(cfg.model.stem, cfg.data.resolution), pretrained=cfg.model.pretrained)
    return {"backbone": backbone, "feature_dim": feature_dim,
            "projector_hidden_dim": cfg.model.projector_hidden_dim,
            "projector_dim": cfg.model.projector_dim}


def encode_views(encode: Callable[[Tensor], Tensor], batch: Batch) -> tuple[Tensor, Tensor]:
    """``encode`` both views of ``batch`` in one pass and split the rows again.

    One pass: half the kernel launches, and BatchNorm sees both views together (every raycl
    two-view method does this).

    Raises:
        ValueError: if the batch does not have exactly two views.
    """
    if len(batch.views) != 2:
        raise ValueError(f"this method needs exactly 2 views per batch, got {len(batch.views)}")
    z1, z2 = encode(torch.cat(batch.views, dim=0)).chunk(2)
    return z1, z2
