"""``--set tune.objectives`` on a YAML that gives ``tune.metric`` (issue 47, finding 1): the
command line's objectives replace the file's single objective (and its ASHA scheduler) with one
line on stderr, ``--set tune.metric=null`` unsets it, and a file giving both is still refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raycl.config.schema import ConfigErrors
from raycl.launch.load import load_search

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "searches" / "quickstart.yaml"
OBJECTIVES = ("tune.objectives=[{metric: val/linear/shape, mode: max}, "
              "{metric: val/linear/texture, mode: max}]")
NOTICE = ("raycl: --set tune.objectives replaces tune.metric=val/linear/mean, tune.mode=max, "
          "tune.scheduler.type=asha")


@pytest.fixture(autouse=True)
def _no_tracking_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m raycl.tune ARGS`` of this checkout, run in ``tmp_path``."""
    env = {key: value for key, value in os.environ.items() if key != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "raycl.tune", *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)


def both_in_file(tmp_path: Path) -> Path:
    """quickstart.yaml with objectives written beside its tune.metric, and no ASHA."""
    text = QUICKSTART.read_text().replace(
        "  metric: val/linear/mean\n",
        "  metric: val/linear/mean\n  objectives: [{metric: val/linear/shape, mode: max}, "
        "{metric: val/linear/texture, mode: max}]\n").replace(
        "  scheduler: {type: asha, grace_period: 2, reduction_factor: 2}\n", "")
    path = tmp_path / "both.yaml"
    path.write_text(text)
    return path


def test_set_objectives_replaces_the_files_metric_with_one_notice(
        capsys: pytest.CaptureFixture) -> None:
    config = load_search(QUICKSTART, [OBJECTIVES], check_references=False)
    objectives = [(item.metric, item.mode) for item in config.tune.objectives or []]
    assert objectives == [("val/linear/shape", "max"), ("val/linear/texture", "max")]
    assert (config.tune.metric, config.tune.mode) == ("val/linear/shape", "max")
    assert config.tune.scheduler.type == "none"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(NOTICE), err


def test_asha_set_after_the_objectives_is_still_refused() -> None:
    with pytest.raises(ConfigErrors, match="compares one number per trial"):
        load_search(QUICKSTART, [OBJECTIVES, "tune.scheduler.type=asha"],
                    check_references=False)


def test_set_metric_null_unsets_it(tmp_path: Path) -> None:
    plain = load_search(QUICKSTART, ["tune.metric=null", "tune.mode=null"],
                        check_references=False)
    assert (plain.tune.metric, plain.tune.mode) == ("val/linear/mean", "max")  # the defaults
    config = load_search(both_in_file(tmp_path), ["tune.metric=null"], check_references=False)
    assert config.tune.metric == "val/linear/shape" and len(config.tune.objectives or []) == 2


def test_the_file_alone_giving_both_is_still_refused(tmp_path: Path) -> None:
    path = both_in_file(tmp_path)
    with pytest.raises(ConfigErrors) as caught:
        load_search(path, check_references=False)
    assert caught.value.lines == [
        f"{path}: tune: give tune.objectives or tune.metric/mode, not both (the first objective, "
        f"val/linear/shape max, is what the leaderboard, confirm and importance rank on)"]
    done = cli(tmp_path, str(path), "--dry-run")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {caught.value.lines[0]}"]


def test_cli_dry_run_with_set_objectives_exits_0_with_the_notice(tmp_path: Path) -> None:
    done = cli(tmp_path, str(QUICKSTART), "--set", OBJECTIVES, "--dry-run",
               "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert done.returncode == 0, done.stderr
    notices = [line for line in done.stderr.splitlines() if "tune.objectives" in line]
    assert len(notices) == 1 and notices[0].startswith(NOTICE), done.stderr
    assert "metric: val/linear/shape" in done.stdout and "type: none" in done.stdout
