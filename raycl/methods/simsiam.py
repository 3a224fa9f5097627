"""SimSiam (Chen & He, 2021): a siamese encoder, a predictor and a stop-gradient; no negatives,
no momentum encoder. One of FGVR's base methods.

``z = g(f(v))`` (projector with BatchNorm after every layer, the output layer included, as in
the paper's ImageNet setting), ``p = h(z)`` (predictor ``Linear-BN-ReLU-Linear``, a bottleneck
of ``simsiam.predictor_hidden_dim``: 512 for 2048-d embeddings in the paper) and
``L = D(p1, sg(z2)) / 2 + D(p2, sg(z1)) / 2`` with D the negative cosine similarity
(:func:`raycl.losses.simsiam_loss`, which applies the stop-gradient itself).

Not followed from the paper: its predictor keeps a **constant** learning rate while the rest
follows the cosine decay (Tab. 1; the official code's ``--fix-pred-lr``). raycl's
parameter groups share one schedule, so the predictor decays with everything else, which the
paper reports works slightly worse (67.7 % against 68.1 %, 100-epoch ImageNet). Both views go
through the encoder in one pass (BatchNorm over 2B rows, as every raycl two-view method; the
official code runs the views one after the other). The projector's output BatchNorm keeps its
affine parameters (the official code's has none, ``affine=False``; the paper does not say).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from raycl.config.schema import Section
from raycl.losses import simsiam_loss
from raycl.methods.base import Batch, Encoder, EncoderMethod
from raycl.methods.registry import register
from raycl.methods.two_view import encode_views
from raycl.models import projection_mlp


class SimSiamConfig(Section):
    """Knobs of ``method: simsiam``. The projector's widths are ``model.projector_hidden_dim``
    and ``model.projector_dim`` (the paper: 2048 and 2048)."""

    projector_layers: int = Field(3, ge=1, le=4, description="Linear layers of the projector, "
                                  "BatchNorm after every one, the output layer included (the "
                                  "paper: 3 on ImageNet, 2 on CIFAR).")
    predictor_hidden_dim: int = Field(512, ge=1, description="Bottleneck width of the 2-layer "
                                      "predictor (the paper: 512 for 2048-d embeddings).")


@register("simsiam", section=SimSiamConfig)
class SimSiam(EncoderMethod):
    """Backbone, projector and predictor trained with the symmetrised negative cosine
    (arguments: :class:`~raycl.methods.base.EncoderMethod`; knobs: :class:`SimSiamConfig`;
    ``model.projector_dim`` is the embedding width D of projector and predictor)."""

    section: SimSiamConfig

    def __init__(self, encoder: Encoder, section: SimSiamConfig | None = None,
                 **knobs: Any) -> None:
        super().__init__(encoder, section, **knobs)
        dim = encoder.projector_dim
        self.predictor = projection_mlp(dim, self.section.predictor_hidden_dim, dim)

    def projector_layout(self) -> dict[str, Any]:
        return {"num_layers": self.section.projector_layers, "last_bn": True}

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """The SimSiam loss between the two views.

        Returns:
            ``{"loss", "pos_sim", "z_std"}`` (detached but the loss): pos_sim is the mean cosine
            similarity of the two views' projections; z_std the per-dimension standard deviation
            of the L2-normalised projections, averaged (the paper's collapse monitor, Fig. 2:
            0 when collapsed, about 1/sqrt(D) when healthy).

        Raises:
            ValueError: if the batch does not have exactly two views.
        """
        z1, z2 = encode_views(self.project, batch)
        p1, p2 = self.predictor(torch.cat([z1, z2])).chunk(2)
        loss = simsiam_loss(p1, p2, z1, z2)
        with torch.no_grad():
            pos_sim = F.cosine_similarity(z1.float(), z2.float(), dim=1).mean()
            z_std = F.normalize(z1.float(), dim=1).std(dim=0).mean()
        return {"loss": loss, "pos_sim": pos_sim, "z_std": z_std}
