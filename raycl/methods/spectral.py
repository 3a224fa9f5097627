"""Spectral Contrastive Learning (HaoChen et al., 2021).

The spectral contrastive loss between the projections of two augmented views: pull positive
pairs together (``-2 z^T z'``), push the squared similarity of every other pair towards zero. It
is the base that HSCL (:mod:`raycl.methods.hscl`) filters. With ``Batch.pseudo_labels`` (MCL with
``mcl.base: spectral``) the pairs of the uniformity term are restricted to samples that share
the pseudo label, as MCL restricts SimCLR's negatives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field
from torch import Tensor, nn

from raycl.config.schema import Section
from raycl.losses import spectral_contrastive_loss
from raycl.methods.registry import register
from raycl.methods.two_view import TwoViewMethod, encoder_kwargs

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


class SpectralConfig(Section):
    """Knobs of ``method: spectral``."""

    mu: float = Field(
        1.0, gt=0.0, le=100.0, description="Squared radius of the ball projections are confined "
        "to (rows longer than √μ are rescaled), as in the authors' code.",
        json_schema_extra={"symbol": "μ"}
    )
    divide_by_mu: bool = Field(
        True, description="Divide the loss by μ, as the authors' released code does (it produced "
        "the reported numbers; the paper's formula does not): the same at μ = 1, a μ times "
        "smaller loss and gradient otherwise (their ImageNet runs use μ = 10)."
    )


@register("spectral", section=SpectralConfig)
class SpectralCL(TwoViewMethod):
    """Backbone + 2-layer projector trained with the spectral contrastive loss.

    Args:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output dimension of ``backbone``.
        projector_hidden_dim: hidden width of the projector.
        projector_dim: output dimension of the projector (the paper uses 128).
        mu: squared radius of the embedding ball, > 0.
        divide_by_mu: divide the loss by ``mu`` (the authors' code).
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        projector_hidden_dim: int,
        projector_dim: int,
        mu: float,
        divide_by_mu: bool = True,
    ) -> None:
        super().__init__(backbone, feature_dim, projector_hidden_dim, projector_dim)
        if not mu > 0:
            raise ValueError(f"mu must be > 0, got {mu}")
        self.mu = mu
        self.divide_by_mu = divide_by_mu

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> SpectralCL:
        section = cfg.section(SpectralConfig)
        return cls(**encoder_kwargs(cfg, in_channels), mu=section.mu,
                   divide_by_mu=section.divide_by_mu)

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        return spectral_contrastive_loss(z1, z2, self.mu, negative_mask=negative_mask,
                                         divide_by_mu=self.divide_by_mu)
