"""Issue 48 end to end, through Ray Tune and MLflow: ``searches/folder.yaml`` on a folder of
images without class folders selects on RankMe, leaves ``rung_agreement.csv``/``.png`` on its
parent run, and ``tune.collapse`` with a threshold every trial falls under stops each trial at
its first evaluation, the sweep still ending well with no trial ranked."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from test_end_to_end import runs_of
from test_unlabelled_folder import FOLDER_SEARCH, write_images

from raycl.results import TrialLookupError, find_trials
from raycl.tracking.runs import ENDED_TAG, NOTE_TAG, OBJECTIVE_TAG, rankable
from raycl.tracking.trial_table import leaderboard_rows
from raycl.tune import main

RANKME = "val/label_free/rankme"
# Small enough for two trials at once on the session's two CPUs, in their trial processes.
SMALL = ["data.resolution=12", "model.width=8", "model.projector_hidden_dim=32",
         "model.projector_dim=16", "train.batch_size=32", "eval.every_n_epochs=1",
         "eval.diagnostics=false", "eval.baseline=false", "mlflow.log_encoder=false",
         "scaling.cpus_per_worker=1", "tune.max_concurrent_trials=2"]


def folder_sweep(tmp_path: Path, root: Path, name: str, samples: int, *extra: str) -> list[str]:
    overrides = [f"data.root={root}", *SMALL, *extra]
    return [str(FOLDER_SEARCH), *[arg for item in overrides for arg in ("--set", item)],
            "--num-samples", str(samples), "--name", name, "--storage", str(tmp_path / "ray"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]


def test_an_unlabelled_folder_sweep_ranks_by_rankme_and_collapse_stops_every_trial(
        ray_session, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flat = write_images(tmp_path / "flat", 100)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    # 1. No tune.metric named, no labels: ranked by RankMe, every trial to its end.
    assert main(folder_sweep(tmp_path, flat, "unlabelled", 3, "train.epochs=2")) == 0
    printed = capsys.readouterr().out
    assert f"tune.metric: {RANKME} (max), the label-free default" in printed
    assert f"The ranking by {RANKME} agreed with the final one" in printed  # the leaderboard
    client, (parent,), children = runs_of(tmp_path, "unlabelled")
    assert len(children) == 3
    for child in children:
        assert child.data.tags[OBJECTIVE_TAG] == RANKME and rankable(child)
        for figure in (RANKME, "val/label_free/std", "val/label_free/alpha"):
            steps = [m.step for m in client.get_metric_history(child.info.run_id, figure)]
            assert sorted(steps) == [1, 2], (figure, steps)
        assert "test/label_free/rankme" in child.data.metrics
        assert not any("linear" in key or "knn" in key for key in child.data.metrics)
    best = max(children, key=lambda run: run.data.metrics[RANKME])
    (found,) = find_trials(uri, "unlabelled", "best")
    assert found.run_id == best.info.run_id
    header, rows, _ = leaderboard_rows(uri, "unlabelled")
    assert header[3] == RANKME and len(rows) == 3
    with open(client.download_artifacts(parent.info.run_id, "rung_agreement.csv",
                                        str(tmp_path))) as handle:
        agreement = list(csv.DictReader(handle))
    assert {(row["figure"], row["epoch"]) for row in agreement if row["figure"] == RANKME} == {
        (RANKME, "1"), (RANKME, "2")}
    final = next(row for row in agreement if row["figure"] == RANKME and row["epoch"] == "2")
    assert math.isclose(float(final["kendall_tau"]), 1.0)  # the final ranking agrees with itself
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    assert {"rung_agreement.csv", "rung_agreement.png"} <= artifacts

    # 2. A collapse threshold every trial falls under (the normalised std is at most ~1):
    # each trial stops at its first evaluation of three, FINISHED as collapsed, never ranked.
    assert main(folder_sweep(tmp_path, flat, "collapsed", 2, "train.epochs=3",
                             "tune.collapse={std_below: 1.5, from_epoch: 1}")) == 0
    client, (parent,), children = runs_of(tmp_path, "collapsed")
    assert len(children) == 2
    for child in children:
        assert child.info.status == "FINISHED" and child.data.tags[ENDED_TAG] == "collapsed"
        assert "val/label_free/std" in child.data.tags[NOTE_TAG] and "< 1.5" in \
            child.data.tags[NOTE_TAG]
        assert [m.step for m in client.get_metric_history(child.info.run_id, RANKME)] == [1]
        assert not rankable(child)
    assert "raycl.best_run" not in parent.data.tags
    with pytest.raises(TrialLookupError):
        find_trials(uri, "collapsed", "best")
