"""MoCo v2 (Chen, Fan, Girshick & He, 2020; MoCo: He et al., 2020): a query encoder contrasted
against a momentum key encoder and a queue of earlier keys. One of FGVR's base methods.

The query encoder is backbone + projector (MoCo v2's MLP head, ``Linear-ReLU-Linear`` without
BatchNorm); the key encoder is a momentum (EMA) copy of both, updated after every optimizer step
with a coefficient that is constant by default (0.999, as MoCo) and may follow BYOL's half-cosine
schedule from ``momentum_start`` to ``momentum_end``. The paper's loss is one-directional:
``q = g(f(v1))``, ``k = g_k(f_k(v2))`` (no gradient) and :func:`raycl.losses.moco_infonce` with
logits ``[q . k, q . queue^T] / tau`` and target 0; ``mocov2.symmetric`` adds the view-swapped
term and averages (the common modern variant, e.g. solo-learn's ``mocov2plus``).

**The queue holds keys.** After the loss, the batch's *key* (momentum-encoder) projections are
enqueued, gathered from every rank by :meth:`raycl.queues.FeatureQueue.enqueue`: view 2's keys,
or both views' keys when symmetric. Never the online queries (a public implementation enqueues
those, which makes the negatives move with the online encoder and drops MoCo's consistency
argument). The enqueue comes after the loss, so a batch never meets its own keys among its
negatives. The queue starts as random unit vectors, as MoCo's does.

**BatchNorm under data parallelism.** MoCo's shuffle-BN (keys encoded with the batch shuffled
across GPUs, so that the query and key of a sample are normalised with different sub-batch
statistics) is **not** implemented. BatchNorm statistics are per rank, which leaks a little
information between a sample's query and its key within a batch (MoCo §3.3); SyncBatchNorm or
shuffle-BN would remove it. The paper mode encodes view 1 with the query encoder and view 2
with the key encoder, each over its own batch as MoCo does; the symmetric mode encodes both
views in one pass per encoder (BatchNorm over 2B rows, as every raycl two-view method).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from raycl.config.schema import Section
from raycl.losses import moco_infonce
from raycl.methods.base import Batch, Method
from raycl.methods.registry import register
from raycl.methods.two_view import encode_views, encoder_kwargs
from raycl.models import projection_mlp
from raycl.models.momentum import ema_update, momentum_coefficient, momentum_copy
from raycl.queues import FeatureQueue

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


class MoCoV2Config(Section):
    """Knobs of ``method: mocov2``. The head's widths are ``model.projector_hidden_dim`` and
    ``model.projector_dim`` (MoCo v2 on ResNet-50: 2048 and 128). Paper defaults."""

    temperature: float = Field(0.2, gt=0.0, le=10.0, description="InfoNCE temperature τ "
                               "(MoCo v2: 0.2).", json_schema_extra={"symbol": "τ"})
    queue_size: int = Field(65_536, ge=1, description="Negative keys in the queue (MoCo: 65 536). "
                            "Any size works: writes wrap around, so it need not be a multiple of "
                            "the global batch.")
    momentum_start: float = Field(0.999, ge=0.0, le=1.0, description="EMA coefficient of the "
                                  "key encoder at the first step (MoCo: 0.999, constant) ...")
    momentum_end: float = Field(0.999, ge=0.0, le=1.0, description="... and at the last; in "
                                "between a half cosine (BYOL's schedule). Equal: constant.")
    projector_layers: int = Field(2, ge=1, le=4, description="Linear layers of the head, ReLU in "
                                  "between and no BatchNorm (MoCo v2: 2; 1 is MoCo v1's linear "
                                  "head).")
    symmetric: bool = Field(False, description="Average the loss with its view-swapped twin and "
                            "enqueue both views' keys (the paper: one-directional, view 2's keys "
                            "enqueued).")

    @model_validator(mode="after")
    def _consistent(self) -> MoCoV2Config:
        if self.momentum_start > self.momentum_end:
            raise ValueError(f"momentum_start ({self.momentum_start}) must not exceed "
                             f"momentum_end ({self.momentum_end})")
        return self


@register("mocov2", section=MoCoV2Config)
class MoCoV2(Method):
    """Query encoder (backbone + MLP head), its momentum key encoder and a queue of keys.

    Args:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output dimension of ``backbone``.
        projector_hidden_dim: hidden width of the head.
        projector_dim: embedding width D (head output, queue entries).
        projector_layers: Linear layers of the head (no BatchNorm).
        temperature: InfoNCE temperature, > 0.
        queue_size: negative keys in the queue.
        momentum: (start, end) of the key encoder's EMA coefficient.
        symmetric: average with the view-swapped loss and enqueue both views' keys.
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        projector_hidden_dim: int,
        projector_dim: int,
        projector_layers: int = 2,
        temperature: float = 0.2,
        queue_size: int = 65_536,
        momentum: tuple[float, float] = (0.999, 0.999),
        symmetric: bool = False,
    ) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        momentum_coefficient(0, 1, *momentum)  # validates 0 <= start <= end <= 1
        self.backbone = backbone
        self.projector = projection_mlp(feature_dim, projector_hidden_dim, projector_dim,
                                        num_layers=projector_layers, batch_norm=False)
        self.key_backbone = momentum_copy(self.backbone)
        self.key_projector = momentum_copy(self.projector)
        self.queue = FeatureQueue(queue_size, projector_dim)
        self.temperature = temperature
        self.momentum = momentum
        self.symmetric = symmetric

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> MoCoV2:
        section = cfg.section(MoCoV2Config)
        return cls(**encoder_kwargs(cfg, in_channels), projector_layers=section.projector_layers,
                   temperature=section.temperature, queue_size=section.queue_size,
                   momentum=(section.momentum_start, section.momentum_end),
                   symmetric=section.symmetric)

    def project(self, images: Tensor) -> Tensor:
        """The online (query) projection, unnormalised."""
        return self.projector(self.backbone(images))

    @torch.no_grad()
    def key_project(self, images: Tensor) -> Tensor:
        """The key encoder's projection, unnormalised, without gradient."""
        return self.key_projector(self.key_backbone(images))

    def on_train_step_end(self, step: int, total_steps: int) -> None:
        coefficient = momentum_coefficient(step, total_steps, *self.momentum)
        ema_update(self.backbone, self.key_backbone, coefficient)
        ema_update(self.projector, self.key_projector, coefficient)

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """MoCo's InfoNCE against the queue; enqueues the batch's keys after the loss.

        Returns:
            ``{"loss", "pos_sim", "queue_fill"}``: pos_sim is the mean cosine similarity of a
            query and its key (detached); queue_fill the share of entries holding real keys.

        Raises:
            ValueError: if the batch does not have exactly two views.
        """
        negatives = self.queue.embeddings  # read before the enqueue below: earlier keys only
        if self.symmetric:
            q1, q2 = encode_views(self.project, batch)
            k1, k2 = encode_views(self.key_project, batch)
            loss = (moco_infonce(q1, k2, negatives, self.temperature)
                    + moco_infonce(q2, k1, negatives, self.temperature)) / 2
            keys, index = torch.cat([k2, k1]), torch.cat([batch.index, batch.index])
        else:
            if len(batch.views) != 2:
                raise ValueError(f"this method needs exactly 2 views per batch, got "
                                 f"{len(batch.views)}")
            q1, k2 = self.project(batch.views[0]), self.key_project(batch.views[1])
            loss = moco_infonce(q1, k2, negatives, self.temperature)
            keys, index = k2, batch.index
        with torch.no_grad():
            pos_sim = F.cosine_similarity(q1.float(), k2.float(), dim=1).mean()
        # After the loss: the queue then holds these keys, never this batch's online queries.
        self.queue.enqueue(keys, index)
        return {"loss": loss, "pos_sim": pos_sim, "queue_fill": self.queue.fill()}
