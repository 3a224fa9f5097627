"""Issue 47, the exported encoder as users meet it: ``raycl.load_encoder`` in a fresh
interpreter, a model registered by ``raycl.export --register`` that ``.eval()`` works on, a
model card that states the resize the trial's dataset really had, and a small_cnn card that
says how to rebuild the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from raycl.data.sources.packaged import resize_images
from raycl.data.sources.shipped import resize_into
from raycl.export.encoder import StageConcat, load_encoder, trained_encoder
from raycl.export.formats import write_encoder
from raycl.export.model_card import card_path
from raycl.export.trial_export import Exported, register_encoder
from tests.test_export_formats import (
    concat_config,
    images,
    raycl_embedding,
    save_checkpoint,
    tiny_config,
    trained,
)


def small_cnn_trial(tmp_path: Path, **sections: Any) -> tuple[Any, Any, Path]:
    config = tiny_config(**sections)
    method = trained(config)
    return config, method, save_checkpoint(method, tmp_path / "checkpoint")


def test_load_encoder_works_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """README's `import raycl; raycl.load_encoder(PATH)`, nothing else imported first: an
    exported file of each kind and a checkpoint directory."""
    config, method, checkpoint = small_cnn_trial(tmp_path)
    (checkpoint / "config.json").write_text(json.dumps(config.to_dict()))
    encoder = trained_encoder(checkpoint, config)
    paths = [str(checkpoint)]
    for export_format, name in (("safetensors", "e.safetensors"), ("small_cnn", "e.pt2")):
        write_encoder(encoder, config, export_format, tmp_path / name, channels=3)
        paths.append(str(tmp_path / name))
    batch = images()
    torch.save(batch, tmp_path / "batch.pt")
    script = ("import sys, torch, raycl\n"
              "batch = torch.load('batch.pt')\n"
              "out = []\n"
              "for path in sys.argv[1:]:\n"
              "    encoder, pre = raycl.load_encoder(path)\n"
              "    with torch.no_grad():\n"
              "        out.append(encoder.eval()(batch))\n"  # eval() works on each
              "torch.save(out, 'features.pt')\n")
    done = subprocess.run([sys.executable, "-c", script, *paths], cwd=tmp_path, timeout=180,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = raycl_embedding(method, batch)
    for features in torch.load(tmp_path / "features.pt"):
        assert torch.allclose(features, expected, atol=1e-6)


def test_registered_model_is_an_ordinary_module_that_embeds(tmp_path: Path) -> None:
    import mlflow
    import mlflow.pytorch

    config, method, checkpoint = small_cnn_trial(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("issue47"))
    client.set_terminated(run.info.run_id, "FINISHED")
    encoder = trained_encoder(checkpoint, config)
    files = write_encoder(encoder, config, "safetensors", tmp_path / "e.safetensors", channels=3)
    trial = SimpleNamespace(tracking_uri=uri, config=config, run_id=run.info.run_id)
    assert register_encoder(trial, Exported(files, encoder, 3), "enc47") == (1, False)
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    batch = images(count=3)  # not the example's batch size
    torch.save(batch, tmp_path / "batch.pt")
    # As a user loads it: no raycl (-I: no cwd on the path), eval() and train() work.
    script = ("import sys, torch, mlflow.pytorch\n"
              "model = mlflow.pytorch.load_model('models:/enc47/1')\n"
              "assert isinstance(model, torch.nn.Module)\n"
              "model.train(); model = model.eval()\n"
              "with torch.no_grad():\n"
              "    torch.save(model(torch.load('batch.pt')), 'features.pt')\n"
              "assert not any(name.startswith('raycl') for name in sys.modules)\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=env,
                          timeout=180, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = raycl_embedding(method, batch)
    assert torch.allclose(torch.load(tmp_path / "features.pt"), expected, atol=1e-5)


@pytest.mark.parametrize(("dataset", "said", "not_said"), [
    ("digits", ["no crop", "bilinear", "antialias=True"], "bicubic"),
    ("mnist_fashion", ["no crop", "bilinear", "antialias=True"], "bicubic"),
    ("cifar10", ["no crop", "bicubic", "antialias=True"], "bilinear"),
    ("folder", ["centre square crop", "bicubic", "Pillow"], "bilinear"),
    ("trifeature", ["generated at resolution"], "bicubic"),
])
def test_model_card_states_the_resize_of_the_trials_dataset(
        tmp_path: Path, dataset: str, said: list[str], not_said: str) -> None:
    data: dict[str, Any] = {"dataset": dataset}
    if dataset == "folder":
        data["root"] = str(tmp_path / "images")
    config, _, checkpoint = small_cnn_trial(tmp_path, data=data)
    out = tmp_path / "e.safetensors"
    write_encoder(trained_encoder(checkpoint, config), config, "safetensors", out, channels=3)
    card = json.loads(card_path(out).read_text())
    stated = card["preprocessing"]["crop"]
    assert all(words in stated for words in said) and not_said not in stated, stated
    assert card["resize"] == stated == load_encoder(str(out))[1].crop
    # A card written before the fix said bicubic for every dataset: read back, the config wins.
    card["preprocessing"]["crop"] = "centre square crop, bicubic resize to resolution x resolution"
    card_path(out).write_text(json.dumps(card))
    assert load_encoder(str(out))[1].crop == card["resize"]


@pytest.mark.parametrize(("mode", "resize"), [
    ("bilinear", lambda batch, side: resize_images(batch, side)),  # digits, mnist_fashion
    ("bicubic", lambda batch, side: _resized_into(batch, side)),  # cifar10/100, stl10
])
def test_the_resize_the_card_states_is_what_the_readers_do(mode: str, resize: Any) -> None:
    batch = np.random.default_rng(0).integers(0, 256, (3, 1, 8, 8), dtype=np.uint8)
    stated = F.interpolate(torch.from_numpy(batch).float(), size=(20, 20), mode=mode,
                           align_corners=False, antialias=True)
    assert np.array_equal(resize(batch, 20), stated.round().clamp(0, 255).to(torch.uint8).numpy())


def _resized_into(batch: np.ndarray, side: int) -> np.ndarray:
    out = np.zeros((*batch.shape[:2], side, side), dtype=np.uint8)
    resize_into(batch, out)
    return out


def test_small_cnn_safetensors_card_describes_and_rebuilds_the_network(tmp_path: Path) -> None:
    config, method, checkpoint = small_cnn_trial(tmp_path)  # width 8
    out = tmp_path / "e.safetensors"
    write_encoder(trained_encoder(checkpoint, config), config, "safetensors", out, channels=3)
    card = json.loads(card_path(out).read_text())
    architecture = card["architecture"]
    assert [(b["out_channels"], b["stride"]) for b in architecture["blocks"]] == [
        (8, 1), (16, 2), (32, 2), (64, 2)]
    assert architecture["blocks"][0]["conv"] == \
        "Conv2d(3, 8, kernel_size=3, stride=1, padding=1, bias=False)"
    assert architecture["feature_dim"] == 64
    assert architecture["config_keys"] == {"model.backbone": "small_cnn", "model.width": 8}
    assert architecture["raycl"] == "raycl.models.backbones.small_cnn(in_channels=3, width=8)"
    # The card's lines build it from torch.nn alone and load the file strictly.
    lines = card["how_to_load"].splitlines()
    assert not [line for line in lines if "raycl" in line.split("#")[0]]
    namespace: dict[str, Any] = {}
    exec(card["how_to_load"].replace("'e.safetensors'", repr(str(out))), namespace)
    batch = images()
    with torch.no_grad():
        assert torch.allclose(namespace["model"](batch), raycl_embedding(method, batch),
                              atol=1e-6)


def test_small_cnn_concat_safetensors_card_rebuilds_every_stage(tmp_path: Path) -> None:
    config = concat_config("small_cnn")
    encoder = StageConcat([trained(tiny_config(), seed=seed).backbone for seed in (0, 1)]).eval()
    out = tmp_path / "concat.safetensors"
    write_encoder(encoder, config, "safetensors", out, channels=3)
    card = json.loads(card_path(out).read_text())
    assert card["architecture"]["feature_dim"] == 64
    namespace: dict[str, Any] = {}
    exec(card["how_to_load"].replace("'concat.safetensors'", repr(str(out))), namespace)
    batch = images()
    with torch.no_grad():
        assert torch.allclose(namespace["model"](batch), encoder(batch), atol=1e-6)
