"""HSCL: High-pass Spectral Contrastive Learning (Algorithm 1 of the paper, appendix B.1).

Spectral CL whose uniformity term is high-pass filtered on the embedding's spectrum: with
``Bmat = sum_i z_i z_i^T + z'_i z'_i^T = V S V^T`` over the global batch and
``W = V S^{-p/2} V^T``, each pair term ``(z_i^T z'_j)^2`` becomes
``(z_i^T z'_j)((W z_i)^T (W z'_j))``. Large-eigenvalue directions are pushed apart less and the
small ones more, so more singular values of the embedding keep growing (the paper's argument,
section 3). ``hscl.filter_exponent`` is p; p = 0 is Spectral CL exactly. The loss and the
gradient choice (none through W) are in :func:`raycl.losses.hscl_loss`.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from raycl.losses import hscl_loss
from raycl.methods.registry import register
from raycl.methods.spectral import SpectralCL, SpectralConfig


class HSCLConfig(SpectralConfig):
    """Knobs of ``method: hscl``: Spectral CL's (``mu``, ``divide_by_mu``: HSCL builds on the
    spectral loss's code, so p = 0 stays Spectral CL) and the filter's."""

    filter_exponent: float = Field(
        0.5, ge=0.0, le=2.0, description="p of the high-pass filter g(λ) = λ^-p (the paper: "
        "0.1, 0.3, 0.5; 0 is Spectral CL).", json_schema_extra={"symbol": "p"}
    )
    eigenvalue_floor: float = Field(
        1e-5, gt=0.0, lt=1.0, description="Eigenvalues of Bmat are floored at this fraction of "
        "the largest, so λ^-p stays finite."
    )


@register("hscl", section=HSCLConfig)
class HSCL(SpectralCL):
    """Backbone + 2-layer projector trained with the high-pass filtered spectral loss
    (arguments: :class:`~raycl.methods.base.EncoderMethod`; knobs: :class:`HSCLConfig`;
    ``model.projector_dim`` is m, Bmat is m x m)."""

    section: HSCLConfig

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        knobs = self.section
        return hscl_loss(z1, z2, knobs.filter_exponent, knobs.mu, knobs.eigenvalue_floor,
                         negative_mask=negative_mask, divide_by_mu=knobs.divide_by_mu)
