"""LARS: SGD with momentum whose step is rescaled per parameter tensor by a trust ratio.

You et al., "Large Batch Training of Convolutional Networks" (2017), eq. 6: each layer's local
rate is ``eta * ||w|| / (||g|| + wd * ||w||)`` (``g`` the loss's gradient, ``wd`` the weight
decay), applied to ``g + wd * w`` before momentum, so the step's size follows the weight's and
not the gradient's. As in SimCLR's, BYOL's and solo-learn's recipes, biases and normalisation
parameters (every tensor of at most one dimension) are neither decayed nor adapted: they take
plain momentum SGD steps (:func:`lars_param_groups` splits the groups; a group's ``adapt``
flag says which kind it holds).

Torch only (no Ray): the optimizer runs wherever torch does. One step launches a fixed number
of ``torch._foreach_*`` kernels per group (per device and dtype), never one per parameter, and
reads nothing back to the host: the trust ratios stay tensors on the parameters' device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor


def trust_ratios(weight_norms: Tensor, grad_norms: Tensor, eta: float,
                 weight_decay: float) -> Tensor:
    """LARS's local rate per tensor: ``eta * ||w|| / (||g|| + wd * ||w||)``, 1 where a norm is 0.

    Args:
        weight_norms: ``||w||`` of each tensor, shape (n,).
        grad_norms: ``||g||`` of each tensor's gradient (without weight decay), shape (n,).
        eta: the trust coefficient (``train.lars_eta``).
        weight_decay: the group's weight decay.

    The paper's eq. 6 (and solo-learn's form); SimCLR's TensorFlow code divides by
    ``||g + wd * w||`` instead: the paper is followed.

    Returns:
        The ratios, shape (n,). A zero weight (nothing to scale by, e.g. a zero-initialised
        layer) or a zero gradient (nothing to step) falls back to 1: a plain SGD step.
    """
    ratios = eta * weight_norms / (grad_norms + weight_decay * weight_norms)
    return torch.where((weight_norms > 0) & (grad_norms > 0), ratios, torch.ones_like(ratios))


def lars_param_groups(groups: Iterable[dict[str, Any]],
                      weight_decay: float) -> list[dict[str, Any]]:
    """Each group split in two: tensors of two or more dimensions (convolution and linear
    weights: decayed and adapted) and the rest (biases, normalisation weights: neither).

    Args:
        groups: optimizer groups ``{"params": [...], **options}``; every other option (``lr``,
            ``name``, ...) is kept by both halves. An empty half is left out.
        weight_decay: the decay of the adapted half (the other half gets 0).

    Returns:
        The groups, each half with ``adapt`` and ``weight_decay`` set, in the input's order.
    """
    split: list[dict[str, Any]] = []
    for group in groups:
        params = list(group["params"])
        options = {key: value for key, value in group.items() if key != "params"}
        matrices = [param for param in params if param.ndim > 1]
        vectors = [param for param in params if param.ndim <= 1]
        if matrices:
            split.append({**options, "params": matrices, "adapt": True,
                          "weight_decay": weight_decay})
        if vectors:
            split.append({**options, "params": vectors, "adapt": False, "weight_decay": 0.0})
    return split


def _by_device_and_dtype(params: list[Tensor]) -> Iterator[list[Tensor]]:
    """``params`` in lists of one device and dtype each (what one foreach kernel takes)."""
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for param in params:
        buckets.setdefault((param.device, param.dtype), []).append(param)
    yield from buckets.values()


class LARS(torch.optim.Optimizer):
    """Momentum SGD with LARS's layer-wise trust ratio (see the module docstring).

    Per tensor ``w`` with gradient ``g``, in a group with rate ``lr``:
    ``d = r * (g + wd * w)``, ``v = momentum * v + d`` (``v = d`` at the first step),
    ``w = w - lr * v``, with ``r`` the trust ratio (:func:`trust_ratios`) in a group with
    ``adapt`` on, else 1. With ``clip_lr`` the scale is ``min(r / lr, 1)`` instead (LARC's clip
    mode, solo-learn's ``clip_lr``): the tensor's rate ``lr * min(r / lr, 1) = min(r, lr)`` is
    the trust ratio, capped at the scheduled rate.

    Args:
        params: tensors or groups; a group may set ``lr``, ``momentum``, ``weight_decay``,
            ``eta``, ``clip_lr`` and ``adapt`` (default True).
        lr: the rate of groups without their own.
        momentum: momentum factor in [0, 1).
        weight_decay: L2 decay added to the gradient (in the adapted groups; see
            :func:`lars_param_groups`).
        eta: trust coefficient (You et al.'s 0.001; solo-learn's recipes 0.02).
        clip_lr: cap each tensor's rate at the group's rate (LARC's clip).
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, eta: float = 0.001, clip_lr: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if eta <= 0.0:
            raise ValueError(f"eta must be > 0, got {eta}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta,
                    "clip_lr": clip_lr, "adapt": True}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LARS step of every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [param for param in group["params"] if param.grad is not None]
            if any(param.grad.is_sparse for param in with_grad):
                raise ValueError("LARS does not take sparse gradients")
            for params in _by_device_and_dtype(with_grad):
                self._update(params, group)
        return loss

    def _update(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """The step of ``params`` (one device and dtype, all with gradients) in ``group``."""
        grads = [param.grad for param in params]
        lr, weight_decay = group["lr"], group["weight_decay"]
        # New tensors, never the gradients themselves (a caller may still read them).
        steps = (torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay
                 else [grad.clone() for grad in grads])
        if group["adapt"]:
            scales = trust_ratios(torch.stack(torch._foreach_norm(params)),
                                  torch.stack(torch._foreach_norm(grads)),
                                  group["eta"], weight_decay)
            if group["clip_lr"]:  # a rate of 0 steps nothing whatever the scale
                scales = (torch.clamp(scales / lr, max=1.0) if lr > 0
                          else torch.ones_like(scales))
            torch._foreach_mul_(steps, list(scales.unbind()))
        momentum = group["momentum"]
        if momentum:
            steps = self._momentum(params, steps, momentum)
        torch._foreach_add_(params, steps, alpha=-lr)

    def _momentum(self, params: list[Tensor], steps: list[Tensor],
                  momentum: float) -> list[Tensor]:
        """The velocities ``v = momentum * v + d`` (``v = d`` the first time), kept in the
        optimizer's state (checkpointed as ``momentum_buffer``, as torch's SGD names it)."""
        velocities: list[Tensor] = []
        old: list[Tensor] = []
        new: list[Tensor] = []
        for param, step in zip(params, steps, strict=True):
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = step.clone()
            else:
                old.append(state["momentum_buffer"])
                new.append(step)
            velocities.append(state["momentum_buffer"])
        if old:
            torch._foreach_mul_(old, momentum)
            torch._foreach_add_(old, new)
        return velocities


__all__ = ["LARS", "lars_param_groups", "trust_ratios"]
