"""All4One (Estepa et al., 2023): neighbour, centroid and feature contrast in one objective.

``L = σ L_nn + κ L_centroid + η L_red`` (paper eq. 4) on top of NNCLR, with a momentum (EMA)
branch whose projections fill the support set and answer its lookups:

- **Neighbour contrast** (eq. 1): InfoNCE between ``nn^1``, the nearest support-set entry of the
  momentum projection of view 1, and ``q_nn(z^2)``, the first predictor on the online view 2.
- **Centroid contrast** (eq. 2): the k nearest entries of each momentum projection form a
  sequence; sinusoidal positions are added and a small transformer encoder ψ returns element 0 as
  the centroid ``c^1``. On the online side the sequence of view 2's neighbours goes through the
  *Shift*: ``q_c(z^2)`` (the second predictor) replaces the k-th neighbour and moves to the
  front, so the gradient reaches the backbone; ψ gives ``c^2``; InfoNCE between ``c^1`` and
  ``c^2``.
- **Feature contrast** (eq. 3): :func:`raycl.losses.redundancy_reduction_loss` between momentum
  and online projections of opposite views.

Defaults are the paper's (σ, κ, η = 0.5, 0.5, 5; λ = 0.5; one-directional eqs. 1-2; τ = 0.1
from NNCLR). The authors' code (solo-learn's ``all4one``) weights differently; in these knobs it
is ``symmetric: true, temperature: 0.2, centroid_temperature: 0.1, eta: 2.5,
redundancy_lambda: 1.0`` (its ``0.5 * 10 * (0.5 on + 0.5 off)``); see docs/methods.md. Where the
paper is silent this file follows that code: the lookups of both views use momentum projections,
ψ's feed-forward width is 512 with dropout 0.1, and view 1's momentum projections are enqueued.

ψ's positional encoding: the paper adds sinusoidal positions along the sequence of k neighbours
(``position_encoding: sequence``, the default, with the paper's other defaults). The authors' code
adds them along the feature axis: solo-learn's ``Summer(PositionalEncodingPermute1D(5))`` on a
(B, k, D) input treats the D features as the positions and the k neighbours as the encoding's
channels, so entry (j, d) is channel j of position d (``position_encoding: feature``). The
headline YAMLs (searches/papers/all4one_*.yaml) use it with the rest of the code's settings,
which together produced the paper's Table 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from raycl.losses import info_nce, redundancy_reduction_loss, sinusoidal_positional_encoding
from raycl.methods.base import Batch, Encoder
from raycl.methods.nnclr import NNCLR, NNCLRConfig
from raycl.methods.registry import register
from raycl.methods.two_view import encode_views
from raycl.models import projection_mlp
from raycl.models.momentum import momentum_copy, momentum_update

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


class All4OneConfig(NNCLRConfig):
    """Knobs of ``method: all4one``: NNCLR's (``temperature`` is the neighbour term's τ) and the
    centroid, redundancy and momentum knobs. Paper defaults."""

    symmetric: bool = Field(False, description="Symmetrise the neighbour and centroid terms "
                            "over the two views (the authors' code does; the paper's eqs. 1-2 "
                            "do not).")
    sigma: float = Field(0.5, ge=0.0, description="σ, weight of the neighbour contrast.",
                         json_schema_extra={"symbol": "σ"})
    kappa: float = Field(0.5, ge=0.0, description="κ, weight of the centroid contrast.",
                         json_schema_extra={"symbol": "κ"})
    eta: float = Field(5.0, ge=0.0, description="η, weight of the feature (redundancy) contrast.",
                       json_schema_extra={"symbol": "η"})
    redundancy_lambda: float = Field(0.5, ge=0.0, description="λ, weight of the off-diagonal "
                                     "square root in the redundancy term (eq. 3).",
                                     json_schema_extra={"symbol": "λ"})
    neighbours: int = Field(5, ge=2, le=64, description="k, support-set neighbours per centroid "
                            "sequence (the paper: 5; ablation 5-20).",
                            json_schema_extra={"symbol": "k"})
    centroid_temperature: float = Field(0.1, gt=0.0, le=10.0, description="InfoNCE τ of the "
                                        "centroid contrast.", json_schema_extra={"symbol": "τ_c"})
    transformer_layers: int = Field(3, ge=1, le=12, description="Encoder layers of ψ.")
    transformer_heads: int = Field(8, ge=1, description="Attention heads of ψ; must divide "
                                   "model.projector_dim.")
    transformer_feedforward: int = Field(512, ge=1, description="Feed-forward width of ψ.")
    transformer_dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout inside ψ.")
    transformer_lr: float | None = Field(None, gt=0.0, description="ψ's absolute peak learning "
                                         "rate (the paper: 0.1 with SGD+LARS); unset: train.lr x "
                                         "transformer_lr_scale. Same warmup-cosine schedule.")
    transformer_lr_scale: float = Field(1.0, gt=0.0, description="ψ's learning rate relative to "
                                        "the base rate (train.lr, scaled by train.lr_scaling), "
                                        "when transformer_lr is unset.")
    position_encoding: Literal["sequence", "feature"] = Field(
        "sequence", description="Axis of ψ's input the sinusoidal positions run along: sequence "
        "(positions 0..k-1 of the neighbours, as the paper describes) or feature (positions "
        "0..D-1 of the embedding, k channels: what the authors' code does and what produced "
        "their reported numbers, with symmetric: true, temperature: 0.2, eta: 2.5, "
        "redundancy_lambda: 1.0). Default sequence, like this section's other defaults (the "
        "paper's); searches/papers/all4one_*.yaml set the code's five together.")
    momentum_start: float = Field(0.99, ge=0.0, le=1.0, description="EMA coefficient of the "
                                  "momentum branch at the first step ...")
    momentum_end: float = Field(1.0, ge=0.0, le=1.0, description="... rising to this at the last "
                                "(half cosine).")

    @model_validator(mode="after")
    def _consistent(self) -> All4OneConfig:
        if self.queue_size < self.neighbours:
            raise ValueError(f"queue_size ({self.queue_size}) must hold at least the "
                             f"{self.neighbours} neighbours looked up per sample")
        if self.momentum_start > self.momentum_end:
            raise ValueError(f"momentum_start ({self.momentum_start}) must not exceed "
                             f"momentum_end ({self.momentum_end})")
        return self


def centroid_positions(length: int, dim: int, layout: str = "sequence") -> Tensor:
    """The (k, D) sinusoidal encoding ψ adds to its (B, k, D) input.

    ``sequence``: row j is the encoding of position j at width D (Vaswani et al.; the paper).
    ``feature``: entry (j, d) is channel j of position d at width k rounded up to even, as the
    authors' code (a 1-D encoding over a (B, D, k) permutation of the input) computes it: the
    transpose of :func:`sinusoidal_positional_encoding` ``(D, k)`` for an even k.

    Args:
        length: sequence length k, >= 1.
        dim: embedding width D, >= 1.
        layout: ``sequence`` or ``feature``.

    Returns:
        (k, D) float32 tensor.

    Raises:
        ValueError: on an unknown layout (or sizes below 1).
    """
    if layout == "sequence":
        return sinusoidal_positional_encoding(length, dim)
    if layout == "feature":
        channels = length + length % 2  # the authors' encoder rounds the width up to even
        return sinusoidal_positional_encoding(dim, channels)[:, :length].T.contiguous()
    raise ValueError(f"position encoding layout must be 'sequence' or 'feature', got {layout!r}")


class CentroidEncoder(nn.Module):
    """ψ: sinusoidal positions + a transformer encoder; element 0 of its output is the centroid.

    Args:
        dim: embedding width D (divisible by ``heads``).
        length: sequence length k.
        layers: encoder layers.
        heads: attention heads.
        feedforward: feed-forward width.
        dropout: dropout probability inside the encoder.
        position_encoding: ``sequence`` or ``feature`` (:func:`centroid_positions`).
    """

    positions: Tensor

    def __init__(self, dim: int, length: int, layers: int, heads: int, feedforward: int,
                 dropout: float, position_encoding: str = "sequence") -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"the transformer's {heads} heads must divide the embedding width "
                             f"{dim}")
        layer = nn.TransformerEncoderLayer(dim, heads, feedforward, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        # not persistent: a function of the config, so checkpoints stay layout-free
        self.register_buffer("positions", centroid_positions(length, dim, position_encoding),
                             persistent=False)

    def forward(self, sequence: Tensor) -> Tensor:
        """(B, k, D) sequence -> (B, D) centroid."""
        return self.encoder(sequence + self.positions.to(sequence.dtype))[:, 0]


def shift(neighbours: Tensor, prediction: Tensor) -> Tensor:
    """The paper's Shift: ``prediction`` replaces the last of the k neighbours and moves to the
    front, ``[q_c(z_i), nn_i1, ..., nn_i(k-1)]``.

    Args:
        neighbours: (B, k, D) support-set neighbours, nearest first.
        prediction: (B, D) centroid-predictor output of the same samples.

    Returns:
        (B, k, D) sequence.
    """
    return torch.cat([prediction[:, None], neighbours[:, :-1].to(prediction.dtype)], dim=1)


@register("all4one", section=All4OneConfig)
class All4One(NNCLR):
    """NNCLR plus a momentum branch, a centroid predictor, ψ and the redundancy term
    (arguments: :class:`~raycl.methods.base.EncoderMethod`; knobs: :class:`All4OneConfig`)."""

    section: All4OneConfig

    def __init__(self, encoder: Encoder, section: All4OneConfig | None = None,
                 **knobs: Any) -> None:
        super().__init__(encoder, section, **knobs)
        dim, section = encoder.projector_dim, self.section  # the given one or the defaults
        self.centroid_predictor = projection_mlp(dim, section.predictor_hidden_dim, dim)
        self.psi = CentroidEncoder(dim, section.neighbours, section.transformer_layers,
                                   section.transformer_heads, section.transformer_feedforward,
                                   section.transformer_dropout, section.position_encoding)
        self.momentum_backbone = momentum_copy(self.backbone)
        self.momentum_projector = momentum_copy(self.projector)

    @classmethod
    def config_problems(cls, cfg: CoreConfig) -> list[tuple[str, str]]:
        section = cfg.section(All4OneConfig)
        if cfg.model.projector_dim % section.transformer_heads:
            return [("all4one.transformer_heads",
                     f"{section.transformer_heads} heads must divide model.projector_dim "
                     f"({cfg.model.projector_dim}), the width of ψ")]
        return []

    @torch.no_grad()
    def momentum_project(self, images: Tensor) -> Tensor:
        return self.momentum_projector(self.momentum_backbone(images))

    def queries(self, images: Tensor) -> Tensor:
        return self.momentum_project(images)

    def param_groups(self) -> list[dict[str, Any]]:
        psi = list(self.psi.parameters())
        psi_ids = {id(param) for param in psi}
        rest = [param for param in self.parameters()
                if param.requires_grad and id(param) not in psi_ids]
        psi_group: dict[str, Any] = {"params": psi, "name": "transformer"}
        if self.section.transformer_lr is not None:
            psi_group["lr"] = self.section.transformer_lr
        else:
            psi_group["lr_scale"] = self.section.transformer_lr_scale
        return [{"params": rest, "name": "default"}, psi_group]

    def on_train_step_end(self, step: int, total_steps: int) -> None:
        momentum_update([(self.backbone, self.momentum_backbone),
                         (self.projector, self.momentum_projector)],
                        step, total_steps, self.section.momentum_start, self.section.momentum_end)

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """The All4One objective; enqueues view 1's momentum projections after the lookups.

        Returns:
            ``{"loss", "neighbour_loss", "centroid_loss", "redundancy_loss", "pos_sim",
            "queue_fill"}`` (all but the loss detached).
        """
        z1, z2 = encode_views(self.project, batch)
        target1, target2 = encode_views(self.momentum_project, batch)
        both = torch.cat([z1, z2])  # each predictor sees both views in one batch
        p1, p2 = self.predictor(both).chunk(2)
        pc1, pc2 = self.centroid_predictor(both).chunk(2)
        knobs = self.section
        neighbours1, _ = self.queue.nearest(target1, knobs.neighbours)
        neighbours2, _ = self.queue.nearest(target2, knobs.neighbours)

        neighbour_loss = info_nce(neighbours1[:, 0], p2, knobs.temperature)
        centroid_loss = info_nce(self.psi(neighbours1), self.psi(shift(neighbours2, pc2)),
                                 knobs.centroid_temperature)
        if knobs.symmetric:
            neighbour_loss = (neighbour_loss
                              + info_nce(neighbours2[:, 0], p1, knobs.temperature)) / 2
            centroid_loss = (centroid_loss + info_nce(
                self.psi(neighbours2), self.psi(shift(neighbours1, pc1)),
                knobs.centroid_temperature)) / 2
        redundancy_loss = redundancy_reduction_loss(target1, z2, target2, z1,
                                                    knobs.redundancy_lambda)
        loss = (knobs.sigma * neighbour_loss + knobs.kappa * centroid_loss
                + knobs.eta * redundancy_loss)
        self.queue.enqueue(target1, batch.index)  # after the lookups: never a sample's own entry
        with torch.no_grad():
            pos_sim = F.cosine_similarity(neighbours1[:, 0], p2.float(), dim=1).mean()
        return {"loss": loss, "neighbour_loss": neighbour_loss.detach(),
                "centroid_loss": centroid_loss.detach(),
                "redundancy_loss": redundancy_loss.detach(), "pos_sim": pos_sim,
                "queue_fill": self.queue.fill()}
