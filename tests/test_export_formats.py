"""Taking a trained encoder out of a raycl checkpoint (issue 35): the encoder rebuilt from
state.pt embeds as raycl's evaluation does, and each export format loads without raycl
(torchvision / timm strictly, safetensors, a small_cnn program, open_clip, MCL soup and concat)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

import raycl
from raycl.data.augment import to_float
from raycl.export.encoder import (
    concat_encoder,
    load_encoder,
    trained_encoder,
)
from raycl.export.formats import format_problem, planned_files, write_encoder
from raycl.export.model_card import card_path
from raycl.methods import SearchConfig, build_method
from raycl.methods.base import Method
from raycl.worker.embed import integrate_stages
from raycl.worker.stage_integration import StageInputs, integrate, soup_weights

RESOLUTION = 16


def tiny_config(**sections: Any) -> Any:
    raw: dict[str, Any] = {"name": "export-test", "method": "simclr",
                           "data": {"resolution": RESOLUTION, "samples_per_combination": 1},
                           "model": {"backbone": "small_cnn", "width": 8}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return SearchConfig.model_validate(raw)


def trained(config: Any, seed: int = 0, channels: int = 3) -> Method:
    """A method of ``config`` whose weights and BatchNorm statistics are not the initial ones
    (so an export that dropped the running statistics would embed differently)."""
    torch.manual_seed(seed)
    method = build_method(config, channels)
    with torch.no_grad():
        for param in method.parameters():
            param.add_(0.01 * torch.randn_like(param))
        method.train()
        method.embed(torch.randn(8, channels, RESOLUTION, RESOLUTION) * 2 + 0.3)
    return method.eval()


def save_checkpoint(method: Method, directory: Path,
                    earlier_soup: list[dict[str, torch.Tensor]] | None = None) -> Path:
    """state.pt as raycl.worker.checkpoints.write_checkpoint writes it (and the earlier stages'
    soup weights, as StageInputs.save does)."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"model": method.state_dict(), "optimizer": {"state": {}, "param_groups": []},
                "scaler": {}}, directory / "state.pt")
    if earlier_soup:
        torch.save(earlier_soup, directory / "stage_weights.pt")
    return directory


def images(channels: int = 3, count: int = 5, seed: int = 1) -> torch.Tensor:
    """Normalised float images, as raycl's evaluation hands them to the encoder."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (count, channels, RESOLUTION, RESOLUTION), dtype=torch.uint8,
                        generator=generator)
    return to_float(raw)


def raycl_embedding(method: Method, batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return method.eval().embed(batch)


def resnet_trial(tmp_path: Path, stem: str, backbone: str = "resnet18") -> tuple[Any, Method, Path]:
    config = tiny_config(model={"backbone": backbone, "stem": stem})
    method = trained(config)
    return config, method, save_checkpoint(method, tmp_path / "checkpoint")


@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_torchvision_export_loads_strictly_and_embeds_as_raycl(tmp_path: Path, stem: str) -> None:
    config, method, checkpoint = resnet_trial(tmp_path, stem)
    encoder = trained_encoder(checkpoint, config)
    batch = images()
    expected = raycl_embedding(method, batch)
    with torch.no_grad():
        assert torch.allclose(encoder(batch), expected, atol=1e-6)
    out = tmp_path / "encoder.pt"
    files = write_encoder(encoder, config, "torchvision", out, channels=3,
                          objective={"metric": "val/linear/mean", "mode": "max", "value": 0.5},
                          test_scores={"test/linear/mean": 0.4})
    assert files == planned_files(config, "torchvision", out)
    assert files[0] == out and files[-1] == card_path(out)
    # Built exactly as the model card says, from torchvision alone.
    model = torchvision.models.resnet18()
    model.fc = nn.Identity()
    if stem == "cifar":
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    with torch.no_grad():
        assert torch.allclose(model.eval()(batch), expected, atol=1e-6)
    card = json.loads(card_path(out).read_text())
    assert card["stem"] == stem and card["backbone"] == "resnet18"
    assert card["normalisation"] == {"mean": [0.5] * 3, "std": [0.5] * 3}
    assert card["validation_objective"]["value"] == 0.5
    assert card["test_scores"] == {"test/linear/mean": 0.4}
    assert ("maxpool = torch.nn.Identity()" in card["how_to_load"]) == (stem == "cifar")
    assert card["config"]["model"]["backbone"] == "resnet18"
    # The card's own lines build the network the file loads into.
    namespace: dict[str, Any] = {}
    exec(card["how_to_load"].replace("'encoder.pt'", repr(str(out))), namespace)
    with torch.no_grad():
        assert torch.allclose(namespace["model"](batch), expected, atol=1e-6)


def test_timm_export_loads_strictly_into_timm(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    config, method, checkpoint = resnet_trial(tmp_path, "cifar")
    out = tmp_path / "encoder_timm.pt"
    write_encoder(trained_encoder(checkpoint, config), config, "timm", out, channels=3)
    model = timm.create_model("resnet18", num_classes=0)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    batch = images()
    with torch.no_grad():
        assert torch.allclose(model.eval()(batch), raycl_embedding(method, batch), atol=1e-6)


def test_safetensors_round_trip(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config, method, checkpoint = resnet_trial(tmp_path, "cifar")
    out = tmp_path / "encoder.safetensors"
    write_encoder(trained_encoder(checkpoint, config), config, "safetensors", out, channels=3)
    state = load_file(str(out))
    backbone_state = method.backbone.state_dict()
    assert set(state) == set(backbone_state)
    assert all(torch.equal(state[key], backbone_state[key]) for key in state)
    module, preprocessing = raycl.load_encoder(str(out))
    batch = images()
    with torch.no_grad():
        assert torch.allclose(module(batch), raycl_embedding(method, batch), atol=1e-6)
    assert (preprocessing.resolution, preprocessing.channels) == (RESOLUTION, 3)


def test_small_cnn_program_loads_with_plain_torch(tmp_path: Path) -> None:
    config = tiny_config()
    method = trained(config, channels=1)
    checkpoint = save_checkpoint(method, tmp_path / "checkpoint")
    out = tmp_path / "encoder.pt2"
    write_encoder(trained_encoder(checkpoint, config), config, "small_cnn", out, channels=1)
    batch = images(channels=1, count=3)
    torch.save(batch, tmp_path / "batch.pt")
    # A clean interpreter (-I: no cwd, no PYTHONPATH) that must not import raycl.
    script = ("import sys, torch\n"
              "model = torch.export.load('encoder.pt2').module()\n"
              "torch.save(model(torch.load('batch.pt')), 'features.pt')\n"
              "assert not any(name.startswith('raycl') for name in sys.modules)\n")
    subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, check=True, timeout=120)
    features = torch.load(tmp_path / "features.pt")
    assert torch.allclose(features, raycl_embedding(method, batch), atol=1e-6)
    module, preprocessing = load_encoder(str(out))
    assert preprocessing.channels == 1 and preprocessing.mean == (0.5,)
    assert torch.allclose(module(batch), features, atol=1e-6)


@pytest.mark.parametrize(("model", "export_format", "fits"), [
    ({"backbone": "resnet18"}, "open_clip", "torchvision or timm or safetensors"),
    ({"backbone": "resnet50"}, "small_cnn", "torchvision or timm or safetensors"),
    ({"backbone": "small_cnn"}, "torchvision", "small_cnn or safetensors"),
    ({"backbone": "small_cnn"}, "onnx", None),
])
def test_format_that_does_not_fit_is_one_line(tmp_path: Path, model: dict[str, Any],
                                              export_format: str, fits: str | None) -> None:
    config = tiny_config(model=model)
    problem = format_problem(config, export_format)
    assert problem is not None and "\n" not in problem
    assert (fits or "formats: torchvision") in problem
    with pytest.raises(ValueError, match=r"does not fit|unknown format"):
        write_encoder(nn.Identity(), config, export_format, tmp_path / "x.pt", channels=3)
    assert not any(tmp_path.iterdir())  # nothing written


def test_mcl_soup_exports_one_backbone_as_raycl_evaluates(tmp_path: Path) -> None:
    config = tiny_config(method="mcl", mcl={"base": "simclr", "stages": 2,
                                            "integration": "soup"})
    stage0, stage1 = trained(config, seed=0), trained(config, seed=1)
    checkpoint = save_checkpoint(stage1, tmp_path / "checkpoint", [soup_weights(stage0)])
    batch = images()
    # raycl's own evaluation of the trial's representation after its last stage.
    expected, _ = integrate_stages(
        config, StageInputs(stage=1, weights=[soup_weights(stage0)]), stage1, {},
        lambda soup: {"x": soup.embed(batch).detach().numpy()})
    encoder = trained_encoder(checkpoint, config)
    with torch.no_grad():
        features = encoder(batch)
    assert np.allclose(features.numpy(), expected["x"], atol=1e-6)
    assert not np.allclose(features.numpy(), raycl_embedding(stage1, batch).numpy(), atol=1e-3)
    out = tmp_path / "soup.safetensors"
    write_encoder(encoder, config, "safetensors", out, channels=3)
    module, _ = load_encoder(str(out))
    with torch.no_grad():
        assert np.allclose(module(batch).numpy(), expected["x"], atol=1e-6)


def test_mcl_concat_needs_every_stage(tmp_path: Path) -> None:
    config = tiny_config(method="mcl", mcl={"base": "simclr", "stages": 2,
                                            "integration": "concat"})
    stages = [trained(config, seed=seed) for seed in (0, 1)]
    checkpoint = save_checkpoint(stages[1], tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="keeps only its last stage's weights"):
        trained_encoder(checkpoint, config)
    # With every stage's encoder at hand: the stages' files and the integrating program.
    batch = images()
    expected = integrate([raycl_embedding(stage, batch).numpy() for stage in stages])
    encoder = concat_encoder([stage.backbone for stage in stages])
    with torch.no_grad():
        assert np.allclose(encoder(batch).numpy(), expected, atol=1e-6)
    out = tmp_path / "concat.pt2"
    files = write_encoder(encoder, config, "small_cnn", out, channels=3)
    assert [path.name for path in files] == ["concat.pt2", "concat.stage0.pt2",
                                             "concat.stage1.pt2", "concat.pt2.model_card.json"]
    module, _ = load_encoder(str(out))
    assert np.allclose(module(batch).detach().numpy(), expected, atol=1e-6)
    stage1 = torch.export.load(str(tmp_path / "concat.stage1.pt2")).module()
    assert torch.allclose(stage1(batch), raycl_embedding(stages[1], batch), atol=1e-6)


def clip_config() -> Any:
    return tiny_config(method="clip", data={"captions": {"color": 1.0}},
                       clip={"tiny_width": 32, "tiny_layers": 2, "tiny_text_layers": 1,
                             "trainable_blocks": 1, "tiny_context_length": 12})


def test_clip_trial_exports_to_open_clip(tmp_path: Path) -> None:
    import open_clip

    from raycl.methods.clip import CLIP_MEAN, CLIP_STD

    config = clip_config()
    torch.manual_seed(0)
    method = build_method(config, 3).eval()
    with torch.no_grad():
        for param in method.clip.visual.parameters():
            param.add_(0.01 * torch.randn_like(param))
    checkpoint = save_checkpoint(method, tmp_path / "checkpoint")
    batch = images()
    expected = raycl_embedding(method, batch)
    encoder = trained_encoder(checkpoint, config)
    with torch.no_grad():
        assert torch.allclose(encoder(batch), expected, atol=1e-6)
    assert "does not fit a CLIP trial" in (format_problem(config, "torchvision") or "")
    out = tmp_path / "clip.pt"
    files = write_encoder(encoder, config, "open_clip", out, channels=3)
    assert files == planned_files(config, "open_clip", out)
    open_clip.add_model_config(tmp_path / "clip-open_clip.json")
    model = open_clip.create_model("clip-open_clip", pretrained=str(out)).eval()
    # The same pixels, normalised with open_clip's statistics instead of raycl's.
    pixels = batch * 0.5 + 0.5
    clip_normalised = ((pixels - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1))
                       / torch.tensor(CLIP_STD).view(1, 3, 1, 1))
    with torch.no_grad():
        features = torch.nn.functional.normalize(model.encode_image(clip_normalised), dim=-1)
    assert torch.allclose(features, expected, atol=1e-5)
    module, preprocessing = load_encoder(str(out))
    assert preprocessing.mean == CLIP_MEAN
    with torch.no_grad():
        assert torch.allclose(module(preprocessing.normalise(pixels)), expected, atol=1e-5)


def test_load_encoder_reads_a_checkpoint_directory(tmp_path: Path) -> None:
    config, method, checkpoint = resnet_trial(tmp_path, "cifar")
    with pytest.raises(ValueError, match="needs its trial's config"):
        load_encoder(str(checkpoint))
    (checkpoint / "config.json").write_text(json.dumps(config.to_dict()))
    module, preprocessing = raycl.load_encoder(f"file://{checkpoint}")
    batch = images()
    with torch.no_grad():
        assert torch.allclose(module(batch), raycl_embedding(method, batch), atol=1e-6)
    assert preprocessing.std == (0.5, 0.5, 0.5)
    raw = torch.randint(0, 256, (2, 3, RESOLUTION, RESOLUTION), dtype=torch.uint8)
    assert torch.equal(preprocessing.normalise(raw), to_float(raw))


def test_import_raycl_stays_light() -> None:
    script = ("import sys, raycl\nassert 'torch' not in sys.modules\n"
              "assert callable(raycl.load_encoder)\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_load_encoder_needs_the_model_card_and_a_local_path(tmp_path: Path) -> None:
    config, _, checkpoint = resnet_trial(tmp_path, "cifar")
    out = tmp_path / "encoder.pt"
    write_encoder(trained_encoder(checkpoint, config), config, "torchvision", out, channels=3)
    card_path(out).unlink()
    with pytest.raises(ValueError, match=r"no model card encoder\.pt\.model_card\.json"):
        load_encoder(str(out))
    with pytest.raises(ValueError, match="only local paths and file:// URIs"):
        load_encoder("s3://bucket/encoder.pt")
    with pytest.raises(FileNotFoundError):
        load_encoder(str(tmp_path / "missing.pt"))
