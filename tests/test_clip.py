"""MCL on CLIP: the image-text loss, the frozen text tower and image blocks, every stage's start
from the same weights, the model soup, checkpoints of local weights, and no network during a run."""

from __future__ import annotations

import ipaddress
import math
import socket
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from faults import injected_fault
from test_config import error_of
from test_reliability import StoredSession

import raycl.worker.stage
from raycl.methods import Batch, SearchConfig, build_method
from raycl.methods.clip import CLIP, CLIPConfig, build_open_clip, clip_loss, read_clip_state
from raycl.worker.context import TrialContext
from raycl.worker.embed import soup_method
from raycl.worker.loop import run_trial_loop
from raycl.worker.stage_integration import average_weights, soup_weights

TINY_CLIP: dict[str, Any] = {
    "name": "clip-test",
    "method": "mcl",
    "mcl": {"base": "clip", "stages": 2, "clusters": 3, "negatives": "mask"},
    "data": {"samples_per_combination": 1, "resolution": 16,
             "captions": {"color": 1.0, "shape": 0.5, "texture": 0.5}},
    "clip": {"tiny_width": 32, "tiny_layers": 2, "tiny_text_layers": 1, "trainable_blocks": 1,
             "tiny_context_length": 12},
    "train": {"epochs": 2, "batch_size": 64, "lr": 0.002},
    "eval": {"every_n_epochs": 0, "linear_max_iter": 20, "mmvp": "synthetic", "mmvp_pairs": 4,
             "diagnostics": False},
    "scaling": {"num_workers": 0, "cpus_per_worker": 2},
}


def clip_config(**sections: dict[str, Any]) -> SearchConfig:
    raw = {key: dict(value) if isinstance(value, dict) else value
           for key, value in TINY_CLIP.items()}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return SearchConfig.model_validate(raw)


def run_clip(root: Path, fault: dict[str, Any] | None = None,
             **sections: dict[str, Any]) -> StoredSession:
    session = StoredSession(root)
    with injected_fault(**fault) if fault else nullcontext():
        run_trial_loop(TrialContext(config=clip_config(**sections)), session)
    return session


def record_builds(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The initial state of every method the loop builds (one per stage), in order."""
    built: list[dict[str, torch.Tensor]] = []
    original = raycl.worker.stage.build_method

    def recording_build(config: Any, channels: int) -> Any:
        method = original(config, channels)
        built.append({k: v.clone() for k, v in method.state_dict().items()})
        return method

    monkeypatch.setattr(raycl.worker.stage, "build_method", recording_build)
    return built


def tiny_method(seed: int = 0, **clip: Any) -> CLIP:
    torch.manual_seed(seed)
    return build_method(clip_config(clip=clip), 3)  # type: ignore[return-value]


def text_batch(method: CLIP, size: int = 6) -> Batch:
    captions = ["a red striped triangle", "a blue object", "a dotted square", "a red object",
                "a green plus", "an orange dotted circle"][:size]
    return Batch(images=torch.rand(size, 3, 16, 16) * 2 - 1, views=[],
                 index=torch.arange(size), texts=method.tokenize(captions))


# ---------------------------------------------------------------------------------------------
# The loss


def test_clip_loss_matches_a_hand_computed_case() -> None:
    """Two pairs, scale 2: each direction is a 2-way softmax over cosines."""
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    texts = F.normalize(torch.tensor([[1.0, 1.0], [0.0, 1.0]]), dim=1)
    scale = torch.tensor(2.0)
    c = 1 / math.sqrt(2)
    # image 0: cosines (c, 0); image 1: (c, 1); text 0: (c, c); text 1: (0, 1).
    image_side = -(math.log(math.exp(2 * c) / (math.exp(2 * c) + 1))
                   + math.log(math.exp(2) / (math.exp(2 * c) + math.exp(2)))) / 2
    text_side = -(math.log(0.5) + math.log(math.exp(2) / (1 + math.exp(2)))) / 2
    expected = (image_side + text_side) / 2
    assert float(clip_loss(images, texts, scale)) == pytest.approx(expected, abs=1e-6)


def test_negative_mask_equals_the_loss_of_each_pseudo_label_group_alone() -> None:
    """MCL's mask: with groups {0, 1} and {2, 3}, each row's softmax only sees its group, which
    is the loss of the two groups as separate batches."""
    torch.manual_seed(0)
    images = F.normalize(torch.randn(4, 8), dim=1)
    texts = F.normalize(torch.randn(4, 8), dim=1)
    labels = torch.tensor([0, 0, 1, 1])
    mask = labels[:, None] == labels[None, :]
    scale = torch.tensor(10.0)
    masked = clip_loss(images, texts, scale, mask)
    groups = (clip_loss(images[:2], texts[:2], scale) + clip_loss(images[2:], texts[2:], scale))
    assert float(masked) == pytest.approx(float(groups) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="negative_mask"):
        clip_loss(images, texts, scale, mask[:3])


# ---------------------------------------------------------------------------------------------
# What trains and what does not


def test_text_tower_and_early_image_blocks_get_no_gradient() -> None:
    method = tiny_method(trainable_blocks=1)
    method(text_batch(method))["loss"].backward()
    with_grad = {name for name, param in method.named_parameters() if param.grad is not None}
    trainable = {name for name, param in method.named_parameters() if param.requires_grad}
    assert with_grad <= trainable
    assert "clip.logit_scale" in with_grad and "clip.visual.proj" in with_grad
    assert "clip.visual.transformer.resblocks.1.mlp.c_fc.weight" in with_grad
    assert "clip.visual.ln_post.weight" in with_grad
    for frozen in ("clip.visual.transformer.resblocks.0.mlp.c_fc.weight",
                   "clip.visual.conv1.weight", "clip.token_embedding.weight",
                   "clip.text_projection",
                   "clip.transformer.resblocks.0.attn.in_proj_weight"):
        assert frozen not in trainable, frozen
    # train_text: both towers whole (plain CLIP training).
    everything = tiny_method(train_text=True)
    assert all(param.requires_grad for param in everything.parameters())


def test_frozen_weights_do_not_change_over_a_stage_and_every_stage_starts_alike(
    data_cache, tmp_path, monkeypatch
) -> None:
    """Through the real loop: each stage's fresh model equals the first (same initial weights);
    after training, the frozen weights are those initial weights, bit for bit, and the trained
    block moved."""
    built = record_builds(monkeypatch)
    session = run_clip(tmp_path / "run")
    assert len(built) == 2
    for key, value in built[0].items():
        assert torch.equal(value, built[1][key]), key
    final = torch.load(sorted((tmp_path / "run").glob("checkpoint_*"))[-1] / "state.pt",
                       weights_only=True)["model"]
    trainable = {name for name, param in tiny_method().named_parameters() if param.requires_grad}
    changed = {key for key, value in final.items() if not torch.equal(value, built[1][key])}
    assert changed and changed <= trainable
    assert "clip.visual.transformer.resblocks.1.mlp.c_fc.weight" in changed
    assert session.reports[-1]["test/mmvp/mean"] >= 0.0


# ---------------------------------------------------------------------------------------------
# Model soup


def test_average_weights_is_the_elementwise_mean_and_rejects_other_architectures() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(0.0)}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor(1.0)}
    soup = average_weights([a, b])
    assert torch.equal(soup["w"], torch.tensor([2.0, 4.0])) and float(soup["b"]) == 0.5
    with pytest.raises(ValueError, match="other weights"):
        average_weights([a, {"w": a["w"]}])
    with pytest.raises(ValueError, match="shapes differ"):
        average_weights([a, {"w": torch.zeros(3), "b": a["b"]}])


def test_soup_model_holds_the_parameter_average_of_the_stages() -> None:
    """Two stages from the same start, trained apart: the soup's trained weights are their
    mean, its frozen weights the shared ones, and its embedding is that model's."""
    first, second = tiny_method(), tiny_method()
    with torch.no_grad():
        for param in second.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param))
    stages = [soup_weights(first), soup_weights(second)]
    assert "clip.token_embedding.weight" not in stages[0]  # frozen: the same in every stage
    soup = soup_method(second, stages)
    for name, param in soup.named_parameters():
        if param.requires_grad:
            before, after = first.get_parameter(name), second.get_parameter(name)
            torch.testing.assert_close(param, (before + after) / 2)
        else:
            assert torch.equal(param, dict(first.named_parameters())[name])
    images = torch.rand(3, 3, 16, 16) * 2 - 1
    assert not torch.allclose(soup.embed(images), second.embed(images))


def test_soup_trial_resumes_in_its_last_stage_with_identical_numbers(data_cache,
                                                                      tmp_path) -> None:
    """The earlier stages' soup weights travel in the checkpoints: a crash in stage 1 resumes to
    the numbers of an uninterrupted run."""
    soup = {"integration": "soup"}
    reference = run_clip(tmp_path / "reference", mcl=soup).reports[-1]
    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected fault"):
        run_clip(root, fault={"stage": 1, "after_epoch": 1, "marker": str(tmp_path / "x")},
                 mcl=soup)
    assert list(root.glob("checkpoint_*/stage_weights.pt"))
    final = run_clip(root, mcl=soup).reports[-1]
    for key in ("test/mmvp/mean", "test/zeroshot/mean", "test/i2t/r5", "test/linear/mean",
                "stage1/test/mmvp/mean"):
        assert final[key] == pytest.approx(reference[key], abs=1e-6), key


# ---------------------------------------------------------------------------------------------
# Local weights only


def test_weights_load_from_open_clip_and_raycl_files(tmp_path) -> None:
    source = tiny_method(seed=3, init_logit_scale=50.0)
    plain, wrapped, raycl_state = (tmp_path / name for name in ("a.pt", "b.pt", "c.pt"))
    torch.save(source.clip.state_dict(), plain)
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.clip.state_dict().items()},
                "epoch": 3}, wrapped)
    torch.save({"model": source.state_dict(), "optimizer": {}}, raycl_state)
    for path in (plain, wrapped, raycl_state):
        loaded = tiny_method(seed=4, pretrained=str(path))
        for key, value in source.clip.state_dict().items():
            assert torch.equal(loaded.clip.state_dict()[key], value), (path.name, key)
    assert set(read_clip_state(raycl_state)) == set(source.clip.state_dict())


def test_weight_files_that_cannot_work_are_rejected_before_launch(tmp_path) -> None:
    """One line naming the key, before anything is launched."""
    wide = build_open_clip(CLIPConfig(**{**TINY_CLIP["clip"], "tiny_width": 64}), 16)
    torch.save(wide.state_dict(), tmp_path / "wide.pt")

    def error(**sections: Any) -> str:
        raw = clip_config(**sections).to_dict()
        return error_of(tmp_path, yaml.safe_dump(raw))

    message = error(clip={"pretrained": str(tmp_path / "wide.pt")})
    assert "clip.pretrained: " in message and "shape" in message
    assert "never downloads" in error(clip={"pretrained": "openai"})
    siglip = error(clip={"model": "ViT-B-16-SigLIP"})
    assert "clip.model: " in siglip and "Hugging Face" in siglip
    assert "data.captions: " in error(data={"captions": None})


class NetworkUsed(AssertionError):
    pass


def _loopback(address: Any) -> bool:
    if not isinstance(address, tuple):  # AF_UNIX paths
        return True
    try:
        return ipaddress.ip_address(address[0]).is_loopback
    except ValueError:  # a host name: resolving it is already network use
        return False


def test_a_clip_trial_opens_no_socket_beyond_loopback(data_cache, tmp_path, monkeypatch) -> None:
    """The whole trial (model, tokenizer, local weights, training, MMVP, evaluation) with every
    non-loopback connect and every DNS lookup failing the test."""
    attempts: list[Any] = []

    def connect(self: socket.socket, address: Any) -> Any:
        if not _loopback(address):
            attempts.append(address)
            raise NetworkUsed(f"socket connect to {address}")
        return real_connect(self, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in ("localhost", "127.0.0.1", "::1", None):
            attempts.append(host)
            raise NetworkUsed(f"DNS lookup of {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    weights = tmp_path / "start.pt"
    torch.save(tiny_method(seed=5).clip.state_dict(), weights)
    session = run_clip(tmp_path / "run", clip={"pretrained": str(weights)},
                       mcl={"stages": 1}, train={"epochs": 1})
    assert attempts == []
    assert np.isfinite(session.reports[-1]["test/mmvp/mean"])
    # The guard itself works.
    with pytest.raises(NetworkUsed):
        socket.create_connection(("192.0.2.1", 80), timeout=0.1)


def test_a_caption_file_without_labels_trains_and_scores_retrieval(data_cache, tmp_path) -> None:
    """data.dataset: pairs (a CSV of image, caption; no labels): no probes, but caption
    retrieval per stage and integrated, and MCL's clustering still runs."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = ["image,caption"]
    for i in range(40):
        colour = ("red", "blue")[i % 2]
        pixels = np.zeros((16, 16, 3), dtype=np.uint8)
        pixels[..., 0 if colour == "red" else 2] = 200
        pixels += rng.integers(0, 40, size=pixels.shape, dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,a {colour} picture number {i}")
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    corpus = {"dataset": "pairs", "root": str(tmp_path / "pairs.csv"), "captions": None}
    session = run_clip(tmp_path / "run", data=corpus, train={"batch_size": 8},
                       mcl={"clusters": 2}, eval={"mmvp": None}, tune={"metric": "val/i2t/r1"})
    final = session.reports[-1]
    assert not any("linear" in key for key in final)
    for key in ("val/i2t/r1", "test/t2i/r5", "stage1/test/i2t/r10"):
        assert 0.0 <= final[key] <= 1.0, key


def test_constant_schedule_keeps_the_rate_after_warmup() -> None:
    from raycl.worker.optim import lr_factor

    assert [lr_factor(step, 10, 2, "constant") for step in (0, 1, 5, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(9, 10, 2) < 0.1


def test_metrics_a_trial_would_never_report_are_rejected(tmp_path) -> None:
    def error(**sections: Any) -> str:
        return error_of(tmp_path, yaml.safe_dump(clip_config(**sections).to_dict()))

    from PIL import Image

    Image.new("RGB", (16, 16)).save(tmp_path / "0.png")
    (tmp_path / "pairs.csv").write_text("image,caption\n" + "0.png,a picture\n" * 10)
    assert "tune.metric: " in error(eval={"mmvp": None}, tune={"metric": "val/mmvp/mean"})
    pairs = {"dataset": "pairs", "root": str(tmp_path / "pairs.csv"), "captions": None}
    assert "pairs has no labels" in error(data=pairs, tune={"metric": "val/linear/mean"})
    # an image-only method on captions: nothing scores it without the label-free figures, and
    # it never reports caption retrieval
    assert "data.dataset: pairs has no labels" in error(
        method="simclr", data=pairs, eval={"mmvp": None, "label_free": False},
        tune={"metric": "val/label_free/rankme"})
    assert "tune.metric: val/i2t/r1 is reported by an image-text method only" in error(
        method="simclr", data=pairs, eval={"mmvp": None}, tune={"metric": "val/i2t/r1"})


def test_real_open_clip_configs_are_checked_without_building_them() -> None:
    """ViT-L-14 (304M image parameters) is checked on the meta device: no memory, no time."""
    config = clip_config(clip={"model": "ViT-L-14", "trainable_blocks": 6},
                         data={"resolution": 28})
    assert CLIP.config_problems(config) == []
    config = clip_config(clip={"model": "ViT-B-32"}, data={"resolution": 48})
    assert CLIP.config_problems(config)[0][0] == "data.resolution"


def test_unimodal_mcl_soup_starts_every_stage_alike_and_reports_the_soup(
    data_cache, tmp_path, monkeypatch
) -> None:
    from test_reliability import run

    built = record_builds(monkeypatch)
    mcl = {"stages": 2, "clusters": 2, "negatives": "mask", "integration": "soup"}
    final = run(tmp_path, extra={"method": "mcl", "mcl": mcl}, epochs=1).reports[-1]
    assert all(torch.equal(value, built[1][key]) for key, value in built[0].items())
    assert {"test/linear/mean", "stage1/test/linear/mean"} <= set(final)
    # The soup is another model than the last stage.
    keys = ("test/linear/shape", "test/linear/texture", "test/linear/color", "test/knn/mean")
    assert [final[key] for key in keys] != [final[f"stage1/{key}"] for key in keys]
