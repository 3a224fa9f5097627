"""Export formats of a trained encoder, each loadable without raycl, and reading them back.

- ``torchvision``: the ResNet backbone's state dict, loading with ``strict=True`` into
  ``torchvision.models.resnet18/50()`` with ``fc = Identity()`` (CIFAR stem: ``conv1 =
  Conv2d(C, 64, 3, 1, 1, bias=False)``, ``maxpool = Identity()``);
- ``timm``: the same state dict: timm's ResNet names its modules exactly as torchvision's
  (``conv1``, ``bn1``, ``layer1..4``, ``downsample.0/1``, ``fc``), so the keys need no mapping;
  it loads strictly into ``timm.create_model("resnet18", num_classes=0)`` (same stem changes);
- ``safetensors``: the same tensors (a ResNet's torchvision keys, small_cnn's own, a CLIP
  trial's open_clip model) in safetensors format;
- ``small_cnn``: raycl's small CNN as a ``torch.export`` program (``.pt2``), which plain torch
  loads with ``torch.export.load(FILE).module()`` (any batch size, the trained resolution);
- ``open_clip``: a CLIP trial's whole open_clip model state dict, for
  ``open_clip.create_model(name, pretrained=FILE)``; the model config is written beside it
  (``<stem>-open_clip.json``, registered with ``open_clip.add_model_config``).

MCL concat (:class:`~raycl.export.encoder.StageConcat`): ``small_cnn`` writes the whole
integrating module (every stage, L2 norms and concatenation) as one ``torch.export`` program;
``torchvision`` / ``timm`` / ``safetensors`` write one file holding every stage's backbone, its
keys prefixed ``stage<j>.`` (the model card's ``how_to_load`` builds the N networks and the
concatenation); ``open_clip`` holds one model and does not fit. A format that does not fit the
encoder is a one-line ValueError. A ``timm/<name>`` backbone: ``timm`` / ``safetensors``
(:mod:`raycl.export.timm_format`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raycl.export.model_card import build_model_card, read_model_card, write_model_card
from raycl.export.modules import (
    STAGE_PREFIX,
    MethodEmbedding,
    Preprocessing,
    StageConcat,
    base_method_name,
    concat_trial,
    dataset_resize,
    raycl_preprocessing,
    read_config,
    split_stages,
)
from raycl.export.plain_torch import (
    export_program,
    plain_module,
    resnet_lines,
    small_cnn_architecture,
    small_cnn_lines,
)
from raycl.export.timm_format import timm_card, timm_how_to_load, timm_lines

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig

FORMATS: tuple[str, ...] = ("torchvision", "timm", "safetensors", "small_cnn", "open_clip")
RESNETS: tuple[str, ...] = ("resnet18", "resnet50")
# Which formats fit which kind of encoder.
_FITTING: dict[str, tuple[str, ...]] = {
    "resnet": ("torchvision", "timm", "safetensors"),
    "small_cnn": ("small_cnn", "safetensors"),
    "clip": ("open_clip", "safetensors"),
    "timm": ("timm", "safetensors"),  # a timm/<name> backbone is timm's model as it is
}


@dataclass(frozen=True)
class EncoderKind:
    """What kind of encoder a trial trained, as the formats see it.

    Attributes:
        kind: "resnet", "small_cnn", "clip" or "timm".
        backbone: ``model.backbone`` (resnet18, resnet50, small_cnn, timm/<name>) or the
            open_clip model.
        stem: "cifar" or "imagenet" for a ResNet, else None.
    """

    kind: str
    backbone: str
    stem: str | None


def encoder_kind(config: CoreConfig) -> EncoderKind:
    """The kind of encoder the trial of ``config`` trains."""
    from raycl.models import resolve_stem
    from raycl.models.timm_backbones import is_timm

    if base_method_name(config) == "clip":
        return EncoderKind("clip", str(config.clip.model), None)  # type: ignore[attr-defined]
    backbone = config.model.backbone
    if is_timm(backbone):
        return EncoderKind("timm", backbone, None)
    if backbone in RESNETS:
        return EncoderKind("resnet", backbone,
                           resolve_stem(config.model.stem, config.data.resolution))
    return EncoderKind("small_cnn", backbone, None)


def format_problem(config: CoreConfig, export_format: str) -> str | None:
    """Why ``export_format`` cannot hold the trial's encoder (one line), None when it can.

    Args:
        config: the trial's config.
        export_format: one of :data:`FORMATS`.

    Returns:
        The problem, or None.
    """
    if export_format not in FORMATS:
        return f"unknown format {export_format!r}; formats: {', '.join(FORMATS)}"
    kind = encoder_kind(config)
    fitting = _FITTING[kind.kind]
    if concat_trial(config):  # one file of N stages: no open_clip model holds that
        fitting = tuple(name for name in fitting if name != "open_clip")
    if export_format in fitting:
        return None
    what = ("a CLIP trial (an open_clip ViT)" if kind.kind == "clip"
            else f"a {kind.backbone} trial")
    if concat_trial(config) and export_format == "open_clip":
        what = f"an MCL concat trial ({config.num_stages} open_clip models)"
    return (f"--format {export_format} does not fit {what}; use "
            f"{' or '.join(fitting)}")


def check_format(config: CoreConfig, export_format: str) -> None:
    """Raises the one-line ValueError of :func:`format_problem`, if any."""
    problem = format_problem(config, export_format)
    if problem:
        raise ValueError(problem)


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s state dict as contiguous CPU tensors that share no storage."""
    return {key: value.detach().cpu().contiguous().clone()
            for key, value in module.state_dict().items()}


def _save_state(state: Mapping[str, Tensor], path: Path, export_format: str) -> None:
    if export_format == "safetensors":
        from safetensors.torch import save_file

        save_file(dict(state), str(path))
    else:
        torch.save(dict(state), path)


def _save_program(module: nn.Module, path: Path, example: Tensor) -> None:
    """``module`` (eval mode) as a torch.export program with a dynamic batch dimension."""
    torch.export.save(export_program(module, example), path)


def _clip_model(encoder: nn.Module) -> nn.Module:
    """The open_clip model inside a CLIP trial's encoder."""
    if not isinstance(encoder, MethodEmbedding) or not hasattr(encoder.method, "clip"):
        raise ValueError("the open_clip format needs a CLIP trial's encoder")
    return encoder.method.clip


def open_clip_config(config: CoreConfig) -> dict[str, Any]:
    """The open_clip model config of a CLIP trial (its image size the trial's resolution)."""
    import copy

    section = config.clip  # type: ignore[attr-defined]
    if section.model == "tiny":
        from raycl.methods.clip import tiny_model_config

        return tiny_model_config(section, config.data.resolution)
    import open_clip

    model_config = copy.deepcopy(open_clip.get_model_config(section.model))
    model_config["vision_cfg"]["image_size"] = config.data.resolution
    return model_config


def _weights_module(encoder: nn.Module, config: CoreConfig) -> nn.Module:
    """The module whose state dict a state-dict format holds: the backbone, or a CLIP trial's
    open_clip model."""
    return _clip_model(encoder) if encoder_kind(config).kind == "clip" else encoder


def concat_state(encoder: StageConcat, config: CoreConfig) -> dict[str, Tensor]:
    """Every stage's tensors in one state dict, stage j's keys prefixed ``stage<j>.``.

    Args:
        encoder: the trial's :class:`~raycl.export.encoder.StageConcat`.
        config: the trial's config.

    Returns:
        The state dict (contiguous CPU tensors sharing no storage).
    """
    return {STAGE_PREFIX.format(j) + key: value
            for j, stage in enumerate(encoder.stages)
            for key, value in _tensors(_weights_module(stage, config)).items()}


def _write_one(encoder: nn.Module, config: CoreConfig, export_format: str, out: Path,
               example: Tensor) -> list[Path]:
    """The (single-stage, or soup) encoder in ``export_format`` at ``out``."""
    kind = encoder_kind(config)
    if kind.kind == "clip":
        model = _clip_model(encoder)
        _save_state(_tensors(model), out, export_format)
        if export_format == "safetensors":
            return [out]
        model_config = out.with_name(f"{out.stem}-open_clip.json")
        model_config.write_text(json.dumps(open_clip_config(config), indent=2) + "\n")
        return [out, model_config]
    if export_format == "small_cnn":
        _save_program(encoder, out, example)
    else:  # torchvision / timm / safetensors: the backbone's own keys
        _save_state(_tensors(encoder), out, export_format)
    return [out]


def planned_files(config: CoreConfig, export_format: str, out: Path) -> list[Path]:
    """The files :func:`write_encoder` writes for a trial's encoder from
    :func:`~raycl.export.encoder.trained_encoder`, model card last: what a caller checks for
    existing files before writing anything (an MCL concat: one file too).

    Args:
        config: the trial's config.
        export_format: one of :data:`FORMATS` (fitting the trial: :func:`format_problem`).
        out: the output file.

    Returns:
        The paths.
    """
    from raycl.export.model_card import card_path

    out = Path(out)
    files = [out]
    if encoder_kind(config).kind == "clip" and export_format == "open_clip":
        files.append(out.with_name(f"{out.stem}-open_clip.json"))
    return [*files, card_path(out)]


def write_encoder(
    encoder: nn.Module,
    config: CoreConfig,
    export_format: str,
    out: Path,
    channels: int,
    objective: dict[str, Any] | None = None,
    test_scores: dict[str, float] | None = None,
) -> list[Path]:
    """Writes ``encoder`` (from :func:`~raycl.export.encoder.trained_encoder`, or a
    :class:`~raycl.export.encoder.StageConcat`) in ``export_format`` at ``out``, and its model
    card beside it.

    Args:
        encoder: the trial's encoder (CPU, eval mode).
        config: the trial's config.
        export_format: one of :data:`FORMATS`.
        out: the output file (its directory must exist).
        channels: image channels of the trial's data.
        objective: the trial's validation objective ``{"metric", "mode", "value"}``.
        test_scores: its test metrics.

    Returns:
        Every file written, the main file first and the model card last.

    Raises:
        ValueError: the format does not fit the encoder.
    """
    check_format(config, export_format)
    out = Path(out)
    encoder = encoder.cpu().eval()
    preprocessing = export_preprocessing(config, channels, export_format)
    example = torch.zeros(2, channels, config.data.resolution, config.data.resolution)
    stages = len(encoder.stages) if isinstance(encoder, StageConcat) else 1
    concat = isinstance(encoder, StageConcat)
    if isinstance(encoder, StageConcat) and export_format == "small_cnn":
        _save_program(encoder, out, example)  # the whole integration, as one program
        files = [out]
    elif isinstance(encoder, StageConcat):
        _save_state(concat_state(encoder, config), out, export_format)
        files = [out]
    else:
        files = _write_one(encoder, config, export_format, out, example)
    kind = encoder_kind(config)
    method = config.method if config.method != "mcl" else f"mcl({base_method_name(config)})"
    card = build_model_card(
        method=method, config=config.to_dict(), export_format=export_format,
        files=[path.name for path in files], preprocessing=preprocessing.to_dict(),
        backbone=kind.backbone, stem=kind.stem,
        how_to_load=how_to_load(config, export_format, out.name, channels, concat=concat,
                                stages=stages),
        objective=objective, test_scores=test_scores,
        extra={"concat": concat,
               "stages": stages,
               "mcl": ({"stages": config.num_stages, "integration": config.mcl.integration}
                       if config.num_stages > 1 else None),
               "width": config.model.width if kind.kind == "small_cnn" else None,
               "timm": (timm_card(config, channels, preprocessing)
                        if kind.kind == "timm" else None),
               # issue 47: how to rebuild the network the weights load into, without raycl
               "architecture": (small_cnn_architecture(channels, config.model.width)
                                if kind.kind == "small_cnn" else None)})
    return [*files, write_model_card(out, card)]


def export_preprocessing(config: CoreConfig, channels: int, export_format: str) -> Preprocessing:
    """The preprocessing the exported file expects: raycl's (mean 0.5, std 0.5), except for a
    CLIP trial's open_clip model, which takes open_clip's own statistics."""
    if encoder_kind(config).kind == "clip":
        from raycl.methods.clip import CLIP_MEAN, CLIP_STD

        return Preprocessing(resolution=config.data.resolution, channels=3, mean=CLIP_MEAN,
                             std=CLIP_STD, crop=dataset_resize(config.data.dataset))
    return raycl_preprocessing(config, channels)


def how_to_load(config: CoreConfig, export_format: str, file: str, channels: int,
                concat: bool = False, stages: int | None = None) -> str:
    """The Python lines that load the exported ``file`` without raycl (for the model card);
    ``concat``: an MCL concat export of ``stages`` stages (by default the trial's count)."""
    kind = encoder_kind(config)
    if concat:
        return concat_how_to_load(config, export_format, file, channels,
                                  stages or config.num_stages)
    if kind.kind == "clip":
        if export_format == "safetensors":
            return "\n".join(["import open_clip, safetensors.torch",
                              "model = open_clip.CLIP(**CONFIG)  # CONFIG: the -open_clip.json "
                              "of an open_clip export, or the model card's clip.model",
                              f"model.load_state_dict(safetensors.torch.load_file({file!r}))"])
        stem = Path(file).stem
        return "\n".join(["import open_clip",
                          f"open_clip.add_model_config({stem + '-open_clip.json'!r})",
                          f"model = open_clip.create_model({stem + '-open_clip'!r}, "
                          f"pretrained={file!r})",
                          "features = model.encode_image(images)  # open_clip's normalisation"])
    if kind.kind == "timm":
        return timm_how_to_load(config, export_format, file, channels,
                                export_preprocessing(config, channels, export_format))
    if kind.kind == "small_cnn":
        if export_format == "small_cnn":
            side = config.data.resolution
            return "\n".join(["import torch",
                              f"model = torch.export.load({file!r}).module()  # (B, "
                              f"{channels}, {side}, {side}) images, any batch size"])
        build = small_cnn_lines(channels, config.model.width)  # torch.nn alone (issue 47)
        load = f"safetensors.torch.load_file({file!r})"
        return "\n".join(["import safetensors.torch", *build,
                          f"model.load_state_dict({load}, strict=True)", "model.eval()"])
    assert kind.stem is not None
    library = "timm" if export_format == "timm" else "torchvision"
    load = (f"safetensors.torch.load_file({file!r})" if export_format == "safetensors"
            else f"torch.load({file!r}, weights_only=True)")
    lines = resnet_lines(kind.backbone, kind.stem, channels, library,
                         export_preprocessing(config, channels, export_format))
    if export_format == "safetensors":
        lines.insert(0, "import safetensors.torch")
    return "\n".join([*lines, f"model.load_state_dict({load}, strict=True)", "model.eval()"])


def concat_how_to_load(config: CoreConfig, export_format: str, file: str, channels: int,
                       stages: int) -> str:
    """The Python lines that load an MCL concat export and give the model raycl evaluates
    (``model(images)``: each stage's features L2-normalised, concatenated, normalised again).

    Args:
        config: the trial's config.
        export_format: the format written.
        file: the exported file's name.
        channels: image channels.
        stages: how many stages it holds.

    Returns:
        The lines.
    """
    kind = encoder_kind(config)
    if export_format == "small_cnn":
        return "\n".join(["import torch",
                          f"model = torch.export.load({file!r}).module()  # images -> the "
                          f"L2-normalised concatenation of the {stages} stages' features"])
    load = (f"safetensors.torch.load_file({file!r})" if export_format == "safetensors"
            else f"torch.load({file!r}, weights_only=True)")
    state = f"state = {load}  # stage j's tensors under 'stage<j>.', j = 0..{stages - 1}"
    if kind.kind == "clip":
        return "\n".join(["import safetensors.torch", state,
                          "# each stage's keys, the prefix taken off, are those of an open_clip "
                          "CLIP (the model card's clip section)"])
    if kind.kind == "small_cnn":
        build = small_cnn_lines(channels, config.model.width)
    elif kind.kind == "timm":
        build = timm_lines(config, channels, export_preprocessing(config, channels, export_format))
    else:
        assert kind.stem is not None
        build = resnet_lines(kind.backbone, kind.stem, channels,
                             "timm" if export_format == "timm" else "torchvision",
                             export_preprocessing(config, channels, export_format))
    return "\n".join([
        build[0], *(["import safetensors.torch"] if export_format == "safetensors" else []),
        state,
        "def stage_model(j):",
        *(f"    {line}" for line in build[1:]),
        "    prefix = f'stage{j}.'",
        "    model.load_state_dict({key[len(prefix):]: value for key, value in state.items()",
        "                           if key.startswith(prefix)}, strict=True)",
        "    return model.eval()",
        f"stages = [stage_model(j) for j in range({stages})]",
        "def model(images):  # as raycl evaluates MCL concat",
        "    normalize = torch.nn.functional.normalize",
        "    features = [normalize(stage(images), dim=1) for stage in stages]",
        "    return normalize(torch.cat(features, dim=1), dim=1)"])


# ---------------------------------------------------------------------------------------------
# Reading an export back (raycl.load_encoder)


class OpenClipImageEncoder(nn.Module):
    """An open_clip model's image tower as raycl embeds it: L2-normalised ``encode_image`` of
    images normalised with open_clip's statistics."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return F.normalize(self.model.encode_image(images), dim=-1)


def _read_state(path: Path, export_format: str) -> dict[str, Tensor]:
    if export_format == "safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _module_from_state(state: dict[str, Tensor], card: dict[str, Any],
                       config: CoreConfig) -> nn.Module:
    """One encoder's state dict (a backbone's, or a CLIP trial's open_clip model's) as the
    module raycl embeds with."""
    kind = encoder_kind(config)
    if kind.kind == "clip":
        import open_clip

        model = open_clip.CLIP(**open_clip_config(config))
        model.load_state_dict(state, strict=True)
        return OpenClipImageEncoder(model).eval()
    from raycl.models import build_backbone

    backbone, _ = build_backbone(kind.backbone, int(card["channels"]), config.model.width,
                                 stem=kind.stem or "cifar", timm_kwargs=config.model.timm_kwargs)
    backbone.load_state_dict(state, strict=True)
    return backbone.eval()


def _load_one(path: Path, card: dict[str, Any], config: CoreConfig) -> nn.Module:
    """One exported encoder file as a module (a concat file: its stages' concatenation)."""
    export_format = card["format"]
    if export_format == "small_cnn":  # a program (a concat one too), exported in eval mode
        return plain_module(torch.export.load(str(path)))  # eval() works on it (issue 47)
    state = _read_state(path, export_format)
    if card.get("concat"):
        return StageConcat([_module_from_state(stage, card, config)
                            for stage in split_stages(state)]).eval()
    return _module_from_state(state, card, config)


def load_exported(path: Path) -> tuple[nn.Module, Preprocessing]:
    """An exported file and its model card as (module in eval mode, Preprocessing).

    Raises:
        ValueError: no model card beside the file.
    """
    card = read_model_card(path)
    config = read_config(card["config"])
    # The resize from the config, not the card: cards of before issue 47 said bicubic for all.
    preprocessing = replace(Preprocessing.from_dict(card["preprocessing"]),
                            crop=dataset_resize(config.data.dataset))
    return _load_one(path, card, config), preprocessing


__all__ = ["FORMATS", "EncoderKind", "OpenClipImageEncoder", "check_format",
           "concat_how_to_load", "concat_state", "encoder_kind", "export_preprocessing",
           "format_problem", "how_to_load", "load_exported", "open_clip_config", "planned_files",
           "resnet_lines", "write_encoder"]
