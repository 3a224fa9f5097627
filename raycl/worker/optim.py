"""The optimizer of a training phase (AdamW, SGD or LARS), its base rate (``train.lr_scaling``),
its learning-rate schedule, and mixed precision."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from raycl.config.schema import CoreConfig
from raycl.methods.base import TRAIN_PHASE, Method, Phase
from raycl.worker.lars import LARS, lars_param_groups

logger = logging.getLogger(__name__)

# Enters the forward pass's autocast region (or nothing, with train.amp off).
Autocast = Callable[[], AbstractContextManager[Any]]


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str = "cosine") -> float:
    """Linear warmup to 1, then cosine decay to 0 (or 1 throughout: ``schedule="constant"``)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# The batch linear scaling refers to (Goyal et al., 2017; SimCLR's and solo-learn's lr x b/256).
LR_REFERENCE_BATCH = 256


def effective_lr(config: CoreConfig, phase: Phase = TRAIN_PHASE) -> float:
    """The phase's base learning rate (before warmup and decay).

    ``train.lr``, times ``train.batch_size / 256`` (the global batch) with ``train.lr_scaling:
    linear``. A phase's own ``lr`` (e.g. FGVR's decoder pre-training) is an absolute rate, as
    written, never scaled: solo-learn likewise scales only its base rates.

    Args:
        config: the trial's config.
        phase: the phase (default: the training phase).

    Returns:
        The rate every group's ``lr_scale`` multiplies.
    """
    if phase.lr is not None:
        return phase.lr
    if config.train.lr_scaling == "linear":
        return config.train.lr * config.train.batch_size / LR_REFERENCE_BATCH
    return config.train.lr


def build_optimizer(
    method: Method, config: CoreConfig, phase: Phase = TRAIN_PHASE
) -> torch.optim.Optimizer:
    """The optimizer of one phase over ``method.param_groups()`` (called after ``set_phase``).

    A group's ``"lr_scale"`` multiplies the phase's base rate (:func:`effective_lr`); a group's
    absolute ``"lr"`` (e.g. All4One's ``transformer_lr``) is used as written, unscaled (as
    solo-learn's All4One sets its transformer's 0.1). With LARS each group is split into its
    adapted weights and its biases and normalisation parameters (:func:`lars_param_groups`),
    both halves keeping the group's rate and name.
    """
    base_lr = effective_lr(config, phase)
    groups = []
    for group in layer_decay_groups(method, config.train.layer_decay, config.train.weight_decay):
        group = dict(group)
        group["lr"] = float(group.pop("lr", base_lr)) * float(group.pop("lr_scale", 1.0))
        group["initial_lr"] = group["lr"]
        groups.append(group)
    train = config.train
    kind = phase.optimizer or train.optimizer
    if kind == "lars":
        return LARS(lars_param_groups(groups, train.weight_decay), lr=base_lr,
                    momentum=train.momentum, weight_decay=train.weight_decay,
                    eta=train.lars_eta, clip_lr=train.lars_clip_lr)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=base_lr, momentum=train.momentum,
                               weight_decay=train.weight_decay)
    return torch.optim.AdamW(groups, lr=base_lr, weight_decay=train.weight_decay)


def layer_decay_groups(method: Method, layer_decay: float | None,
                       weight_decay: float) -> list[dict[str, Any]]:
    """``method.param_groups()``, with ``train.layer_decay`` on a timm backbone: its weights
    taken out of their groups and put in timm's per-layer groups (the last block at
    ``lr_scale`` 1, each lower one ``layer_decay`` times the one above, the embeddings lowest;
    biases and norms without weight decay), each also scaled by the group it came from.
    Unchanged without layer decay or a timm backbone (one with timm's ``group_matcher``)."""
    groups = method.param_groups()
    backbone = getattr(method, "backbone", None)
    if layer_decay is None or backbone is None or not hasattr(backbone, "group_matcher"):
        return groups
    from timm.optim import param_groups_layer_decay

    # The rate scale each backbone parameter had in the method's own groups.
    owner = {id(param): float(group.get("lr_scale", 1.0))
             for group in groups for param in group["params"]}
    layered = []
    for index, group in enumerate(param_groups_layer_decay(
            backbone, weight_decay=weight_decay, layer_decay=layer_decay)):
        params = [param for param in group["params"] if id(param) in owner]
        if params:
            layered.append({"params": params, "name": f"backbone_layer_{index}",
                            "weight_decay": group["weight_decay"],
                            "lr_scale": group["lr_scale"] * owner[id(params[0])]})
    taken = {id(param) for group in layered for param in group["params"]}
    rest = [{**group, "params": [p for p in group["params"] if id(p) not in taken]}
            for group in groups]
    return [group for group in rest if group["params"]] + layered


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every step of one phase, as a factor of each group's initial rate.

    Attributes:
        total_steps: the phase's optimizer steps (epochs x steps per epoch).
        warmup_steps: linear warmup steps (``train.warmup_epochs``; none in a constant phase).
        schedule: ``train.lr_schedule`` after the warmup ("cosine" or "constant").
        constant: the phase sets its own ``lr``: factor 1 at every step.
    """

    total_steps: int
    warmup_steps: int
    schedule: str
    constant: bool

    @classmethod
    def for_phase(
        cls, config: CoreConfig, phase: Phase, epochs: int, steps_per_epoch: int
    ) -> LrSchedule:
        """The schedule of ``phase`` over its ``epochs`` of ``steps_per_epoch`` steps."""
        warmup_steps = (int(config.train.warmup_epochs * steps_per_epoch)
                        if phase.lr is None else 0)
        return cls(epochs * steps_per_epoch, warmup_steps, config.train.lr_schedule,
                   phase.lr is not None)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Set every group's rate for ``step`` (counted from the phase's first step)."""
        factor = 1.0 if self.constant else lr_factor(
            step, self.total_steps, self.warmup_steps, self.schedule)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer ``state`` (momentum, Adam's moments) into ``optimizer``
    built from the current config, keeping the built groups' hyperparameters (``lr``,
    ``initial_lr``, ``weight_decay``, ``momentum``, ...).

    torch's ``load_state_dict`` replaces every group's hyperparameters with the checkpoint's:
    a population-based training exploit (raycl.sweep.pbt) resumes another trial's checkpoint under
    mutated values, which would be silently undone (ray-project/ray#62173 is this bug in
    RLlib's PBT). Resuming a trial's own checkpoint changes nothing: its config built the same.

    Args:
        optimizer: the phase's optimizer, built by :func:`build_optimizer`.
        state: ``optimizer.state_dict()`` of the checkpoint (same groups, same order).
    """
    built = [{key: value for key, value in group.items() if key != "params"}
             for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, hyperparameters in zip(optimizer.param_groups, built, strict=True):
        group.update(hyperparameters)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA GPU of compute capability 8.0
    (Ampere) or later. ``torch.cuda.is_bf16_supported()`` also counts the slow emulation on
    older GPUs and looks at the current device only, hence the capability of ``device``."""
    return device.type == "cuda" and torch.cuda.get_device_properties(device).major >= 8


def resolve_amp(mode: str, device: torch.device) -> str:
    """``train.amp`` as run on ``device``: ``auto`` is bf16 on a GPU with native bf16 (no loss
    scaler, so no host sync per step), fp16 on an older GPU, off elsewhere."""
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "off"
    return "bf16" if native_bf16(device) else "fp16"


def autocast_and_scaler(
    config: CoreConfig, device: torch.device
) -> tuple[Autocast, torch.amp.GradScaler]:
    """The forward pass's autocast region and the loss scaler for ``train.amp``.

    ``auto`` is :func:`resolve_amp`'s choice. The scaler only scales for fp16 on CUDA (bf16
    needs none; fp16's scaler reads its inf check on the host every step), and is a no-op
    otherwise so the loop calls it the same way in every mode.
    """
    mode = resolve_amp(config.train.amp, device)
    if mode == "off":
        return nullcontext, torch.amp.GradScaler(device.type, enabled=False)
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16" and device.type == "cuda")
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler


def inference_autocast(config: CoreConfig, device: torch.device) -> Autocast:
    """The autocast region of evaluation passes (embedding): the trial's training precision on
    CUDA, none elsewhere (CPU evaluation stays float32, as CPU autocast is slow and its numbers
    would move). Callers cast the outputs to float32 for the probes."""
    mode = resolve_amp(config.train.amp, device)
    if device.type != "cuda" or mode == "off":
        return nullcontext
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    return lambda: torch.autocast("cuda", dtype=dtype)


def load_scaler_state(scaler: torch.amp.GradScaler, state: dict[str, Any]) -> None:
    """Give ``scaler`` a checkpoint's loss-scaler ``state`` when both scale (fp16 on CUDA).

    A disabled scaler saves ``{}``, and an enabled one refuses ``{}``: a trial resumed under
    another AMP mode (``train.amp`` changed, or a CPU checkpoint resumed on a GPU) starts the loss
    scale afresh instead, with a warning, since the scale is a running estimate, not weights.
    """
    if state and scaler.is_enabled():
        scaler.load_state_dict(state)
    elif bool(state) != scaler.is_enabled():
        then, now = (("scaling", "not scaling") if state else ("not scaling", "scaling"))
        logger.warning("the AMP mode changed since the checkpoint (loss scaler %s then, %s now): "
                       "the loss scale starts afresh", then, now)


__all__ = ["LR_REFERENCE_BATCH", "Autocast", "LrSchedule", "autocast_and_scaler",
           "build_optimizer", "effective_lr", "inference_autocast", "load_scaler_state",
           "lr_factor", "native_bf16", "resolve_amp"]
