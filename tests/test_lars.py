"""LARS (raycl.worker.lars), the base learning rate's linear scaling and where both are wired:
the optimizer of a phase, the refusal of LARS for transformer methods before launch."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from raycl.launch.optimizer_check import check_optimizer
from raycl.methods import SearchConfig
from raycl.methods.all4one import All4One
from raycl.methods.base import TRAIN_PHASE, Phase
from raycl.tune import main
from raycl.worker.lars import LARS, lars_param_groups, trust_ratios
from raycl.worker.optim import build_optimizer, effective_lr

TINY_ALL4ONE: dict[str, Any] = {
    "name": "x", "method": "all4one",
    "model": {"backbone": "small_cnn", "width": 8, "projector_hidden_dim": 32,
              "projector_dim": 16},
    "all4one": {"queue_size": 30, "predictor_hidden_dim": 32, "neighbours": 3,
                "transformer_layers": 1, "transformer_heads": 2, "transformer_feedforward": 32},
}


def tiny_layer(weight: list[float], bias: float) -> nn.Linear:
    """A Linear(2, 1) with the given weight row and bias."""
    layer = nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([weight]))
        layer.bias.fill_(bias)
    return layer


def lars_step(layer: nn.Linear, optimizer: torch.optim.Optimizer, weight_grad: list[float],
              bias_grad: float) -> None:
    """One optimizer step with the given gradients."""
    layer.weight.grad = torch.tensor([weight_grad])
    layer.bias.grad = torch.tensor([bias_grad])
    optimizer.step()


def test_two_steps_match_the_hand_computed_update() -> None:
    """lr 0.2, momentum 0.9, weight decay 0.1, eta 0.5; the bias is neither decayed nor adapted.

    Step 1: |w| = |(3, 4)| = 5, |g| = |(0.6, 0.8)| = 1: ratio 0.5 x 5 / (1 + 0.1 x 5) = 5/3,
    d = 5/3 (g + 0.1 w) = 5/3 (0.9, 1.2) = (1.5, 2.0) = v, w = (3, 4) - 0.2 v = (2.7, 3.6).
    Step 2: |w| = 4.5, |g| = |(0.33, 0.44)| = 0.55: ratio 0.5 x 4.5 / (0.55 + 0.45) = 2.25,
    d = 2.25 ((0.33, 0.44) + (0.27, 0.36)) = (1.35, 1.8), v = 0.9 (1.5, 2.0) + d = (2.7, 3.6),
    w = (2.7, 3.6) - 0.2 v = (2.16, 2.88).
    Bias (plain momentum SGD, no decay): 2 - 0.2 x 0.5 = 1.9; v = 0.9 x 0.5 + 1 = 1.45,
    1.9 - 0.2 x 1.45 = 1.61.
    """
    layer = tiny_layer([3.0, 4.0], 2.0)
    groups = lars_param_groups([{"params": layer.parameters()}], weight_decay=0.1)
    optimizer = LARS(groups, lr=0.2, momentum=0.9, weight_decay=0.1, eta=0.5)

    lars_step(layer, optimizer, [0.6, 0.8], 0.5)
    assert layer.weight[0].tolist() == pytest.approx([2.7, 3.6])
    assert layer.bias.tolist() == pytest.approx([1.9])
    lars_step(layer, optimizer, [0.33, 0.44], 1.0)
    assert layer.weight[0].tolist() == pytest.approx([2.16, 2.88])
    assert layer.bias.tolist() == pytest.approx([1.61])
    assert layer.weight.grad[0].tolist() == pytest.approx([0.33, 0.44])  # gradients untouched


def test_clip_lr_caps_the_trust_ratio_at_the_rate() -> None:
    """clip_lr: the tensor steps at min(ratio, lr) x (g + wd w). eta 0.05: ratio 0.05 x 5 / 1.5
    = 1/6 < lr 0.2, so w = (3, 4) - 1/6 (0.9, 1.2) = (2.85, 3.8); eta 0.5 (ratio 5/3 > lr):
    w = (3, 4) - 0.2 (0.9, 1.2) = (2.82, 3.76), plain SGD."""
    for eta, expected in ((0.05, [2.85, 3.8]), (0.5, [2.82, 3.76])):
        layer = tiny_layer([3.0, 4.0], 2.0)
        groups = lars_param_groups([{"params": layer.parameters()}], weight_decay=0.1)
        optimizer = LARS(groups, lr=0.2, momentum=0.9, weight_decay=0.1, eta=eta, clip_lr=True)
        lars_step(layer, optimizer, [0.6, 0.8], 0.5)
        assert layer.weight[0].tolist() == pytest.approx(expected)


def test_a_zero_weight_or_gradient_takes_a_plain_sgd_step() -> None:
    """Ratio 1 where a norm is 0 (no 0/0): a zero weight steps by -lr g; a zero gradient by the
    decay alone, -lr wd w."""
    assert trust_ratios(torch.tensor([0.0, 2.0, 0.0, 5.0]), torch.tensor([1.0, 0.0, 0.0, 1.0]),
                        eta=0.5, weight_decay=0.1).tolist() == pytest.approx([1, 1, 1, 5 / 3])
    zero_weight = tiny_layer([0.0, 0.0], 0.0)
    optimizer = LARS(lars_param_groups([{"params": zero_weight.parameters()}], 0.1),
                     lr=0.2, momentum=0.9, weight_decay=0.1, eta=0.5)
    lars_step(zero_weight, optimizer, [0.6, 0.8], 0.0)
    assert zero_weight.weight[0].tolist() == pytest.approx([-0.12, -0.16])
    assert zero_weight.bias.tolist() == [0.0]
    zero_grad = tiny_layer([3.0, 4.0], 1.0)
    optimizer = LARS(lars_param_groups([{"params": zero_grad.parameters()}], 0.1),
                     lr=0.2, momentum=0.9, weight_decay=0.1, eta=0.5)
    lars_step(zero_grad, optimizer, [0.0, 0.0], 0.0)
    assert zero_grad.weight[0].tolist() == pytest.approx([2.94, 3.92])


def test_groups_split_into_adapted_weights_and_excluded_vectors() -> None:
    """Every matrix is adapted and decayed, every 1-D tensor (bias, norm weight) neither; each
    half keeps its group's options (rate, name); an empty half is left out."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2, bias=False))
    groups = [{"params": list(model[0].parameters()) + list(model[1].parameters()),
               "name": "default", "lr": 0.3},
              {"params": list(model[2].parameters()), "name": "head", "lr": 0.1}]
    split = lars_param_groups(groups, weight_decay=1e-5)
    assert [(group["name"], group["lr"], group["adapt"], group["weight_decay"],
             [tuple(param.shape) for param in group["params"]]) for group in split] == [
        ("default", 0.3, True, 1e-5, [(4, 3)]),
        ("default", 0.3, False, 0.0, [(4,), (4,), (4,)]),
        ("head", 0.1, True, 1e-5, [(2, 4)]),
    ]


def test_all4one_transformer_keeps_its_own_rate_and_is_adapted() -> None:
    """With lars, All4One's groups keep their rates after the split (ψ's absolute
    transformer_lr, unscaled by lr_scaling, as solo-learn's 0.1), its matrices are adapted (as
    solo-learn: one LARS optimizer over every group) and its biases and norms are not."""
    cfg = SearchConfig.model_validate({
        **TINY_ALL4ONE, "all4one": {**TINY_ALL4ONE["all4one"], "transformer_lr": 0.1},
        "train": {"optimizer": "lars", "lr": 0.3, "batch_size": 512, "lr_scaling": "linear"}})
    method = All4One.from_config(cfg, 1)
    optimizer = build_optimizer(method, cfg)
    assert isinstance(optimizer, LARS)
    summary = [(group["name"], group["adapt"], group["lr"]) for group in optimizer.param_groups]
    scaled = pytest.approx(0.3 * 512 / 256)
    assert summary == [("default", True, scaled), ("default", False, scaled),
                       ("transformer", True, 0.1), ("transformer", False, 0.1)]
    psi = {id(param) for param in method.psi.parameters()}
    transformer = [param for group in optimizer.param_groups if group["name"] == "transformer"
                   for param in group["params"]]
    assert {id(param) for param in transformer} == psi
    assert all(param.ndim <= 1 for group in optimizer.param_groups if not group["adapt"]
               for param in group["params"])
    assert all(group["weight_decay"] == 0.0 for group in optimizer.param_groups
               if not group["adapt"])


def test_linear_scaling_multiplies_train_lr_by_the_global_batch_over_256() -> None:
    """lr x b / 256 for train.lr (and the groups relative to it); a phase's own rate as written."""
    def config(**train: Any) -> SearchConfig:
        return SearchConfig.model_validate({**TINY_ALL4ONE, "train": train})

    assert effective_lr(config(lr=0.4, batch_size=512, lr_scaling="linear")) == \
        pytest.approx(0.8)
    assert effective_lr(config(lr=0.4, batch_size=64, lr_scaling="linear")) == \
        pytest.approx(0.1)
    assert effective_lr(config(lr=0.4, batch_size=512)) == 0.4  # none: as written
    scaled = config(lr=0.4, batch_size=512, lr_scaling="linear")
    assert effective_lr(scaled, Phase("decoder", lr=1e-4)) == 1e-4
    assert effective_lr(scaled, TRAIN_PHASE) == pytest.approx(0.8)
    # A group relative to the base rate follows it.
    relative = SearchConfig.model_validate({
        **TINY_ALL4ONE, "all4one": {**TINY_ALL4ONE["all4one"], "transformer_lr_scale": 0.5},
        "train": {"lr": 0.4, "batch_size": 512, "lr_scaling": "linear", "optimizer": "sgd"}})
    optimizer = build_optimizer(All4One.from_config(relative, 1), relative)
    assert {group["name"]: group["initial_lr"] for group in optimizer.param_groups} == \
        pytest.approx({"default": 0.8, "transformer": 0.4})


CLIP_SEARCH = """
name: t
method: clip
data: {dataset: trifeature, resolution: 16, samples_per_combination: 1,
       captions: {color: 1.0}}
clip: {tiny_width: 32, tiny_layers: 2, tiny_text_layers: 1, tiny_context_length: 12}
train: {epochs: 1, batch_size: 32}
tune: {num_samples: 1}
"""


def test_lars_for_a_transformer_method_is_one_line_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(CLIP_SEARCH))
    code = main([str(path), "--set", "train.optimizer=lars", "--storage", str(tmp_path / "ray")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {path}: train.optimizer: lars is for convolutional encoders (LARS 'only for "
        f"CNNs', as the papers); clip trains transformers: use adamw")
    assert not (tmp_path / "ray").exists()


def test_a_searched_lars_is_refused_for_clip_and_fine_for_a_cnn_method() -> None:
    space = {"train.optimizer": {"choice": ["adamw", "lars"]}}
    clip = SearchConfig.model_validate({"name": "t", "method": "mcl", "mcl": {"base": "clip"},
                                        "tune": {"search_space": space}})
    problems = list(check_optimizer(clip))
    assert [(problem.key, problem.why.split(":")[0]) for problem in problems] == [
        ("train.optimizer", "with searched train.optimizer=lars")]
    cnn = SearchConfig.model_validate({**TINY_ALL4ONE, "train": {"optimizer": "lars"}})
    assert list(check_optimizer(cnn)) == []


def test_a_checkpointed_optimizer_resumes_with_the_same_steps() -> None:
    """The state (momentum per tensor, across the split groups) survives state_dict and
    load_state_dict: a resumed optimizer takes the same next step as one never stopped."""
    def model_and_optimizer(seed: int) -> tuple[nn.Module, LARS]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        return model, LARS(lars_param_groups([{"params": model.parameters()}], 1e-4), lr=0.1,
                           momentum=0.9, weight_decay=1e-4, eta=0.02)

    def step(model: nn.Module, optimizer: LARS, batch: int) -> None:
        optimizer.zero_grad()
        inputs = torch.randn(8, 3, generator=torch.Generator().manual_seed(batch))
        model(inputs).square().mean().backward()
        optimizer.step()

    running, optimizer = model_and_optimizer(0)
    step(running, optimizer, 1)
    resumed, fresh = model_and_optimizer(1)
    resumed.load_state_dict(running.state_dict())
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as read from a checkpoint
    step(running, optimizer, 2)
    step(resumed, fresh, 2)
    for kept, restored in zip(running.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(kept, restored)
