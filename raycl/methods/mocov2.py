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
enqueued, gathered from every rank by :meth:`raycl.methods.queues.FeatureQueue.enqueue`: view
2's keys, or both views' keys when symmetric. Never the online queries (a public implementation
enqueues those, which makes the negatives move with the online encoder and drops MoCo's consistency
argument). The enqueue comes after the loss, so a batch never meets its own keys among its
negatives. The queue starts as random unit vectors, as MoCo's does.

**BatchNorm under data parallelism.** MoCo's shuffle-BN (keys encoded with the batch shuffled
across GPUs, so that the query and key of a sample are normalised with different sub-batch
statistics) is **not** implemented. On several workers (GPU, or CPU over gloo)
``model.sync_batchnorm`` (the default) computes BatchNorm statistics over the global batch, as
MoCo v3 does; with it off they are per rank, which leaks a little information between a
sample's query and its key within a batch (MoCo §3.3). The paper mode encodes view 1 with the
query encoder and view 2 with the key encoder, each over its own batch as MoCo does; the
symmetric mode encodes both views in one pass per encoder (BatchNorm over 2B rows, as every
raycl two-view method).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor

from raycl.config.schema import Section
from raycl.losses import moco_infonce
from raycl.methods.base import Batch, Encoder, EncoderMethod
from raycl.methods.queues import FeatureQueue
from raycl.methods.registry import register
from raycl.methods.two_view import encode_views
from raycl.models.momentum import momentum_copy, momentum_update


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
class MoCoV2(EncoderMethod):
    """Query encoder (backbone + MLP head), its momentum key encoder and a queue of keys
    (arguments: :class:`~raycl.methods.base.EncoderMethod`; knobs: :class:`MoCoV2Config`;
    ``model.projector_dim`` is the embedding width D of the head and the queue's entries)."""

    section: MoCoV2Config

    def __init__(self, encoder: Encoder, section: MoCoV2Config | None = None,
                 **knobs: Any) -> None:
        super().__init__(encoder, section, **knobs)
        self.key_backbone = momentum_copy(self.backbone)
        self.key_projector = momentum_copy(self.projector)
        self.queue = FeatureQueue(self.section.queue_size, encoder.projector_dim)

    def projector_layout(self) -> dict[str, Any]:
        return {"num_layers": self.section.projector_layers, "batch_norm": False}

    @torch.no_grad()
    def key_project(self, images: Tensor) -> Tensor:
        """The key encoder's projection, unnormalised, without gradient."""
        return self.key_projector(self.key_backbone(images))

    def on_train_step_end(self, step: int, total_steps: int) -> None:
        momentum_update([(self.backbone, self.key_backbone), (self.projector, self.key_projector)],
                        step, total_steps, self.section.momentum_start, self.section.momentum_end)

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """MoCo's InfoNCE against the queue; enqueues the batch's keys after the loss.

        Returns:
            ``{"loss", "pos_sim", "queue_fill"}``: pos_sim is the mean cosine similarity of a
            query and its key (detached); queue_fill the share of entries holding real keys.

        Raises:
            ValueError: if the batch does not have exactly two views.
        """
        temperature = self.section.temperature
        negatives = self.queue.embeddings  # read before the enqueue below: earlier keys only
        if self.section.symmetric:
            q1, q2 = encode_views(self.project, batch)
            k1, k2 = encode_views(self.key_project, batch)
            loss = (moco_infonce(q1, k2, negatives, temperature)
                    + moco_infonce(q2, k1, negatives, temperature)) / 2
            keys, index = torch.cat([k2, k1]), torch.cat([batch.index, batch.index])
        else:
            if len(batch.views) != 2:
                raise ValueError(f"this method needs exactly 2 views per batch, got "
                                 f"{len(batch.views)}")
            q1, k2 = self.project(batch.views[0]), self.key_project(batch.views[1])
            loss = moco_infonce(q1, k2, negatives, temperature)
            keys, index = k2, batch.index
        with torch.no_grad():
            pos_sim = F.cosine_similarity(q1.float(), k2.float(), dim=1).mean()
        # After the loss: the queue then holds these keys, never this batch's online queries.
        self.queue.enqueue(keys, index)
        return {"loss": loss, "pos_sim": pos_sim, "queue_fill": self.queue.fill()}
