"""Backbone weights from a local file (``model.pretrained``); nothing is ever downloaded.

Two formats are read, both with ``torch.load(weights_only=True)``:

- a torchvision ResNet state dict, ``torch.save(torchvision.models.resnet50().state_dict())``
  (keys ``conv1.weight``, ``layer1.0.conv1.weight``, ...); its ``fc.*`` keys are dropped, raycl's
  backbone ends before the classifier;
- a raycl checkpoint's ``state.pt``, ``{"model": method.state_dict(), ...}``: the keys under
  ``backbone.`` (the encoder a finished trial evaluated; ``base.backbone.`` for a method wrapping
  a base method, as FGVR does) are taken, so a trial can start from another one.

Loading is strict: every weight of the backbone must be in the file with the same shape, and the
file may hold nothing else. A problem is one line saying what differs and, where it can tell,
which config key to change (model.stem, model.backbone, model.width). BatchNorm's
``num_batches_tracked`` counters are exempt: older torchvision files lack them and they carry no
learnt value.

The bottom of :mod:`raycl.models`' weights handling: it builds no backbone (the caller hands over
the backbone, or its expected shapes, and the names raycl builds). :mod:`raycl.models.backbones`
loads through :func:`load_pretrained`; :mod:`raycl.models.pretrained` checks a config before
launch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

# Block counts per layer (layer1..layer4) and block type -> torchvision name, to tell a user
# which ResNet a file holds when it is not the configured one.
_RESNETS: dict[tuple[str, tuple[int, ...]], str] = {
    ("basic", (2, 2, 2, 2)): "resnet18",
    ("basic", (3, 4, 6, 3)): "resnet34",
    ("bottleneck", (3, 4, 6, 3)): "resnet50",
    ("bottleneck", (3, 4, 23, 3)): "resnet101",
    ("bottleneck", (3, 8, 36, 3)): "resnet152",
}
_OPTIONAL_SUFFIX = "num_batches_tracked"
# Where a raycl method keeps its evaluated encoder, tried in order (FGVR wraps a base method).
_CHECKPOINT_PREFIXES: tuple[str, ...] = ("backbone.", "base.backbone.")
_SHOWN_KEYS = 3


def describe_backbone(name: str, stem: str, width: int) -> str:
    """``"the resnet50 backbone (cifar stem)"``: what the weights must fit, for messages."""
    detail = f"width {width}" if name == "small_cnn" else f"{stem} stem"
    return f"the {name} backbone ({detail})"


def read_backbone_state(path: str | Path) -> dict[str, Tensor]:
    """The backbone weights in a torchvision state dict or a raycl checkpoint.

    Args:
        path: the weights file.

    Returns:
        Backbone key (as in ``backbone.state_dict()``) -> tensor.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file cannot be read as torch weights, or holds neither format.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        shown = file if file.is_absolute() else f"{file} ({file.resolve()})"
        raise FileNotFoundError(f"no such file: {shown}")
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"cannot read {file} as torch weights: {first_line[:160]}") from None
    if isinstance(loaded, Mapping) and isinstance(loaded.get("model"), Mapping):
        state = checkpoint_backbone(loaded["model"])
        if not state:
            raise ValueError(f"the raycl checkpoint {file} has no backbone.* weights in 'model'")
    elif isinstance(loaded, Mapping) and loaded:
        state = {key: value for key, value in loaded.items() if not str(key).startswith("fc.")}
    else:
        state = {}
    if not state or not all(isinstance(key, str) and isinstance(value, Tensor)
                            for key, value in state.items()):
        raise ValueError(f"{file} is neither a torchvision state dict (name -> tensor) nor a "
                         f"raycl checkpoint's state.pt (a dict with 'model')")
    return state


def checkpoint_backbone(model: Mapping[str, object]) -> dict[str, object]:
    """The backbone's entries of a raycl method's state dict, prefix removed ({} if none)."""
    for prefix in _CHECKPOINT_PREFIXES:
        state = {str(key).removeprefix(prefix): value for key, value in model.items()
                 if str(key).startswith(prefix)}
        if state:
            return state
    return {}


def guess_backbone(keys: set[str]) -> str | None:
    """The torchvision ResNet (or raycl small_cnn) whose weights these keys are, if known."""
    if "0.0.weight" in keys and "conv1.weight" not in keys:
        return "small_cnn"
    blocks = tuple(len({match.group(1) for key in keys
                        if (match := re.match(rf"layer{layer}\.(\d+)\.", key))})
                   for layer in range(1, 5))
    if not any(blocks):
        return None
    kind = "bottleneck" if any(key.endswith(".conv3.weight") for key in keys) else "basic"
    return _RESNETS.get((kind, blocks))


def _shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown + (f" (+{len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else "")


def _shape_hint(key: str, found: tuple[int, ...], wanted: tuple[int, ...]) -> str:
    """Which config key would make ``found`` fit, for the first layer; "" when unknown."""
    if key not in ("conv1.weight", "0.0.weight") or len(found) != 4 or len(wanted) != 4:
        return ""
    if found[1] != wanted[1]:
        return (f"; the file's first layer takes {found[1]}-channel images, the data has "
                f"{wanted[1]} channel{'s' if wanted[1] > 1 else ''}")
    if key == "conv1.weight" and found[2:] != wanted[2:] and found[2] in (3, 7):
        return f"; set model.stem: {'imagenet' if found[2] == 7 else 'cifar'}"
    if key == "0.0.weight" and found[0] != wanted[0]:
        return f"; set model.width: {found[0]}"
    return ""


def state_problem(
    state: Mapping[str, Tensor],
    expected: Mapping[str, tuple[int, ...]],
    source: str,
    name: str,
    what: str,
    buildable: Sequence[str],
    identify: bool = True,
) -> str | None:
    """Why ``state`` cannot be loaded strictly into a backbone with ``expected`` shapes.

    Args:
        state: weights read by :func:`read_backbone_state`.
        expected: key -> shape of the backbone's ``state_dict()``.
        source: the file, for the message.
        name: the configured backbone name (model.backbone).
        what: :func:`describe_backbone` of the configured backbone.
        buildable: the backbone names raycl builds (model.backbone's choices), for the fix.
        identify: name the torchvision ResNet the file holds when it is not ``name`` (off for a
            timm backbone, whose ResNets share torchvision's key names).

    Returns:
        One line, or None when every weight is present with its shape and nothing is extra.
    """
    guess = guess_backbone(set(state)) if identify else None
    if guess is not None and guess != name:
        fix = (f"; set model.backbone: {guess}" if guess in buildable
               else f" (raycl builds {', '.join(buildable)})")
        return f"{source} holds a {guess} backbone but model.backbone is {name}{fix}"
    missing = [key for key in expected
               if key not in state and not key.endswith(_OPTIONAL_SUFFIX)]
    unexpected = [key for key in state if key not in expected]
    differing = [key for key in expected
                 if key in state and tuple(state[key].shape) != tuple(expected[key])]
    extra = [f"{len(keys)} {label}" for keys, label in ((missing, "missing"),
                                                         (unexpected, "unexpected")) if keys]
    if differing:
        key = differing[0]
        found, wanted = tuple(state[key].shape), tuple(expected[key])
        others = (f" (+{len(differing) - 1} more of another shape)" if len(differing) > 1
                  else "")
        also = f" (also {', '.join(extra)} keys)" if extra else ""
        return (f"{key} has shape {_shape(found)} in {source} but {what} expects "
                f"{_shape(wanted)}{others}{also}{_shape_hint(key, found, wanted)}")
    if missing or unexpected:
        parts = [f"{label} {_listed(keys)}" for keys, label in ((missing, "missing"),
                                                                (unexpected, "unexpected")) if keys]
        return f"{source} does not fit {what}: {'; '.join(parts)}"
    return None


def load_pretrained(
    module: nn.Module, path: str, name: str, stem: str, width: int, buildable: Sequence[str]
) -> None:
    """Copy the weights in ``path`` into ``module`` (strict; see the module docstring).

    Args:
        module: the freshly built backbone.
        path: the weights file.
        name: its backbone name, stem and width, for the messages.
        stem: "cifar" or "imagenet".
        width: small_cnn's width.
        buildable: the backbone names raycl builds, for the messages.

    Raises:
        FileNotFoundError, ValueError: the file is missing, unreadable or does not fit.
    """
    state = read_backbone_state(path)
    expected = {key: tuple(value.shape) for key, value in module.state_dict().items()}
    problem = state_problem(state, expected, str(path), name,
                            describe_backbone(name, stem, width), buildable)
    if problem:
        raise ValueError(problem)
    # strict=False only for the exempt counters; everything else was checked above.
    module.load_state_dict(state, strict=False)
