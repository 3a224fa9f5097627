"""Taking a trained encoder out of a raycl checkpoint (issue 35): the encoder rebuilt from
state.pt embeds as raycl's evaluation does, and each export format loads without raycl
(torchvision / timm strictly, safetensors, a small_cnn program, open_clip, MCL soup and concat)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import load_file
from torch import nn

import raycl
from raycl.data.augment import to_float
from raycl.export.encoder import StageConcat, load_encoder, trained_encoder
from raycl.export.formats import format_problem, planned_files, write_encoder
from raycl.export.model_card import card_path
from raycl.methods import SearchConfig, build_method
from raycl.methods.base import Method
from raycl.worker.checkpoints import read_checkpoint, write_checkpoint
from raycl.worker.embed import integrate_stages
from raycl.worker.perf import Clock
from raycl.worker.stage_integration import StageInputs, kept_weights, soup_weights

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
    # Issue 46, finding 12: the model card's own timm lines give a model whose data config says
    # what the weights expect ((x - 0.5) / 0.5 at the trial's resolution), not timm's default
    # ImageNet statistics, so timm's transform feeds it what raycl trained it on.
    namespace: dict[str, Any] = {}
    card = json.loads(card_path(out).read_text())
    exec(card["how_to_load"].replace("'encoder_timm.pt'", repr(str(out))), namespace)
    data_config = timm.data.resolve_data_config(model=namespace["model"])
    assert data_config["mean"] == (0.5, 0.5, 0.5) and data_config["std"] == (0.5, 0.5, 0.5)
    side = config.data.resolution
    assert data_config["input_size"] == (3, side, side)
    with torch.no_grad():
        assert torch.allclose(namespace["model"](batch), raycl_embedding(method, batch), atol=1e-6)


def test_safetensors_round_trip(tmp_path: Path) -> None:
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
    # What the worker keeps of a finished soup stage: its soup share, as before concat's.
    checkpoint = save_checkpoint(stage1, tmp_path / "checkpoint", [kept_weights(config, stage0)])
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


def concat_config(backbone: str = "small_cnn") -> Any:
    return tiny_config(method="mcl", model={"backbone": backbone, "stem": "cifar"},
                       mcl={"base": "simclr", "stages": 2, "integration": "concat",
                            "clusters": 2})


def worker_checkpoint(directory: Path, config: Any, method: Method, inputs: StageInputs,
                      features: dict[str, np.ndarray] | None) -> Path:
    """A checkpoint of stage ``inputs.stage`` as the worker writes it (write_checkpoint): at
    the stage's end (``features`` given) with the stage's kept weights, else mid-stage."""
    directory.mkdir(parents=True)
    progress = {"stage": inputs.stage, "phase": "train", "epoch": 1,
                "stage_complete": features is not None}
    write_checkpoint(directory, method, torch.optim.SGD(method.parameters(), lr=0.1),
                     torch.amp.GradScaler("cpu", enabled=False), progress, inputs, features,
                     {}, soup=kept_weights(config, method) if features is not None else None)
    return directory


def integrated_features(config: Any, stages: list[Method], batch: torch.Tensor) -> np.ndarray:
    """raycl's evaluation of a 2-stage concat trial on ``batch``: integrate_stages over stage
    0's frozen features and stage 1's."""
    inputs = StageInputs(stage=1, features=[{"x": raycl_embedding(stages[0], batch).numpy()}])
    expected, _ = integrate_stages(config, inputs, stages[1],
                                   {"x": raycl_embedding(stages[1], batch).numpy()},
                                   lambda _: pytest.fail("concat embeds no soup"))
    return expected["x"]


@pytest.mark.parametrize(("backbone", "export_format", "file"), [
    ("resnet18", "torchvision", "concat.pt"),
    ("resnet18", "safetensors", "concat.safetensors"),
    ("small_cnn", "small_cnn", "concat.pt2"),
])
def test_mcl_concat_exports_every_stage_as_raycl_evaluates(
    tmp_path: Path, backbone: str, export_format: str, file: str
) -> None:
    config = concat_config(backbone)
    stages = [trained(config, seed=seed) for seed in (0, 1)]
    inputs = StageInputs(stage=1, features=[{}], weights=[kept_weights(config, stages[0])])
    checkpoint = worker_checkpoint(tmp_path / "checkpoint", config, stages[1], inputs,
                                   {"train": np.zeros((2, 4), np.float32)})
    batch = images()
    expected = integrated_features(config, stages, batch)
    assert expected.shape[1] == 2 * raycl_embedding(stages[0], batch).shape[1]
    encoder = trained_encoder(checkpoint, config)
    assert isinstance(encoder, StageConcat) and len(encoder.stages) == 2
    with torch.no_grad():
        assert np.allclose(encoder(batch).numpy(), expected, atol=1e-6)
    out = tmp_path / file
    files = write_encoder(encoder, config, export_format, out, channels=3)
    assert files == planned_files(config, export_format, out) == [out, card_path(out)]
    card = json.loads(card_path(out).read_text())
    assert (card["concat"], card["stages"]) == (True, 2)
    module, _ = raycl.load_encoder(str(out))
    with torch.no_grad():
        assert np.allclose(module(batch).numpy(), expected, atol=1e-6)
    if export_format == "small_cnn":  # the whole concatenation, one program for plain torch
        program = torch.export.load(str(out)).module()
        assert np.allclose(program(batch).detach().numpy(), expected, atol=1e-6)
        return
    # One file, stage j's torchvision keys under stage<j>.; the card's lines (torchvision
    # alone) build both networks, load each strictly and concatenate as raycl does.
    state = (torch.load(out, weights_only=True) if export_format == "torchvision"
             else load_file(str(out)))
    assert set(state) == {f"stage{j}.{key}" for j in (0, 1)
                          for key in stages[0].backbone.state_dict()}
    namespace: dict[str, Any] = {}
    exec(card["how_to_load"].replace(repr(file), repr(str(out))), namespace)
    with torch.no_grad():
        assert np.allclose(namespace["model"](batch).numpy(), expected, atol=1e-6)


def test_a_concat_trial_resumed_keeps_every_stage_encoder(tmp_path: Path) -> None:
    """Stage 0's encoder goes into its last checkpoint; a trial resumed there (and again inside
    stage 1) carries it on, so stage 1's last checkpoint exports the whole concatenation."""
    from raycl.worker.loop import _resume_point

    config = concat_config()
    stages = [trained(config, seed=seed) for seed in (0, 1)]
    train = np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)
    boundary = worker_checkpoint(tmp_path / "stage0_end", config, stages[0], StageInputs(),
                                 {"train": train})
    session = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    inputs, resume = _resume_point(config, read_checkpoint(boundary), session,  # type: ignore[arg-type]
                                   Clock(None))
    assert resume is None and inputs.stage == 1
    inside = worker_checkpoint(tmp_path / "stage1_mid", config, stages[1], inputs, None)
    restored = read_checkpoint(inside)
    (kept,) = restored.inputs.weights
    expected = stages[0].backbone.state_dict()
    assert set(kept) == set(expected)  # the backbone alone: no projector, no optimizer state
    assert all(torch.equal(kept[key], expected[key]) for key in expected)
    inputs, _ = _resume_point(config, restored, session, Clock(None))  # type: ignore[arg-type]
    end = worker_checkpoint(tmp_path / "stage1_end", config, stages[1], inputs,
                            {"train": train})
    batch = images()
    with torch.no_grad():
        features = trained_encoder(end, config)(batch).numpy()
    assert np.allclose(features, integrated_features(config, stages, batch), atol=1e-6)


def test_a_concat_checkpoint_from_before_kept_weights_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A concat checkpoint of raycl before each stage's encoder was kept (state.pt alone):
    one line, exit 2 from the CLI, nothing written."""
    import raycl.export.__main__ as export_cli
    from raycl.results.trials import FinishedTrial

    config = concat_config()
    checkpoint = save_checkpoint(trained(config, seed=1), tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="trained before raycl kept each stage's weights: "
                                         "re-run the trial"):
        trained_encoder(checkpoint, config)
    trial = FinishedTrial(run_id="0" * 32, run_name="t00", experiment="old",
                          config=config, checkpoint=str(checkpoint))
    monkeypatch.setattr(export_cli, "_trial", lambda _: trial)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = export_cli.main(["--experiment", "old", "--format", "small_cnn",
                            "--out", str(out_dir / "encoder.pt2")])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1
    assert "trained before raycl kept each stage's weights: re-run the trial" in error
    assert not any(out_dir.iterdir())


def test_open_clip_does_not_fit_a_concat_trial() -> None:
    config = tiny_config(method="mcl", mcl={"base": "clip", "stages": 2,
                                            "integration": "concat"},
                         data={"captions": {"color": 1.0}}, clip={"tiny_width": 32})
    assert "does not fit an MCL concat trial" in (format_problem(config, "open_clip") or "")
    assert format_problem(config, "safetensors") is None


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
