"""Rebuild a trial's trained encoder from its checkpoint (issue 35).

:func:`trained_encoder` gives the module raycl's evaluation embeds with: images normalised as
:func:`raycl.data.augment.to_float` does -> the features the probes scored. The method is built
again from the trial's config (weight files not read again: the checkpoint holds the trained
weights), its ``state.pt`` loaded to the CPU, and

- a method whose ``embed`` is the default (``backbone(images)``) gives its backbone alone, the
  module every export format writes;
- a method with its own ``embed`` (CLIP: its pixel statistics, ``encode_image``, L2 norm) gives
  a :class:`MethodEmbedding` around the whole method;
- MCL ``integration: soup`` gives the soup (the mean of every stage's weights, as
  :func:`raycl.worker.embed.integrate_stages` evaluates it): one backbone;
- MCL ``integration: concat`` needs every stage's encoder, and a checkpoint keeps only its own
  stage's weights (earlier stages live on as their frozen *features*, not their weights): it
  raises a ValueError saying so. :class:`StageConcat` is the module that integrates encoders
  when they are at hand (:func:`concat_encoder`).

:func:`load_encoder` reads back what :mod:`raycl.export.formats` wrote (the file and its model
card) or a checkpoint directory with a config beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from raycl.export.modules import (
    MethodEmbedding,
    Preprocessing,
    StageConcat,
    base_method_name,
    concat_encoder,
    raycl_preprocessing,
    read_config,
)

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig
    from raycl.methods.base import Method

STATE_FILE = "state.pt"  # raycl.worker.stage_integration.STATE_FILE (no Ray import here)
STAGE_WEIGHTS_FILE = "stage_weights.pt"  # ... .STAGE_WEIGHTS_FILE: the earlier stages' soup
# Files beside a checkpoint's state.pt that hold the trial's config (first found wins).
CONFIG_FILES: tuple[str, ...] = ("model_card.json", "config.json")


def checkpoint_channels(model_state: dict[str, Tensor], method_name: str) -> int:
    """The image channels a checkpoint's encoder takes: the input width of its first conv.

    Args:
        model_state: ``state.pt``'s ``"model"``.
        method_name: the (base) method's name, for the message.

    Returns:
        Channels (3 for CLIP, whose image tower takes RGB only).

    Raises:
        ValueError: no 4-D (convolution) weight in the checkpoint.
    """
    for key, value in model_state.items():
        if "backbone." in key and isinstance(value, Tensor) and value.dim() == 4:
            return int(value.shape[1])
    if method_name == "clip":
        return 3
    raise ValueError(f"cannot tell the image channels of the {method_name} checkpoint: no "
                     f"convolution weight under backbone.*")


def read_state(checkpoint_dir: Path) -> dict[str, Any]:
    """``state.pt`` of a checkpoint directory, read to the CPU without running code.

    Raises:
        FileNotFoundError: the directory has no ``state.pt``.
    """
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint_dir}: no {STATE_FILE} (not a raycl checkpoint)")
    return torch.load(path, map_location="cpu", weights_only=True)


def trained_method(
    checkpoint_dir: Path, config: CoreConfig, state: dict[str, Any] | None = None
) -> tuple[Method, int]:
    """The trial's method rebuilt from ``config`` with the checkpoint's weights, in eval mode,
    on the CPU, and its image channels.

    Args:
        checkpoint_dir: directory holding ``state.pt``.
        config: the trial's config.
        state: ``state.pt`` already read (else read here).

    Returns:
        (method, channels).
    """
    from raycl.config.search_config import apply_overrides
    from raycl.methods import build_method, method_class

    state = read_state(checkpoint_dir) if state is None else state
    cls = method_class(config)
    model_state = state["model"]
    channels = checkpoint_channels(model_state, base_method_name(config))
    # The weights come from the checkpoint: a model.pretrained / clip.pretrained file is not
    # read again (it may be gone), as when a trial resumes (raycl.worker.stage).
    weight_files = {key: None for key in ("model.pretrained", *cls.weight_file_keys)}
    method = build_method(apply_overrides(config, weight_files), channels)
    method.load_state_dict(model_state)
    return method.eval(), channels


def _embedding_module(method: Method) -> nn.Module:
    """The module that computes ``method.embed``: its backbone when ``embed`` is the default."""
    from raycl.methods.base import Method

    if type(method).embed is Method.embed:
        return method.backbone
    return MethodEmbedding(method)


def trained_encoder(
    checkpoint_dir: Path, config: CoreConfig, device: str | torch.device = "cpu"
) -> nn.Module:
    """Return the trial's encoder: normalised float images -> evaluation features.

    Args:
        checkpoint_dir: directory holding the trial's ``state.pt`` (and, for an MCL soup,
            ``stage_weights.pt``).
        config: the trial's config.
        device: where the returned module lives.

    Returns:
        A module in eval mode embedding images (normalised as
        :func:`raycl.data.augment.to_float`) exactly as raycl's evaluation does.

    Raises:
        FileNotFoundError: no ``state.pt``.
        ValueError: an MCL ``concat`` trial (its checkpoint keeps one stage's weights only).
    """
    from raycl.worker.embed import soup_method
    from raycl.worker.stage_integration import soup_weights

    directory = Path(checkpoint_dir)
    method, _ = trained_method(directory, config)
    if config.num_stages > 1:
        if config.mcl.integration != "soup":
            raise ValueError(
                f"{directory}: an MCL concat trial's checkpoint keeps only its last stage's "
                f"weights (earlier stages are kept as features), so its {config.num_stages}-"
                f"stage encoder cannot be rebuilt; export an integration: soup trial or a "
                f"single stage")
        weights_file = directory / STAGE_WEIGHTS_FILE
        earlier = (torch.load(weights_file, map_location="cpu", weights_only=True)
                   if weights_file.is_file() else [])
        if earlier:  # as integrate_stages: the earlier stages' soup shares and this stage's
            method = soup_method(method, [*earlier, soup_weights(method)]).eval()
    return _embedding_module(method).to(device).eval()


def _checkpoint_config(directory: Path) -> CoreConfig:
    """The config written beside a checkpoint (a model card or ``config.json``)."""
    for name in CONFIG_FILES:
        path = directory / name
        if path.is_file():
            raw = json.loads(path.read_text())
            return read_config(raw.get("config", raw) if name == "model_card.json" else raw)
    raise ValueError(f"{directory}: a checkpoint needs its trial's config beside state.pt "
                     f"({' or '.join(CONFIG_FILES)}); or call "
                     f"raycl.export.encoder.trained_encoder(directory, config)")


def load_encoder(path_or_uri: str) -> tuple[nn.Module, Preprocessing]:
    """Load an exported encoder (file + model card) or a raycl checkpoint directory.

    Args:
        path_or_uri: a file written by ``python -m raycl.export`` (its model card beside it),
            or a directory holding ``state.pt`` and the trial's config
            (``model_card.json`` or ``config.json``); a ``file://`` URI is read as its path.

    Returns:
        (module in eval mode on the CPU, its Preprocessing).

    Raises:
        FileNotFoundError: nothing at that path.
        ValueError: a file without its model card, or another URI scheme.
    """
    from raycl.export.formats import load_exported

    path = _local_path(path_or_uri)
    if path.is_dir():
        config = _checkpoint_config(path)
        channels = checkpoint_channels(read_state(path)["model"], base_method_name(config))
        return trained_encoder(path, config), raycl_preprocessing(config, channels)
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    return load_exported(path)


def _local_path(path_or_uri: str) -> Path:
    """A local path from a path or a ``file://`` URI (other schemes: ValueError)."""
    text = str(path_or_uri)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        if scheme != "file":
            raise ValueError(f"{text}: only local paths and file:// URIs are read; copy the "
                             f"export here first")
        text = rest
    return Path(text).expanduser()


__all__ = ["MethodEmbedding", "Preprocessing", "StageConcat", "base_method_name",
           "checkpoint_channels", "concat_encoder", "load_encoder", "raycl_preprocessing",
           "read_config", "read_state", "trained_encoder", "trained_method"]
