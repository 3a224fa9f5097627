"""The method contract: what every self-supervised method implements.

A method is an ``nn.Module`` that owns its networks (``self.backbone`` at least) and turns a
:class:`Batch` into a loss. The training loop knows nothing else about it. The hooks below
are what the planned methods need; keep them generic:

- **Knobs are declared once**, in the method's config section (a
  :class:`~raycl.config.section.Section` beside the class, registered with it): its fields give
  the defaults, bounds and descriptions. A method reads them from ``self.section``; it is built
  from a config with that section (:meth:`Method.from_config`) or, in a test, with a few
  keyword overrides the section validates (``SimCLR(encoder, temperature=0.1)``).
- **Backbone + projector methods** (all but FGVR and CLIP) derive from :class:`EncoderMethod`,
  which builds both from an :class:`Encoder` (``model:``); a subclass only says how its
  projector is laid out (:meth:`EncoderMethod.projector_layout`).
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
- **Support sets.** A method with a queue of past samples
  (:class:`raycl.methods.queues.FeatureQueue`) answers :meth:`Method.neighbour_retrieval`; the
  loop scores it against labels at every evaluation (``val/nn_retrieval/<attribute>``). DDP does
  not re-broadcast queue buffers.
- **Config checks across sections** (e.g. All4One's heads must divide ``model.projector_dim``)
  go in :meth:`Method.config_problems`, which the loader runs before anything is launched.
- **Phases.** A method that trains in several phases (FGVR pre-trains its decoder on the frozen
  encoder before joint training) lists them in :meth:`Method.phases`, each a :class:`Phase`
  with its own epochs and optimizer; the loop calls :meth:`Method.set_phase` before each one,
  builds that phase's optimizer from :meth:`Method.param_groups`, and checkpoints which phase
  it is in, so a resumed trial continues in the right one. The last phase is ``"train"``
  (``train.epochs``). The default is that phase alone.
- **Pictures.** :meth:`Method.diagnostic_arrays` returns arrays computed on a batch of test
  images at the end of a trial (FGVR's reconstruction triples), keys prefixed with the method's
  name; :mod:`raycl.eval.figures` draws them on the driver, logged to the trial's MLflow run.
  A method draws nothing itself.
- **Image-text methods** (CLIP) set ``multimodal``: the loop tokenises the dataset's captions
  once with :meth:`Method.tokenize`, hands each batch its captions' tokens as ``Batch.texts``,
  and scores image-text metrics (MMVP-style pairs, zero-shot, caption retrieval) with
  :meth:`Method.embed_texts`.
- **Initial weights.** ``stages_share_initial_weights``: every MCL stage starts from the same
  weights (CLIP tuning; also forced by ``mcl.integration: soup``), not a fresh seed per stage.
  ``weight_file_keys`` names the method's own weight-file keys (besides ``model.pretrained``),
  which a resumed stage does not read again.
- **MCL** is not a method: it wraps a base method and supplies ``Batch.pseudo_labels``. A
  method that sets ``accepts_negative_mask`` restricts its negatives to samples with the same
  pseudo label (``mcl.negatives: mask``); any method can be MCL's base with ``sampler``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from torch import Tensor, nn

from raycl.config.section import Section
from raycl.distributed import gather_no_grad
from raycl.losses import same_label_mask
from raycl.models import build_backbone, projection_mlp, resolve_stem

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig


@dataclass
class Batch:
    """One training batch, already on the training device.

    Attributes:
        images: clean images, normalised float (B, C, H, W).
        views: augmented views, each like ``images``.
        index: int64 (B,) dataset indices of the samples.
        pseudo_labels: int64 (B,) MCL group codes, or None; when given, an anchor's negatives
            are restricted to samples with the same code.
        texts: int64 (B, L) tokens of each image's caption (multimodal methods), or None.
    """

    images: Tensor
    views: list[Tensor]
    index: Tensor
    pseudo_labels: Tensor | None = None
    texts: Tensor | None = None

    def negative_mask(self) -> Tensor | None:
        """MCL's (B_local, B_global) mask of allowed negatives (same pseudo label), or None.

        Collective under DDP (it gathers the labels): every rank must call it.
        """
        if self.pseudo_labels is None:
            return None
        return same_label_mask(self.pseudo_labels, gather_no_grad(self.pseudo_labels))


@dataclass(frozen=True)
class Phase:
    """One training phase of a method.

    Attributes:
        name: what :meth:`Method.set_phase` is called with; the last phase is ``"train"``.
        epochs: epochs of the phase (None: ``train.epochs``).
        optimizer: the phase's optimizer (None: ``train.optimizer``).
        lr: a constant learning rate for the phase (None: ``train.lr`` with the warmup-cosine
            schedule over the phase's own steps).
        augment: whether the phase's batches need augmented views (False: ``Batch.views`` is
            empty and only the clean images are prepared).
        evaluate: whether the phase's epochs are evaluated (a phase that leaves the encoder
            unchanged need not be).
    """

    name: str
    epochs: int | None = None
    optimizer: Literal["adamw", "sgd", "lars"] | None = None
    lr: float | None = None
    augment: bool = True
    evaluate: bool = True

    def epoch_count(self, train_epochs: int) -> int:
        """The phase's epochs, given ``train.epochs``."""
        return train_epochs if self.epochs is None else self.epochs


TRAIN_PHASE = Phase("train")


class Method(nn.Module):
    """Base class of all self-supervised methods; see the module docstring for the hooks.

    Subclasses set ``self.backbone`` (the encoder used for evaluation) and implement
    :meth:`forward` and :meth:`from_config`.

    Args:
        section: the method's knobs, an instance of its config section (``cfg.section(...)``);
            None: the section's defaults, with ``knobs`` overriding them.
        knobs: keyword overrides of the section's fields, validated by the section (a bad value
            raises pydantic's ``ValidationError``, a ``ValueError``); only without ``section``.

    Raises:
        TypeError: for ``section`` and ``knobs`` together, a section of another type, or knobs
            for a method without a section.
    """

    backbone: nn.Module
    # The config section of the method's knobs; set by @register(name, section=...).
    section_type: ClassVar[type[Section] | None] = None
    section: Section | None
    # True when forward honours Batch.negative_mask() (MCL's ``negatives: mask``).
    accepts_negative_mask: ClassVar[bool] = False
    # True for image-text methods: Batch.texts, tokenize and embed_texts.
    multimodal: ClassVar[bool] = False
    # True when the trained encoder is convolutional: LARS applies ("only for CNNs", All4One
    # §4.1; transformers train with AdamW), checked before launch.
    convolutional: ClassVar[bool] = True
    # True when every MCL stage starts from the same initial weights.
    stages_share_initial_weights: ClassVar[bool] = False
    # Config keys of weight files the method reads (a resumed stage does not read them again).
    weight_file_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, section: Section | None = None, **knobs: Any) -> None:
        super().__init__()
        name, expected = type(self).__name__, type(self).section_type
        if section is None:
            if expected is None and knobs:
                raise TypeError(f"{name} has no config section for {sorted(knobs)}")
            section = None if expected is None else expected(**knobs)  # validated
        elif knobs:
            raise TypeError(f"{name}: give a section or knobs, not both")
        elif type(section) is not expected:
            raise TypeError(f"{name} reads a {getattr(expected, '__name__', 'no section')}, "
                            f"got a {type(section).__name__}")
        self.section = section

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

    def tokenize(self, texts: Sequence[str]) -> Tensor:
        """Tokens of each caption (multimodal methods only).

        Args:
            texts: N captions.
        Returns:
            int64 (N, L) tokens, on the CPU.
        """
        raise NotImplementedError(f"{type(self).__name__} is not an image-text method")

    @classmethod
    def caption_tokenizer(cls, cfg: CoreConfig) -> Any:
        """A picklable callable, list of N captions -> int64 numpy (N, L), giving
        :meth:`tokenize`'s tokens without the model, that stream mode's decoders run on each
        chunk of captions (multimodal methods); None: the training process tokenises each
        streamed batch with :meth:`tokenize`."""
        return None

    def embed_texts(self, tokens: Tensor) -> Tensor:
        """L2-normalised text embeddings in the image embedding's space (multimodal methods).

        Args:
            tokens: int64 (B, L) from :meth:`tokenize`, on the method's device.
        Returns:
            (B, D) embeddings.
        """
        raise NotImplementedError(f"{type(self).__name__} is not an image-text method")

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

    @classmethod
    def phases(cls, cfg: CoreConfig) -> list[Phase]:
        """The training phases for ``cfg``, run in order; the last is ``"train"`` with
        ``train.epochs``. A single ``"train"`` phase by default."""
        return [TRAIN_PHASE]

    def set_phase(self, name: str) -> None:
        """Switches to phase ``name`` (e.g. freezing or unfreezing modules). Called by the loop
        before a phase's optimizer is built, also when a trial resumes inside it.

        Args:
            name: the name of one of :meth:`phases`.

        Raises:
            ValueError: if ``name`` is not a phase of this method.
        """
        if name != TRAIN_PHASE.name:
            raise ValueError(f"unknown phase {name!r}; this method has the single phase 'train'")

    def diagnostic_arrays(self, batch: Batch) -> dict[str, np.ndarray]:
        """Arrays for the end-of-trial pictures (none by default), called in eval mode. Keys
        are prefixed with the method's name; they travel in the checkpoint.

        Args:
            batch: a few test images with two augmented views each (index = position).
        """
        return {}

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


@dataclass
class Encoder:
    """The backbone a method starts from and its projector's widths, from ``model:``.

    Attributes:
        backbone: encoder mapping (B, C, H, W) -> (B, feature_dim).
        feature_dim: output width of ``backbone``.
        projector_hidden_dim: hidden width of the projector (``model.projector_hidden_dim``).
        projector_dim: output width D of the projector (``model.projector_dim``): the embedding
            the loss acts on.
    """

    backbone: nn.Module
    feature_dim: int
    projector_hidden_dim: int
    projector_dim: int

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> Encoder:
        """``model.backbone`` at ``model.width`` with ``model.stem`` (``auto`` resolved at
        ``data.resolution``), starting from ``model.pretrained`` when it is set, and the
        projector's widths."""
        model = cfg.model
        backbone, feature_dim = build_backbone(
            model.backbone, in_channels, model.width,
            stem=resolve_stem(model.stem, cfg.data.resolution), pretrained=model.pretrained,
            timm_kwargs=model.timm_kwargs)
        return cls(backbone, feature_dim, model.projector_hidden_dim, model.projector_dim)


class EncoderMethod(Method):
    """A method with a backbone and a projector (every method but FGVR and CLIP).

    Args:
        encoder: the backbone and the projector's widths (:meth:`Encoder.from_config`).
        section, knobs: the method's knobs (see :class:`Method`).
    """

    def __init__(self, encoder: Encoder, section: Section | None = None, **knobs: Any) -> None:
        super().__init__(section, **knobs)
        self.backbone = encoder.backbone
        self.feature_dim = encoder.feature_dim
        self.projector = projection_mlp(encoder.feature_dim, encoder.projector_hidden_dim,
                                        encoder.projector_dim, **self.projector_layout())

    def projector_layout(self) -> dict[str, Any]:
        """:func:`~raycl.models.projection_mlp` options of the projector (``num_layers``,
        ``batch_norm``, ``last_bn``); by default 2 layers, BatchNorm after the hidden one. Called
        once ``self.section`` is set."""
        return {}

    def project(self, images: Tensor) -> Tensor:
        """The projection the loss acts on (online branch, unnormalised)."""
        return self.projector(self.backbone(images))

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> Method:
        if cls.section_type is None:
            raise TypeError(f"{cls.__name__} is registered without a config section")
        return cls(Encoder.from_config(cfg, in_channels), cfg.section(cls.section_type))
