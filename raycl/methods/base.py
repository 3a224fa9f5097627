"""The method contract: what every self-supervised method implements.

A method is an ``nn.Module`` that owns its networks (``self.backbone`` at least) and turns a
:class:`Batch` into a loss. The training loop knows nothing else about it. The hooks below
are what the planned methods need; keep them generic:

- **State lives in the module.** Momentum encoders, queues and support sets (MoCo, All4One's
  nearest-neighbour queue) are registered as submodules or buffers (``register_buffer``), so
  ``state_dict()`` checkpoints them and DDP broadcasts them; they are updated in
  :meth:`Method.on_train_step_end` (EMA with a schedule over ``step / total_steps``) or inside
  ``forward`` under ``torch.no_grad()``.
- **Global-batch statistics** (queue updates, batch-level whitening or filters such as HSCL's
  ``Bmat``) use :mod:`raycl.distributed` (``gather_no_grad``, ``all_reduce_mean``, or
  ``gather_with_grad`` when gradients must flow), which are no-ops in a single process.
- **Parameter groups.** :meth:`Method.param_groups` returns optimizer groups; a group may carry
  ``"lr_scale"`` (multiplied into the base learning rate by the trainer), e.g. a predictor
  trained at 10x lr, an absolute ``"lr"`` (All4One's transformer), or ``"weight_decay"``
  overrides. Every group follows the same warmup-cosine schedule. Frozen parameters are left out.
- **Support sets.** A method with a queue of past samples (:class:`raycl.queues.FeatureQueue`)
  answers :meth:`Method.neighbour_retrieval`; the loop scores it against labels at every
  evaluation (``val/nn_retrieval/<attribute>``). DDP does not re-broadcast queue buffers.
- **Config checks across sections** (e.g. All4One's heads must divide ``model.projector_dim``)
  go in :meth:`Method.config_problems`, which the loader runs before anything is launched.
- **Phases.** A method that trains in several phases (FGVR pre-trains its decoder before the
  min-max stage) lists them in :meth:`Method.phases`; the trainer calls
  :meth:`Method.set_phase` before each phase. The default is the single phase ``"train"``.
- **Multi-modal batches.** Image-text methods (MCL on CLIP) subclass :class:`Batch` and add a
  ``texts`` field; everything else stays the same.
- **MCL** is not a method: it wraps a base method and supplies ``Batch.pseudo_labels``. A
  method that sets ``accepts_negative_mask`` restricts its negatives to samples with the same
  pseudo label (``mcl.negatives: mask``); any method can be MCL's base with ``sampler``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from raycl.distributed import gather_no_grad
from raycl.losses import same_label_mask

if TYPE_CHECKING:
    from raycl.config import CoreConfig


@dataclass
class Batch:
    """One training batch, already on the training device.

    Attributes:
        images: clean images, normalised float (B, C, H, W).
        views: augmented views, each like ``images``.
        index: int64 (B,) dataset indices of the samples.
        pseudo_labels: int64 (B,) MCL group codes, or None; when given, an anchor's negatives
            are restricted to samples with the same code.
    """

    images: Tensor
    views: list[Tensor]
    index: Tensor
    pseudo_labels: Tensor | None = None

    def negative_mask(self) -> Tensor | None:
        """MCL's (B_local, B_global) mask of allowed negatives (same pseudo label), or None.

        Collective under DDP (it gathers the labels): every rank must call it.
        """
        if self.pseudo_labels is None:
            return None
        return same_label_mask(self.pseudo_labels, gather_no_grad(self.pseudo_labels))


class Method(nn.Module):
    """Base class of all self-supervised methods; see the module docstring for the hooks.

    Subclasses set ``self.backbone`` (the encoder used for evaluation) and implement
    :meth:`forward` and :meth:`from_config`.
    """

    backbone: nn.Module
    # True when forward honours Batch.negative_mask() (MCL's ``negatives: mask``).
    accepts_negative_mask: ClassVar[bool] = False

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        """Computes the training loss.

        Args:
            batch: the current batch.

        Returns:
            ``{"loss": differentiable scalar, ...}`` plus detached scalars worth logging.
        """
        raise NotImplementedError

    def embed(self, images: Tensor) -> Tensor:
        """Backbone features for evaluation (no projector).

        Args:
            images: normalised float (B, C, H, W).

        Returns:
            (B, feature_dim) features.
        """
        return self.backbone(images)

    def project(self, images: Tensor) -> Tensor | None:
        """The embedding the loss acts on (projector output), for the spectrum diagnostic.

        Args:
            images: normalised float (B, C, H, W).

        Returns:
            (B, projector_dim) projections, or None for a method without one (the default).
        """
        return None

    def neighbour_retrieval(self, images: Tensor) -> Tensor | None:
        """The dataset index of each image's nearest support-set entry, for the NN-retrieval
        diagnostic (does its neighbour share its label?).

        Args:
            images: normalised float (B, C, H, W).

        Returns:
            (B,) int64 training-split indices (-1 for an entry that holds no sample yet), or
            None for a method without a support set (the default).
        """
        return None

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups.

        Returns:
            A list of groups ``{"params": [...], "name": str, optional "lr_scale": float}``;
            by default a single group with every trainable parameter.
        """
        params = [param for param in self.parameters() if param.requires_grad]
        return [{"params": params, "name": "default"}]

    def on_train_step_end(self, step: int, total_steps: int) -> None:
        """Called after every optimizer step (EMA updates, schedules); no-op by default.

        Args:
            step: number of optimizer steps taken so far (1 after the first).
            total_steps: total number of optimizer steps of the run.
        """

    def phases(self) -> list[str]:
        """Names of the training phases, run in order; a single "train" phase by default."""
        return ["train"]

    def set_phase(self, name: str) -> None:
        """Switches to phase ``name`` (e.g. freezing or unfreezing modules).

        Args:
            name: one of :meth:`phases`.

        Raises:
            ValueError: if ``name`` is not one of :meth:`phases`.
        """
        if name not in self.phases():
            raise ValueError(f"unknown phase {name!r}; phases of this method: {self.phases()}")

    @classmethod
    def config_problems(cls, cfg: CoreConfig) -> list[tuple[str, str]]:
        """Problems with ``cfg`` that one section's validation cannot see, as ``(key, why)``;
        the loader reports the first as ``FILE: key: why`` before launching. None by default
        (an empty list).
        """
        return []

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> Method:
        """Builds the method from a search configuration.

        Args:
            cfg: the run configuration.
            in_channels: number of image channels of the dataset.

        Returns:
            A new, randomly initialised method.
        """
        raise NotImplementedError
