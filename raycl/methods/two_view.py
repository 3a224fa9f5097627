"""The shape SimCLR, Spectral CL and HSCL share: backbone + projector, a loss between the
projections of two augmented views. A subclass supplies :meth:`TwoViewMethod.loss` and its
config section; forward lives here once, the encoder's construction in
:class:`~raycl.methods.base.EncoderMethod`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from raycl.methods.base import Batch, EncoderMethod


class TwoViewMethod(EncoderMethod):
    """Backbone + 2-layer projector; the loss compares the two views' projections (arguments:
    :class:`~raycl.methods.base.EncoderMethod`)."""

    accepts_negative_mask = True

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
