"""model.stem and model.pretrained: ResNet stems, backbones from local weights files, and the
one-line errors the config loader gives before anything launches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torchvision
from test_config import error_of, write  # one-line ConfigError of a YAML in tmp_path
from torch import nn

from raycl.launch.load import load_search, with_absolute_paths
from raycl.models import build_backbone, resolve_stem
from raycl.models.weights import guess_backbone, read_backbone_state
from raycl.tune import main

SEARCH = """
name: t
method: {method}
data: {{dataset: {dataset}, resolution: {resolution}, samples_per_combination: 1}}
model: {{backbone: {backbone}, stem: {stem}, pretrained: {pretrained}}}
train: {{epochs: 1, batch_size: 32}}
tune: {{num_samples: 1}}
"""


def search(pretrained: Path | str, backbone: str = "resnet18", stem: str = "cifar",
           dataset: str = "trifeature", resolution: int = 32, method: str = "simclr") -> str:
    """A minimal search YAML whose model starts from ``pretrained``."""
    return SEARCH.format(pretrained=pretrained, backbone=backbone, stem=stem, dataset=dataset,
                         resolution=resolution, method=method)


def _torchvision_resnet18(stem: str) -> nn.Module:
    """torchvision's resnet18 with a 10-class fc, in the stem raycl builds for ``stem``."""
    model = torchvision.models.resnet18(num_classes=10)
    if stem == "cifar":
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    with torch.no_grad():  # non-default BatchNorm statistics, so copying them is visible
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.num_batches_tracked.fill_(7)
    return model


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torchvision-format resnet18 state dicts (fc included) with the CIFAR and ImageNet stem."""
    directory = tmp_path_factory.mktemp("weights")
    files = {}
    for stem in ("cifar", "imagenet"):
        files[stem] = directory / f"resnet18_{stem}.pt"
        torch.save(_torchvision_resnet18(stem).state_dict(), files[stem])
    return files


def _assert_same_weights(backbone: nn.Module, state: dict[str, torch.Tensor]) -> None:
    own = backbone.state_dict()
    assert set(own) == {key for key in state if not key.startswith("fc.")}
    for key, value in own.items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)


# --- stems -------------------------------------------------------------------------------


def test_auto_stem_follows_the_resolution() -> None:
    assert resolve_stem("auto", 32) == "cifar" and resolve_stem("auto", 127) == "cifar"
    assert resolve_stem("auto", 128) == "imagenet" and resolve_stem("auto", 224) == "imagenet"
    assert resolve_stem("cifar", 224) == "cifar" and resolve_stem("imagenet", 32) == "imagenet"
    with pytest.raises(ValueError, match="unknown stem"):
        resolve_stem("vit", 32)


@pytest.mark.parametrize("channels", [1, 3])
def test_imagenet_stem_is_torchvisions(channels: int) -> None:
    backbone, feature_dim = build_backbone("resnet18", channels, stem="imagenet")
    conv1 = backbone.conv1
    assert (conv1.in_channels, conv1.kernel_size, conv1.stride, conv1.padding) == (
        channels, (7, 7), (2, 2), (3, 3))
    assert isinstance(backbone.maxpool, nn.MaxPool2d) and isinstance(backbone.fc, nn.Identity)
    backbone.eval()
    with torch.no_grad():
        out = backbone(torch.randn(2, channels, 64, 64))
    assert out.shape == (2, feature_dim) and feature_dim == 512
    # layer1 sees a quarter of the side: 64 px -> 16 px (the CIFAR stem keeps 64).
    with torch.no_grad():
        stem_out = backbone.maxpool(backbone.relu(backbone.bn1(conv1(
            torch.randn(1, channels, 64, 64)))))
    assert stem_out.shape[-1] == 16


def test_default_stem_is_unchanged_for_existing_configs(tmp_path: Path) -> None:
    from raycl.methods import build_method

    config = load_search(write(tmp_path, search("null", stem="auto").replace(
        ", stem: auto, pretrained: null", "")))
    assert config.model.stem == "auto" and config.model.pretrained is None
    method = build_method(config, 3)
    assert method.backbone.conv1.kernel_size == (3, 3)
    assert isinstance(method.backbone.maxpool, nn.Identity)


# --- loading -----------------------------------------------------------------------------


@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_torchvision_state_dict_loads(weights: dict[str, Path], stem: str) -> None:
    backbone, _ = build_backbone("resnet18", 3, stem=stem, pretrained=str(weights[stem]))
    _assert_same_weights(backbone, torch.load(weights[stem], weights_only=True))


def test_raycl_checkpoint_loads(tmp_path: Path) -> None:
    source, _ = build_backbone("small_cnn", 3, width=8)
    model_state = {f"backbone.{key}": value for key, value in source.state_dict().items()}
    model_state["projector.0.weight"] = torch.zeros(4, 64)  # the rest of the method: ignored
    path = tmp_path / "state.pt"
    torch.save({"model": model_state, "optimizer": {"state": {}, "param_groups": []},
                "scaler": {}}, path)
    backbone, _ = build_backbone("small_cnn", 3, width=8, pretrained=str(path))
    _assert_same_weights(backbone, source.state_dict())
    # A method that wraps a base method (FGVR) keeps its encoder under base.backbone.
    torch.save({"model": {f"base.{key}": value for key, value in model_state.items()}}, path)
    backbone, _ = build_backbone("small_cnn", 3, width=8, pretrained=str(path))
    _assert_same_weights(backbone, source.state_dict())
    # A checkpoint of another width says which width it holds.
    with pytest.raises(ValueError, match=r"0\.0\.weight has shape \(8, 3, 3, 3\).*set model"
                                         r"\.width: 8"):
        build_backbone("small_cnn", 3, width=16, pretrained=str(path))


def test_methods_start_from_the_file(tmp_path: Path, weights: dict[str, Path]) -> None:
    """Encoder.from_config threads model.stem and model.pretrained; MoCo's key encoder copies it."""
    from raycl.methods import build_method

    state = torch.load(weights["imagenet"], weights_only=True)
    config = load_search(write(tmp_path, search(weights["imagenet"], stem="auto",
                                                resolution=128, method="mocov2")))
    method = build_method(config, 3)
    _assert_same_weights(method.backbone, state)
    _assert_same_weights(method.key_backbone, state)


def test_file_formats_and_unreadable_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"cannot read .*garbage\.pt as torch weights"):
        read_backbone_state(garbage)
    no_backbone = tmp_path / "no_backbone.pt"
    torch.save({"model": {"projector.0.weight": torch.zeros(2, 2)}}, no_backbone)
    with pytest.raises(ValueError, match=r"raycl checkpoint .* has no backbone\.\* weights"):
        read_backbone_state(no_backbone)
    a_list = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], a_list)
    with pytest.raises(ValueError, match="neither a torchvision state dict"):
        read_backbone_state(a_list)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_backbone_state(tmp_path / "missing.pt")


def test_guess_backbone_names_torchvision_resnets() -> None:
    for name in ("resnet18", "resnet34", "resnet50", "resnet101"):
        keys = set(getattr(torchvision.models, name)().state_dict())
        assert guess_backbone(keys) == name
    assert guess_backbone({"0.0.weight", "0.1.weight"}) == "small_cnn"
    assert guess_backbone({"weight"}) is None


# --- errors before launch ----------------------------------------------------------------


def test_valid_pretrained_config_loads(tmp_path: Path, weights: dict[str, Path]) -> None:
    config = load_search(write(tmp_path, search(weights["cifar"])))
    assert config.model.pretrained == str(weights["cifar"])
    imagenet = load_search(write(tmp_path, search(weights["imagenet"], stem="imagenet")))
    assert imagenet.model.stem == "imagenet"


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, search(tmp_path / "nope.pt"))
    assert message.endswith(f"search.yaml: model.pretrained: no such file: {tmp_path}/nope.pt")


def test_unreadable_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "w.pt").write_bytes(b"\x00" * 10)
    message = error_of(tmp_path, search(tmp_path / "w.pt"))
    assert "search.yaml: model.pretrained: cannot read " in message


def test_wrong_stem_names_the_shapes_and_the_fix(tmp_path: Path, weights: dict[str, Path]) -> None:
    message = error_of(tmp_path, search(weights["imagenet"], stem="cifar"))
    assert message == (
        f"{tmp_path}/search.yaml: model.pretrained: conv1.weight has shape (64, 3, 7, 7) in "
        f"{weights['imagenet']} but the resnet18 backbone (cifar stem) expects (64, 3, 3, 3); "
        f"set model.stem: imagenet")
    # auto at 32 px is the CIFAR stem too.
    assert "set model.stem: imagenet" in error_of(tmp_path, search(weights["imagenet"],
                                                                   stem="auto"))
    assert "set model.stem: cifar" in error_of(tmp_path, search(weights["cifar"],
                                                                stem="imagenet"))


def test_wrong_backbone_is_named(tmp_path: Path, weights: dict[str, Path]) -> None:
    message = error_of(tmp_path, search(weights["cifar"], backbone="resnet50"))
    assert message.endswith(f": model.pretrained: {weights['cifar']} holds a resnet18 backbone "
                            f"but model.backbone is resnet50; set model.backbone: resnet18")
    assert "model.backbone is small_cnn" in error_of(tmp_path, search(weights["cifar"],
                                                                      backbone="small_cnn"))


def test_channel_mismatch_names_the_channels(tmp_path: Path, weights: dict[str, Path]) -> None:
    message = error_of(tmp_path, search(weights["cifar"], dataset="digits"))
    assert ": model.pretrained: conv1.weight has shape (64, 3, 3, 3)" in message
    assert "expects (64, 1, 3, 3); the file's first layer takes 3-channel images, the data " \
           "has 1 channel" in message


def test_missing_keys_are_listed(tmp_path: Path, weights: dict[str, Path]) -> None:
    state = torch.load(weights["cifar"], weights_only=True)
    for key in [key for key in state if key.startswith("layer4.1.")]:
        del state[key]
    state["extra.weight"] = torch.zeros(1)
    partial = tmp_path / "partial.pt"
    torch.save(state, partial)
    message = error_of(tmp_path, search(partial))
    assert f"model.pretrained: {partial} does not fit the resnet18 backbone (cifar stem): " \
           f"missing layer4.1.conv1.weight, layer4.1.bn1.weight, layer4.1.bn1.bias (+" in message
    assert message.endswith("; unexpected extra.weight")


def test_searched_stem_is_checked_for_every_value(tmp_path: Path,
                                                  weights: dict[str, Path]) -> None:
    text = search(weights["cifar"]).replace(
        "tune: {num_samples: 1}", "tune:\n  num_samples: 2\n  search_space:\n"
        "    model.stem: {choice: [cifar, imagenet]}")
    message = error_of(tmp_path, text)
    assert ": model.pretrained: with searched model.stem=imagenet: conv1.weight" in message


def test_cli_exits_2_with_the_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                   weights: dict[str, Path]) -> None:
    path = write(tmp_path, search(weights["imagenet"], stem="cifar"))
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "model.pretrained: conv1.weight" in err
    assert "\n" not in err


def test_relative_path_is_made_absolute_for_trials(tmp_path: Path,
                                                   weights: dict[str, Path]) -> None:
    os.link(weights["cifar"], tmp_path / "w.pt")
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        config = load_search(write(tmp_path, search("w.pt")))
        assert with_absolute_paths(config).model.pretrained == str(tmp_path / "w.pt")
        relative_missing = error_of(tmp_path, search("gone.pt"))
    finally:
        os.chdir(cwd)
    assert relative_missing.endswith(f"no such file: gone.pt ({tmp_path}/gone.pt)")
