"""MLP heads: projectors ``g`` and predictors ``q``."""

from __future__ import annotations

from torch import nn


def projection_mlp(
    in_dim: int,
    hidden_dim: int,
    out_dim: int,
    num_layers: int = 2,
    batch_norm: bool = True,
    last_bn: bool = False,
) -> nn.Sequential:
    """An MLP ``Linear-BN-ReLU (x num_layers-1) - Linear [- BN]``.

    ``projection_mlp(d, 2048, 128)`` is SimCLR's projector; ``num_layers=3, last_bn=True`` gives
    the 3-layer projector of BYOL-style methods such as All4One; predictors use the default 2.

    Args:
        in_dim: input features.
        hidden_dim: width of every hidden layer.
        out_dim: output features.
        num_layers: number of Linear layers, >= 1 (1 gives a single Linear).
        batch_norm: BatchNorm1d after each hidden Linear.
        last_bn: BatchNorm1d after the final Linear as well.

    Returns:
        The MLP as an ``nn.Sequential``.

    Raises:
        ValueError: on non-positive dimensions or num_layers < 1.
    """
    for arg_name, value in (("in_dim", in_dim), ("hidden_dim", hidden_dim), ("out_dim", out_dim)):
        if value < 1:
            raise ValueError(f"{arg_name} must be >= 1, got {value}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")

    layers: list[nn.Module] = []
    previous = in_dim
    for _ in range(num_layers - 1):
        # bias is redundant in front of BatchNorm
        layers.append(nn.Linear(previous, hidden_dim, bias=not batch_norm))
        if batch_norm:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers.append(nn.ReLU(inplace=True))
        previous = hidden_dim
    layers.append(nn.Linear(previous, out_dim, bias=not last_bn))
    if last_bn:
        layers.append(nn.BatchNorm1d(out_dim))
    return nn.Sequential(*layers)
