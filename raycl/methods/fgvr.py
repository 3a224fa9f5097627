"""FGVR (Shu et al., 2024, "Learning fine-grained features from synthesised data pairs"): a
decoder turns the feature vector and a perturbed copy of it back into images, and the encoder
learns to map the two reconstructions together, so it becomes invariant to the dimensions the
perturbation touches: the non-discriminative ones.

On top of a base method (``fgvr.base``: MoCo v2, the paper's "ours", or SimSiam), each step:

1. ``L_C``: the base method's loss on the two augmented views (MoCo also enqueues its keys).
2. ``v = f(x)`` on the clean image, ``x̂ = h(v)``, ``L_R = ||x − x̂||² / m`` (eq. 2). As in the
   paper's pseudo-code the gradient of ``L_R`` reaches the encoder as well as the decoder.
3. ``v`` enters the FIFO memory bank ``M`` of D feature vectors (global under DDP).
4. Grad-CAM on the feature vector (eq. 3-5): ``η = ReLU(∂L(g(v), g(v''))/∂v ⊙ v)`` with ``L``
   a SimCLR loss between the clean image and the second view, min-max normalised per sample;
   noise ``N(0, ε_g (1 − η̄_i))``: dimensions that matter for the contrast are perturbed less.
5. Low variance (eq. 6): ``s_i`` the variance of ``M``'s i-th column after ℓ2-normalising the
   column, min-max normalised to ``s̄``; noise ``N(0, ε_var (1 − s̄_i))`` where ``s_i < κ``.
6. ``v_p = v + ṽ^g + ṽ^var``, ``x̂_p = h(v_p)``; ``L_Cp`` = SimCLR loss between ``g(f(x̂))`` and
   ``g(f(x̂_p))`` with both reconstructions **detached** (pseudo-code: ``x̂.detach()``), so
   ``L_Cp`` trains the encoder and projector only, and the decoder learns from ``L_R`` alone.
7. ``L = L_C + α L_R + ν L_Cp`` (eq. 8).

Before joint training the decoder is pre-trained on the frozen encoder with ``L_R`` on
non-augmented images (appendix 0.B.2: Adam, lr 1e-4, 200 epochs): the method's ``"decoder"``
phase (``fgvr.decoder_epochs``, 0 skips it). The encoder's parameters do not change in it; its
BatchNorm layers use batch statistics, as in joint training, so the decoder learns the features
it will be given (their running statistics, buffers, do follow the data).

**Where we follow what.** The paper writes the SimCLR losses with the positive left out of the
denominator (eqs. 1, 7); its pseudo-code calls ``simclr_loss``: we follow the pseudo-code
(:func:`raycl.losses.nt_xent`, positive in the denominator, temperature ``fgvr.temperature``,
which the paper does not give; MoCo v2's 0.2 by default). ε is a standard deviation, as the text
says ("controls the standard deviation"); the pseudo-code's ``normal(std=1 − η̄)`` drops ε. The
variance is torch's unbiased estimate over the filled rows of the bank. Note that an ℓ2-
normalised column of D entries has variance at most 1/D, so at the paper's D = 5 632 every
``s_i`` is below κ = 0.02 and the threshold selects all dimensions (consistent with the paper's
Table 7, where κ = 0.02 and κ = ∞ differ by 0.12 points); κ bites only for banks of fewer than
~1/κ = 50 rows, or not at all. The ablations (``fgvr.perturbation``): ``gradcam`` and
``low_variance`` use one criterion; ``random`` ("Ours – random", Table 8) perturbs every
dimension with the full ``ε_g`` and ``ε_var`` noise, as if every score were 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from raycl.config.schema import Section
from raycl.losses import nt_xent
from raycl.methods.base import TRAIN_PHASE, Batch, EncoderMethod, Method, Phase
from raycl.methods.queues import FeatureQueue
from raycl.methods.registry import METHODS, register
from raycl.models.decoder import FeatureDecoder

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig

Perturbation = Literal["both", "gradcam", "low_variance", "random"]


class FGVRConfig(Section):
    """Knobs of ``method: fgvr``; the base method's own knobs stay in its section (``mocov2:``
    or ``simsiam:``). Paper defaults (section 4.1.2, appendix 0.B)."""

    base: Literal["mocov2", "simsiam"] = Field("mocov2", description="Base method giving L_C "
                                               "(the paper's 'ours' is MoCo v2).")
    perturbation: Perturbation = Field(
        "both", description="Which dimensions are perturbed: both criteria (the paper), "
        "gradcam or low_variance alone, or random (every dimension, the 'Ours – random' "
        "ablation).")
    epsilon_g: float = Field(0.1, ge=0.0, description="ε_g: noise std on dimensions with Grad-CAM "
                             "score 0 (scaled by 1 − η̄).", json_schema_extra={"symbol": "ε_g"})
    epsilon_var: float = Field(0.05, ge=0.0, description="ε_var: noise std on the lowest-variance "
                               "dimension (scaled by 1 − s̄, only where s < κ).",
                               json_schema_extra={"symbol": "ε_var"})
    kappa: float = Field(0.02, ge=0.0, description="κ: a dimension whose normalised-column "
                         "variance s is below κ counts as low variance (s <= 1/bank rows).",
                         json_schema_extra={"symbol": "κ"})
    alpha: float = Field(1.0, ge=0.0, description="α: weight of the reconstruction loss L_R.",
                         json_schema_extra={"symbol": "α"})
    nu: float = Field(0.5, ge=0.0, description="ν: weight of the synthesised-pair loss L_Cp.",
                      json_schema_extra={"symbol": "ν"})
    memory_size: int = Field(5632, ge=2, description="D: feature vectors in the memory bank "
                             "the variance is estimated on (FIFO, checkpointed).",
                             json_schema_extra={"symbol": "D"})
    temperature: float = Field(0.2, gt=0.0, le=10.0, description="τ of the two SimCLR losses "
                               "(Grad-CAM's and L_Cp); not given by the paper.",
                               json_schema_extra={"symbol": "τ"})
    decoder_epochs: int = Field(200, ge=0, description="Decoder pre-training epochs on the "
                                "frozen encoder before joint training (0: none).")
    decoder_lr: float = Field(1e-4, gt=0.0, description="Decoder pre-training learning rate "
                              "(Adam(W), constant; joint training uses train.lr).")
    decoder_width: int = Field(32, ge=1, description="Channels of the decoder's last block; "
                               "earlier blocks double it, up to 8x.")


# ---------------------------------------------------------------------------------------------
# The perturbation, as small pure functions


def min_max_normalise(values: Tensor, dim: int = -1) -> Tensor:
    """``(x − min) / (max − min)`` along ``dim`` (eq. 4); 0 where all values are equal."""
    low = values.amin(dim=dim, keepdim=True)
    span = values.amax(dim=dim, keepdim=True) - low
    return (values - low) / span.clamp_min(torch.finfo(values.dtype).tiny)


def gradcam_scores(
    features: Tensor, view_features: Tensor, projector: nn.Module, temperature: float,
    gather: bool = True,
) -> Tensor:
    """FGVR's Grad-CAM on the feature vector (eq. 3), min-max normalised per sample (eq. 4).

    ``η = ReLU(∂L/∂v ⊙ v)`` with ``L = nt_xent(g(v), g(v''))``, the SimCLR loss between the
    clean images' features ``v`` and the second view's ``v''``. Only ``v`` is differentiated:
    no parameter gradient is accumulated.

    Args:
        features: (B, n) features ``v`` of the clean images.
        view_features: (B, n) features ``v''`` of an augmented view of the same images.
        projector: the projection head ``g``.
        temperature: τ of the SimCLR loss.
        gather: contrast against the global batch under DDP (training: every rank calls it,
            and the scores are those of the global batch, as on one device); False for a
            single rank's own batch (the end-of-trial diagnostics, which only rank 0 runs).

    Returns:
        (B, n) scores ``η̄`` in [0, 1] (no gradient); higher is more important.
    """
    v = features.detach().float().requires_grad_(True)
    # float32, autocast off: an fp16 gradient of this loss, unscaled, would underflow.
    with torch.enable_grad(), torch.autocast(v.device.type, enabled=False):
        loss = nt_xent(projector(v), projector(view_features.detach().float()), temperature,
                       gather=gather)
        (gradient,) = torch.autograd.grad(loss, v)
    return min_max_normalise(F.relu(gradient * v.detach()), dim=1)


def column_variance(bank: Tensor) -> Tensor:
    """``s_i``: the (unbiased) variance of the i-th column of the bank after ℓ2-normalising that
    column over the bank's rows (section 3.4; pseudo-code ``var(normalize(M, dim=0), dim=0)``).

    Args:
        bank: (D, n) feature vectors, D >= 2.

    Returns:
        (n,) variances, each at most 1/(D − 1).
    """
    if bank.shape[0] < 2:
        raise ValueError(f"the variance needs at least 2 feature vectors, got {bank.shape[0]}")
    return F.normalize(bank.float(), dim=0).var(dim=0)


def noise_std(
    scores: Tensor | None,
    variance: Tensor | None,
    epsilon_g: float,
    epsilon_var: float,
    kappa: float,
) -> tuple[Tensor | None, Tensor | None]:
    """Standard deviations of the two Gaussian perturbations (eqs. 5 and 6).

    Args:
        scores: (B, n) normalised Grad-CAM scores η̄, or None (criterion off).
        variance: (n,) column variances s of the bank, or None (criterion off).
        epsilon_g: ε_g.
        epsilon_var: ε_var.
        kappa: κ; only dimensions with ``s_i < κ`` get the variance noise.

    Returns:
        ``(std_g, std_var)``: (B, n) ``ε_g (1 − η̄)`` and (n,) ``ε_var (1 − s̄) [s < κ]``, each
        None when its input is.
    """
    std_g = None if scores is None else epsilon_g * (1.0 - scores)
    std_var = None
    if variance is not None:
        std_var = epsilon_var * (1.0 - min_max_normalise(variance)) * (variance < kappa)
    return std_g, std_var


def perturb(features: Tensor, std_g: Tensor | None, std_var: Tensor | None) -> Tensor:
    """``v_p = v + ṽ^g + ṽ^var``, each noise drawn from N(0, std²) element-wise (no gradient)."""
    perturbed = features.detach().float()
    for std in (std_g, std_var):
        if std is not None:
            perturbed = perturbed + torch.randn_like(perturbed) * std
    return perturbed


# ---------------------------------------------------------------------------------------------
# The method


@register("fgvr", section=FGVRConfig)
class FGVR(Method):
    """A base method (MoCo v2 or SimSiam) plus FGVR's decoder, memory bank and pair loss.

    Args:
        base: the base method; its ``backbone`` is ``f`` and its ``projector`` is ``g``.
        decoder: ``h``, from ``f``'s features to images.
        section, knobs: FGVR's knobs (:class:`FGVRConfig`; see :class:`Method`).
    """

    section: FGVRConfig

    def __init__(self, base: EncoderMethod, decoder: nn.Module,
                 section: FGVRConfig | None = None, **knobs: Any) -> None:
        super().__init__(section, **knobs)
        if not isinstance(base, EncoderMethod):
            raise ValueError(f"{type(base).__name__} has no projector to serve as g")
        self.base = base
        self.decoder = decoder
        self.memory = FeatureQueue(self.section.memory_size, base.feature_dim, normalize=False)
        self.phase = TRAIN_PHASE.name
        # What the base trains (its momentum copies are frozen for good).
        self._trainable = {name for name, p in self.named_parameters() if p.requires_grad}

    @property
    def backbone(self) -> nn.Module:  # type: ignore[override]
        return self.base.backbone

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> FGVR:
        section = cfg.section(FGVRConfig)
        base = METHODS[section.base].from_config(cfg, in_channels)
        assert isinstance(base, EncoderMethod), "fgvr.base is mocov2 or simsiam"
        decoder = FeatureDecoder(base.feature_dim, in_channels, cfg.data.resolution,
                                 width=section.decoder_width)
        return cls(base, decoder, section)

    @classmethod
    def phases(cls, cfg: CoreConfig) -> list[Phase]:
        section = cfg.section(FGVRConfig)
        if section.decoder_epochs == 0:
            return [TRAIN_PHASE]
        # The encoder does not change while the decoder pre-trains: nothing to evaluate.
        return [Phase("decoder", epochs=section.decoder_epochs, optimizer="adamw",
                      lr=section.decoder_lr, augment=False, evaluate=False), TRAIN_PHASE]

    def set_phase(self, name: str) -> None:
        if name not in ("decoder", TRAIN_PHASE.name):
            raise ValueError(f"unknown phase {name!r}; phases of fgvr: 'decoder', 'train'")
        self.phase = name
        for param_name, param in self.named_parameters():
            param.requires_grad_(param_name.startswith("decoder.") if name == "decoder"
                                 else param_name in self._trainable)

    def param_groups(self) -> list[dict]:
        decoder = {"params": list(self.decoder.parameters()), "name": "decoder"}
        if self.phase == "decoder":
            return [decoder]
        return [*self.base.param_groups(), decoder]

    def project(self, images: Tensor) -> Tensor | None:
        return self.base.project(images)

    def on_train_step_end(self, step: int, total_steps: int) -> None:
        if self.phase == TRAIN_PHASE.name:  # MoCo's key encoder follows the trained encoder
            self.base.on_train_step_end(step, total_steps)

    def _criteria(
        self, v: Tensor, view: Tensor, gather: bool = True
    ) -> tuple[Tensor | None, Tensor | None]:
        """The normalised Grad-CAM scores of features ``v`` (``view``: x'') and the bank's
        column variances (bank already updated), each None when its criterion is off.
        ``gather``: Grad-CAM over the global batch (training, every rank) or this rank's."""
        scores = variance = None
        perturbation = self.section.perturbation
        if perturbation in ("both", "gradcam"):
            with torch.no_grad():
                view_features = self.backbone(view)
            scores = gradcam_scores(v, view_features, self.base.projector,
                                    self.section.temperature, gather=gather)
        bank = self.memory.filled()
        if perturbation in ("both", "low_variance") and bank.shape[0] >= 2:
            variance = column_variance(bank)
        return scores, variance

    def _noise_std(
        self, v: Tensor, scores: Tensor | None, variance: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The two noise stds for features ``v`` from :meth:`_criteria`'s outputs."""
        knobs = self.section
        if knobs.perturbation == "random":
            return (torch.full_like(v, knobs.epsilon_g, dtype=torch.float32),
                    torch.full_like(v[0], knobs.epsilon_var, dtype=torch.float32))
        return noise_std(scores, variance, knobs.epsilon_g, knobs.epsilon_var, knobs.kappa)

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """``L_C + α L_R + ν L_Cp`` (or ``L_R`` alone in the decoder phase).

        Returns:
            ``{"loss", "contrastive_loss", "reconstruction_loss", "pair_loss",
            "perturbed_dims", "perturbation_norm", ...the base's detached metrics}``;
            ``perturbed_dims`` is the share of dimensions under the variance noise,
            ``perturbation_norm`` the mean ``||v_p − v|| / ||v||``.
        """
        if self.phase == "decoder":
            with torch.no_grad():
                v = self.backbone(batch.images)
            loss = F.mse_loss(self.decoder(v).float(), batch.images.float())
            return {"loss": loss, "reconstruction_loss": loss.detach()}
        if len(batch.views) != 2:
            raise ValueError(f"fgvr needs exactly 2 views per batch, got {len(batch.views)}")

        base = self.base(batch)
        v = self.backbone(batch.images)
        reconstruction = self.decoder(v)
        loss_r = F.mse_loss(reconstruction.float(), batch.images.float())
        self.memory.enqueue(v, batch.index)  # before the variance, as the pseudo-code
        std_g, std_var = self._noise_std(v, *self._criteria(v, batch.views[1]))
        with torch.no_grad():
            perturbed = perturb(v, std_g, std_var)
            reconstruction_p = self.decoder(perturbed.to(v.dtype))
        z = self.base.project(reconstruction.detach())
        z_p = self.base.project(reconstruction_p)
        loss_cp = nt_xent(z, z_p, self.section.temperature)
        loss = base["loss"] + self.section.alpha * loss_r + self.section.nu * loss_cp
        with torch.no_grad():
            relative = ((perturbed - v.float()).norm(dim=1)
                        / v.float().norm(dim=1).clamp_min(1e-12)).mean()
            dims = (std_var > 0).float().mean() if std_var is not None else v.new_zeros(())
        extras = {key: value for key, value in base.items() if key != "loss"}
        return {**extras, "loss": loss, "contrastive_loss": base["loss"].detach(),
                "reconstruction_loss": loss_r.detach(), "pair_loss": loss_cp.detach(),
                "perturbed_dims": dims.float(), "perturbation_norm": relative}

    def diagnostic_arrays(self, batch: Batch) -> dict[str, np.ndarray]:
        """Reconstruction triples (x, x̂, x̂_p) as uint8 images, the Grad-CAM scores η̄ and the
        bank's column variances s (with κ), for the pictures. Only rank 0 calls it: Grad-CAM
        contrasts these images alone (no gather, which the other ranks would never join)."""
        with torch.no_grad():
            v = self.backbone(batch.images)
        scores, variance = self._criteria(v, batch.views[1], gather=False)
        std_g, std_var = self._noise_std(v, scores, variance)
        with torch.no_grad():
            reconstruction = self.decoder(v)
            reconstruction_p = self.decoder(perturb(v, std_g, std_var).to(v.dtype))
        triples = torch.stack([batch.images, reconstruction, reconstruction_p], dim=1)
        arrays = {"fgvr_triples": _to_uint8(triples),
                  "fgvr_kappa": np.array([self.section.kappa])}
        if scores is not None:
            arrays["fgvr_gradcam_scores"] = scores.cpu().numpy()
        bank = self.memory.filled()
        if variance is None and bank.shape[0] >= 2:  # shown even when the criterion is off
            variance = column_variance(bank)
        if variance is not None:
            arrays["fgvr_variance"] = variance.cpu().numpy()
        return arrays


def _to_uint8(images: Tensor) -> np.ndarray:
    """Normalised [-1, 1] images (any leading shape, C, H, W) -> uint8 in [0, 255]."""
    return ((images.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


__all__ = ["FGVR", "FGVRConfig", "column_variance", "gradcam_scores",
           "min_max_normalise", "noise_std", "perturb"]
