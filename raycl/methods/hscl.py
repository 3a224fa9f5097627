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

from typing import TYPE_CHECKING

from pydantic import Field
from torch import Tensor, nn

from raycl.losses import check_filter_args, hscl_loss
from raycl.methods.registry import register
from raycl.methods.spectral import SpectralCL, SpectralConfig
from raycl.methods.two_view import encoder_kwargs

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


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
    """Backbone + 2-layer projector trained with the high-pass filtered spectral loss.

    Args:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output dimension of ``backbone``.
        projector_hidden_dim: hidden width of the projector.
        projector_dim: output dimension of the projector, m (Bmat is m x m).
        mu: squared radius of the embedding ball, > 0.
        filter_exponent: p >= 0.
        eigenvalue_floor: relative eigenvalue floor in (0, 1).
        divide_by_mu: divide the loss by ``mu``, as Spectral CL.
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        projector_hidden_dim: int,
        projector_dim: int,
        mu: float,
        filter_exponent: float,
        eigenvalue_floor: float,
        divide_by_mu: bool = True,
    ) -> None:
        super().__init__(backbone, feature_dim, projector_hidden_dim, projector_dim, mu,
                         divide_by_mu)
        check_filter_args(filter_exponent, eigenvalue_floor)
        self.filter_exponent = filter_exponent
        self.eigenvalue_floor = eigenvalue_floor

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> HSCL:
        section = cfg.section(HSCLConfig)
        return cls(**encoder_kwargs(cfg, in_channels), mu=section.mu,
                   filter_exponent=section.filter_exponent,
                   eigenvalue_floor=section.eigenvalue_floor,
                   divide_by_mu=section.divide_by_mu)

    def loss(self, z1: Tensor, z2: Tensor, negative_mask: Tensor | None) -> Tensor:
        return hscl_loss(z1, z2, self.filter_exponent, self.mu, self.eigenvalue_floor,
                         negative_mask=negative_mask, divide_by_mu=self.divide_by_mu)
