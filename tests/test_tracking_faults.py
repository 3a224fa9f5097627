"""Faults on the MLflow logging path, end to end: ``python -m raycl.tune`` sweeps (each starting
its own Ray) through a driver killed outright (its trial held by the test) and resumed through a
sqlite store another process holds locked, and through an MLflow server down for seconds, then a
Ctrl+C (SIGINT) to that driver; plus the retry layer's bound and its one-row retried metrics
(raycl.tracking.retry) and the runs of trials a killed driver's Tune state lost, without Ray."""

from __future__ import annotations

import contextlib
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
from local_servers import free_port, spawn, wait_for_http
from mlflow import MlflowClient
from mlflow.entities import Run
from test_tracking import StubTrial

from raycl.config.search_config import SearchConfig
from raycl.tracking import MLflowSweepCallback
from raycl.tracking.retry import RETRY_ENV, TrackingUnavailableError
from raycl.tracking.runs import ROLE_TAG, TRIAL_TAG, mlflow_client
from raycl.worker.faults import FAULT_ENV

REPO = Path(__file__).resolve().parents[1]
# The two sweeps start a Ray of their own each (RAY_ADDRESS=local) and share nothing: no xdist
# group, so each is a unit of its own that starts early (tests/xdist_order.py). Every driver
# costs a Ray start-up and a trial process (torch, raycl) of its own: the killed sweep has two
# drivers and two trials, the outage sweep one driver; a Ctrl+C needs no driver of its own (the
# outage sweep's ends with one; test_confirm and test_pbt resume a Ctrl+C'd sweep).
TINY = ["data.samples_per_combination=1", "data.resolution=16", "train.batch_size=64",
        "model.width=8", "model.projector_hidden_dim=32", "model.projector_dim=16",
        "eval.linear_max_iter=50", "tune.scheduler.type=none", "scaling.cpus_per_worker=1",
        # Neither the sweep's baseline task nor the driver's encoder logging is under test here
        # (tests/test_end_to_end.py's quickstart has them): each is seconds of every driver.
        "eval.baseline=false", "mlflow.log_encoder=false"]


@pytest.fixture(autouse=True)
def _settings_stay_in_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """raycl's clients and callbacks set these for their process when unset (setdefault): the
    sweeps here get them fresh, and the rest of the test run does not inherit them."""
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "TUNE_GLOBAL_CHECKPOINT_S"):
        monkeypatch.delenv(name, raising=False)


def sweep_command(tmp_path: Path, name: str, tracking_uri: str, trials: int = 2,
                  epochs: int = 3, plots: bool = True) -> list[str]:
    """``trials`` trials of the quickstart at tiny sizes, one after the other, on a Ray of its
    own: ``epochs`` epochs each, evaluated at the last; ``plots``: eval.diagnostics (the
    end-of-trial spectrum and plots, which keep a trial running for seconds after its last
    epoch)."""
    overrides = [*TINY, f"train.epochs={epochs}", f"eval.every_n_epochs={epochs}",
                 f"eval.diagnostics={str(plots).lower()}"]
    return [sys.executable, "-m", "raycl.tune", str(REPO / "searches" / "quickstart.yaml"),
            *[arg for override in overrides for arg in ("--set", override)],
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


def wait_until(check: object, process: object, log: Path, timeout_s: float = 300,
               poll_s: float = 0.5) -> object:
    """Poll ``check()`` every ``poll_s`` until it returns something true; fail with the log's
    tail should the sweep end or the time run out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:  # type: ignore[attr-defined]
        found = check()  # type: ignore[operator]
        if found:
            return found
        time.sleep(poll_s)
    pytest.fail(f"not seen in time; the sweep's log ends:\n{log.read_text()[-3000:]}")


def steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def assert_finished_with_each_epoch_once(client: MlflowClient, run: Run, epochs: int) -> None:
    """A trial's run finished, every epoch's metrics logged once, the objective at the last."""
    assert run.info.status == "FINISHED", run.data.tags
    assert run.data.tags.get("raycl.ended") == "completed"
    for key in ("train/loss", "train/lr", "train/epoch"):
        assert steps(client, run.info.run_id, key) == list(range(1, epochs + 1)), key
    assert steps(client, run.info.run_id, "val/linear/mean") == [epochs]


def assert_one_run_per_trial_each_epoch_once(client: MlflowClient, name: str, trials: int,
                                             epochs: int) -> list:
    """One child run per trial, each finished, every epoch's metrics logged once."""
    children = trial_runs(client, name)
    assert len(children) == trials, [r.data.tags.get(TRIAL_TAG) for r in children]
    assert len({r.data.tags[TRIAL_TAG] for r in children}) == trials
    for child in children:
        assert_finished_with_each_epoch_once(client, child, epochs)
    return children


def hold_exclusive_lock(database: Path, until: Callable[[], bool], limit_s: float = 120,
                        poll_s: float = 0.1) -> threading.Thread:
    """Another connection holds ``BEGIN EXCLUSIVE`` on the store, in a thread, until ``until()``
    (checked every ``poll_s``; at most ``limit_s``): no one else reads or writes meanwhile."""
    taken = threading.Event()

    def hold() -> None:
        connection = sqlite3.connect(database, timeout=60, isolation_level=None)
        try:
            connection.execute("BEGIN EXCLUSIVE")
            taken.set()
            deadline = time.monotonic() + limit_s
            while not until() and time.monotonic() < deadline:
                time.sleep(poll_s)
            connection.execute("COMMIT")
        finally:
            connection.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(timeout=60), "could not lock the store"
    return thread


class EpochGate:
    """The fault spec the first driver's trials read ($RAYCL_TEST_FAULT, read halfway through
    and after the report of every epoch: raycl.worker.epoch), served from a thread through a
    FIFO: the first ``passes`` reads get no fault, the next one blocks, its trial held right
    there until the test kills it. Each read opens a FIFO of its own (the next is put in place
    once a reader has one), so none gets two answers."""

    def __init__(self, path: Path, passes: int) -> None:
        self.path, self.passes = path, passes
        self.held = threading.Event()  # a trial waits on the read that gets no answer
        self._stopping = False
        self._holding: int | None = None
        self._install()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _install(self) -> None:
        fresh = self.path.with_suffix(".next")
        os.mkfifo(fresh)
        os.replace(fresh, self.path)

    def _serve(self) -> None:
        for _ in range(self.passes):
            answer = os.open(self.path, os.O_WRONLY)  # returns once a reader opened it
            self._install()
            try:
                if not self._stopping:
                    os.write(answer, b"null")  # no fault
            except OSError:  # the reader went away (stop())
                pass
            finally:
                os.close(answer)
            if self._stopping:
                return
        self._holding = os.open(self.path, os.O_WRONLY)  # never written: the reader waits
        self.held.set()

    def stop(self) -> None:
        """End the thread (a reader that reads nothing lets a waiting writer go)."""
        self._stopping = True
        deadline = time.monotonic() + 10
        while self._thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.close(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))
            self._thread.join(timeout=0.1)
        if self._holding is not None:
            os.close(self._holding)


def test_driver_sigkilled_resumes_each_epoch_once_through_a_locked_store(tmp_path: Path) -> None:
    """SIGKILL to the driver's process group (the driver and its Ray, and then Ray's workers)
    once the first of two trials finished and the second logged an epoch, held by the test
    (:class:`EpochGate`) so the kill lands while it runs; the same command again, the sqlite
    store held locked by another connection from the resumed driver's start until it has
    waited past sqlite's own 5 s. The resume finishes (exit 0), the finished trial is not re-run
    (its run unchanged), MLflow holds one parent and one child run per trial (the run of a
    trial Tune's saved state had lost is deleted), and every epoch of both trials is logged
    exactly once."""
    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    command = sweep_command(tmp_path, "killed", uri, epochs=2, plots=False)
    client = MlflowClient(tracking_uri=uri)
    # The store made here (a copy of tests/conftest.py's template), not by the first driver.
    client.search_experiments()

    def finished_and_training() -> tuple | None:
        runs = trial_runs(client, "killed")
        done = [r for r in runs if r.info.status == "FINISHED"]
        training = [r for r in runs if r.info.status == "RUNNING"
                    and "train/loss" in r.data.metrics]
        return (done[0], training[0]) if done and training else None

    # Passed: the first trial's two epochs (two reads each) and the middle of the second's first
    # epoch; held: the second trial's read after it reported its first epoch.
    gate = EpochGate(tmp_path / "fault.json", passes=2 * 2 + 1)
    first_log = tmp_path / "first.log"
    first = spawn(command, log=first_log, env={**sweep_env(), FAULT_ENV: str(gate.path)})
    try:
        wait_until(gate.held.is_set, first.process, first_log, poll_s=0.1)
        done, killed_in = wait_until(finished_and_training, first.process, first_log,
                                     timeout_s=120)
        os.killpg(first.process.pid, signal.SIGKILL)  # the driver and its Ray, outright
        first.process.wait(timeout=30)
    finally:
        first.stop(grace_s=0)  # SIGKILL at once to what has a process group of its own (Ray)
        gate.stop()
    done_epochs = steps(client, done.info.run_id, "train/loss")

    out = resume_through_a_locked_store(command, database, tmp_path / "second.log")
    parents = parent_runs(client, "killed")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    children = assert_one_run_per_trial_each_epoch_once(client, "killed", trials=2, epochs=2)
    if killed_in.info.run_id not in {r.info.run_id for r in children}:
        # Created after Tune's last upload of its state: the trial was replaced by a new one.
        assert client.get_run(killed_in.info.run_id).info.lifecycle_stage == "deleted"
        assert "was lost with the killed driver" in out
    again = client.get_run(done.info.run_id)  # the finished trial was not re-run
    assert again.info.end_time == done.info.end_time
    assert steps(client, done.info.run_id, "train/loss") == done_epochs == [1, 2]


def resume_through_a_locked_store(command: list[str], database: Path, log: Path) -> str:
    """Run ``command`` again, the store locked from before the resumed driver's first write
    until it has said it waits; it must resume, and finish (exit 0) having waited and come
    back. Its output."""
    resumed = spawn(command, log=log, env=sweep_env())
    try:
        # Read every 0.1 s (a file): locked well before the driver opens the store, a second
        # or so after it says it resumes. It opens it with sqlite's 5 s wait and says it waits.
        wait_until(lambda: "resuming sweep" in log.read_text(), resumed.process, log,
                   poll_s=0.1)
        locked = time.monotonic()
        # Released as soon as the driver said it waits: its next attempt, 0.5 s later, succeeds.
        hold_exclusive_lock(database, lambda: "retrying for up to" in log.read_text()).join()
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
    epoch reached it and started again on the same port at once (down for its own start-up,
    seconds): the sweep waits it out, and its first trial FINISHED with every epoch on the
    server once. Then Ctrl+C (SIGINT to the driver only) as the second trial starts: exit 130
    with raycl's hint (not Ray's ``Tuner.restore``), the parent run KILLED and the stopped
    trial's run KILLED as interrupted. (A Ctrl+C'd sweep resumed: tests/test_confirm.py,
    tests/test_pbt.py.)

    The sweep starts a Ray of its own (RAY_ADDRESS=local: a workstation without a cluster):
    sampled every half second from start to end, nothing of its process tree listens beyond
    127.0.0.1 / ::1 (tests/listening.py)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    database = tmp_path / "server.db"
    # Made here (tests/conftest.py's template copied): no schema migrations in its start-up.
    MlflowClient(tracking_uri=f"sqlite:///{database}").search_experiments()
    server_command = [sys.executable, "-m", "raycl.server", "--port", str(port), "--workers", "1",
                      "--backend-store-uri", f"sqlite:///{database}",
                      "--artifacts-destination", str(tmp_path / "artifacts")]
    server_log, sweep_log = tmp_path / "server.log", tmp_path / "sweep.log"
    server = spawn(server_command, log=server_log)
    sweep = None
    try:
        # The sweep checks at its start that the server answers: it waits for the server.
        wait_for_http(f"{url}/health", server.process, timeout_s=120, any_status=False)
        # Two epochs, no end-of-trial plots: the outage meets the first trial's second epoch,
        # and the Ctrl+C is sent as the second trial starts, with all of it still to run.
        sweep = spawn(sweep_command(tmp_path, "outage", url, epochs=2, plots=False),
                      log=sweep_log, env=sweep_env())
        listeners = ListenerSampler(sweep.process.pid).start()
        client = MlflowClient(tracking_uri=url)
        # MLflow asked only once the driver says the trial started (reading a file is cheap).
        first = wait_until(lambda: "started with" in sweep_log.read_text() and next(
            (r for r in trial_runs(client, "outage") if "train/loss" in r.data.metrics), None),
            sweep.process, sweep_log)
        outage_from = sweep_log.stat().st_size
        os.killpg(server.process.pid, signal.SIGKILL)
        server.stop(grace_s=5)
        down = time.monotonic()
        # At once: the server's start-up (seconds) is the outage the driver's next calls meet.
        server = spawn(server_command, log=server_log)
        wait_for_http(f"{url}/health", server.process, timeout_s=120, any_status=False)
        print(f"MLflow was down {time.monotonic() - down:.0f} s")
        assert sweep.process.poll() is None, sweep_log.read_text()[-3000:]

        def second_started() -> bool:  # MLflow asked once the driver says so, as above
            if sweep_log.read_text().count("started with") < 2:
                return False
            runs = trial_runs(client, "outage")
            return len(runs) == 2 and any(r.info.status == "FINISHED" for r in runs)

        wait_until(second_started, sweep.process, sweep_log)
        sweep.process.send_signal(signal.SIGINT)  # Ctrl+C: the driver only
        assert sweep.process.wait(timeout=120) == 130, sweep_log.read_text()[-3000:]
        listeners.stop()
        out = sweep_log.read_text()
        since = sweep_log.read_bytes()[outage_from:].decode(errors="replace")
        assert "retrying for up to" in since and "back after" in since, out[-3000:]
        assert "interrupted; run the same command again" in out
        assert "Tuner.restore" not in out, out[-3000:]  # raycl's hint only, not Ray's
        (parent,) = parent_runs(client, "outage")
        assert parent.info.status == "KILLED" and parent.data.tags["raycl.interrupted"] == "true"
        runs = {r.info.run_id: r for r in trial_runs(client, "outage")}
        assert len(runs) == 2
        assert_finished_with_each_epoch_once(client, runs.pop(first.info.run_id), epochs=2)
        (second,) = runs.values()
        print(f"the second trial after the Ctrl+C: {second.info.status}")
        if second.info.status != "FINISHED":  # (a signal late by seconds: it ended first)
            assert second.info.status == "KILLED", second.data.tags
            assert second.data.tags.get("raycl.ended") == "interrupted"
        listeners.assert_loopback_only()
    finally:
        if sweep is not None:
            sweep.stop(grace_s=5)
        server.stop(grace_s=0)  # SIGKILL: nothing of it is read any more


def test_a_store_away_past_the_bound_stops_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing listens: the call is retried for $RAYCL_MLFLOW_RETRY_S, then one error names
    the store, how long it waited, and what to do."""
    monkeypatch.setenv(RETRY_ENV, "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TrackingUnavailableError) as error:
        mlflow_client(uri).set_tag("0" * 32, "raycl.x", "1")
    assert 1 <= time.monotonic() - started < 30
    message = str(error.value)
    assert f"MLflow at {uri} stayed unavailable" in message
    assert "run the same command again" in message and RETRY_ENV in message


def test_a_locked_store_is_waited_out_and_a_metric_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A metric write that reached the store but failed on the way back (sqlite's "database
    is locked") is retried, with its first timestamp: the store holds one row. (A store really
    held locked past sqlite's wait: the driver-kill test's resume above. Within a call MLflow's
    sqlite sessions wait up to 20 s for a lock, so a lock of seconds never fails a write.)"""
    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("locked")).info.run_id
    attempts: list[tuple] = []
    write = MlflowClient.log_metric

    def written_then_locked(self: MlflowClient, *args: object) -> None:
        attempts.append(args)
        write(self, *args)
        if len(attempts) == 1:
            raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(MlflowClient, "log_metric", written_then_locked)
    client.log_metric(run_id, "train/loss", 0.5, step=1)
    assert len(attempts) == 2 and attempts[0] == attempts[1]  # the same timestamp twice
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
