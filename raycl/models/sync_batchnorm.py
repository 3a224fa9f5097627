"""BatchNorm over a data-parallel group's global batch, on every backend (``model.sync_batchnorm``).

SimCLR's global BN, BYOL across accelerators and the multi-GPU recipes the papers follow (SyncBN)
normalise with the statistics of the whole batch, not each worker's share of it: per-worker
statistics leak batch information into the contrastive loss and change with the worker count.

:func:`convert_batchnorm` replaces every ``nn.BatchNorm1d/2d/3d`` of a model in place, keeping
the layer's parameter and buffer objects (an optimizer built before the conversion trains the
new layers; checkpoint keys are unchanged), by

- :class:`GlobalBatchNorm` on CPU (gloo) workers: torch's ``nn.SyncBatchNorm`` refuses CPU
  tensors. Each rank's per-channel (mean, sum of squared deviations, count) is all-gathered
  (:func:`raycl.distributed.gather_no_grad`) and combined exactly (Chan et al.'s pairwise
  formula: no cancellation of E[x²] - E[x]², ranks may hold different numbers of rows); the
  normalisation is torch's own kernel with those statistics. Its backward is BatchNorm's, with
  the two per-channel gradient sums (of dy and dy·x̂) all-reduced over the ranks
  (:func:`raycl.distributed.all_reduce_sum`), as torch's SyncBatchNorm does: every rank's input
  gradient is that of the concatenated batch. On one CPU thread a (128, 32, 16, 16)
  BatchNorm2d forward and backward takes 3.3 ms against plain BatchNorm's 2.8 ms before the
  collectives (autograd through the gather, and torch.var_mean, made it 8 ms).
- :class:`GuardedSyncBatchNorm` on CUDA: torch's ``nn.SyncBatchNorm``, whose CUDA kernels
  fuse what :class:`GlobalBatchNorm` does in several passes (Welford statistics in one read, the
  backward's elementwise step in one) and never wait for the host, where
  :class:`GlobalBatchNorm` reads the global row count back (a device sync per layer on a GPU).
  Reasoned from the kernels, not measured (no GPU here). Both compute the same function; the
  subclass only adds the rank-0 guard.

In eval mode both are plain BatchNorm (running statistics, no collective), so evaluation, which
ranks run on shards of different sizes or rank 0 alone, never waits for a peer. A training
forward is a collective: every rank must run it, the same number of times; one entered inside
:func:`raycl.distributed.single_rank_section` raises instead of hanging.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from raycl import distributed

# The plain BatchNorm classes converted (exact types: a subclass such as timm's BatchNormAct2d
# does more than normalise, and would lose it), with the input ranks each accepts.
INPUT_DIMS: dict[type[nn.Module], tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}


def local_moments(x: Tensor) -> Tensor:
    """This rank's per-channel statistics of ``x``, in the layout :func:`combine_moments` reads.

    Args:
        x: (N, C, ...) activations; N may be 0.

    Returns:
        (2C + 1,) tensor ``[mean (C), sum of squared deviations (C), row count]`` in float32
        (float64 for float64 input); zeros for an empty ``x``.
    """
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    stats = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    count = x.numel() // channels if channels else 0
    if count == 0:
        mean = m2 = stats.new_zeros(channels)
    else:  # two passes: torch.var_mean over (N, H, W) of NCHW is 7x slower on CPU
        mean = stats.mean(dims)
        centred = stats - mean.view((1, -1) + (1,) * (x.dim() - 2))
        m2 = centred.mul_(centred).sum(dims)
    return torch.cat([mean, m2, stats.new_tensor([float(count)])])


def combine_moments(moments: Tensor) -> tuple[Tensor, Tensor, float]:
    """The global mean and biased variance from every rank's :func:`local_moments`.

    ``mean = Σ n_r m_r / N``, ``M2 = Σ (M2_r + n_r (m_r - mean)²)``, ``var = M2 / N`` (Chan,
    Golub and LeVeque's pairwise update; exact, and free of E[x²] - E[x]²'s cancellation).

    Args:
        moments: (world_size, 2C + 1), one :func:`local_moments` row per rank.

    Returns:
        ``(mean (C), biased variance (C), N)``, with N the global row count.

    Raises:
        ValueError: when the global batch holds fewer than 2 values per channel (as torch's
            BatchNorm refuses in training: the variance would be 0 or undefined).
    """
    channels = (moments.shape[1] - 1) // 2
    means, m2s, counts = moments[:, :channels], moments[:, channels:-1], moments[:, -1:]
    total = float(counts.detach().sum())
    if total < 2:
        raise ValueError("BatchNorm over the global batch expects more than 1 value per channel "
                         f"when training, got {total:.0f} over all ranks")
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training forward normalises with the global batch's statistics and
    updates the running ones with its unbiased variance, as torch's BatchNorm does with its
    own batch's; in eval mode plain BatchNorm. Any backend, any input rank in ``input_dims``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 input_dims: tuple[int, ...] = (2, 3, 4, 5),
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.input_dims = input_dims

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() not in self.input_dims:
            raise ValueError(f"expected a {' or '.join(f'{d}D' for d in self.input_dims)} input "
                             f"(got {input.dim()}D input)")

    def _average_factor(self) -> float:
        """The running statistics' update weight for this step (torch's rule: ``momentum``, or
        the cumulative average 1 / batches when ``momentum`` is None), counting the step."""
        if not self.track_running_stats or self.num_batches_tracked is None:
            return 0.0
        self.num_batches_tracked.add_(1)
        return 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:  # running statistics (or this rank's batch without them)
            return super().forward(input)
        self._check_input_dim(input)
        with torch.no_grad():
            local = local_moments(input).unsqueeze(0)
            mean, var, total = combine_moments(distributed.gather_no_grad(local))
        factor = self._average_factor()
        if self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                unbiased = var * (total / (total - 1))
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        # torch's kernels want the statistics in the parameters' dtype (the input's without).
        dtype = self.weight.dtype if self.weight is not None else input.dtype
        return _GlobalNormalise.apply(input, self.weight, self.bias, mean.to(dtype),
                                      var.to(dtype), total, self.eps)


class _GlobalNormalise(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with the global batch's ``mean`` and
    ``var``, differentiated as BatchNorm over the global batch (the statistics depend on every
    rank's ``x``): ``dx = w·invstd·(dy - mean(dy) - x̂·mean(dy·x̂))`` with the means over the
    global batch (one all-reduce of two per-channel sums); ``dw``, ``db``: this rank's rows'
    sums, which DDP then combines like any parameter gradient."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                mean: Tensor, var: Tensor, total: float, eps: float) -> Tensor:
        ctx.save_for_backward(x, weight, mean, torch.rsqrt(var + eps))
        ctx.total, ctx.eps = total, eps  # type: ignore[attr-defined]
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors  # type: ignore[attr-defined]
        channels = x.shape[1]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        if x.numel():  # this rank's sum(dy) and sum(dy·x̂) in one fused pass
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad, x, torch.ones_like(invstd), None, None, mean, invstd, True, ctx.eps,
                [False, True, True])
        else:  # no rows here (the kernel divides by the row count)
            sum_dy_xhat = sum_dy = invstd.new_zeros(channels)
        grad_x = None
        if ctx.needs_input_grad[0]:  # the same on every rank, so all of them reduce or none
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            sums = distributed.all_reduce_sum(torch.cat([sum_dy, sum_dy_xhat]).to(invstd.dtype))
            mean_dy, mean_dy_xhat = sums[:channels] / ctx.total, sums[channels:] / ctx.total
            # scale·dy - scale·mean(dy) - (x - mean)·scale·invstd·mean(dy·x̂)
            grad_x = torch.addcmul((-mean_dy * scale).view(shape), grad.to(scale.dtype),
                                   scale.view(shape))
            grad_x.addcmul_(x.to(scale.dtype) - mean.view(shape),
                            (-scale * invstd * mean_dy_xhat).view(shape))
            grad_x = grad_x.to(x.dtype)
        grad_weight = (sum_dy_xhat.to(weight.dtype)
                       if weight is not None and ctx.needs_input_grad[1] else None)
        grad_bias = (sum_dy.to(weight.dtype if weight is not None else sum_dy.dtype)
                     if ctx.needs_input_grad[2] else None)
        return grad_x, grad_weight, grad_bias, None, None, None, None


class GuardedSyncBatchNorm(nn.SyncBatchNorm):
    """torch's ``nn.SyncBatchNorm`` (CUDA) whose training forward, a collective torch enters
    itself, first passes the rank-0 guard of :mod:`raycl.distributed`."""

    def forward(self, input: Tensor) -> Tensor:
        if self.training:
            distributed.guard_collective("all_gather (SyncBatchNorm's training forward)")
        return super().forward(input)


def _global_layer(layer: nn.Module, fused_cuda: bool) -> nn.Module:
    """A :class:`GlobalBatchNorm` (or :class:`GuardedSyncBatchNorm`) holding ``layer``'s own
    parameter and buffer objects, in ``layer``'s training mode."""
    assert isinstance(layer, _BatchNorm)
    settings = dict(eps=layer.eps, momentum=layer.momentum, affine=layer.affine,
                    track_running_stats=layer.track_running_stats, device="meta")
    new: nn.Module = (GuardedSyncBatchNorm(layer.num_features, **settings) if fused_cuda
                      else GlobalBatchNorm(layer.num_features, input_dims=INPUT_DIMS[type(layer)],
                                           **settings))
    # The meta placeholders give way to the layer's tensors (None where it has none).
    for name in ("weight", "bias"):
        setattr(new, name, getattr(layer, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        new._buffers[name] = layer._buffers.get(name)
    new.train(layer.training)
    return new


def convert_batchnorm(model: nn.Module, fused_cuda: bool = False) -> int:
    """Replaces every plain BatchNorm layer inside ``model`` (:data:`INPUT_DIMS`), in place, by
    one over the global batch holding the same parameters and buffers (state-dict keys and an
    optimizer's references unchanged). Layers already converted are left as they are, so a
    second call (a later phase's DDP wrap) changes nothing.

    Args:
        model: the module whose layers are replaced (momentum copies and other submodules
            included).
        fused_cuda: torch's fused ``nn.SyncBatchNorm`` (CUDA only) instead of
            :class:`GlobalBatchNorm` (every device).

    Returns:
        The number of layers replaced.

    Raises:
        TypeError: when ``model`` is itself a BatchNorm layer (there is no parent to put the
            replacement in).
    """
    if type(model) in INPUT_DIMS:
        raise TypeError("convert_batchnorm converts the BatchNorm layers inside a model, not one "
                        "layer")
    # A layer shared by two parents is replaced once (the originals are kept here, so no id is
    # reused while walking).
    replaced: dict[int, tuple[nn.Module, nn.Module]] = {}
    _convert_children(model, fused_cuda, replaced)
    return len(replaced)


def _convert_children(
    module: nn.Module, fused_cuda: bool, replaced: dict[int, tuple[nn.Module, nn.Module]]
) -> None:
    """:func:`convert_batchnorm`'s walk below ``module``."""
    for name, child in list(module.named_children()):
        if type(child) in INPUT_DIMS:
            if id(child) not in replaced:
                replaced[id(child)] = (child, _global_layer(child, fused_cuda))
            module.add_module(name, replaced[id(child)][1])
        else:
            _convert_children(child, fused_cuda, replaced)


__all__ = ["INPUT_DIMS", "GlobalBatchNorm", "GuardedSyncBatchNorm", "combine_moments",
           "convert_batchnorm", "local_moments"]
