"""A sweep's settings and data are its identity: a re-run of its name with other settings or
other data stops before launch, before Ray starts (exit 2), naming the differing keys or what
changed in the data; identical ones resume it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

import raycl.sweep.run
import raycl.tune
from raycl.config.schema import ConfigError, CoreConfig
from raycl.data.listed_once import listed_once
from raycl.launch.data_identity import data_changes, dataset_key, key_change
from raycl.launch.identity import (
    SWEEP_FILE,
    check_same_sweep,
    read_identity,
    read_settings,
    setting_changes,
    store_settings,
)
from raycl.launch.load import with_absolute_paths
from raycl.launch.sweep_plan import plan_sweep
from raycl.tune import main, parse_args, resolve

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "searches" / "quickstart.yaml")


def quickstart(tmp_path: Path, *args: str) -> CoreConfig:
    """The quickstart as ``python -m raycl.tune`` resolves it (its trials' absolute paths)."""
    flags = ["--storage", str(tmp_path / "ray"), "--tracking-uri",
             f"sqlite:///{tmp_path / 'mlflow.db'}", *args]
    return with_absolute_paths(resolve(parse_args([QUICKSTART, *flags])))


def launched(tmp_path: Path, config: CoreConfig, data: dict[str, Any] | None = None) -> str:
    """A stored sweep as a launch leaves it: the identity file and the ``tuner.pkl`` by which
    ``Tuner.can_restore`` knows a sweep."""
    experiment = tmp_path / "ray" / config.name
    assert store_settings(config, str(experiment), data) is None
    (experiment / "tuner.pkl").write_bytes(b"")
    return str(experiment)


def test_the_readme_rerun_lists_what_changed(tmp_path: Path) -> None:
    first = quickstart(tmp_path)
    changes = setting_changes(first.to_dict(),
                              quickstart(tmp_path, "--set", "train.epochs=1",
                                         "--num-samples", "2").to_dict())
    # The grace period follows: clamped to the one epoch a trial now has.
    assert changes == [("train.epochs", 8, 1), ("tune.num_samples", 3, 2),
                       ("tune.scheduler.grace_period", 2, 1)]


def test_identical_settings_resume(tmp_path: Path) -> None:
    config = quickstart(tmp_path)
    experiment = launched(tmp_path, config)
    assert read_settings(experiment) == config.to_dict()
    assert check_same_sweep(quickstart(tmp_path), experiment, QUICKSTART) is None
    # Where the sweep's state lives is how it was found, however it is spelled.
    moved = quickstart(tmp_path, "--storage", f"{tmp_path}/./ray")
    assert check_same_sweep(moved, experiment) is None


def test_more_samples_stop_too(tmp_path: Path) -> None:
    """Ray's restore keeps the searcher's trial count: more samples would be ignored."""
    experiment = launched(tmp_path, quickstart(tmp_path))
    with pytest.raises(ConfigError, match=r"tune\.num_samples: 3 → 5\); run these"):
        check_same_sweep(quickstart(tmp_path, "--num-samples", "5"), experiment)


def test_keys_unknown_to_an_older_raycl(tmp_path: Path) -> None:
    stored = quickstart(tmp_path).to_dict()
    del stored["train"]["lr_schedule"]  # as if stored by a raycl that did not have the key
    stored["train"]["gone"] = 1  # a key this raycl no longer has
    assert setting_changes(stored, quickstart(tmp_path).to_dict()) == []
    new = quickstart(tmp_path, "--set", "train.lr_schedule=constant").to_dict()
    assert setting_changes(stored, new) == [("train.lr_schedule", None, "constant")]


def test_a_sweep_without_settings_resumes_with_a_notice(tmp_path: Path) -> None:
    assert "older raycl" in check_same_sweep(quickstart(tmp_path), str(tmp_path))


def test_storage_pyarrow_cannot_reach_is_skipped(tmp_path: Path) -> None:
    config = quickstart(tmp_path)
    assert "could not be stored" in store_settings(config, "nofs://bucket/quickstart")
    assert "cannot be read" in check_same_sweep(config, "nofs://bucket/quickstart")


def folder_key(files: dict[str, int]) -> dict[str, Any]:
    """A folder's stored key: (path, size, mtime) of each image."""
    return {"dataset": "folder", "root": "/d",
            "files": [[name, size, 7] for name, size in sorted(files.items())]}


def test_a_data_change_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = folder_key({"a/1.png": 10, "a/2.png": 11, "b/3.png": 12})
    assert key_change(before, folder_key({"a/1.png": 10, "a/2.png": 11, "b/3.png": 12})) is None
    grown = folder_key({"a/1.png": 10, "a/2.png": 11, "b/3.png": 12, "b/4.png": 13})
    assert key_change(before, grown) == (
        "folder /d: 1 image added, 0 removed, 0 changed (3 → 4 images)")
    edited = folder_key({"a/1.png": 10, "a/2.png": 99})
    assert data_changes({"data": before}, {"data": edited}) == [
        ("data", "folder /d: 0 images added, 1 removed, 1 changed (3 → 2 images)")]
    # A dataset stored without a key (its files were not there yet) is not compared.
    assert data_changes({"data": None}, {"data": edited}) == []
    # Generated sets: their key is their settings; shards are itemised like files.
    assert key_change({"dataset": "trifeature", "seed": 0}, {"dataset": "trifeature",
                                                             "seed": 1}) == (
        "trifeature: seed: 0 → 1")
    shards = {"dataset": "webdataset", "root": "/s", "shards": [["0.tar", 5], ["1.tar", 5]]}
    assert key_change(shards, {**shards, "shards": [["0.tar", 5]]}) == (
        "webdataset /s: 0 shards added, 1 removed, 0 changed (2 → 1 shard)")

    # A long file list is stored as its count and digest: a change is found, not itemised.
    folder = tmp_path / "imgs"
    write_images(folder, 3)
    cfg = SimpleNamespace(dataset="folder", root=str(folder), layout="auto")
    listed = dataset_key(cfg, 0)
    monkeypatch.setattr("raycl.launch.data_identity.LISTED_FILES", 5)
    assert dataset_key(cfg, 0)["files"]["count"] == 6
    assert key_change(listed, dataset_key(cfg, 0)) is None  # stored under another limit
    write_images(folder, 4)
    assert key_change(listed, dataset_key(cfg, 0)) == (
        f"folder {folder}: its images changed (6 → 8 images)")


def test_a_sweep_stored_without_its_data_resumes_with_a_notice(tmp_path: Path) -> None:
    """As an older raycl stored it: the settings alone."""
    config = quickstart(tmp_path)
    experiment = tmp_path / "ray" / config.name
    experiment.mkdir(parents=True)
    (experiment / SWEEP_FILE).write_text(json.dumps(config.to_dict()))
    assert read_identity(str(experiment)) == {"settings": config.to_dict(), "data": None}
    data = {"data": {"dataset": "trifeature", "samples_per_combination": 5, "seed": 0}}
    assert "stored no key of its data" in check_same_sweep(config, str(experiment), data=data)


def write_images(folder: Path, per_class: int) -> None:
    """Two class folders of ``per_class`` tiny PNGs each (rewritten ones keep their bytes)."""
    for name in ("circle", "square"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            path = folder / name / f"{index}.png"
            if not path.exists():
                Image.new("RGB", (8, 8), (index, 0, 0)).save(path)


def test_cli_rerun_with_other_data_or_settings_stops_before_ray_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    """The issue's case: a folder sweep, one image added, the same command: refused before
    Ray starts, naming the change; so is a changed setting; --fresh sets the sweep aside."""
    folder = tmp_path / "imgs"
    write_images(folder, 30)
    args = [QUICKSTART, "--set", "data.dataset=folder", "--set", f"data.root={folder}",
            "--set", "train.batch_size=16", "--storage", str(tmp_path / "ray"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    with listed_once():  # the first launch, as build_tuner stores it (without training)
        config = resolve(parse_args(args))
        plan = plan_sweep(config, QUICKSTART)
    assert not plan.resume
    experiment = launched(tmp_path, with_absolute_paths(config), plan.data)
    assert read_identity(experiment)["data"]["data"]["files"][0][0] == "circle/0.png"
    ray_started: list[Any] = []
    monkeypatch.setattr(raycl.sweep.run, "init_ray", lambda *a, **k: ray_started.append(a))

    (folder / "square" / "30.png").write_bytes((folder / "square" / "0.png").read_bytes())
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {QUICKSTART}: data.root: sweep 'quickstart' at {experiment} was "
                   f"launched on other data (data: folder {folder}: 1 image added, 0 removed, "
                   f"0 changed (60 → 61 images)); run it as a new sweep (--name NEW) or start "
                   f"this one over (--fresh)")

    assert main([*args, "--set", "train.epochs=1", "--num-samples", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {QUICKSTART}: name: sweep 'quickstart' at {experiment} was "
                   f"launched with other settings (train.epochs: 8 → 1, tune.num_samples: "
                   f"3 → 2, tune.scheduler.grace_period: 2 → 1); run these as a new sweep "
                   f"(--name NEW) or start this one over (--fresh)")
    assert main([*args, "--dry-run"]) == 0  # launches nothing, decides nothing
    assert ray_started == []
    assert sorted(p.name for p in Path(experiment).iterdir()) == [SWEEP_FILE, "tuner.pkl"]

    class RayStarts(Exception):
        pass

    def start_ray(*args: Any, **kwargs: Any) -> None:
        raise RayStarts

    monkeypatch.setattr(raycl.sweep.run, "init_ray", start_ray)
    with pytest.raises(RayStarts):
        main([*args, "--fresh"])
    assert not Path(experiment).exists()  # set aside, before Ray started
    (aside,) = Path(experiment).parent.glob("quickstart.*")
    assert (aside / SWEEP_FILE).is_file()
