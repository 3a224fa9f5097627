"""SimCLR (Chen et al., 2020): NT-Xent between the projections of two augmented views.

With ``Batch.pseudo_labels`` it becomes MCL's stage-j objective: negatives are restricted to
samples sharing the pseudo label (the loss-side form of the paper's per-group batch sampler).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from raycl.losses import nt_xent
from raycl.methods import register
from raycl.methods.base import Batch, Method
from raycl.models import build_backbone, projection_mlp
from raycl.schema import Section

if TYPE_CHECKING:
    from raycl.config import CoreConfig


class SimCLRConfig(Section):
    """Knobs of ``method: simclr`` (also MCL's default base method)."""

    temperature: float = Field(0.5, gt=0.0, le=10.0, description="NT-Xent temperature τ.")


@register("simclr", section=SimCLRConfig)
class SimCLR(Method):
    """Backbone + 2-layer projector trained with NT-Xent.

    Args:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output dimension of ``backbone``.
        projector_hidden_dim: hidden width of the projector.
        projector_dim: output dimension of the projector.
        temperature: NT-Xent temperature, > 0.
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        projector_hidden_dim: int,
        projector_dim: int,
        temperature: float,
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.backbone = backbone
        self.projector = projection_mlp(feature_dim, projector_hidden_dim, projector_dim)
        self.temperature = temperature

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> SimCLR:
        backbone, feature_dim = build_backbone(cfg.model.backbone, in_channels, cfg.model.width)
        return cls(
            backbone=backbone,
            feature_dim=feature_dim,
            projector_hidden_dim=cfg.model.projector_hidden_dim,
            projector_dim=cfg.model.projector_dim,
            temperature=cfg.section(SimCLRConfig).temperature,
        )

    def project(self, images: Tensor) -> Tensor:
        return self.projector(self.backbone(images))

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """NT-Xent between the two views' projections.

        Args:
            batch: a batch with exactly two views.

        Returns:
            ``{"loss", "pos_sim"}``; pos_sim is the mean cosine similarity of the positive
            pairs (detached).

        Raises:
            ValueError: if the batch does not have exactly two views.
        """
        if len(batch.views) != 2:
            raise ValueError(f"SimCLR needs exactly 2 views per batch, got {len(batch.views)}")
        batch_size = batch.views[0].shape[0]
        # One pass over both views: half the kernel launches; BN sees both views together.
        projections = self.projector(self.backbone(torch.cat(batch.views, dim=0)))
        z1, z2 = projections[:batch_size], projections[batch_size:]

        loss = nt_xent(z1, z2, self.temperature, negative_mask=batch.negative_mask())

        with torch.no_grad():
            pos_sim = F.cosine_similarity(z1, z2, dim=1).mean()
        return {"loss": loss, "pos_sim": pos_sim.detach()}
