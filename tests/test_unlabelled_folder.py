"""A folder of images without class folders (``data.dataset: folder``, ``root/*.png``) is read as
unlabelled data without any extra key: split at random, no probe, the label-free figures
reported, and a sweep that names no objective selects on RankMe (issue 48)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_clip import clip_config
from test_reliability import StoredSession

from raycl.config.schema import ConfigError, DataConfig
from raycl.data import attributes_of, unlabelled_split_sizes
from raycl.data.sources.folders import READER, image_folder_files, list_folder
from raycl.launch.load import load_search
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop

REPO = Path(__file__).resolve().parents[1]
FOLDER_SEARCH = REPO / "searches" / "folder.yaml"


def write_images(folder: Path, count: int, seed: int = 0) -> Path:
    """``count`` small random PNGs in ``folder`` (made if missing)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for index in range(count):
        pixels = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index:03d}.png")
    return folder


def test_a_folder_without_class_folders_is_unlabelled_and_split_at_random(
        tmp_path: Path) -> None:
    """Images straight in the root: no label, random split sizes, no attribute; the same
    images in class folders keep their class; images beside class folders are one clear
    error, never a silent class."""
    flat = write_images(tmp_path / "flat", 50)
    (flat / "notes").mkdir()  # a sub-folder without images is no class
    files = image_folder_files(flat)
    assert files.labels == {} and files.test_mask is None
    assert [Path(path).name for path in files.paths] == [f"{i:03d}.png" for i in range(50)]
    data = DataConfig(dataset="folder", root=str(flat), val_fraction=0.1, test_fraction=0.2)
    assert attributes_of(data) == ()
    assert READER.split_sizes(data) == unlabelled_split_sizes(50, 0.1, 0.2) == {
        "train": 35, "val": 5, "test": 10}

    labelled = tmp_path / "labelled"
    for label in ("cat", "dog"):
        write_images(labelled / label, 6, seed=len(label))
    assert attributes_of(DataConfig(dataset="folder", root=str(labelled))) == ("class",)
    assert set(image_folder_files(labelled).labels) == {"class"}

    write_images(flat / "cat", 1)
    with pytest.raises(ValueError, match="image\\(s\\) of its own beside class folders"):
        list_folder(flat)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"root/\*\.png\|jpg \(unlabelled\)"):
        list_folder(empty)


def test_the_folder_search_on_unlabelled_images_selects_on_rankme(tmp_path: Path) -> None:
    """searches/folder.yaml with only data.root: on class folders it probes the classes, on
    images without class folders it selects on RankMe (said in a notice); a labelled objective
    there is one line naming tune.metric."""
    flat = write_images(tmp_path / "flat", 100)  # a training split that holds the batch of 64
    notices: list[str] = []
    config = load_search(FOLDER_SEARCH, [f"data.root={flat}"], notices=notices)
    assert (config.tune.metric, config.tune.mode) == ("val/label_free/rankme", "max")
    assert any(line.startswith("tune.metric: val/label_free/rankme (max), the label-free "
                               "default") for line in notices)
    with pytest.raises(ConfigError) as refused:
        load_search(FOLDER_SEARCH, [f"data.root={flat}", "tune.metric=val/linear/mean"])
    (line,) = str(refused.value).splitlines()
    assert line.startswith(f"{FOLDER_SEARCH}: tune.metric: data.root {flat} (images without "
                           f"class folders) has no labels to probe"), line

    labelled = tmp_path / "labelled"
    for label in ("a", "b"):
        write_images(labelled / label, 50, seed=len(label))
    assert load_search(FOLDER_SEARCH, [f"data.root={labelled}"]).tune.metric == \
        "val/linear/mean"


def test_a_trial_on_unlabelled_images_reports_the_label_free_figures(
        tmp_path: Path, one_torch_thread: None) -> None:
    """A SimCLR trial on images without class folders trains, evaluates with the label-free
    figures at every evaluation and at the end, and never reports a probe."""
    flat = write_images(tmp_path / "flat", 40)
    config = clip_config(method="simclr", data={"dataset": "folder", "root": str(flat),
                                                "captions": None, "resolution": 12},
                         eval={"mmvp": None, "every_n_epochs": 1},
                         train={"epochs": 2, "batch_size": 16},
                         tune={"metric": "val/label_free/rankme"})
    session = StoredSession(tmp_path / "run")
    run_trial_loop(TrialContext(config=config), session)
    assert [report["epoch"] for report in session.reports] == [1, 2]
    for report in session.reports:
        assert report["val/label_free/rankme"] >= 1.0
        assert report["val/label_free/std"] > 0.0
        assert not any("linear" in key or "knn" in key for key in report)
    assert "test/label_free/rankme" in session.reports[-1]
