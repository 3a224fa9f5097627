"""Spectral Contrastive Learning (HaoChen et al., 2021).

The spectral contrastive loss between the projections of two augmented views: pull positive
pairs together (``-2 z^T z'``), push the squared similarity of every other pair towards zero. It
is the base that HSCL (:mod:`raycl.methods.hscl`) filters. With ``Batch.pseudo_labels`` (MCL with
``mcl.base: spectral``) the pairs of the uniformity term are restricted to samples that share
the pseudo label, as MCL restricts SimCLR's negatives.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from raycl.config.schema import Section
from raycl.losses import spectral_contrastive_loss
from raycl.methods.registry import register
from raycl.methods.two_view import TwoViewMethod


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
    """Backbone + 2-layer projector trained with the spectral contrastive loss (arguments:
    :class:`~raycl.methods.base.EncoderMethod`; knobs: :class:`SpectralConfig`; the paper's
    ``model.projector_dim`` is 128)."""

    section: SpectralConfig

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        return spectral_contrastive_loss(z1, z2, self.section.mu, negative_mask=negative_mask,
                                         divide_by_mu=self.section.divide_by_mu)
