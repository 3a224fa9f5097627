"""NNCLR (Dwibedi et al., 2021), the paper's "All4One v0": contrast each view's nearest neighbour
in a support set with the predictor output of the other view.

For each sample, ``nn^1`` is the support-set entry most cosine-similar to the projection ``z^1``
of view 1 and the loss is InfoNCE between ``nn^1`` and ``q(z^2)`` over the batch (All4One paper
eq. 1); ``nnclr.symmetric`` adds the swapped term and averages (NNCLR's paper does). The support
set is a global, checkpointed FIFO queue of online projections (:class:`raycl.queues
.FeatureQueue`); neighbours are looked up before the batch is enqueued, so no sample is its own
neighbour within its step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from raycl.config.schema import Section
from raycl.losses import info_nce
from raycl.methods.base import Batch, Method
from raycl.methods.registry import register
from raycl.methods.two_view import encode_views, encoder_kwargs
from raycl.models import projection_mlp
from raycl.queues import FeatureQueue, KnnBackend

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


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
class NNCLR(Method):
    """Backbone, projector, predictor and a support-set queue of projections.

    Args:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output dimension of ``backbone``.
        projector_hidden_dim: hidden width of the projector.
        projector_dim: embedding width D (projector output, queue entries).
        projector_layers: Linear layers of the projector.
        predictor_hidden_dim: hidden width of the predictor.
        temperature: InfoNCE temperature, > 0.
        queue_size: support-set entries.
        symmetric: average with the view-swapped loss.
        knn_backend: lookup backend (see :func:`raycl.queues.cosine_topk`).
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        projector_hidden_dim: int,
        projector_dim: int,
        projector_layers: int,
        predictor_hidden_dim: int,
        temperature: float,
        queue_size: int,
        symmetric: bool,
        knn_backend: KnnBackend = "torch",
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.backbone = backbone
        self.projector = projection_mlp(feature_dim, projector_hidden_dim, projector_dim,
                                        num_layers=projector_layers)
        self.predictor = projection_mlp(projector_dim, predictor_hidden_dim, projector_dim)
        self.queue = FeatureQueue(queue_size, projector_dim, knn_backend)
        self.temperature = temperature
        self.symmetric = symmetric

    @staticmethod
    def nnclr_kwargs(cfg: CoreConfig, in_channels: int, section: NNCLRConfig) -> dict[str, Any]:
        """The constructor arguments shared with All4One, from ``cfg.model`` and ``section``."""
        return {**encoder_kwargs(cfg, in_channels),
                "projector_layers": section.projector_layers,
                "predictor_hidden_dim": section.predictor_hidden_dim,
                "temperature": section.temperature, "queue_size": section.queue_size,
                "symmetric": section.symmetric, "knn_backend": section.knn_backend}

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> NNCLR:
        return cls(**cls.nnclr_kwargs(cfg, in_channels, cfg.section(NNCLRConfig)))

    def project(self, images: Tensor) -> Tensor:
        return self.projector(self.backbone(images))

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
        neighbour1 = self.queue.nearest(z1, k=1)[0][:, 0]
        loss = info_nce(neighbour1, p2, self.temperature)
        if self.symmetric:
            neighbour2 = self.queue.nearest(z2, k=1)[0][:, 0]
            loss = (loss + info_nce(neighbour2, p1, self.temperature)) / 2
        self.queue.enqueue(z1, batch.index)  # after the lookups: never a sample's own entry
        with torch.no_grad():
            pos_sim = F.cosine_similarity(neighbour1, p2.float(), dim=1).mean()
        return {"loss": loss, "pos_sim": pos_sim, "queue_fill": self.queue.fill()}
