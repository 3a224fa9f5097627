"""The cloud on one machine: a head and two worker nodes (``ray.cluster_utils.Cluster``) whose
worker nodes declare ``gpu_node``, the stand-in for a GPU node type that trials ask for with
``scaling.resources_per_worker``; checkpoints in an S3 bucket served by moto on loopback; a
worker node drained with the preemption reason and removed mid-trial; another killed abruptly;
the bucket's server stopped mid-trial until a checkpoint upload has met the outage;
four trials at once logging to an MLflow server whose database is PostgreSQL; and Ray's fake
multi-node autoscaler (~80 s of its own; ``RAYCL_SKIP_AUTOSCALING=1`` leaves it out): zero
worker nodes, two for two concurrent trials, both released when idle.

The cluster and its driver run in a process of their own (``tests/cloud_local.py``), so they
never meet the test session's shared Ray (``ray_session``); the scenarios run in an xdist group
of their own, the autoscaler (a process and cluster of its own) in another. That process's temp
directory (``TMPDIR``, ``RAY_TMPDIR``) is a new, empty one, removed afterwards: nothing an
earlier run left under ``/tmp`` matters, and nothing is left there. Everything it starts ends
with it; whatever outlives it, a timeout or a failure included,
is stopped by the spawn's handle (tests/local_servers.py; never ``ray stop``). The scenarios
share one cluster: start-up is most of their cost.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from local_servers import TRAIN_POLL, short_temp_dir, spawn
from mlflow import MlflowClient

from raycl.tracking import ROLE_TAG

pytest.importorskip("moto.server", reason="moto[server] (the dev extra) serves the S3 bucket")

# The scenarios share one cluster (the ``cloud`` fixture): one xdist group.
SCENARIO = pytest.mark.xdist_group("cloud-local")

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ["reference", "drained", "killed", "outage", "postgres"]
TIMEOUT_S = 600  # the scenarios take ~5-7 min on 2 busy cores
OBJECTIVE = "val/linear/mean"
HEAD_NODE = "00000"  # the end of the fake provider's head node id
# A sweep's epochs (train.epochs in tests/cloud_local.py): the trials pause, lose their node or
# meet the outage after epoch 1, and the epoch after it shows what became of that.
EPOCHS = [1, 2]


@dataclass
class Outcome:
    """What tests/cloud_local.py left: its outcome.json, its output, its MLflow database."""

    results: dict[str, Any]
    output: str
    tracking_uri: str

    def trial_run(self, sweep: str) -> Any:
        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(sweep)
        assert experiment is not None, sweep
        runs = [run for run in client.search_runs([experiment.experiment_id])
                if run.data.tags.get(ROLE_TAG) == "trial"]
        assert len(runs) == 1, [run.info.run_name for run in runs]
        return runs[0]

    def logged_epochs(self, sweep: str) -> list[int]:
        client = MlflowClient(tracking_uri=self.tracking_uri)
        history = client.get_metric_history(self.trial_run(sweep).info.run_id, "train/loss")
        return sorted(metric.step for metric in history)


def _run_scenarios_in(root: Path, data_cache: Path, scenarios: list[str]) -> Outcome:
    """tests/cloud_local.py in ``root``, its temp directory too, stopped with everything it
    started by the timeout at the latest; what it left."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("RAY_", "MLFLOW_", "AWS_"))}
    env.update([TRAIN_POLL], RAYCL_CACHE=str(data_cache), PYTHONPATH=str(REPO),
               TMPDIR=str(root), RAY_TMPDIR=str(root))
    log = root / "output.log"
    scenario = spawn([sys.executable, str(REPO / "tests" / "cloud_local.py"), str(root),
                      *scenarios], cwd=root, env=env, log=log)
    try:
        assert scenario.process is not None
        scenario.process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        scenario.stop(grace_s=10.0)
    output = log.read_text()
    print(output[-6000:])  # shown by pytest when a test failed
    try:
        results = json.loads((root / "outcome.json").read_text())
    except FileNotFoundError:
        pytest.fail(f"tests/cloud_local.py left no outcome:\n{output[-6000:]}")
    return Outcome(results, output, f"sqlite:///{root / 'mlflow.db'}")


@contextlib.contextmanager
def run_scenarios(data_cache: Path, scenarios: list[str]) -> Iterator[Outcome]:
    """The scenarios in a temporary directory, removed afterwards."""
    # Short: Ray's unix sockets live under the temp dir (a path limit of ~107 bytes).
    root = short_temp_dir("cloud-")
    try:
        yield _run_scenarios_in(root, data_cache, scenarios)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# What a run of the scenarios leaves that the tests read.
_KEPT = ("outcome.json", "output.log", "mlflow.db")


@pytest.fixture(scope="session")
def cloud(data_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The scenarios, run once per pytest run: xdist may hand this group's tests to both of its
    workers, so the first to come runs them under a lock and keeps what they left in a directory
    of this pytest run that both workers share; the other reads it."""
    base = tmp_path_factory.getbasetemp()
    # Not xdist's worker_id fixture: without xdist (-p no:xdist) it does not exist.
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cloud-local"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "outcome.json").exists():
            with run_scenarios(data_cache, SCENARIOS) as outcome:
                for name in _KEPT:
                    shutil.copy2(Path(outcome.tracking_uri.removeprefix("sqlite:///")).parent
                                 / name, shared / name)
            print("measured:", {name: {key: result[key]
                                       for key in ("seconds", "ended_after_removal_s")
                                       if key in result}
                                for name, result in outcome.results.items()
                                if isinstance(result, dict) and "seconds" in result})
    return Outcome(json.loads((shared / "outcome.json").read_text()),
                   (shared / "output.log").read_text(), f"sqlite:///{shared / 'mlflow.db'}")


def final_objective(outcome: Outcome, sweep: str) -> float:
    (metrics,) = outcome.results[sweep]["metrics"]
    return metrics[OBJECTIVE]


@SCENARIO
def test_the_cloud_scenarios_start_from_an_empty_temp_dir(cloud: Outcome) -> None:
    """Their Ray made its temp dir (it did not exist before), and wrote everything under the
    process's own temp dir: the address file ``Cluster`` writes too, which went to the machine's
    ``/tmp/ray`` and failed where that had never existed (issue 31); its socket paths fit."""
    temp = cloud.results["temp"]
    own = temp["tmpdir"]
    assert temp["fresh"] is True
    assert Path(own).name.startswith("cloud-")
    assert Path(own).parent in {Path(tempfile.gettempdir()), Path("/tmp")}
    assert temp["session_dir"].startswith(f"{own}/ray/session_")
    assert temp["address_file"] == f"{own}/ray/ray_current_cluster"
    assert temp["address_written"] == temp["address"]
    for elsewhere in (Path("/tmp/ray"), Path(tempfile.gettempdir()) / "ray"):
        written = elsewhere / "ray_current_cluster"
        assert not written.is_file() or written.read_text() != temp["address"]
    assert len(temp["sockets"]) == 6  # the head's and both worker nodes'
    for socket in temp["sockets"]:
        assert socket.startswith(f"{own}/ray/session_") and len(socket.encode()) <= 107, socket


@SCENARIO
def test_checkpoints_and_sweep_state_live_in_the_bucket(cloud: Outcome) -> None:
    reference = cloud.results["reference"]
    assert reference["errors"] == [], cloud.output[-4000:]
    keys = cloud.results["bucket_keys"]
    # Tune's state and the sweep's settings, Ray Train's checkpoints: all in the bucket.
    assert "raycl/reference/raycl_sweep.json" in keys
    assert any(key.startswith("raycl/reference/experiment_state") for key in keys)
    assert any(key.startswith("raycl/reference-train/") and key.endswith("/state.pt")
               for key in keys)
    assert cloud.logged_epochs("reference") == EPOCHS
    assert cloud.trial_run("reference").info.status == "FINISHED"


@SCENARIO
def test_the_same_sweep_again_resumes_from_the_bucket(cloud: Outcome) -> None:
    rerun = cloud.results["rerun"]
    assert "raycl: resuming sweep 'reference' from s3://raycl-test/raycl/reference?" \
        in cloud.output
    assert rerun["errors"] == []
    assert final_objective(cloud, "rerun") == final_objective(cloud, "reference")
    assert cloud.logged_epochs("reference") == EPOCHS  # nothing trained or logged twice


@SCENARIO
@pytest.mark.parametrize("sweep", ["drained", "killed"])
def test_a_trial_survives_losing_its_node(cloud: Outcome, sweep: str) -> None:
    """Drained with the preemption reason then removed, or killed outright: the trial resumes
    on the other worker node from its checkpoint in the bucket, and ends as an uninterrupted
    run does."""
    outcome = cloud.results[sweep]
    assert outcome["errors"] == [], cloud.output[-4000:]
    assert outcome["node_taken"], "the test never took the trial's node away"
    if sweep == "drained":
        assert outcome["drain_accepted"] is True, outcome
    (metrics,) = outcome["metrics"]
    assert metrics["resumed_from_epoch"] == 1  # not from scratch: from epoch 1's checkpoint
    assert final_objective(cloud, sweep) == final_objective(cloud, "reference")
    assert cloud.logged_epochs(sweep) == EPOCHS  # every epoch once in MLflow
    run = cloud.trial_run(sweep)
    assert run.info.status == "FINISHED"
    # Logged by the trial process through the driver's relay after the node was gone.
    assert "diagnostics/spectrum.png" in outcome["diagnostics"]


@SCENARIO
def test_a_checkpoint_written_while_the_bucket_is_away_waits_for_it(cloud: Outcome) -> None:
    """The bucket's server stopped (connections refused) right after epoch 1's checkpoint,
    so epoch 2's checkpoint is written into the outage, and started again 2 s after that
    upload met it: the upload is retried until the bucket is back (at least as long as Ray's
    own retry would wait), the trial goes on in place (no restart), every epoch in MLflow once.

    This is the reference sweep (one sweep fewer to start): the drained and killed trials,
    restarted from epoch 1 on another node, end exactly as it does."""
    outcome = cloud.results["reference"]
    assert outcome["errors"] == [], cloud.output[-4000:]
    assert outcome["refused"] is True, "the stopped bucket still took connections"
    assert outcome["outage_s"] >= 3, outcome  # restarted by the scenario, not left out
    # The worker's upload met the outage and was retried until the bucket was back, at least as
    # long as Ray's own retry (3 tries, 1 s and 2 s apart) waits before it fails the report.
    back = re.search(r"checkpoint upload: the storage s3://raycl-test/raycl/reference-train/"
                     r"\S+ is back after (\d+) s", cloud.output)
    assert back is not None and int(back.group(1)) >= 3, cloud.output[-4000:]
    # Epoch 2 trains in ~1 s; its report waited on its checkpoint until the bucket was back.
    assert outcome["logged_at"]["2"] > outcome["restarted_at"]
    (metrics,) = outcome["metrics"]
    assert metrics["resumed_from_epoch"] == 0  # retried in place, not restarted
    (run,) = outcome["runs"]
    assert run["status"] == "FINISHED"
    assert run["steps"]["train/loss"] == EPOCHS  # every epoch once
    assert all(steps == sorted(set(steps)) for steps in run["steps"].values())


@SCENARIO
def test_four_trials_at_once_lose_no_write_to_postgresql(cloud: Outcome) -> None:
    """MLflow's production backend: a PostgreSQL started on loopback behind ``python -m
    raycl.server``, four trials logging at once through the driver; what they logged is read
    back from PostgreSQL itself."""
    if "postgres_skipped" in cloud.results:
        pytest.skip(f"no PostgreSQL to start: {cloud.results['postgres_skipped']}")
    outcome = cloud.results["postgres"]
    assert outcome["errors"] == [], cloud.output[-4000:]
    runs = outcome["runs"]
    assert len(runs) == 4 and all(run["status"] == "FINISHED" for run in runs)
    # The same metrics for every trial, each epoch's value once, the last one what Tune got.
    assert len({frozenset(run["metrics"]) for run in runs}) == 1
    assert {OBJECTIVE, "test/linear/mean", "train/loss"} <= set(runs[0]["metrics"])
    for run in runs:
        assert run["steps"]["train/loss"] == EPOCHS
        assert all(steps == sorted(set(steps)) for steps in run["steps"].values())
    assert sorted(run["metrics"][OBJECTIVE] for run in runs) == sorted(
        metrics[OBJECTIVE] for metrics in outcome["metrics"])


# A cluster and process of its own, nothing shared with the scenarios': a work unit of its own,
# which the other xdist worker may run meanwhile (tests/xdist_order.py).
@pytest.mark.xdist_group("cloud-autoscale")
@pytest.mark.skipif(os.environ.get("RAYCL_SKIP_AUTOSCALING") == "1",
                    reason="RAYCL_SKIP_AUTOSCALING=1 (saves ~80 s)")
def test_an_autoscaler_adds_worker_nodes_for_trials_and_removes_them(data_cache: Path) -> None:
    """Ray's fake multi-node provider (``ray start --head --autoscaling-config``): the sweep
    starts with no node that has ``gpu_node``; two concurrent trials make the autoscaler start
    two, and idle ones go after ``idle_timeout_minutes``."""
    with run_scenarios(data_cache, ["autoscale"]) as outcome:
        scaled = outcome.results["autoscale"]
    print("measured:", {key: value for key, value in scaled.items() if key != "sweep"})
    assert scaled["sweep"]["errors"] == [], outcome.output[-4000:]
    assert len(scaled["sweep"]["metrics"]) == 2
    assert scaled["workers_at_start"] == 0
    assert scaled["most_workers"] == 2
    assert "first_epoch_s" in scaled  # measured: sweep start to the first epoch in MLflow
    # Both go once idle: no detached actor of Ray Train's is left on one (ray#58481; the
    # workaround is raycl.sweep.tuner._keep_train_coordinator_on_this_node).
    assert scaled["workers_after_idle"] == 0
    assert all(node == HEAD_NODE for _, node in scaled["actors_left"])
