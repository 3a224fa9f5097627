"""Faults on the MLflow logging path, end to end: ``python -m raycl.tune`` sweeps (each starting
its own Ray) through a driver interrupted (SIGINT) and then killed outright, an MLflow server
down for seconds, and a sqlite store another process holds locked; plus the retry layer's bound
(raycl.tracking.retry) and the runs of trials a killed driver's Tune state lost, without Ray."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from listening import ListenerSampler
from local_servers import free_port, marked_processes, spawn, wait_for_http
from mlflow import MlflowClient
from test_tracking import StubTrial

from raycl.config.search_config import SearchConfig
from raycl.tracking import MLflowSweepCallback
from raycl.tracking.retry import RETRY_ENV, TrackingUnavailableError
from raycl.tracking.runs import ROLE_TAG, TRIAL_TAG, mlflow_client

REPO = Path(__file__).resolve().parents[1]
# The two sweeps start a Ray of their own each (RAY_ADDRESS=local) and share nothing: no xdist
# group, so each is a unit of its own that starts early (tests/xdist_order.py).
TINY = ["data.samples_per_combination=1", "data.resolution=16", "train.batch_size=64",
        "model.width=8", "model.projector_hidden_dim=32", "model.projector_dim=16",
        "eval.linear_max_iter=50", "train.epochs=3", "eval.every_n_epochs=3",
        "tune.scheduler.type=none", "scaling.cpus_per_worker=1",
        # Neither the sweep's baseline task nor the driver's encoder logging is under test here
        # (tests/test_end_to_end.py's quickstart has them): each is seconds of every driver.
        "eval.baseline=false", "mlflow.log_encoder=false"]
# eval.diagnostics stays on: its end-of-trial plots keep a trial running for seconds after its
# last epoch, so the SIGINT sent once a trial has logged a loss lands while it still runs. With
# them off a 1 s trial could end first and the driver stop between trials (a fresh-clone CI run
# exited 0 instead of 130).
EPOCHS = [1, 2, 3]
# How long the MLflow server stays down before it is started again; its start-up adds ~5 s
# alone, more on busy cores, so the driver's retries (0.5, 1, 2, 4 s apart) meet it down for
# several attempts and wait out the restart. Not longer: every second is waited.
SERVER_DOWN_S = 2.0


@pytest.fixture(autouse=True)
def _settings_stay_in_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """raycl's clients and callbacks set these for their process when unset (setdefault): the
    sweeps here get them fresh, and the rest of the test run does not inherit them."""
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "TUNE_GLOBAL_CHECKPOINT_S"):
        monkeypatch.delenv(name, raising=False)


def sweep_command(tmp_path: Path, name: str, tracking_uri: str, trials: int = 2) -> list[str]:
    """``trials`` trials of the quickstart at tiny sizes, one after the other, on a Ray of its
    own."""
    return [sys.executable, "-m", "raycl.tune", str(REPO / "searches" / "quickstart.yaml"),
            *[arg for override in TINY for arg in ("--set", override)],
            "--num-samples", str(trials),
            "--name", name, "--storage", str(tmp_path / "ray"), "--tracking-uri", tracking_uri]


def sweep_env() -> dict[str, str]:
    # "local": a new Ray every time, never one a killed driver left behind.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": "local"}


def trial_runs(client: MlflowClient, name: str) -> list:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`{ROLE_TAG}` = 'trial'")


def parent_runs(client: MlflowClient, name: str) -> list:
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None, f"no MLflow experiment {name}"
    return client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`{ROLE_TAG}` = 'sweep'")


def wait_until(check: object, process: object, log: Path, timeout_s: float = 300) -> object:
    """Poll ``check()`` every 0.5 s until it returns something true; fail with the log's tail
    should the sweep end or the time run out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:  # type: ignore[attr-defined]
        found = check()  # type: ignore[operator]
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"not seen in time; the sweep's log ends:\n{log.read_text()[-3000:]}")


def steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def assert_one_run_per_trial_each_epoch_once(client: MlflowClient, name: str,
                                             trials: int = 2) -> list:
    """One child run per trial, each finished, every epoch's metrics logged once."""
    children = trial_runs(client, name)
    assert len(children) == trials, [r.data.tags.get(TRIAL_TAG) for r in children]
    assert len({r.data.tags[TRIAL_TAG] for r in children}) == trials
    for child in children:
        assert child.info.status == "FINISHED", child.data.tags
        assert child.data.tags.get("raycl.ended") == "completed"
        for key in ("train/loss", "train/lr", "train/epoch"):
            assert steps(client, child.info.run_id, key) == EPOCHS, key
        assert steps(client, child.info.run_id, "val/linear/mean") == [3]
    return children


def hold_exclusive_lock(database: Path, until: Callable[[], bool], limit_s: float = 120,
                        then_s: float = 3.0) -> threading.Thread:
    """Another connection holds ``BEGIN EXCLUSIVE`` on the store, in a thread, until
    ``until()`` (then ``then_s`` more, at most ``limit_s`` in all): no one else reads or writes
    meanwhile, and sqlite's own wait (5 s in MLflow's engine) runs out."""
    taken = threading.Event()

    def hold() -> None:
        connection = sqlite3.connect(database, timeout=60, isolation_level=None)
        try:
            connection.execute("BEGIN EXCLUSIVE")
            taken.set()
            deadline = time.monotonic() + limit_s
            while not until() and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(then_s)
            connection.execute("COMMIT")
        finally:
            connection.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(timeout=60), "could not lock the store"
    return thread


def test_driver_sigkilled_resumes_each_epoch_once_through_a_locked_store(tmp_path: Path) -> None:
    """One three-trial sweep, stopped twice and resumed with the same command each time.
    SIGINT to the driver once the first trial finished and the second logged an epoch: exit
    130 with raycl's hint (not Ray's), the parent run KILLED. Resumed, then SIGKILL to the
    driver's process group once two trials finished and the third logged an epoch. Resumed
    again, the sqlite store held locked by another connection from that driver's start until
    it has waited past sqlite's own 5 s: it finishes (exit 0), the finished trial is not re-run
    (its run unchanged), the interrupted one kept its run, MLflow holds one parent and one child
    run per trial (the run of a trial Tune's saved state had lost is deleted), and every epoch
    of every trial is logged exactly once."""
    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    command = sweep_command(tmp_path, "stopped", uri, trials=3)
    client = MlflowClient(tracking_uri=uri)

    def finished_and_training(finished: int) -> Callable[[], tuple | None]:
        def check() -> tuple | None:
            runs = trial_runs(client, "stopped")
            done = [r for r in runs if r.info.status == "FINISHED"]
            training = [r for r in runs if r.info.status == "RUNNING"
                        and "train/loss" in r.data.metrics]
            return (done[0], training[0]) if len(done) >= finished and training else None
        return check

    first_log = tmp_path / "first.log"
    first = spawn(command, log=first_log, env=sweep_env())
    try:
        done, interrupted_in = wait_until(finished_and_training(1), first.process, first_log)
        first.process.send_signal(signal.SIGINT)  # Ctrl+C: the driver only
        assert first.process.wait(timeout=120) == 130, first_log.read_text()[-3000:]
    finally:
        first.stop(grace_s=5)
    out = first_log.read_text()
    assert "interrupted; run the same command again" in out
    assert "Tuner.restore" not in out, out[-3000:]  # raycl's hint only, not Ray's
    assert parent_runs(client, "stopped")[0].info.status == "KILLED"
    done_epochs = steps(client, done.info.run_id, "train/loss")

    second_log = tmp_path / "second.log"
    second = spawn(command, log=second_log, env=sweep_env())
    try:
        _, killed_in = wait_until(finished_and_training(2), second.process, second_log)
        os.killpg(second.process.pid, signal.SIGKILL)  # the driver and its Ray, outright
        second.process.wait(timeout=30)
        time.sleep(1)  # Ray's workers see their raylet gone: what is left after that is printed
        print("left alive by the SIGKILL:", marked_processes(second.token))
    finally:
        second.stop(grace_s=5)  # what survived in process groups of its own (Ray's workers)
    assert "resuming sweep 'stopped'" in second_log.read_text()

    out = resume_through_a_locked_store(command, database, tmp_path / "third.log")
    parents = parent_runs(client, "stopped")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = assert_one_run_per_trial_each_epoch_once(client, "stopped", trials=3)
    assert interrupted_in.info.run_id in {r.info.run_id for r in children}
    if killed_in.info.run_id not in {r.info.run_id for r in children}:
        # Created after Tune's last upload of its state: the trial was replaced by a new one.
        assert client.get_run(killed_in.info.run_id).info.lifecycle_stage == "deleted"
        assert "was lost with the killed driver" in out
    again = client.get_run(done.info.run_id)  # the finished trial was not re-run
    assert again.info.end_time == done.info.end_time
    assert steps(client, done.info.run_id, "train/loss") == done_epochs == EPOCHS


def resume_through_a_locked_store(command: list[str], database: Path, log: Path) -> str:
    """Run ``command`` again, the store locked from before the resumed driver's first write
    until it has said it waits; it must finish (exit 0) having waited and come back. Its
    output."""
    resumed = spawn(command, log=log, env=sweep_env())
    try:
        wait_until(lambda: "resuming sweep" in log.read_text(), resumed.process, log)
        locked = time.monotonic()
        # Released once the driver said it waits: its next attempt (0.5 s later) then blocks in
        # sqlite's own wait until the lock goes, and succeeds.
        hold_exclusive_lock(database, lambda: "retrying for up to" in log.read_text(),
                            then_s=0.5).join()
        print(f"the store was locked for {time.monotonic() - locked:.0f} s")
        assert resumed.process.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        resumed.stop(grace_s=5)
    out = log.read_text()
    assert "database is locked" in out and "retrying for up to" in out, out[-3000:]
    assert "back after" in out
    return out


def test_mlflow_server_down_mid_sweep_loses_nothing_on_a_loopback_only_ray(
    tmp_path: Path,
) -> None:
    """A real ``python -m raycl.server`` over sqlite, its process group SIGKILLed once the first
    epoch reached it and started again on the same port ``SERVER_DOWN_S`` later: the sweep
    waits it out (exit 0, its trial FINISHED) and the server holds every epoch once.

    The sweep starts a Ray of its own (RAY_ADDRESS=local: a workstation without a cluster):
    sampled every half second from start to end, nothing of its process tree listens beyond
    127.0.0.1 / ::1 (tests/listening.py)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_command = [sys.executable, "-m", "raycl.server", "--port", str(port), "--workers", "1",
                      "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                      "--artifacts-destination", str(tmp_path / "artifacts")]
    server_log = tmp_path / "server.log"
    server = spawn(server_command, log=server_log)
    sweep_log = tmp_path / "sweep.log"
    sweep = None
    try:
        wait_for_http(f"{url}/health", server.process, timeout_s=120, any_status=False)
        # One trial (the driver's waiting is the same for every trial's writes).
        sweep = spawn(sweep_command(tmp_path, "outage", url, trials=1), log=sweep_log,
                      env=sweep_env())
        listeners = ListenerSampler(sweep.process.pid).start()
        client = MlflowClient(tracking_uri=url)
        wait_until(lambda: any("train/loss" in r.data.metrics
                               for r in trial_runs(client, "outage")), sweep.process, sweep_log)
        os.killpg(server.process.pid, signal.SIGKILL)
        server.stop(grace_s=5)
        down = time.monotonic()
        time.sleep(SERVER_DOWN_S)
        assert sweep.process.poll() is None, sweep_log.read_text()[-3000:]
        server = spawn(server_command, log=server_log)
        wait_for_http(f"{url}/health", server.process, timeout_s=120, any_status=False)
        print(f"MLflow was down {time.monotonic() - down:.0f} s")
        assert sweep.process.wait(timeout=400) == 0, sweep_log.read_text()[-3000:]
        listeners.stop()
        out = sweep_log.read_text()
        assert "retrying for up to" in out and "back after" in out, out[-3000:]
        assert_one_run_per_trial_each_epoch_once(client, "outage", trials=1)
        listeners.assert_loopback_only()
    finally:
        if sweep is not None:
            sweep.stop(grace_s=5)
        server.stop(grace_s=5)


def test_a_store_away_past_the_bound_stops_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing listens: the call is retried for $RAYCL_MLFLOW_RETRY_S, then one error names
    the store, how long it waited, and what to do."""
    monkeypatch.setenv(RETRY_ENV, "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TrackingUnavailableError) as error:
        mlflow_client(uri).set_tag("0" * 32, "raycl.x", "1")
    assert 2 <= time.monotonic() - started < 30
    message = str(error.value)
    assert f"MLflow at {uri} stayed unavailable" in message
    assert "run the same command again" in message and RETRY_ENV in message


def test_a_locked_store_is_waited_out_and_a_metric_logged_once(tmp_path: Path) -> None:
    """A write that meets sqlite's lock (held 7 s, past sqlite's own 5 s wait) is retried;
    the metric, retried with its first timestamp, is one row."""
    database = tmp_path / "mlflow.db"
    client = mlflow_client(f"sqlite:///{database}")
    run_id = client.create_run(client.create_experiment("locked")).info.run_id
    taken = time.monotonic()
    holder = hold_exclusive_lock(database, lambda: time.monotonic() - taken > 4, then_s=3)
    client.log_metric(run_id, "train/loss", 0.5, step=1)
    holder.join()
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5)]


def test_a_killed_drivers_lost_trial_run_is_deleted_and_an_ended_one_kept(tmp_path: Path) -> None:
    """The root of three child runs for two trials: the killed driver created the run of a
    trial that Tune's last saved state (≤ 10 s old by default) does not hold. The restored
    driver's first step deletes it: Tune replaces that trial with a new one, which gets its own
    run. A trial that ended after that save is run again by Tune: its run is left alone."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = SearchConfig.model_validate({"name": "lost", "mlflow": {"tracking_uri": uri}})
    killed = MLflowSweepCallback(sweep)
    killed.setup()
    result = {"stage": 0, "epoch": 1, "global_epoch": 1, "train/loss": 2.0, "done": True}
    saved, lost = StubTrial("saved01", {}, result), StubTrial("lost0001", {}, {})
    for trial in (saved, lost):
        killed.on_trial_start(0, [saved, lost], trial)
    killed.on_trial_result(0, [saved, lost], saved, result)
    killed.on_trial_complete(0, [saved, lost], saved)  # after Tune's last save
    client = MlflowClient(tracking_uri=uri)
    ended = client.search_runs([killed.experiment_id], f"tags.`{TRIAL_TAG}` = 'saved01'")[0]
    # The restored driver: the same callback as pickled before the sweep started.
    restored = MLflowSweepCallback(sweep)
    restored.sweep_uid = killed.sweep_uid
    restored.setup()
    assert restored.parent_run_id == killed.parent_run_id
    restored.on_step_begin(0, [saved])  # what Tune restored: the lost trial is not there
    replacement = StubTrial("new00001", {}, {})
    restored.on_step_begin(1, [saved, replacement])
    restored.on_trial_start(1, [saved, replacement], replacement)
    runs = trial_runs(client, "lost")
    assert sorted(r.data.tags[TRIAL_TAG] for r in runs) == ["new00001", "saved01"]
    # Tune runs the trial that had ended again (its state was older): its run stays as it was.
    restored.on_trial_start(1, [saved, replacement], saved)
    restored.on_trial_result(1, [saved, replacement], saved, {**result, "train/loss": 3.0})
    restored.on_trial_complete(1, [saved, replacement], saved)
    again = client.get_run(ended.info.run_id)
    assert again.info.status == "FINISHED" and again.info.end_time == ended.info.end_time
    assert [m.value for m in client.get_metric_history(ended.info.run_id, "train/loss")] == [2.0]
