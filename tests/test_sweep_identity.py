"""A sweep's settings are part of its identity: a re-run of its name with other settings stops
before launch (exit 2) naming the differing keys; identical settings resume it."""

from __future__ import annotations

from pathlib import Path

import pytest

from raycl.config.identity import (
    SWEEP_FILE,
    check_same_sweep,
    read_settings,
    setting_changes,
    store_settings,
)
from raycl.config.load import with_absolute_paths
from raycl.config.schema import ConfigError, CoreConfig
from raycl.tune import main, parse_args, resolve

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "searches" / "quickstart.yaml")


def quickstart(tmp_path: Path, *args: str) -> CoreConfig:
    """The quickstart as ``python -m raycl.tune`` resolves it (its trials' absolute paths)."""
    flags = ["--storage", str(tmp_path / "ray"), "--tracking-uri",
             f"sqlite:///{tmp_path / 'mlflow.db'}", *args]
    return with_absolute_paths(resolve(parse_args([QUICKSTART, *flags])))


def launched(tmp_path: Path, config: CoreConfig) -> str:
    """A stored sweep as a launch leaves it: the settings file and the ``tuner.pkl`` by which
    ``Tuner.can_restore`` knows a sweep."""
    experiment = tmp_path / "ray" / config.name
    assert store_settings(config, str(experiment)) is None
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


def test_cli_rerun_with_other_settings_stops_before_launch(
        ray_session, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    experiment = launched(tmp_path, quickstart(tmp_path))
    args = [QUICKSTART, "--set", "train.epochs=1", "--num-samples", "2", "--storage",
            str(tmp_path / "ray"), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {QUICKSTART}: name: sweep 'quickstart' at {experiment} was "
                   f"launched with other settings (train.epochs: 8 → 1, tune.num_samples: "
                   f"3 → 2, tune.scheduler.grace_period: 2 → 1); run these as a new sweep "
                   f"(--name NEW) or start this one over (--fresh)")
    assert sorted(p.name for p in Path(experiment).iterdir()) == [SWEEP_FILE, "tuner.pkl"]
