"""Spectral Contrastive Learning (HaoChen et al., 2021).

The spectral contrastive loss between the projections of two augmented views: pull positive
pairs together (``-2 z^T z'``), push the squared similarity of every other pair towards zero. It
is the base that HSCL (:mod:`raycl.methods.hscl`) filters. With ``Batch.pseudo_labels`` (MCL with
``mcl.base: spectral``) the pairs of the uniformity term are restricted to samples that share
the pseudo label, as MCL restricts SimCLR's negatives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from raycl.losses import spectral_contrastive_loss
from raycl.methods import register
from raycl.methods.base import Batch, Method
from raycl.models import build_backbone, projection_mlp
from raycl.schema import Section

if TYPE_CHECKING:
    from raycl.config import CoreConfig


class SpectralConfig(Section):
    """Knobs of ``method: spectral``."""

    mu: float = Field(
        1.0, gt=0.0, le=100.0, description="Squared radius of the ball projections are confined "
        "to (rows longer than √μ are rescaled), as in the authors' code."
    )


@register("spectral", section=SpectralConfig)
class SpectralCL(Method):
    """Backbone + 2-layer projector trained with the spectral contrastive loss.

    Args:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output dimension of ``backbone``.
        projector_hidden_dim: hidden width of the projector.
        projector_dim: output dimension of the projector (the paper uses 128).
        mu: squared radius of the embedding ball, > 0.
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        projector_hidden_dim: int,
        projector_dim: int,
        mu: float,
    ) -> None:
        super().__init__()
        if not mu > 0:
            raise ValueError(f"mu must be > 0, got {mu}")
        self.backbone = backbone
        self.projector = projection_mlp(feature_dim, projector_hidden_dim, projector_dim)
        self.mu = mu

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> SpectralCL:
        backbone, feature_dim = build_backbone(cfg.model.backbone, in_channels, cfg.model.width)
        return cls(backbone, feature_dim, cfg.model.projector_hidden_dim,
                   cfg.model.projector_dim, mu=cfg.section(SpectralConfig).mu)

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        """The objective on the two views' projections (HSCL overrides this)."""
        return spectral_contrastive_loss(z1, z2, self.mu, negative_mask=negative_mask)

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
        if len(batch.views) != 2:
            raise ValueError(f"{type(self).__name__} needs exactly 2 views per batch, got "
                             f"{len(batch.views)}")
        batch_size = batch.views[0].shape[0]
        projections = self.project(torch.cat(batch.views, dim=0))  # one pass over both views
        z1, z2 = projections[:batch_size], projections[batch_size:]
        loss = self.loss(z1, z2, batch.negative_mask())
        with torch.no_grad():
            pos_sim = F.cosine_similarity(z1, z2, dim=1).mean()
        return {"loss": loss, "pos_sim": pos_sim.detach()}
