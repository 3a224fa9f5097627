"""NNCLR (Dwibedi et al., 2021), the paper's "All4One v0": contrast each view's nearest neighbour
in a support set with the predictor output of the other view.

For each sample, ``nn^1`` is the support-set entry most cosine-similar to the projection ``z^1``
of view 1 and the loss is InfoNCE between ``nn^1`` and ``q(z^2)`` over the batch (All4One paper
eq. 1); ``nnclr.symmetric`` adds the swapped term and averages (NNCLR's paper does). The support
set is a global, checkpointed FIFO queue of online projections (:class:`raycl.methods.queues
.FeatureQueue`); neighbours are looked up before the batch is enqueued, so no sample is its own
neighbour within its step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from raycl.config.schema import Section
from raycl.losses import info_nce
from raycl.methods.base import Batch, Encoder, EncoderMethod
from raycl.methods.queues import FeatureQueue, KnnBackend
from raycl.methods.registry import register
from raycl.methods.two_view import encode_views
from raycl.models import projection_mlp


class NNCLRConfig(Section):
    """Knobs of ``method: nnclr``. The projector's widths are ``model.projector_hidden_dim`` and
    ``model.projector_dim`` (the papers: 2048 and 256)."""

    temperature: float = Field(0.1, gt=0.0, le=10.0, description="InfoNCE temperature τ of the "
                               "neighbour contrast (NNCLR: 0.1).",
                               json_schema_extra={"symbol": "τ"})
    queue_size: int = Field(98_304, ge=1, description="Support-set entries (the papers: 98 304). "
                            "Any size works: writes wrap around, so it need not be a multiple of "
                            "the global batch.")
    projector_layers: int = Field(3, ge=1, le=4, description="Linear layers of the projector "
                                  "(BatchNorm after all but the last).")
    predictor_hidden_dim: int = Field(4096, ge=1, description="Hidden width of the 2-layer "
                                      "predictor (the papers: 4096).")
    symmetric: bool = Field(True, description="Average the loss with its view-swapped twin "
                            "(NNCLR's paper does).")
    knn_backend: KnnBackend = Field("torch", description="Support-set lookup: torch (matmul + "
                                    "topk on the device) or faiss (host); torch measured faster "
                                    "(docs/benchmarks.md).")


@register("nnclr", section=NNCLRConfig)
class NNCLR(EncoderMethod):
    """Backbone, projector, predictor and a support-set queue of projections (arguments:
    :class:`~raycl.methods.base.EncoderMethod`; knobs: :class:`NNCLRConfig`;
    ``model.projector_dim`` is the embedding width D of the projector and the queue's entries).
    """

    section: NNCLRConfig

    def __init__(self, encoder: Encoder, section: NNCLRConfig | None = None,
                 **knobs: Any) -> None:
        super().__init__(encoder, section, **knobs)
        dim = encoder.projector_dim
        self.predictor = projection_mlp(dim, self.section.predictor_hidden_dim, dim)
        self.queue = FeatureQueue(self.section.queue_size, dim, self.section.knn_backend)

    def projector_layout(self) -> dict[str, Any]:
        return {"num_layers": self.section.projector_layers}

    def queries(self, images: Tensor) -> Tensor:
        """The embeddings the support set is searched with and filled from (here: online
        projections; All4One: momentum projections)."""
        return self.project(images)

    @torch.no_grad()
    def neighbour_retrieval(self, images: Tensor) -> Tensor:
        _, sample_index = self.queue.nearest(self.queries(images), k=1)
        return sample_index[:, 0]

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """Neighbour contrast; enqueues view 1's projections after the lookup.

        Returns:
            ``{"loss", "pos_sim", "queue_fill"}``: pos_sim is the mean cosine similarity of a
            view-1 neighbour and its view-2 prediction (detached).
        """
        z1, z2 = encode_views(self.project, batch)
        p1, p2 = self.predictor(torch.cat([z1, z2])).chunk(2)
        temperature = self.section.temperature
        neighbour1 = self.queue.nearest(z1, k=1)[0][:, 0]
        loss = info_nce(neighbour1, p2, temperature)
        if self.section.symmetric:
            neighbour2 = self.queue.nearest(z2, k=1)[0][:, 0]
            loss = (loss + info_nce(neighbour2, p1, temperature)) / 2
        self.queue.enqueue(z1, batch.index)  # after the lookups: never a sample's own entry
        with torch.no_grad():
            pos_sim = F.cosine_similarity(neighbour1, p2.float(), dim=1).mean()
        return {"loss": loss, "pos_sim": pos_sim, "queue_fill": self.queue.fill()}
