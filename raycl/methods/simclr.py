"""SimCLR (Chen et al., 2020): NT-Xent between the projections of two augmented views.

With ``Batch.pseudo_labels`` it becomes MCL's stage-j objective: negatives are restricted to
samples sharing the pseudo label (the loss-side form of the paper's per-group batch sampler).
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from raycl.config.schema import Section
from raycl.losses import nt_xent
from raycl.methods.registry import register
from raycl.methods.two_view import TwoViewMethod


class SimCLRConfig(Section):
    """Knobs of ``method: simclr`` (also MCL's default base method)."""

    temperature: float = Field(0.5, gt=0.0, le=10.0, description="NT-Xent temperature τ.",
                               json_schema_extra={"symbol": "τ"})


@register("simclr", section=SimCLRConfig)
class SimCLR(TwoViewMethod):
    """Backbone + 2-layer projector trained with NT-Xent (arguments:
    :class:`~raycl.methods.base.EncoderMethod`; knobs: :class:`SimCLRConfig`)."""

    section: SimCLRConfig

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        return nt_xent(z1, z2, self.section.temperature, negative_mask=negative_mask)
