"""How a trial ended, as MLflow records it, decided from what the trial reported."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mlflow import MlflowClient

from raycl.config import SearchConfig
from raycl.tracking import TRIAL_TAG, MLflowSweepCallback


@dataclass
class StubTrial:
    """What the callback reads of a Tune trial."""

    trial_id: str
    config: dict
    last_result: dict
    error_file: str | None = None
    metric_analysis: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"run_trial_{self.trial_id}"


@pytest.mark.parametrize(
    ("config", "last_result", "status", "ended"),
    [
        # Tune marks a trial stopped by ASHA as done too: only the last stage and epoch tell.
        ({}, {"stage": 0, "epoch": 4, "done": True}, "FINISHED", "completed"),
        ({}, {"stage": 0, "epoch": 2, "done": True}, "KILLED", "stopped_by_scheduler"),
        ({"train.epochs": 2}, {"stage": 0, "epoch": 2, "done": True}, "FINISHED", "completed"),
        ({"mcl.stages": 2}, {"stage": 0, "epoch": 4, "done": True}, "KILLED",
         "stopped_by_scheduler"),
        # A restarted trial fast-forwards finished stages: few reports, yet complete.
        ({"mcl.stages": 2}, {"stage": 1, "epoch": 4, "training_iteration": 3, "done": True},
         "FINISHED", "completed"),
        ({}, {"training_iteration": 1, "done": True, "raycl/skipped": 1.0}, "KILLED", "skipped"),
    ],
)
def test_trial_end_status(
    tmp_path: Path, config: dict, last_result: dict, status: str, ended: str
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = SearchConfig.model_validate({"name": "ends", "method": "mcl", "train": {"epochs": 4},
                                         "mcl": {"stages": 1},
                                         "mlflow": {"tracking_uri": uri}})
    callback = MLflowSweepCallback(sweep)
    callback.setup()
    trial = StubTrial("t1", config, last_result)
    callback.on_trial_start(0, [], trial)
    callback.on_trial_complete(0, [], trial)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([callback.experiment_id], f"tags.`{TRIAL_TAG}` = 't1'")
    assert run.info.status == status and run.data.tags["raycl.ended"] == ended
