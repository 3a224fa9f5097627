"""``model.sync_batchnorm``: BatchNorm over the global batch (raycl.models.sync_batchnorm).

In a real two-worker gloo world (spawned once for every check, with ranks holding different
numbers of rows), a projector (BatchNorm1d) and a conv backbone (BatchNorm2d), converted and
wrapped in DDP as a trial's worker does, give the outputs, running statistics and input
gradients of plain BatchNorm on the concatenated batch in one process, and parameter gradients
that DDP's averaging makes 1/world of the concatenated batch's; the momentum (EMA) copy of a
converted model works the same; eval mode enters no collective (rank 0 alone runs it inside the
rank-0 guard) and equals plain BatchNorm; with sync off each rank keeps its own statistics.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fake_world import run_fake_world
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from raycl.distributed import CollectiveInSingleRankSection, single_rank_section
from raycl.models.momentum import ema_update, momentum_copy
from raycl.models.sync_batchnorm import (
    GlobalBatchNorm,
    GuardedSyncBatchNorm,
    combine_moments,
    convert_batchnorm,
    local_moments,
)

WORLD_SIZE = 2
# The tests reading the world, on one xdist worker: the world is spawned once.
IN_THE_WORLD = pytest.mark.xdist_group("sync-batchnorm-world")


def _randomise_batchnorm(model: nn.Module, seed: int) -> nn.Module:
    """Affine parameters and running statistics away from their 1 / 0 defaults, so that each
    one shows in the output (float64 model)."""
    generator = torch.Generator().manual_seed(seed)
    model.double()
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                for tensor in (layer.weight, layer.bias, layer.running_mean):
                    tensor.copy_(torch.rand(tensor.shape, generator=generator,
                                            dtype=tensor.dtype) + 0.5)
                layer.running_var.fill_(2.0)
    return model


def _projector() -> nn.Module:
    """A projector MLP with BatchNorm after the hidden and the output layer (SimSiam's)."""
    torch.manual_seed(0)
    return _randomise_batchnorm(nn.Sequential(
        nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3), nn.BatchNorm1d(3)), 1)


def _backbone() -> nn.Module:
    """A conv block with BatchNorm2d, pooled to a vector."""
    torch.manual_seed(0)
    return _randomise_batchnorm(nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)), 2)


# name -> (model builder, rows of rank 0 and rank 1): unequal shares of the global batch, and
# a rank with none (a short last shard).
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, int]]] = {
    "projector": (_projector, (5, 3)),
    "backbone": (_backbone, (4, 1)),
    "projector_rank1_empty": (_projector, (8, 0)),
}
# Plain BatchNorm refuses a training batch of one value per channel: no per-rank reference.
PER_RANK_CASES = ("projector", "backbone")


def _inputs() -> dict[str, tuple[Tensor, Tensor]]:
    """Each case's global batch and the fixed weights ``g`` of its loss ``sum(g * output)``."""
    generator = torch.Generator().manual_seed(3)
    shapes = {"projector": ((8, 5), (8, 3)), "backbone": ((5, 2, 4, 4), (5, 2)),
              "projector_rank1_empty": ((8, 5), (8, 3))}
    return {name: (torch.randn(x_shape, generator=generator, dtype=torch.float64) * 2 + 1,
                   torch.randn(g_shape, generator=generator, dtype=torch.float64))
            for name, (x_shape, g_shape) in shapes.items()}


def _share(rows: tuple[int, int], rank: int) -> slice:
    """Rank ``rank``'s rows of the global batch."""
    start = sum(rows[:rank])
    return slice(start, start + rows[rank])


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()
            if "running" in name or "num_batches" in name}


def _train_step(model: nn.Module, x: Tensor, g: Tensor) -> dict[str, Any]:
    """One training forward and backward of ``sum(g * model(x))``: output, input and parameter
    gradients, buffers after."""
    x = x.clone().requires_grad_()
    out = model(x)
    (g * out).sum().backward()
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {"out": out.detach(), "x_grad": x.grad,
            "grads": [p.grad.clone() for p in inner.parameters()], "buffers": _buffers(inner)}


def _rank_checks(rank: int, inputs: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Any]:
    """What one rank measures (see the module docstring)."""
    results: dict[str, Any] = {}
    for name, (build, rows) in CASES.items():
        x, g = (t[_share(rows, rank)] for t in inputs[name])
        model = build()
        convert_batchnorm(model)
        synced = _train_step(DistributedDataParallel(model), x, g)
        # The momentum copy of the converted model: EMA step, then its own training forward.
        target = momentum_copy(model)
        ema_update(model, target, 0.5)
        with torch.no_grad():
            synced["target_out"] = target(x)
        synced["target_buffers"] = _buffers(target)
        model.eval()
        if rank == 0:  # alone, inside the guard: eval mode must enter no collective
            with single_rank_section("rank 0's evaluation"):
                synced["eval_out"] = model(inputs[name][0])
            model.train()
            try:
                with single_rank_section("rank 0's training forward"):
                    model(x)
                synced["guard"] = "no error"
            except CollectiveInSingleRankSection:
                synced["guard"] = "raised"
        results[name] = synced
        if name in PER_RANK_CASES:  # model.sync_batchnorm: false: the same model, not converted
            results[f"{name}_per_rank"] = _train_step(DistributedDataParallel(build()), x, g)
    return results


def _worker(rank: int, init_method: str, inputs: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    try:
        torch.save(_rank_checks(rank, inputs), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The inputs, and what each rank of one two-worker run measured."""
    tmp = tmp_path_factory.mktemp("sync-bn")
    inputs = _inputs()
    run_fake_world(_worker, (f"file://{tmp / 'rendezvous'}", inputs, str(tmp)), WORLD_SIZE)
    return inputs, [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD_SIZE)]


def _concatenated(name: str, inputs: dict[str, tuple[Tensor, Tensor]]) -> tuple[nn.Module,
                                                                                 dict[str, Any]]:
    """Plain BatchNorm on the concatenated batch, in one process: the model after the step, and
    what the step measured."""
    model = CASES[name][0]()
    return model, _train_step(model, *inputs[name])


@IN_THE_WORLD
@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_statistics_and_gradients_are_the_concatenated_batchs(
    name: str, world: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    inputs, ranks = world
    _, reference = _concatenated(name, inputs)
    torch.testing.assert_close(torch.cat([r[name]["out"] for r in ranks]), reference["out"])
    # The input gradient of each rank's rows is the concatenated batch's (the gradient through
    # the global statistics comes back from the other rank's loss)...
    torch.testing.assert_close(torch.cat([r[name]["x_grad"] for r in ranks]),
                               reference["x_grad"])
    for rank in ranks:
        # ... each rank's loss is its rows' share of the sum, and DDP averages: 1 / world.
        for synced, single in zip(rank[name]["grads"], reference["grads"], strict=True):
            torch.testing.assert_close(synced, single / WORLD_SIZE)
        # Running statistics: the global batch's (unbiased variance), the same on every rank.
        for key, value in reference["buffers"].items():
            torch.testing.assert_close(rank[name]["buffers"][key], value, msg=key)


@IN_THE_WORLD
@pytest.mark.parametrize("name", sorted(CASES))
def test_momentum_copy_and_eval_mode(
    name: str, world: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    """The EMA copy of a converted model normalises over the global batch too; eval mode is
    plain BatchNorm on the running statistics, and rank 0 ran it alone (no collective); a
    training forward there raised instead of waiting for rank 1."""
    inputs, ranks = world
    model, _ = _concatenated(name, inputs)
    target = copy.deepcopy(model)
    with torch.no_grad():
        target_out = target(inputs[name][0])
    torch.testing.assert_close(torch.cat([r[name]["target_out"] for r in ranks]), target_out)
    for key, value in _buffers(target).items():
        torch.testing.assert_close(ranks[1][name]["target_buffers"][key], value, msg=key)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(ranks[0][name]["eval_out"], model(inputs[name][0]))
    assert ranks[0][name]["guard"] == "raised"


@IN_THE_WORLD
@pytest.mark.parametrize("name", PER_RANK_CASES)
def test_without_sync_each_rank_keeps_its_own_statistics(
    name: str, world: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    inputs, ranks = world
    build, rows = CASES[name]
    for rank, result in enumerate(ranks):
        x, g = (t[_share(rows, rank)] for t in inputs[name])
        alone = _train_step(build(), x, g)
        torch.testing.assert_close(result[f"{name}_per_rank"]["out"], alone["out"])
        for key, value in alone["buffers"].items():
            torch.testing.assert_close(result[f"{name}_per_rank"]["buffers"][key], value)
    _, global_step = _concatenated(name, inputs)
    assert not torch.allclose(ranks[0][f"{name}_per_rank"]["buffers"]["1.running_mean"],
                              global_step["buffers"]["1.running_mean"])


# --- one process -----------------------------------------------------------------------------

def test_combine_moments_on_a_hand_computed_case() -> None:
    """Ranks holding [1, 2, 3] and [10]: mean 4, biased variance (9 + 4 + 1 + 36) / 4 = 12.5."""
    moments = torch.stack([local_moments(torch.tensor([[1.0], [2.0], [3.0]])),
                           local_moments(torch.tensor([[10.0]])),
                           local_moments(torch.zeros(0, 1))])  # a rank with no rows
    mean, var, total = combine_moments(moments)
    assert total == 4
    torch.testing.assert_close(mean, torch.tensor([4.0]))
    torch.testing.assert_close(var, torch.tensor([12.5]))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        combine_moments(local_moments(torch.tensor([[1.0]])).unsqueeze(0))


def test_conversion_keeps_parameters_buffers_keys_and_the_optimizer() -> None:
    """Every plain BatchNorm layer (momentum copies included) is replaced in place by one that
    holds the same tensors: state-dict keys unchanged, and an optimizer built before trains the
    new layers. A second conversion (the next phase's wrap) changes nothing."""
    online = _projector()
    method = nn.ModuleDict({"online": online, "momentum": momentum_copy(online)})
    params, buffers = list(method.parameters()), list(method.buffers())
    keys = list(method.state_dict())
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1)
    assert convert_batchnorm(method) == 4
    assert convert_batchnorm(method) == 0
    layers = [m for m in method.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert [type(m) for m in layers] == [GlobalBatchNorm] * 4
    assert layers[0].input_dims == (2, 3)
    assert all(a is b for a, b in zip(params, method.parameters(), strict=True))
    assert all(a is b for a, b in zip(buffers, method.buffers(), strict=True))
    assert list(method.state_dict()) == keys
    weight = online[1].weight
    before = weight.detach().clone()
    # (a plain sum of the output-BatchNorm'd projections would not depend on the hidden layer)
    out = online(torch.randn(4, 5, dtype=torch.float64))
    (out * torch.randn_like(out)).sum().backward()
    optimizer.step()
    assert not torch.equal(weight, before)
    with pytest.raises(TypeError, match="not one layer"):
        convert_batchnorm(nn.BatchNorm1d(3))


def test_one_rank_is_plain_batchnorm_and_the_guard_covers_both_layers() -> None:
    """In one process the converted layer is plain BatchNorm (cumulative average included),
    and inside a rank-0 section its training forward raises at once, as torch's fused one on
    CUDA does (checked before torch's own CPU refusal); eval forwards pass."""
    torch.manual_seed(0)
    plain = _randomise_batchnorm(nn.Sequential(nn.BatchNorm2d(3, momentum=None)), 4)
    converted = copy.deepcopy(plain)
    convert_batchnorm(converted)
    for _ in range(2):
        x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
        torch.testing.assert_close(converted(x), plain(x))
    torch.testing.assert_close(_buffers(converted), _buffers(plain))
    fused = nn.Sequential(nn.BatchNorm1d(3))
    convert_batchnorm(fused, fused_cuda=True)
    assert type(fused[0]) is GuardedSyncBatchNorm
    for model, x in ((converted, torch.randn(4, 3, 2, 2, dtype=torch.float64)),
                     (fused, torch.randn(4, 3))):
        with single_rank_section("a test's rank-0 block"):
            with pytest.raises(CollectiveInSingleRankSection, match="rank-0 block"):
                model(x)
            model.eval()
            model(x)
        model.train()
