"""CLIP tuning (Radford et al., 2021) on open_clip models: MCL's multimodal base method.

As in MCL's CLIP setting (paper §5.4, the authors' open_clip code): every stage starts from the
same initial weights, the text tower is frozen, and only the last ``clip.trainable_blocks``
blocks of the image transformer (with its final norm and projection) and the logit scale are
trained, by the symmetric image-text InfoNCE loss. Under MCL (``method: mcl``,
``mcl.base: clip``) each image's negatives are restricted to captions (and images) with its
pseudo label, from k-means on the image embeddings of the stages before.

Nothing is downloaded: the model is random (``clip.pretrained: null``) or starts from a local
checkpoint file; only models whose tokenizer ships with open_clip (its BPE vocabulary) and whose
image tower is a ViT are accepted, checked before launch. ``clip.model: tiny`` is a 4-block ViT
and a 2-layer text transformer for CPU runs and tests; any open_clip ViT config (``ViT-B-32``,
``ViT-L-14``) is the GPU-scale choice. ``clip.train_text: true`` unfreezes the text tower and
every image block: plain CLIP pre-training, e.g. to make the initial checkpoint of a CPU-scale
experiment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from raycl.config.schema import Section
from raycl.data.stream.decoders import CaptionTokenizer
from raycl.distributed import gather_with_grad, rank
from raycl.losses.common import full_precision
from raycl.methods.base import Batch, Method
from raycl.methods.registry import register

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig

# open_clip's preprocessing statistics (OPENAI_DATASET_MEAN / STD), applied inside the method.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# open_clip's training script clamps the logit scale at 100 (temperature 0.01).
MAX_LOGIT_SCALE = 100.0


class CLIPConfig(Section):
    """Knobs of ``method: clip`` (MCL's multimodal base: ``mcl.base: clip``)."""

    model: str = Field(
        "tiny", description="open_clip model config with a ViT image tower and open_clip's own "
        "tokenizer (ViT-B-32, ViT-L-14, ...; the image size follows data.resolution), or 'tiny' "
        "(tiny_* below) for CPU runs."
    )
    pretrained: str | None = Field(
        None, description="Local checkpoint file every stage starts from (never downloaded): "
        "an open_clip/OpenAI CLIP state dict (torch.save, 'state_dict' or TorchScript archives "
        "too) or a raycl state.pt of a clip run. None: random initialisation (seeded, the same "
        "for every stage). A hub tag such as 'openai' is rejected: download it elsewhere and "
        "give the file."
    )
    trainable_blocks: int = Field(
        6, ge=0, description="Last image transformer blocks trained (with the final norm, the "
        "projection and the logit scale); the rest is frozen. Paper 6, its appendix found 4 "
        "better. (The authors' code counts open_clip lock groups: its 6 groups are 5 blocks.) "
        "Capped at the tower's depth, where the whole image tower trains."
    )
    train_text: bool = Field(
        False, description="Also train the text tower and every image block (plain CLIP "
        "training, e.g. to make an initial checkpoint); MCL's setting keeps it false."
    )
    init_logit_scale: float | None = Field(
        None, gt=0.0, le=MAX_LOGIT_SCALE, description="Initial logit scale 1/τ. None: the "
        "checkpoint's value, or 1/0.07 for a random model.", json_schema_extra={"symbol": "1/τ"}
    )
    learn_logit_scale: bool = Field(True, description="Train the logit scale (clamped at 100).")
    tiny_width: int = Field(64, ge=8, description="tiny: width of both towers.")
    tiny_layers: int = Field(4, ge=1, description="tiny: image transformer blocks.")
    tiny_text_layers: int = Field(2, ge=1, description="tiny: text transformer blocks.")
    tiny_patch_size: int = Field(4, ge=1, description="tiny: image patch side in pixels.")
    tiny_embed_dim: int = Field(64, ge=4, description="tiny: joint embedding dimension.")
    tiny_context_length: int = Field(24, ge=8, description="tiny: tokens per caption.")


@full_precision
def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    negative_mask: Tensor | None = None,
) -> Tensor:
    """Symmetric image-text InfoNCE over the global batch.

    Each rank scores its own rows against every rank's columns (gathered with gradients), as
    open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``. The logits (up to
    100 x a cosine) and their softmax are float32: autocast is off inside, so the casts hold.

    Args:
        image_features: (B_local, D) L2-normalised image embeddings.
        text_features: (B_local, D) L2-normalised embeddings of the matching captions.
        logit_scale: scalar 1/τ (already exponentiated).
        negative_mask: optional bool (B_local, B_global), True where a pair may serve as a
            negative (MCL: same pseudo label); the positive must be True.

    Returns:
        Scalar loss, the mean of the image->text and text->image cross-entropies.

    Example:
        >>> x = F.normalize(torch.eye(3), dim=1)
        >>> float(clip_loss(x, x, torch.tensor(100.0))) < 1e-3
        True
    """
    if image_features.shape != text_features.shape or image_features.dim() != 2:
        raise ValueError(f"image and text features must both be (B, D), got "
                         f"{tuple(image_features.shape)} and {tuple(text_features.shape)}")
    local = image_features.shape[0]
    all_images = gather_with_grad(image_features)
    all_texts = gather_with_grad(text_features)
    targets = torch.arange(local, device=image_features.device) + rank() * local
    image_to_text = logit_scale * image_features.float() @ all_texts.float().T
    text_to_image = logit_scale * text_features.float() @ all_images.float().T
    if negative_mask is not None:
        if negative_mask.shape != image_to_text.shape:
            raise ValueError(f"negative_mask must be {tuple(image_to_text.shape)}, got "
                             f"{tuple(negative_mask.shape)}")
        image_to_text = image_to_text.masked_fill(~negative_mask, float("-inf"))
        text_to_image = text_to_image.masked_fill(~negative_mask, float("-inf"))
    return (F.cross_entropy(image_to_text, targets) + F.cross_entropy(text_to_image, targets)) / 2


# ---------------------------------------------------------------------------------------------
# Building open_clip models without a network


def tiny_model_config(section: CLIPConfig, resolution: int) -> dict[str, Any]:
    """The open_clip model config (``open_clip.CLIP(**config)``, or a model config JSON) of
    ``clip.model: tiny`` at ``resolution``."""
    width = section.tiny_width
    heads = max(1, width // 32)
    return {
        "embed_dim": section.tiny_embed_dim,
        "vision_cfg": {"layers": section.tiny_layers, "width": width,
                       "head_width": width // heads, "mlp_ratio": 2.0,
                       "patch_size": section.tiny_patch_size, "image_size": resolution},
        "text_cfg": {"context_length": section.tiny_context_length, "vocab_size": 49408,
                     "width": width, "heads": heads, "layers": section.tiny_text_layers,
                     "mlp_ratio": 2.0},
    }


def _tiny_model(section: CLIPConfig, resolution: int) -> nn.Module:
    import open_clip

    return open_clip.CLIP(**tiny_model_config(section, resolution))


def model_problem(name: str) -> str | None:
    """Why the open_clip config ``name`` cannot be used offline by raycl, or None."""
    if name == "tiny":
        return None
    import open_clip

    config = open_clip.get_model_config(name)
    if config is None:
        known = ", ".join(model for model in open_clip.list_models() if model.startswith("ViT"))
        return f"unknown open_clip model {name!r} (ViT configs: {known[:300]}...)"
    vision, text = config.get("vision_cfg", {}), config.get("text_cfg", {})
    if text.get("hf_tokenizer_name") or text.get("hf_model_name"):
        return (f"{name} needs a Hugging Face tokenizer/text model, which would be downloaded; "
                f"choose a model with open_clip's bundled tokenizer (ViT-B-32, ViT-L-14, ...)")
    if vision.get("timm_model_name") or not isinstance(vision.get("layers"), int) \
            or not vision.get("patch_size"):
        return f"{name} has no open_clip ViT image tower (raycl trains the last ViT blocks)"
    return None


def build_open_clip(section: CLIPConfig, resolution: int) -> nn.Module:
    """The open_clip model ``section.model`` at ``resolution``, randomly initialised."""
    problem = model_problem(section.model)
    if problem:
        raise ValueError(f"clip.model: {problem}")
    if section.model == "tiny":
        return _tiny_model(section, resolution)
    import copy

    import open_clip

    # Built from the config directly (not create_model, which moves the model to a device), so
    # the same code builds it on the "meta" device for the checks before launch.
    config = copy.deepcopy(open_clip.get_model_config(section.model))
    config["vision_cfg"]["image_size"] = resolution
    cls = open_clip.CustomTextCLIP if config.pop("custom_text", False) else open_clip.CLIP
    return cls(**config)


def read_clip_state(path: str | Path) -> dict[str, Tensor]:
    """The CLIP state dict in a local file: a plain or ``{"state_dict": ...}`` dict (open_clip
    training checkpoints, ``module.`` prefixes dropped), a raycl ``state.pt`` of a clip run
    (its ``clip.*`` weights), or an OpenAI TorchScript archive."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"not a file: {path}")
    try:
        # weights_only: a file a user points at must not run code; mmap: no full read.
        state: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as load_error:
        try:  # OpenAI's original checkpoints are TorchScript archives
            state = torch.jit.load(str(path), map_location="cpu").state_dict()
        except Exception:
            raise ValueError(f"cannot read {path}: {type(load_error).__name__}: "
                             f"{str(load_error).splitlines()[0][:200]}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")
    if isinstance(state.get("model"), dict):  # raycl checkpoint
        state = {key.removeprefix("clip."): value for key, value in state["model"].items()
                 if key.startswith("clip.")}
    elif isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    return {key.removeprefix("module."): value for key, value in state.items()
            if isinstance(value, Tensor)}


def _mismatch(model: nn.Module, state: dict[str, Tensor]) -> str | None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        return (f"keys do not match the model: missing {missing[:3]}"
                f"{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
                f"{'...' if len(unexpected) > 3 else ''}")
    for key, value in expected.items():
        # The positional embedding is interpolated when the resolution differs.
        if key != "visual.positional_embedding" and tuple(state[key].shape) != tuple(value.shape):
            return (f"{key} has shape {tuple(state[key].shape)}, the model needs "
                    f"{tuple(value.shape)} (another model config?)")
    return None


def load_clip_weights(model: nn.Module, path: str | Path) -> None:
    """Loads the checkpoint at ``path`` into ``model`` (strict; the image positional embedding
    is interpolated to the model's resolution)."""
    import open_clip

    state = dict(read_clip_state(path))
    problem = _mismatch(model, state)
    if problem:
        raise ValueError(f"{path}: {problem}")
    open_clip.model.resize_pos_embed(state, model)  # in place; no-op at the same grid
    model.load_state_dict(state, strict=True)


# ---------------------------------------------------------------------------------------------
# The method


@register("clip", section=CLIPConfig)
class CLIP(Method):
    """An open_clip model tuned with image-text InfoNCE, the text tower frozen.

    Args:
        model: an open_clip ``CLIP`` with a ViT image tower.
        tokenizer: open_clip tokenizer (callable: list of str -> (N, L) int64).
        section, knobs: the knobs (:class:`CLIPConfig`; see :class:`Method`): which blocks
            train (``trainable_blocks``, ``train_text``) and whether the logit scale does. The
            model is built and loaded from it by :meth:`from_config`.
    """

    accepts_negative_mask = True
    multimodal = True
    convolutional = False  # both towers are transformers: no LARS
    stages_share_initial_weights = True
    weight_file_keys: ClassVar[tuple[str, ...]] = ("clip.pretrained",)
    section: CLIPConfig

    def __init__(self, model: nn.Module, tokenizer: Any, section: CLIPConfig | None = None,
                 **knobs: Any) -> None:
        super().__init__(section, **knobs)
        self.clip = model
        self.tokenizer = tokenizer
        self.register_buffer("pixel_mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1),
                             persistent=False)
        self.register_buffer("pixel_std", torch.tensor(CLIP_STD).view(1, 3, 1, 1),
                             persistent=False)
        visual = model.visual
        blocks = visual.transformer.resblocks
        # Capped at the tower's depth, where the whole image tower trains.
        self.trainable_blocks = min(self.section.trainable_blocks, len(blocks))
        train_text = self.section.train_text
        for param in model.parameters():
            param.requires_grad_(False)
        trainable: list[nn.Module] = [*blocks[len(blocks) - self.trainable_blocks:],
                                      visual.ln_post]
        if train_text or self.trainable_blocks == len(blocks):
            trainable.append(visual)
        if train_text:
            trainable.extend(module for name, module in model.named_children()
                             if name != "visual")
        for module in trainable:
            module.requires_grad_(True)
        for _, param in model.named_parameters(recurse=False):  # text_projection, ...
            param.requires_grad_(train_text)
        if isinstance(visual.proj, nn.Parameter):
            visual.proj.requires_grad_(True)
        model.logit_scale.requires_grad_(self.section.learn_logit_scale)

    @property
    def backbone(self) -> nn.Module:  # type: ignore[override]
        return self.clip.visual

    @classmethod
    def from_config(cls, cfg: CoreConfig, in_channels: int) -> CLIP:
        section = cfg.section(CLIPConfig)
        if in_channels != 3:
            raise ValueError(f"clip needs RGB images, the data has {in_channels} channel(s)")
        model = build_open_clip(section, cfg.data.resolution)
        if section.pretrained:
            load_clip_weights(model, section.pretrained)
        if section.init_logit_scale is not None:
            with torch.no_grad():
                model.logit_scale.fill_(math.log(section.init_logit_scale))
        return cls(model, _tokenizer(section, model), section)

    def _pixels(self, images: Tensor) -> Tensor:
        # The loop's images are (x - 0.5) / 0.5; CLIP expects its own statistics.
        return (images * 0.5 + 0.5 - self.pixel_mean) / self.pixel_std

    def embed(self, images: Tensor) -> Tensor:
        """L2-normalised image embeddings (what k-means, probes and image-text metrics use)."""
        return F.normalize(self.clip.encode_image(self._pixels(images)), dim=-1)

    def tokenize(self, texts: Sequence[str]) -> Tensor:
        return self.tokenizer(list(texts)).long()

    @classmethod
    def caption_tokenizer(cls, cfg: CoreConfig) -> CaptionTokenizer:
        """:meth:`tokenize`'s tokenizer for stream mode's decoders (open_clip's bundled BPE at
        the text tower's context length, known from the config without building the model)."""
        return CaptionTokenizer(context_length(cfg.section(CLIPConfig)))

    def embed_texts(self, tokens: Tensor) -> Tensor:
        return F.normalize(self.clip.encode_text(tokens), dim=-1)

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        if batch.texts is None:
            raise ValueError("clip needs Batch.texts (tokenised captions)")
        images = batch.views[0] if batch.views else batch.images
        image_features = self.embed(images)
        with torch.set_grad_enabled(self.section.train_text and torch.is_grad_enabled()):
            text_features = self.embed_texts(batch.texts)
        scale = self.clip.logit_scale.exp()
        loss = clip_loss(image_features, text_features, scale, batch.negative_mask())
        return {"loss": loss, "logit_scale": scale.detach()}

    def on_train_step_end(self, step: int, total_steps: int) -> None:
        with torch.no_grad():
            self.clip.logit_scale.clamp_(0.0, math.log(MAX_LOGIT_SCALE))

    @classmethod
    def config_problems(cls, cfg: CoreConfig) -> list[tuple[str, str]]:
        section = cfg.section(CLIPConfig)
        problem = model_problem(section.model)
        if problem:
            return [("clip.model", problem)]
        problems: list[tuple[str, str]] = []
        data = cfg.data
        if data.dataset not in ("trifeature", "pairs", "webdataset", "parquet"):
            problems.append(("data.dataset", f"clip needs image-text pairs: trifeature with "
                             f"data.captions, pairs (a CSV of image, caption), or webdataset / "
                             f"parquet shards with captions; got {data.dataset}"))
        elif data.dataset == "trifeature" and not getattr(data, "captions", None):
            problems.append(("data.captions", "clip needs captions: set data.captions, e.g. "
                             "{color: 1.0, shape: 0.5, texture: 0.2}"))
        with torch.device("meta"):  # shapes only: no memory, no time
            model = build_open_clip(section, data.resolution)
        patch = model.visual.patch_size[0]
        if data.resolution % patch:
            problems.append(("data.resolution", f"{data.resolution} is not a multiple of the "
                             f"{section.model} patch size {patch}"))
        if section.pretrained:
            try:
                problem = _mismatch(model, read_clip_state(section.pretrained))
            except ValueError as exc:
                problem = str(exc)
            if problem and not Path(section.pretrained).exists():
                problem = _missing_weights(section)
            if problem:
                problems.append(("clip.pretrained", problem))
        return problems


def context_length(section: CLIPConfig) -> int:
    """Tokens per caption of ``section.model``'s text tower (open_clip's default 77 where its
    config names none): what ``model.context_length`` is once built."""
    if section.model == "tiny":
        return section.tiny_context_length
    import open_clip

    config = open_clip.get_model_config(section.model) or {}
    return int(config.get("text_cfg", {}).get("context_length", 77))


def _tokenizer(section: CLIPConfig, model: nn.Module) -> Any:
    from open_clip.tokenizer import SimpleTokenizer

    # open_clip's bundled BPE vocabulary: no download (model_problem rejects HF tokenizers).
    return SimpleTokenizer(context_length=model.context_length)


def _missing_weights(section: CLIPConfig) -> str:
    import open_clip

    value = str(section.pretrained)
    tags = open_clip.list_pretrained_tags_by_model(section.model) if section.model != "tiny" \
        else []
    if value in tags or value in open_clip.list_pretrained_tags_by_model("ViT-B-32") \
            or ("/" not in value and "." not in value):
        return (f"{value!r} is not a local file but looks like a hub tag, and raycl never "
                f"downloads: fetch the weights elsewhere (open_clip.create_model(MODEL, "
                f"pretrained=TAG), then torch.save(model.state_dict(), FILE)) and give the "
                f"file's path")
    return f"file not found: {section.pretrained}"
