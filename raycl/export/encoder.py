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
- MCL ``integration: concat`` gives a :class:`StageConcat` of every stage's encoder (each
  stage's features L2-normalised, concatenated, normalised again: what
  :func:`raycl.worker.embed.integrate_stages` scores): the checkpointed stage's from
  ``state.pt``, the earlier stages' from ``stage_weights.pt`` (each finished stage's backbone,
  kept since raycl keeps them; a checkpoint of an older raycl has none: a one-line ValueError).

:func:`at_init_encoder` is the same encoder before any training (the reference a trial's number
is read against: ``python -m raycl.evaluate``'s ``at_init``, ``benchmarks/fidelity.py``).

:func:`load_encoder` reads back what :mod:`raycl.export.formats` wrote (the file and its model
card) or a checkpoint directory with a config beside it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
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
STAGE_WEIGHTS_FILE = "stage_weights.pt"  # ... .STAGE_WEIGHTS_FILE: earlier stages' kept weights
PROGRESS_FILE = "progress.json"  # ... .PROGRESS_FILE: the checkpoint's stage
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


def at_init_encoder(config: CoreConfig, channels: int) -> nn.Module:
    """The trial's encoder before training: each stage's method built and seeded as
    :func:`raycl.worker.stage.build_stage_method` builds it (an MCL ``concat`` trial: every
    stage, concatenated as its trained encoder is), on the CPU, in eval mode.

    Args:
        config: the trial's config.
        channels: the image channels of its trained encoder.

    Returns:
        Normalised float images -> features.
    """
    from raycl.methods import build_method, method_class

    same_start = method_class(config).stages_share_initial_weights \
        or config.mcl.integration == "soup"
    concat = config.num_stages > 1 and config.mcl.integration == "concat"
    stages = []
    for stage in range(config.num_stages if concat else 1):
        np.random.seed(config.seed)  # as the trial's rank 0 (raycl.sweep.baseline too)
        torch.manual_seed(config.seed if same_start else config.seed + 1000 * stage)
        stages.append(_embedding_module(build_method(config, channels).eval()))
    # A soup of stages that start alike is that start: one stage.
    return (concat_encoder(stages) if concat else stages[0]).eval()


def checkpoint_stage(checkpoint_dir: Path, config: CoreConfig) -> int:
    """The MCL stage a checkpoint was written in (its ``progress.json``; without one, the
    trial's last stage)."""
    path = Path(checkpoint_dir) / PROGRESS_FILE
    if path.is_file():
        return int(json.loads(path.read_text())["stage"])
    return config.num_stages - 1


def _earlier_weights(checkpoint_dir: Path) -> list[dict[str, Tensor]]:
    """The earlier stages' kept weights beside a checkpoint's ``state.pt`` (none: ``[]``)."""
    path = Path(checkpoint_dir) / STAGE_WEIGHTS_FILE
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else []


def _stage_embedding(method: Method, backbone_state: dict[str, Tensor]) -> nn.Module:
    """The embedding of an earlier stage: a copy of ``method`` with that stage's backbone."""
    stage = copy.deepcopy(method)
    stage.backbone.load_state_dict(backbone_state, strict=True)
    return _embedding_module(stage.eval())


def trained_encoder(
    checkpoint_dir: Path, config: CoreConfig, device: str | torch.device = "cpu"
) -> nn.Module:
    """Return the trial's encoder: normalised float images -> evaluation features.

    Args:
        checkpoint_dir: directory holding the trial's ``state.pt`` (and, for an MCL trial past
            its first stage, ``stage_weights.pt``).
        config: the trial's config.
        device: where the returned module lives.

    Returns:
        A module in eval mode embedding images (normalised as
        :func:`raycl.data.augment.to_float`) exactly as raycl's evaluation does: for MCL
        ``concat`` a :class:`StageConcat` of every stage so far.

    Raises:
        FileNotFoundError: no ``state.pt``.
        ValueError: an MCL ``concat`` checkpoint of a raycl that did not keep each stage's
            weights yet.
    """
    from raycl.worker.embed import soup_method
    from raycl.worker.stage_integration import soup_weights

    directory = Path(checkpoint_dir)
    method, _ = trained_method(directory, config)
    earlier = _earlier_weights(directory) if config.num_stages > 1 else []
    if config.num_stages > 1 and config.mcl.integration == "concat":
        stage = checkpoint_stage(directory, config)
        if len(earlier) != stage:  # written by a raycl that kept the stages' features only
            raise ValueError(
                f"{directory}: trained before raycl kept each stage's weights: re-run the trial "
                f"to export its MCL concat encoder (the checkpoint of stage {stage} holds "
                f"{len(earlier)} earlier stage encoder(s), not {stage})")
        if earlier:  # as integrate_stages: the stages in order, this one last
            stages = [*(_stage_embedding(method, weights) for weights in earlier),
                      _embedding_module(method)]
            return concat_encoder(stages).to(device).eval()
    elif earlier:  # the soup, as integrate_stages: the earlier stages' shares and this stage's
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
            (``model_card.json`` or ``config.json``); a ``file://`` URI is read as its path;
            a trial run's logged encoder, ``runs:/<run_id>/encoder`` (from MLflow's tracking
            URI, else ``sqlite:///mlflow.db``), or a local folder of that artifact.

    Returns:
        (module in eval mode on the CPU, its Preprocessing).

    Raises:
        FileNotFoundError: nothing at that path (or that run has no such artifact).
        ValueError: a file without its model card, or another URI scheme.
    """
    from raycl.export.formats import load_exported
    from raycl.export.run_artifact import load_run_encoder

    logged = load_run_encoder(path_or_uri)  # runs:/<id>/encoder, or a folder of that artifact
    if logged is not None:
        return logged
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


__all__ = ["MethodEmbedding", "Preprocessing", "StageConcat", "at_init_encoder",
           "base_method_name", "checkpoint_channels", "checkpoint_stage", "concat_encoder",
           "load_encoder", "raycl_preprocessing", "read_config", "read_state", "trained_encoder",
           "trained_method"]
