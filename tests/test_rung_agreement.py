"""rung_agreement.csv: how early a sweep's ranking agreed with its final one, per figure and
epoch (raycl.tracking.rung_agreement), on hand-made histories and through MLflow."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from raycl.methods import SearchConfig
from raycl.tracking.rung_agreement import (
    RUNG_AGREEMENT_TAG,
    agreement_rows,
    log_rung_agreement,
    settled_epoch,
)
from raycl.tracking.runs import ENDED_TAG, PARENT_TAG, ROLE_TAG
from raycl.tracking.trial_table import build_leaderboard

OBJECTIVE = "val/linear/mean"
# Four trials whose ranking reverses: at epoch 1 the eventual worst leads, from epoch 2 on the
# order is the final one. Final objective (epoch 3): a 0.9 > b 0.8 > c 0.7 > d 0.6.
HISTORY = {"a": {1: 0.1, 2: 0.7, 3: 0.9}, "b": {1: 0.2, 2: 0.6, 3: 0.8},
           "c": {1: 0.3, 2: 0.5, 3: 0.7}, "d": {1: 0.4, 2: 0.4, 3: 0.6}}
FINAL = {run: epochs[3] for run, epochs in HISTORY.items()}
LOSS = {"a": {1: 1.0, 2: 0.5}, "b": {1: 2.0, 2: 0.6}, "c": {1: 3.0, 2: 0.7}, "d": {1: 4.0}}


def test_each_epochs_ranking_is_compared_with_the_final_one() -> None:
    rows = agreement_rows({OBJECTIVE: HISTORY, "train/loss": LOSS}, FINAL,
                          {OBJECTIVE: "max", "train/loss": "min"}, "max")
    by = {(row["figure"], row["epoch"]): row for row in rows}
    assert by[(OBJECTIVE, 1)]["kendall_tau"] == pytest.approx(-1.0)  # reversed
    assert by[(OBJECTIVE, 1)]["top3_overlap"] == pytest.approx(2 / 3)  # b, c of a, b, c
    assert by[(OBJECTIVE, 2)]["kendall_tau"] == pytest.approx(1.0)
    assert by[(OBJECTIVE, 3)]["top3_overlap"] == 1.0 and by[(OBJECTIVE, 3)]["trials"] == 4
    # lower loss is better: the loss ranks the trials in the final order at epoch 1
    assert by[("train/loss", 1)]["kendall_tau"] == pytest.approx(1.0)
    assert by[("train/loss", 2)]["trials"] == 3  # d has no epoch-2 loss
    assert settled_epoch(rows, OBJECTIVE) == 2 and settled_epoch(rows, "train/loss") == 1
    assert settled_epoch(rows, "val/label_free/rankme") is None


def test_too_few_trials_or_a_tie_say_so_rather_than_a_number() -> None:
    two = {run: HISTORY[run] for run in ("a", "b")}
    assert agreement_rows({OBJECTIVE: two}, {r: FINAL[r] for r in two}, {OBJECTIVE: "max"},
                          "max") == []
    flat = {run: {1: 0.5} for run in HISTORY}  # every trial equal at epoch 1: no order
    (row,) = agreement_rows({OBJECTIVE: flat}, FINAL, {OBJECTIVE: "max"}, "max")
    assert math.isnan(row["kendall_tau"])
    assert settled_epoch([row], OBJECTIVE) is None


def test_the_parent_run_gets_the_csv_once_every_trial_ended(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = SearchConfig.model_validate({"name": "rungs", "mlflow": {"tracking_uri": uri}})
    client = MlflowClient(uri)
    experiment = client.create_experiment("rungs")
    parent = client.create_run(experiment, tags={ROLE_TAG: "sweep"}).info.run_id
    for name, epochs in HISTORY.items():
        run_id = client.create_run(experiment, run_name=name, tags={
            ROLE_TAG: "trial", PARENT_TAG: parent, ENDED_TAG: "completed"}).info.run_id
        client.log_batch(run_id, metrics=[Metric(OBJECTIVE, value, 0, step)
                                          for step, value in epochs.items()])
        client.set_terminated(run_id, "FINISHED")
    children = [run for run in client.search_runs([experiment])
                if run.data.tags.get(ROLE_TAG) == "trial"]
    line = log_rung_agreement(client, parent, children, config)
    assert "from epoch 2 of 3 on, over 4 trials" in line
    # The same line as a tag, which raycl.leaderboard prints under its table.
    assert client.get_run(parent).data.tags[RUNG_AGREEMENT_TAG] == line.strip()
    assert line.strip() in build_leaderboard(uri, "rungs", 10).notes
    path = client.download_artifacts(parent, "rung_agreement.csv", str(tmp_path))
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["figure"], row["epoch"]) for row in rows] == [
        (OBJECTIVE, "1"), (OBJECTIVE, "2"), (OBJECTIVE, "3")]
    plot = client.download_artifacts(parent, "rung_agreement.png", str(tmp_path))
    assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a trial still running: nothing yet (the ranking is not final)
    running = client.create_run(experiment, tags={ROLE_TAG: "trial", PARENT_TAG: parent})
    assert log_rung_agreement(client, parent, [*children, client.get_run(
        running.info.run_id)], config) == ""
