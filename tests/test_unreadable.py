"""Bad image files (issue 31): the launch names the first few and their count; with
``data.skip_unreadable: true`` they are left out of every split, before it is made, in memory
and stream mode, and listed; an evaluation pass never scores a file it cannot decode as a blank
image. No Ray (the sweep through Ray and MLflow is tests/test_stream.py's)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from data_fixtures import _write_jpeg, class_images
from PIL import Image

from raycl.config.training import DataConfig
from raycl.data import load_dataset
from raycl.data.load import split_sizes_for
from raycl.data.sources.folders import image_folder_files
from raycl.data.stream.files import FileRows
from raycl.tune import main
from raycl.worker.embed import embed_images
from raycl.worker.evaluate import _keep_rows, decodable_rows

REPO = Path(__file__).resolve().parents[1]
CLASSES, PER_CLASS = 3, 8


def write_folder_with_bad_images(root: Path) -> list[str]:
    """``root/c<k>/<n>.jpg`` (PER_CLASS good JPEGs a class) and five bad files: a corrupt one,
    an empty one, a truncated one (a sound header), two more corrupt ones; their paths, sorted
    as the listing names them."""
    rng = np.random.default_rng(0)
    for label in range(CLASSES):
        (root / f"c{label}").mkdir(parents=True)
        for n, image in enumerate(class_images(np.full(PER_CLASS, label), 16, 20, rng)):
            _write_jpeg(image, root / f"c{label}" / f"{n:02d}.jpg")
    whole = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(whole, "JPEG")
    bad = {root / "c0" / "corrupt.jpg": b"\xff\xd8 not a jpeg",
           root / "c1" / "empty.jpg": b"",
           root / "c2" / "truncated.jpg": whole.getvalue()[: len(whole.getvalue()) // 2],
           root / "c2" / "zz1.jpg": b"nope", root / "c2" / "zz2.jpg": b"nope"}
    for path, data in bad.items():
        path.write_bytes(data)
    return [str(path) for path in bad]


@pytest.fixture
def folder(tmp_path: Path) -> tuple[Path, list[str]]:
    root = tmp_path / "images"
    return root, write_folder_with_bad_images(root)


def data_cfg(tmp_path: Path, root: Path, **overrides: Any) -> DataConfig:
    """The data settings a folder is loaded with (the schema's for every other key)."""
    fields = dict(dataset="folder", resolution=8, root=str(root), val_fraction=0.25,
                  test_fraction=0.25, cache_dir=str(tmp_path / "cache"), decode_workers=2,
                  loader="memory")
    return DataConfig(**{**fields, **overrides})


def tune_args(tmp_path: Path, root: Path, *extra: str) -> list[str]:
    sets = ["data.dataset=folder", f"data.root={root}", "train.batch_size=4", *extra]
    return [str(REPO / "searches" / "quickstart.yaml"), "--dry-run",
            "--storage", str(tmp_path / "ray"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
            *[arg for value in sets for arg in ("--set", value)]]


def test_the_launch_names_the_first_bad_files_and_their_count_or_skips_them(
    folder: tuple[Path, list[str]], tmp_path: Path, capsys: Any
) -> None:
    """Refused before launch (exit 2, one line) naming the corrupt, empty and truncated files
    with why, the two more, the count and the key; with the key it goes on, the count printed
    once and the split sizes (checked before launch) without the left-out files."""
    root, bad = folder
    assert main(tune_args(tmp_path, root)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "data.root" in line]
    assert len(lines) == 1
    line = lines[0]
    for path, why in zip(bad[:3], ("not an image Pillow can decode", "empty file",
                                   "image file is truncated"), strict=True):
        assert f"{path!r}: {why}" in line
    assert all(path not in line for path in bad[3:])
    total = CLASSES * PER_CLASS + len(bad)
    assert (f"and 2 more (5 of {total} image files unreadable): set data.skip_unreadable: true "
            f"to leave them out") in line

    assert main(tune_args(tmp_path, root, "data.skip_unreadable=true")) == 0
    notices = [line for line in capsys.readouterr().out.splitlines()
               if "data.skip_unreadable" in line and line.startswith("raycl:")]
    assert len(notices) == 1 and f"5 of {total} image files unreadable" in notices[0]
    sizes = split_sizes_for(data_cfg(tmp_path, root, skip_unreadable=True))
    assert sum(sizes.values()) == CLASSES * PER_CLASS


@pytest.mark.parametrize("loader", ["memory", "stream"])
def test_skipped_files_are_in_no_split_and_the_split_is_stratified_and_repeatable(
    folder: tuple[Path, list[str]], tmp_path: Path, loader: str
) -> None:
    """Memory and stream mode leave the same five files out, count and list them with why, and
    split the rest as a folder without them would be split: stratified, the same every load.
    Memory mode's cache is one per content: a later run without the key is refused by it."""
    root, bad = folder
    cfg = data_cfg(tmp_path, root, loader=loader, skip_unreadable=True)
    data = load_dataset(cfg, seed=3)
    assert [name for name, _ in data.skipped] == bad
    assert all(why for _, why in data.skipped)
    paths = [str(path) for path in image_folder_files(root).paths]
    split_files = {}
    for split in ("train", "val", "test"):
        images = data.split(split).images
        rows = images.paths if isinstance(images, FileRows) else [paths[r] for r in images.rows]
        split_files[split] = [str(path) for path in rows]
        assert not set(split_files[split]) & set(bad)
        labels = data.split(split).labels["class"]
        assert [int(Path(path).parent.name[1:]) for path in split_files[split]] == list(labels)
    assert sum(map(len, split_files.values())) == CLASSES * PER_CLASS
    assert {split: len(files) for split, files in split_files.items()} == split_sizes_for(cfg)
    assert np.bincount(data.val.labels["class"]).tolist() == [2] * CLASSES  # stratified
    again = load_dataset(cfg, seed=3)
    assert [list(again.split(split).labels["class"]) for split in ("train", "val")] == \
        [list(data.split(split).labels["class"]) for split in ("train", "val")]
    if loader == "memory":
        with pytest.raises(ValueError, match=r"\(5 of 29 image files unreadable\): set "
                                             r"data.skip_unreadable: true"):
            load_dataset(data_cfg(tmp_path, root), seed=3)


class _Session:
    rank, world_size, device = 0, 1, torch.device("cpu")


def test_an_evaluation_pass_never_scores_a_file_it_cannot_decode(tmp_path: Path) -> None:
    """Stream mode, no key: a file that turns out undecodable in an evaluation pass is a NaN
    row of the embedding, never a blank image's features, and the scoring drops it from the
    split's features and labels together."""
    root = tmp_path / "images"
    write_folder_with_bad_images(root)
    data = load_dataset(data_cfg(tmp_path, root, loader="stream"), seed=0)
    images = data.test.images
    assert isinstance(images, FileRows)
    broken = [row for row, path in enumerate(images.paths)
              if Path(path).name in ("corrupt.jpg", "empty.jpg", "truncated.jpg", "zz1.jpg",
                                     "zz2.jpg")]
    assert broken, "the split holds a broken file (the test's seed)"
    method = torch.nn.Identity()
    features = embed_images(method, images, _Session(), batch_size=4,
                            embed=lambda batch: batch.flatten(1)[:, :6] + 1.0)
    assert np.isnan(features[broken]).all()
    good = np.setdiff1d(np.arange(len(images)), broken)
    assert np.isfinite(features[good]).all() and (features[good] != 1.0).any()
    keep = decodable_rows([{"test": features}])
    assert keep["test"].tolist() == good.tolist()
    scored = _keep_rows(data, keep)
    assert scored.test.labels["class"].tolist() == data.test.labels["class"][good].tolist()
    assert len(scored.test.images) == len(good) and len(scored.val.images) == len(data.val.images)

    # A whole evaluation (every split, the test split too): scored without them, counted.
    from raycl.eval.multimodal import EvalSets
    from raycl.methods import SearchConfig
    from raycl.worker.evaluate import evaluate_epoch
    from raycl.worker.session import InProcessSession
    from raycl.worker.stage import build_stage_method
    from raycl.worker.stage_integration import StageInputs

    config = SearchConfig.model_validate({
        "name": "unreadable", "method": "simclr",
        "data": {"dataset": "folder", "root": str(root), "resolution": 8, "loader": "stream"},
        "model": {"width": 8, "projector_hidden_dim": 16, "projector_dim": 8},
        "eval": {"linear_max_iter": 10, "diagnostics": False}})
    model = build_stage_method(config, 3, 0, torch.device("cpu"), None)
    embedded, metrics, _ = evaluate_epoch(config, data, EvalSets([], {}), StageInputs(), model,
                                          InProcessSession(torch.device("cpu"), None), True)
    assert metrics["data/eval_skipped"] == 5.0  # each bad file is in one split
    assert np.isfinite(metrics["test/linear/mean"]) and np.isfinite(metrics["val/knn/mean"])
    assert all(np.isfinite(values).all() and len(values) == len(data.split(split).images)
               for split, values in embedded.items())


def test_a_trial_counts_the_skipped_files_every_epoch(tmp_path: Path) -> None:
    """A memory-mode trial (the worker loop in process) on the folder with data.skip_unreadable
    trains and evaluates without the five files and reports them as data/skipped every epoch."""
    from raycl.methods import SearchConfig
    from raycl.worker.context import TrialContext
    from raycl.worker.loop import run_trial_loop
    from raycl.worker.session import InProcessSession

    root = tmp_path / "images"
    write_folder_with_bad_images(root)
    config = SearchConfig.model_validate({
        "name": "unreadable", "method": "simclr",
        "data": {"dataset": "folder", "root": str(root), "resolution": 16, "loader": "memory",
                 "skip_unreadable": True, "cache_dir": str(tmp_path / "cache"),
                 "val_fraction": 0.25, "test_fraction": 0.25},
        "model": {"width": 8, "projector_hidden_dim": 16, "projector_dim": 8},
        "train": {"epochs": 2, "batch_size": 4},
        "eval": {"every_n_epochs": 1, "linear_max_iter": 10, "diagnostics": False},
        "scaling": {"num_workers": 0, "cpus_per_worker": 1}})
    reports: list[dict[str, Any]] = []

    class Session(InProcessSession):
        def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
            reports.append(metrics)
            super().report(metrics, checkpoint_dir)

    run_trial_loop(TrialContext(config=config), Session(torch.device("cpu"), None))
    assert [report["data/skipped"] for report in reports] == [5.0, 5.0]
    assert np.isfinite(reports[-1]["test/linear/mean"])
    assert "data/eval_skipped" not in reports[-1]


def test_the_data_and_a_transfer_set_are_checked_alike_before_launch(
    folder: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """One pre-launch check asks the folder's reader about the data and about a transfer set:
    the same line for both, the transfer set's without data.skip_unreadable (a key it does not
    have); with that key set the data's problem goes and the transfer set's stays."""
    from raycl.config.schema import ConfigErrors
    from raycl.launch.load import load_search

    root, bad = folder
    search = REPO / "searches" / "quickstart.yaml"
    overrides = ["data.dataset=folder", f"data.root={root}", "train.batch_size=4",
                 f"eval.transfer=[{{dataset: folder, root: {root}}}]"]
    with pytest.raises(ConfigErrors) as error:
        load_search(search, overrides)
    lines = error.value.lines
    data_line = next(line for line in lines if ": data.root: " in line)
    transfer_line = next(line for line in lines if ": eval.transfer.0.root: " in line)
    why = transfer_line.split(": eval.transfer.0.root: ", 1)[1]
    assert why.startswith(f"cannot read image {bad[0]!r}: ") and "skip_unreadable" not in why
    assert data_line.endswith(f": data.root: {why}: set data.skip_unreadable: true to leave "
                              f"them out")
    with pytest.raises(ConfigErrors) as error:
        load_search(search, [*overrides, "data.skip_unreadable=true"])
    assert [line.split(": ")[1] for line in error.value.lines] == ["eval.transfer.0.root"]
