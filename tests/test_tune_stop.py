"""A sweep told to stop (Ctrl+C) between two trials is an interrupted sweep, not a finished one:
the callback reads Tune's own stop signal (raycl.tracking.tune_stop), through the handler Tune
installs for every ``tune.run``, without Ray running."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from test_tracking import StubTrial

from raycl.config.search_config import SearchConfig
from raycl.launch.load import load_search
from raycl.sweep import confirm_tuner
from raycl.sweep.confirm_tuner import ConfirmCallback, confirm_path, confirmation_tuner
from raycl.sweep.confirmation import SEED_STRIDE
from raycl.tracking import MLflowSweepCallback
from raycl.tracking.callback import INTERRUPTED
from raycl.tracking.tune_stop import handler_event, tune_stop_requested, unfinished_trials

REPO = Path(__file__).resolve().parents[1]
RESULT = {"stage": 0, "epoch": 1, "global_epoch": 1, "train/loss": 2.0, "done": True}


@pytest.fixture
def tune_signal_handlers() -> Iterator[object]:
    """Tune's handlers as ``tune.run`` installs them (Ray's own function); the test's handlers
    back afterwards. Yields Tune's stop event."""
    from ray.tune.tune import _setup_signal_catching

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGUSR1)}
    try:
        yield _setup_signal_catching()
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


def finished_sweep(uri: str, name: str, confirmation: bool = False
                   ) -> tuple[MLflowSweepCallback, StubTrial]:
    """A callback whose one trial has completed, as Tune leaves it before creating the next;
    with ``confirmation``, the seed confirmation's callback on the search's parent run."""
    config = SearchConfig.model_validate({"name": name, "mlflow": {"tracking_uri": uri}})
    callback = MLflowSweepCallback(config)
    callback.setup()
    if confirmation:
        callback = ConfirmCallback(config, None, callback.parent_run_id,
                                   {"configurations": [{}], "seeds": [[SEED_STRIDE]]})
        callback.setup()
    trial = StubTrial("done0001", {"seed": SEED_STRIDE}, RESULT, status="TERMINATED")
    callback.on_trial_start(0, [trial], trial)
    callback.on_trial_result(0, [trial], trial, RESULT)
    callback.on_trial_complete(0, [trial], trial)
    return callback, trial


@pytest.mark.parametrize("confirmation", [False, True], ids=["search", "confirmation"])
def test_ctrl_c_between_two_trials_ends_the_sweep_interrupted(
    tmp_path: Path, tune_signal_handlers: object, confirmation: bool
) -> None:
    """Ctrl+C after the first trial ended and before the searcher's next one exists: no trial
    is unfinished, yet Tune stopped the sweep; the parent run is KILLED and marked interrupted,
    and raycl.tune exits 130 (INTERRUPTED). Resuming it runs the rest. The same between two
    seeds of the confirmation (whose confirm.csv would otherwise be written over one seed)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    callback, trial = finished_sweep(uri, "between", confirmation)
    assert not tune_stop_requested()
    signal.raise_signal(signal.SIGINT)  # Tune's handler: sets its stop event, no exception
    assert tune_signal_handlers.is_set()  # type: ignore[attr-defined]
    assert tune_stop_requested()
    callback.on_experiment_end([trial])
    assert INTERRUPTED["between"] is True
    parent = MlflowClient(tracking_uri=uri).get_run(callback.parent_run_id)
    assert parent.info.status == "KILLED"
    assert parent.data.tags["raycl.interrupted"] == "true"


def test_handler_event_is_tunes_only_and_unfinished_trials_are_pending_or_unended() -> None:
    assert handler_event(signal.SIG_DFL) is None
    assert handler_event(lambda number, frame: None) is None
    pending, running, ended = (StubTrial("p", {}, {}, status="PENDING"), StubTrial("r", {}, {}),
                               StubTrial("e", {}, {}, status="TERMINATED"))
    assert unfinished_trials([pending, running, ended], {"r", "e"}, {"e"}) == [pending, running]


def test_ctrl_c_after_the_search_interrupts_the_sweep_before_its_confirmation(
    tmp_path: Path, tune_signal_handlers: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl+C once the search's loop has ended (its parent run closed FINISHED) reaches the
    search's Tune handler, still installed: the confirmation is not started, the sweep is
    interrupted (exit 130 in raycl.tune) and its parent run KILLED; nothing of the
    confirmation is written, so the same command again starts it."""
    from types import SimpleNamespace

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_search(REPO / "searches" / "quickstart.yaml", [
        "name=late", f"tune.storage_path={tmp_path / 'ray'}", f"mlflow.tracking_uri={uri}",
        "tune.confirm={top_k: 1, seeds: 2}"])
    client = MlflowClient(tracking_uri=uri)
    parent = client.create_run(client.create_experiment("late")).info.run_id
    client.set_terminated(parent, status="FINISHED")  # as the search's callback left it
    monkeypatch.setattr(confirm_tuner, "sweep_parent_run", lambda config, results: parent)
    results = [SimpleNamespace(config={"train.lr": 0.004}, error=None,
                               metrics={"val/linear/mean": 0.9})]
    signal.raise_signal(signal.SIGINT)
    assert confirmation_tuner(config, config, None, results, trainable=None) is None
    assert INTERRUPTED["late"] is True
    run = client.get_run(parent)
    assert run.info.status == "KILLED" and run.data.tags["raycl.interrupted"] == "true"
    assert not Path(confirm_path(config)).exists()
