"""Any timm model as a backbone: ``model.backbone: timm/<name>``.

The backbone is ``timm.create_model(name, pretrained=False, num_classes=0, in_chans=C,
**model.timm_kwargs)``: without its classifier a timm model returns its pooled features
(``num_features`` wide: a ViT's class token or average after the final norm, a ConvNeXt's
pooled map), which is what every raycl method reads. Nothing is downloaded: a model starts from
random weights, or from a local file (``model.pretrained``: a timm state dict as safetensors or
``.pth``, e.g. DINOv2 weights a user downloaded, or a raycl checkpoint's ``state.pt``), checked
key by key and shape by shape. The model module's own ``checkpoint_filter_fn`` is applied first
when it has one: it converts the original repositories' key names and resamples a ViT's
position embedding to the configured ``img_size``.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

TIMM_PREFIX = "timm/"
# Set by raycl from the data and the method; a user's value would contradict it.
RESERVED_KWARGS: tuple[str, ...] = ("pretrained", "num_classes", "in_chans")


def is_timm(name: str) -> bool:
    """Whether ``model.backbone`` names a timm model (``timm/<name>``)."""
    return name.startswith(TIMM_PREFIX)


def timm_name(name: str) -> str:
    """The timm model name of ``model.backbone`` (``timm/vit_small_patch16_224`` -> the rest)."""
    return name.removeprefix(TIMM_PREFIX)


def unknown_name_problem(name: str) -> str | None:
    """Why ``model.backbone`` names no timm model, with the closest names; None when it does."""
    import timm

    model = timm_name(name)
    if timm.is_model(model):
        return None
    close = difflib.get_close_matches(model, timm.list_models(), n=3, cutoff=0.5)
    hint = f"; close: {', '.join(TIMM_PREFIX + c for c in close)}" if close else ""
    return f"{model!r} is not a timm model (timm.list_models()){hint}"


def create(name: str, in_channels: int, kwargs: Mapping[str, Any]) -> nn.Module:
    """``timm.create_model`` as raycl calls it: no weights downloaded, no classifier.

    Args:
        name: ``model.backbone`` (``timm/<name>``).
        in_channels: the data's channels.
        kwargs: ``model.timm_kwargs`` (``img_size``, ``patch_size``, ``drop_path_rate``, ...).
    """
    import timm

    return timm.create_model(timm_name(name), pretrained=False, num_classes=0,
                             in_chans=in_channels, **dict(kwargs))


def is_transformer(model: nn.Module) -> bool:
    """Whether ``model`` has attention layers (a ViT, Swin, EVA, ...: AdamW, not LARS)."""
    return any("Attention" in type(module).__name__ for module in model.modules())


def _read_file(path: Path) -> Mapping[str, Any]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_timm_state(path: str | Path, model: nn.Module) -> dict[str, Tensor]:
    """The weights in ``path`` as ``model``'s state dict would name them.

    A raycl checkpoint's ``state.pt`` gives its ``backbone.*`` weights; a dict with ``model`` or
    ``state_dict`` is unwrapped; the model module's ``checkpoint_filter_fn`` (when timm has one)
    converts the file's names and resamples a ViT's position embedding; the classifier's keys
    (``model.pretrained_cfg['classifier']``), which a model without one lacks, are dropped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file cannot be read as weights.
    """
    from raycl.models.weights import checkpoint_backbone

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {file}")
    try:
        loaded = _read_file(file)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"cannot read {file} as weights: {first_line[:160]}") from None
    if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
        loaded = checkpoint_backbone(loaded["model"]) or loaded["model"]
    elif isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping) or not all(
            isinstance(key, str) and isinstance(value, Tensor) for key, value in loaded.items()):
        raise ValueError(f"{file} is not a state dict (name -> tensor)")
    state = dict(loaded)
    filter_fn = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        state = dict(filter_fn(state, model))
    classifier = str(getattr(model, "pretrained_cfg", {}).get("classifier") or "")
    own = model.state_dict()
    return {key: value for key, value in state.items()
            if key in own or not classifier or not key.startswith(classifier + ".")}


def build_timm(name: str, in_channels: int, kwargs: Mapping[str, Any],
               pretrained: str | None = None) -> tuple[nn.Module, int]:
    """The timm backbone of ``model.backbone`` and its feature width (``num_features``),
    starting from ``pretrained`` when given (strict: every weight present with its shape).

    Raises:
        ValueError: an unknown name, or weights that do not fit.
        FileNotFoundError: ``pretrained`` does not exist.
    """
    problem = unknown_name_problem(name)
    if problem:
        raise ValueError(problem)
    model = create(name, in_channels, kwargs)
    if pretrained is not None:
        state = read_timm_state(pretrained, model)
        problem = timm_state_problem(state, model, str(pretrained), name)
        if problem:
            raise ValueError(problem)
        model.load_state_dict(state, strict=False)  # checked above; counters exempt
    return model, int(model.num_features)


def timm_state_problem(state: Mapping[str, Tensor], model: nn.Module, source: str,
                       name: str) -> str | None:
    """Why ``state`` (:func:`read_timm_state`) does not load strictly into ``model``, the
    ``name`` backbone; None when it does. One line, as :func:`raycl.models.weights.state_problem`
    words it."""
    from raycl.models.weights import state_problem

    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    # No ResNet guess: timm's ResNets share torchvision's key names.
    return state_problem(state, expected, source, name, f"the {name} backbone", (),
                         identify=False)


__all__ = ["RESERVED_KWARGS", "TIMM_PREFIX", "build_timm", "create", "is_timm",
           "is_transformer", "read_timm_state", "timm_name", "timm_state_problem",
           "unknown_name_problem"]
