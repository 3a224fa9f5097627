"""Issue 52, "export back": a ``model.backbone: timm/<name>`` trial's encoder out of raycl.

A tiny ViT trial (one block, 32 wide, 16 px Trifeature, one epoch) runs in this process; an
MLflow store records it as a sweep's driver would (tests/finished_sweep.py's tags, no Ray).
``python -m raycl.export --format timm`` / ``safetensors`` write a file that loads strictly into
``timm.create_model`` built from the model card's own name and kwargs and embeds as raycl does;
formats that do not fit are one line; ``raycl.load_encoder`` and ``python -m raycl.evaluate``
work on the trial (the latter from its checkpoint, and from the encoder logged into its run once
the checkpoint is gone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient
from test_reliability import TINY, StoredSession
from test_timm_backbones import VIT, VIT_KWARGS, vit_config

import raycl
from raycl.data.augment import to_float
from raycl.evaluate import main as evaluate_main
from raycl.export.__main__ import main as export_main
from raycl.export.encoder import StageConcat, load_encoder, trained_encoder
from raycl.export.formats import write_encoder
from raycl.export.model_card import card_path
from raycl.export.modules import Preprocessing
from raycl.models import build_backbone
from raycl.results.run_encoder import log_ended_trial_encoder
from raycl.tracking.runs import (
    CHECKPOINT_TAG,
    ENDED_TAG,
    PARENT_TAG,
    ROLE_TAG,
    TRIAL_TAG,
)
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop
from tests.finished_sweep import METRIC, log_trial_config, sweep_store, write_folder
from tests.test_export_formats import tiny_config

timm = pytest.importorskip("timm")

EXPERIMENT = "vit-export"
RESOLUTION = 16


@dataclass
class VitSweep:
    """The finished one-trial sweep: its store, the trial's config and checkpoint, new images."""

    uri: str
    config: Any
    checkpoint: Path
    folder: Path


def record_trial(tmp: Path, config: Any, checkpoint: Path) -> str:
    """An MLflow store holding the trial's run as the sweep's callbacks leave it (parent run,
    tags, objective, ``config.yaml``, checkpoint tag, the encoder logged into the run); returns
    its URI."""
    uri, client, experiment_id, parent = sweep_store(tmp, EXPERIMENT)
    run_id = client.create_run(experiment_id, run_name="t01", tags={
        PARENT_TAG: parent, ROLE_TAG: "trial", TRIAL_TAG: "vit01", ENDED_TAG: "completed",
        CHECKPOINT_TAG: str(checkpoint)}).info.run_id
    client.log_metric(run_id, METRIC, 0.5)
    log_trial_config(client, run_id, tmp, "vit01", config)
    client.set_terminated(run_id)
    client.set_terminated(parent)
    # As the sweep's driver does when the trial ends: its encoder logged into its run.
    assert log_ended_trial_encoder(uri, EXPERIMENT, "vit01") is not None
    return uri


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> VitSweep:
    """The tiny ViT trial, trained for one epoch in this process, and its store."""
    tmp = tmp_path_factory.mktemp("vit-sweep")
    config = vit_config("simclr", train={**TINY["train"], "epochs": 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a busy machine
    try:
        run_trial_loop(TrialContext(config=config), StoredSession(tmp / "run"))
    finally:
        torch.set_num_threads(threads)
    checkpoint = sorted((tmp / "run").glob("checkpoint_*"))[-1]
    write_folder(tmp / "new_images")
    return VitSweep(record_trial(tmp, config, checkpoint), config, checkpoint,
                    tmp / "new_images")


def uint8_images(count: int = 6, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, RESOLUTION, RESOLUTION), dtype=torch.uint8,
                         generator=generator)


def raycl_features(sweep: VitSweep, images: torch.Tensor) -> torch.Tensor:
    """What raycl's evaluation embeds ``images`` (uint8) as: the trial's encoder on
    ``to_float``."""
    with torch.no_grad():
        return trained_encoder(sweep.checkpoint, sweep.config)(to_float(images))


def export(sweep: VitSweep, export_format: str, out: Path) -> int:
    return export_main(["--experiment", EXPERIMENT, "--tracking-uri", sweep.uri,
                        "--trial", "best", "--format", export_format, "--out", str(out)])


def read_weights(path: Path, export_format: str) -> dict[str, torch.Tensor]:
    if export_format == "safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize(("export_format", "name"), [("timm", "vit.pt"),
                                                     ("safetensors", "vit.safetensors")])
def test_export_loads_strictly_into_the_timm_model_its_card_names(
        sweep: VitSweep, tmp_path: Path, export_format: str, name: str) -> None:
    out = tmp_path / name
    assert export(sweep, export_format, out) == 0
    card = json.loads(card_path(out).read_text())
    assert card["format"] == export_format and card["backbone"] == VIT
    entry = card["timm"]
    assert entry["model"] == "vit_tiny_patch16_224" and entry["kwargs"] == VIT_KWARGS
    assert entry["in_chans"] == card["channels"] == 3
    assert entry["input_size"] == [3, RESOLUTION, RESOLUTION]
    assert entry["mean"] == [0.5] * 3 and entry["std"] == [0.5] * 3
    assert card["normalisation"] == {"mean": [0.5] * 3, "std": [0.5] * 3}
    assert card["resize"].startswith("none: generated at resolution")  # Trifeature's
    # Built from the card alone, loaded strictly.
    model = timm.create_model(entry["model"], pretrained=False, num_classes=0,
                              in_chans=card["channels"], **entry["kwargs"])
    model.load_state_dict(read_weights(out, export_format), strict=True)
    batch = uint8_images()
    expected = raycl_features(sweep, batch)
    normalised = Preprocessing.from_dict(card["preprocessing"]).normalise(batch)
    with torch.no_grad():
        assert torch.allclose(model.eval()(normalised), expected, atol=1e-5)
    # The card's own lines: timm's data config says what the weights were fed.
    namespace: dict[str, Any] = {"images": batch.float() / 255.0}
    exec(card["how_to_load"].replace(repr(name), repr(str(out))), namespace)
    data_config = timm.data.resolve_data_config(model=namespace["model"])
    assert data_config["mean"] == (0.5,) * 3 and data_config["std"] == (0.5,) * 3
    assert data_config["input_size"] == (3, RESOLUTION, RESOLUTION)
    assert data_config["crop_pct"] == 1.0  # raycl's readers crop no border away
    with torch.no_grad():
        assert torch.allclose(namespace["features"], expected, atol=1e-5)


@pytest.mark.parametrize("export_format", ["torchvision", "small_cnn", "open_clip"])
def test_formats_that_do_not_fit_a_timm_trial_are_one_line(
        sweep: VitSweep, tmp_path: Path, export_format: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "vit.pt"
    assert export(sweep, export_format, out) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --format {export_format} does not fit a {VIT} trial; use timm or "
                   f"safetensors")
    assert list(tmp_path.iterdir()) == []


def test_load_encoder_of_the_export_embeds_as_raycl(sweep: VitSweep, tmp_path: Path) -> None:
    batch = uint8_images()
    expected = raycl_features(sweep, batch)
    # safetensors first: what the sweep logs into every trial's run, and raycl.load_encoder reads
    for export_format, name in (("safetensors", "vit.safetensors"), ("timm", "vit.pt")):
        assert export(sweep, export_format, tmp_path / name) == 0
        encoder, preprocessing = raycl.load_encoder(str(tmp_path / name))
        assert preprocessing == Preprocessing(RESOLUTION, 3, (0.5,) * 3, (0.5,) * 3)
        with torch.no_grad():
            assert torch.allclose(encoder(preprocessing.normalise(batch)), expected, atol=1e-5)
    # A checkpoint directory with its config beside it, as well.
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    (directory / "state.pt").write_bytes((sweep.checkpoint / "state.pt").read_bytes())
    (directory / "config.json").write_text(json.dumps(sweep.config.to_dict()))
    encoder, preprocessing = load_encoder(str(directory))
    with torch.no_grad():
        assert torch.allclose(encoder(preprocessing.normalise(batch)), expected, atol=1e-5)


def evaluate(sweep: VitSweep, name: str) -> dict[str, float]:
    """``python -m raycl.evaluate`` of the trial on the new images; its run's metrics."""
    code = evaluate_main(["--experiment", EXPERIMENT, "--tracking-uri", sweep.uri, "--no-ray",
                          "--set", "data.dataset=folder", "--set", f"data.root={sweep.folder}",
                          "--name", name])
    assert code == 0
    client = MlflowClient(sweep.uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    (run,) = [run for run in client.search_runs([experiment_id])
              if run.data.tags.get(ROLE_TAG) == "trial"]
    return run.data.metrics


def test_evaluate_scores_the_vit_trial_from_its_checkpoint_and_its_logged_encoder(
        sweep: VitSweep) -> None:
    metrics = evaluate(sweep, "colours")
    for family in ("linear", "knn"):
        assert 0.0 <= metrics[f"transfer/colours/{family}/mean"] <= 1.0
    # The untrained ViT (built with the trial's timm_kwargs) is scored beside it.
    assert 0.0 <= metrics["transfer/colours/at_init/linear/mean"] <= 1.0
    # ray_results gone: the encoder the sweep logged into the run (safetensors) scores the same.
    away = sweep.checkpoint.with_name("moved-away")
    sweep.checkpoint.rename(away)
    try:
        logged = evaluate(sweep, "colours_logged")
    finally:
        away.rename(sweep.checkpoint)
    for family in ("linear", "knn"):
        assert logged[f"transfer/colours_logged/{family}/mean"] == pytest.approx(
            metrics[f"transfer/colours/{family}/mean"], abs=1e-4)


def test_mcl_concat_of_vits_exports_every_stage(tmp_path: Path) -> None:
    """No training needed: two ViT stages, as a concat trial's encoder holds them."""
    config = tiny_config(method="mcl", model={"backbone": VIT, "timm_kwargs": VIT_KWARGS},
                         mcl={"base": "simclr", "stages": 2, "integration": "concat",
                              "clusters": 2})
    torch.manual_seed(0)
    stages = [build_backbone(VIT, 3, 8, timm_kwargs=VIT_KWARGS)[0].eval() for _ in range(2)]
    encoder = StageConcat(stages).eval()
    batch = to_float(uint8_images())
    with torch.no_grad():
        expected = encoder(batch)
    out = tmp_path / "concat.pt"
    write_encoder(encoder, config, "timm", out, channels=3)
    card = json.loads(card_path(out).read_text())
    assert card["concat"] and card["timm"]["kwargs"] == VIT_KWARGS
    namespace: dict[str, Any] = {}
    exec(card["how_to_load"].replace("'concat.pt'", repr(str(out))), namespace)
    loaded, _ = load_encoder(str(out))
    with torch.no_grad():
        assert torch.allclose(namespace["model"](batch), expected, atol=1e-5)
        assert torch.allclose(loaded(batch), expected, atol=1e-5)
