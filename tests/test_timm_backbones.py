"""``model.backbone: timm/<name>`` (issue 52): any timm model trains with the methods that read a
feature vector, starts from a local timm file checked key by key, and is refused before launch
in one line when timm, the data or the optimizer cannot take it. Tiny ViTs (one block, 32 wide)
on 16 px Trifeature: seconds on a CPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_reliability import TINY, StoredSession

from raycl.config.schema import ConfigError
from raycl.launch.checks import CONFIG_CHECKS, run_checks
from raycl.launch.load import load_search
from raycl.methods import SearchConfig, build_method
from raycl.models import build_backbone
from raycl.models.timm_backbones import create, read_timm_state
from raycl.worker import epoch as epoch_module
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop
from raycl.worker.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "searches" / "quickstart.yaml"
VIT = "timm/vit_tiny_patch16_224"
# A ViT for 16 px images: 4 px patches (a 4 x 4 grid), one block, 32 wide.
VIT_KWARGS: dict[str, Any] = {"img_size": 16, "patch_size": 4, "depth": 1, "embed_dim": 32,
                              "num_heads": 2}


def vit_config(method: str, **sections: dict[str, Any]) -> SearchConfig:
    raw: dict[str, Any] = {**TINY, "method": method,
                           "model": {**TINY["model"], "backbone": VIT, "timm_kwargs": VIT_KWARGS},
                           "train": {**TINY["train"], "epochs": 2},
                           "eval": {**TINY["eval"], "every_n_epochs": 1}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return SearchConfig.model_validate(raw)


@pytest.mark.parametrize(("method", "section"), [
    # With a ViT recipe's clipping and layer-wise decay (read below).
    ("simclr", {"train": {"grad_clip_norm": 1.0, "layer_decay": 0.5}}),
    ("mocov2", {"mocov2": {"queue_size": 128}}),
    ("nnclr", {"nnclr": {"queue_size": 256, "predictor_hidden_dim": 32}}),
    # MCL over SimCLR: a fresh ViT per stage, the stages' features concatenated.
    ("mcl", {"mcl": {"base": "simclr", "stages": 2, "clusters": 2, "kmeans_iterations": 10},
             "train": {"epochs": 1}}),
])
def test_a_vit_trains_and_evaluates_with_each_method(
        method: str, section: dict[str, Any], tmp_path: Path, one_torch_thread: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = vit_config(method, **section)
    model = build_method(config, 3)
    # The encoder is timm's ViT, its pooled class token the projector's input.
    assert type(model.backbone).__name__ == "VisionTransformer"
    assert model.feature_dim == 32
    before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    session = StoredSession(tmp_path / "run")
    clipped: list[float] = []

    def recording_clip(params: Any, max_norm: float) -> torch.Tensor:
        clipped.append(max_norm)
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    monkeypatch.setattr(epoch_module, "clip_grad_norm_", recording_clip)
    run_trial_loop(TrialContext(config=config), session)
    # Clipped at every step when asked (Trifeature at 1 sample per combination: 15 steps of 64
    # over 2 epochs), never otherwise.
    assert clipped == ([1.0] * len(clipped) if config.train.grad_clip_norm else [])
    assert bool(clipped) == bool(config.train.grad_clip_norm)
    assert [(report["stage"], report["epoch"]) for report in session.reports] == \
        ([(0, 1), (1, 1)] if method == "mcl" else [(0, 1), (0, 2)])
    final = session.reports[-1]
    assert math.isfinite(final["train/loss"]) and 0.0 <= final["val/linear/mean"] <= 1.0
    assert "test/linear/mean" in final
    if method == "mcl":  # the integrated encoder: both stages' ViT features side by side
        assert final["stage"] == 1 and "stage1/test/linear/mean" in final
        return
    # The ViT's weights are what trained: the checkpoint's attention weights moved.
    (checkpoint,) = sorted((tmp_path / "run").glob("checkpoint_*"))[-1:]
    state = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=True)["model"]
    key = "blocks.0.attn.qkv.weight"
    assert not torch.equal(state[f"backbone.{key}"], before[key])


def test_a_local_timm_file_is_read_key_by_key_and_a_classifier_dropped(tmp_path: Path) -> None:
    import timm

    # A file as timm saves one, classifier included (a DINO or ImageNet checkpoint has one).
    with_head = timm.create_model(VIT[5:], pretrained=False, num_classes=10, **VIT_KWARGS)
    path = tmp_path / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in with_head.state_dict().items()}, str(path))
    backbone, dim = build_backbone(VIT, 3, pretrained=str(path), timm_kwargs=VIT_KWARGS)
    assert dim == 32
    for key, value in backbone.state_dict().items():
        assert torch.equal(value, with_head.state_dict()[key]), key
    # A raycl checkpoint's backbone.* weights are read too (continued from another trial).
    trial = tmp_path / "state.pt"
    torch.save({"model": {f"backbone.{k}": v for k, v in backbone.state_dict().items()}}, trial)
    assert set(read_timm_state(trial, backbone)) == set(backbone.state_dict())
    # Weights of another image size (DINOv2's 518 px for 16 px images): timm's own filter
    # resamples the position embedding; every other weight is the file's.
    larger = tmp_path / "larger.pth"
    torch.save(create(VIT, 3, {**VIT_KWARGS, "img_size": 32}).state_dict(), larger)
    resized, _ = build_backbone(VIT, 3, pretrained=str(larger), timm_kwargs=VIT_KWARGS)
    assert tuple(resized.pos_embed.shape) == (1, 17, 32)
    assert torch.equal(resized.blocks[0].attn.qkv.weight,
                       torch.load(larger, weights_only=True)["blocks.0.attn.qkv.weight"])
    # A file of another width is one line naming the first key that differs.
    wider = tmp_path / "wider.pth"
    torch.save(create(VIT, 3, {**VIT_KWARGS, "embed_dim": 64}).state_dict(), wider)
    with pytest.raises(ValueError, match=r"cls_token has shape \(1, 1, 64\) in .*wider.pth but "
                                         r"the timm/vit_tiny_patch16_224 backbone expects "
                                         r"\(1, 1, 32\)"):
        build_backbone(VIT, 3, pretrained=str(wider), timm_kwargs=VIT_KWARGS)


def _problems(*overrides: str) -> str:
    """The lines the launch prints for quickstart.yaml with ``overrides`` (its checks run)."""
    with pytest.raises(ConfigError) as caught:
        load_search(QUICKSTART, list(overrides))
    return str(caught.value)


def test_what_timm_or_the_data_cannot_take_is_one_line_before_launch(tmp_path: Path) -> None:
    kwargs = "model.timm_kwargs={img_size: 32, patch_size: 4, depth: 1}"
    fine = load_search(QUICKSTART, [f"model.backbone={VIT}", kwargs])
    run_checks(fine, "q.yaml", CONFIG_CHECKS)  # nothing to say
    assert _problems("model.backbone=timm/vit_tiny_patch16") == (
        f"{QUICKSTART}: model.backbone: 'vit_tiny_patch16' is not a timm model "
        "(timm.list_models()); close: timm/vit_tiny_patch16_384, timm/vit_tiny_patch16_224, "
        "timm/deit_tiny_patch16_224")
    assert "data.resolution: timm/vit_tiny_patch16_224 with model.timm_kwargs {} cannot take " \
        "32 px images" in _problems(f"model.backbone={VIT}")
    assert "model.timm_kwargs: timm.create_model('vit_tiny_patch16_224', in_chans=3, " \
        "**{'depth': 1, 'bogus': 2}) fails: " in _problems(
            f"model.backbone={VIT}", "model.timm_kwargs={depth: 1, bogus: 2}")
    assert "train.optimizer: lars is for convolutional encoders" in _problems(
        f"model.backbone={VIT}", kwargs, "train.optimizer=lars")
    run_checks(load_search(QUICKSTART, ["model.backbone=timm/convnext_atto",
                                        "train.optimizer=lars"]), "q.yaml", CONFIG_CHECKS)
    wider = tmp_path / "wider.pth"
    torch.save(create(VIT, 3, {"img_size": 32, "patch_size": 4, "depth": 1, "embed_dim": 64,
                               "num_heads": 2}).state_dict(), wider)
    assert "model.pretrained: cls_token has shape (1, 1, 64) in " in _problems(
        f"model.backbone={VIT}", kwargs, f"model.pretrained={wider}")
    # Searched backbones are each checked, the line naming the combination.
    assert "with searched model.backbone=timm/not_a_model: " in _problems(
        "tune.search_space={model.backbone: {choice: [small_cnn, timm/not_a_model]}}")
    for bad, line in ((["model.backbone=vit"], "model.backbone: unknown backbone 'vit'"),
                      (["model.timm_kwargs={img_size: 32}"],
                       "model.timm_kwargs: for a timm/ backbone, not small_cnn"),
                      ([f"model.backbone={VIT}", "model.timm_kwargs={in_chans: 1}"],
                       "model.timm_kwargs: in_chans set by raycl")):
        with pytest.raises(ConfigError, match=line):
            load_search(QUICKSTART, bad)


def test_layer_decay_scales_each_vit_block_and_leaves_the_heads_at_full_rate() -> None:
    config = vit_config("simclr", train={"layer_decay": 0.5},
                        model={"timm_kwargs": {**VIT_KWARGS, "depth": 3}})
    method = build_method(config, 3)
    optimizer = build_optimizer(method, config)
    scale = {id(p): group["lr"] / config.train.lr
             for group in optimizer.param_groups for p in group["params"]}
    # Every trainable parameter once: nothing lost or doubled by the regrouping.
    trainable = [p for p in method.parameters() if p.requires_grad]
    assert sorted(scale) == sorted(id(p) for p in trainable)
    backbone = method.backbone
    # 3 blocks: the last at the full rate, each lower one half the one above, the embeddings
    # lowest; the final norm and the projector at the full rate.
    assert scale[id(backbone.pos_embed)] == pytest.approx(0.5 ** 3)
    assert [scale[id(block.attn.qkv.weight)] for block in backbone.blocks] == \
        pytest.approx([0.25, 0.5, 1.0])
    assert scale[id(backbone.norm.weight)] == 1.0
    assert all(scale[id(p)] == 1.0 for p in method.projector.parameters())
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups
             for p in group["params"]}
    assert decay[id(backbone.blocks[0].norm1.weight)] == 0.0  # norms and biases undecayed
    assert decay[id(backbone.blocks[0].attn.qkv.weight)] == config.train.weight_decay
    # Off: the method's own single group.
    plain = vit_config("simclr")
    assert len(build_optimizer(build_method(plain, 3), plain).param_groups) == 1


@pytest.mark.parametrize("method", ["simclr", "mocov2", "simsiam", "spectral", "hscl", "nnclr",
                                    "all4one", "fgvr"])
def test_every_image_method_takes_a_step_on_a_vit(method: str) -> None:
    """One training step (both views, the loss, backward) of each method that reads a feature
    vector, on the tiny ViT: FGVR's Grad-CAM and decoder work from its pooled features too."""
    from raycl.methods.base import Batch

    sizes: dict[str, dict[str, Any]] = {
        "nnclr": {"nnclr": {"queue_size": 256, "predictor_hidden_dim": 32}},
        "all4one": {"all4one": {"queue_size": 256, "predictor_hidden_dim": 32,
                                "transformer_heads": 2, "transformer_layers": 1,
                                "transformer_feedforward": 32}},
        "fgvr": {"fgvr": {"memory_size": 64, "decoder_width": 8}},
        "mocov2": {"mocov2": {"queue_size": 128}}}
    model = build_method(vit_config(method, **sizes.get(method, {})), 3)
    generator = torch.Generator().manual_seed(0)
    views = [torch.randn(16, 3, 16, 16, generator=generator) for _ in range(2)]
    batch = Batch(images=views[0], views=views, index=torch.arange(16))
    loss = model(batch)["loss"]
    loss.backward()
    assert math.isfinite(loss.item())
    grads = [p.grad for p in model.backbone.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)  # the ViT learns
