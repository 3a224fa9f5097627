"""``benchmarks/peers.py``'s pieces that need no training: the matched settings it lists, the
one JSON line of issue 37, the table, and what it says when lightly is not installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from script_modules import load_script

peers = load_script("benchmarks/peers.py", "peers_bench")


def figures(images: float, knn: float, rss: float) -> dict[str, object]:
    return {"images_per_s": {"median": images, "min": images - 1, "max": images + 1},
            "knn": {"median": knn, "min": knn, "max": knn},
            "peak_rss_mb": {"median": rss, "min": rss, "max": rss}, "repeats": 3}


def test_the_listed_settings_are_the_issue_s_matched_ones() -> None:
    rows = dict(peers.settings_rows(peers.Settings()))
    assert rows["projector"] == "512 -> 512 -> 128"
    assert rows["batch"] == "256"
    assert rows["optimizer"].startswith("SGD lr 0.06 (constant) momentum 0.9")
    assert rows["temperature"] == "0.5"
    assert rows["augmentation"] == ("crop scale (0.2, 1.0), flip 0.5, jitter 0.5 p 0.8, "
                                    "grayscale 0.2, no blur, no solarize")
    assert "num_workers=1" in rows["data loading"]


def test_quick_trains_two_full_batches_per_epoch_on_every_side() -> None:
    settings = peers.quick_settings(peers.Settings())
    batch = settings.batch_size
    # The peers train on all of train/, raycl on what its validation share leaves: both 2 steps.
    assert settings.train_images // batch == 2
    raycl_train = settings.train_images - round(settings.train_images * peers.RAYCL_VAL_FRACTION)
    assert raycl_train // batch == 2
    assert settings.epochs == 2  # one warm-up epoch, one timed


def test_the_json_line_has_the_issue_s_shape() -> None:
    results = {"raycl": figures(30.0, 0.41, 1500.0), "lightly": figures(25.0, 0.4, 900.0)}
    line = json.loads(peers.json_line(results))
    assert list(line) == ["raycl", "lightly", "plain"]
    assert line["raycl"] == {"images_per_s": 30.0, "knn": 0.41, "peak_rss_mb": 1500.0}
    assert line["plain"] is None  # asked for but not run


def test_the_table_gives_each_side_s_ratio_to_lightly() -> None:
    table = peers.markdown_table({"raycl": figures(30.0, 0.41, 1500.0),
                                  "lightly": figures(25.0, 0.4, 900.0)})
    raycl_row = next(row for row in table.splitlines() if row.startswith("| raycl"))
    assert "| 30.0 [29.0–31.0] | 1.20 |" in raycl_row


def test_without_lightly_one_line_says_how_to_install_it_and_the_rest_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "lightly", None)  # an import of lightly now fails
    assert not peers.lightly_available()
    sides, notes = peers.runnable_sides(["raycl", "lightly", "plain"], "simclr", False)
    assert sides == ["raycl", "plain"]
    assert notes == [peers.LIGHTLY_MISSING]
    assert "pip install -e '.[peers]'" in notes[0]
    sides, notes = peers.runnable_sides(["raycl", "lightly", "plain"], "nnclr", True)
    assert sides == ["raycl", "lightly"] and "SimCLR only" in notes[0]


def test_a_small_cnn_run_matches_the_model_on_every_side(tmp_path: Path) -> None:
    import torch

    settings = peers.matched_settings("simclr", "small_cnn", 16, 2, epochs=2)
    assert settings.projector == (256, 512, 128)  # the projector reads small_cnn's features
    assert (settings.resolution, settings.epochs) == (16, 2)
    rows = dict(peers.settings_rows(settings))
    assert "small_cnn" in rows["backbone"] and "16 px" in rows["data"]
    backbone = peers.peer_backbone("small_cnn")
    assert backbone(torch.zeros(2, 3, 16, 16)).shape == (2, settings.projector[0])
    folder = peers.write_image_folder(  # the config reads the folder's classes
        tmp_path / "folder", peers.replace(settings, train_images=600, test_images=20))
    assert len(list((folder / "train").rglob("*.png"))) == 600
    config = peers.raycl_config(folder, tmp_path, settings, 0, "cpu", "name")
    assert (config.model.backbone, config.model.width) == ("small_cnn", peers.SMALL_CNN_WIDTH)
    from raycl.config.training import ModelConfig

    assert ModelConfig.model_fields["width"].default == peers.SMALL_CNN_WIDTH
    assert config.data.resolution == 16 and config.train.epochs == 2
    assert peers.matched_settings("simclr", "resnet18", 32, 2).projector == (512, 512, 128)
    full = peers.matched_settings("simclr", "resnet18", 32, 2, epochs=2, train_images=2560,
                                  seed=1)
    assert (full.epochs, full.train_images, full.seed) == (2, 2560, 1)
    with pytest.raises(ValueError, match="backbone must be one of"):
        peers.matched_settings("simclr", "vit", 32, 2)
    with pytest.raises(ValueError, match="--epochs must be >= 2"):
        peers.matched_settings("simclr", "resnet18", 32, 2, epochs=1)
    with pytest.raises(ValueError, match="--train-images must be >= 536"):
        peers.matched_settings("simclr", "resnet18", 32, 2, train_images=500)
