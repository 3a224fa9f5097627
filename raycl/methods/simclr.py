"""SimCLR (Chen et al., 2020): NT-Xent between the projections of two augmented views.

With ``Batch.pseudo_labels`` it becomes MCL's stage-j objective: negatives are restricted to
samples sharing the pseudo label (the loss-side form of the paper's per-group batch sampler).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field
from torch import Tensor, nn

from raycl.config.schema import Section
from raycl.losses import nt_xent
from raycl.methods.registry import register
from raycl.methods.two_view import TwoViewMethod, encoder_kwargs

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


class SimCLRConfig(Section):
    """Knobs of ``method: simclr`` (also MCL's default base method)."""

    temperature: float = Field(0.5, gt=0.0, le=10.0, description="NT-Xent temperature τ.",
                               json_schema_extra={"symbol": "τ"})


@register("simclr", section=SimCLRConfig)
class SimCLR(TwoViewMethod):
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
        super().__init__(backbone, feature_dim, projector_hidden_dim, projector_dim)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> SimCLR:
        return cls(**encoder_kwargs(cfg, in_channels),
                   temperature=cfg.section(SimCLRConfig).temperature)

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        return nt_xent(z1, z2, self.temperature, negative_mask=negative_mask)
