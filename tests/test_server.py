"""The MLflow server on loopback, the tracking URI's precedence, and trials logging through the
driver's relay. (A real server under a real ``ray job submit``: tests/test_job_submit.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from test_tracking import StubTrial

from raycl import server
from raycl.methods import SearchConfig
from raycl.tracking import COMMIT_ENV, MLflowSweepCallback, git_commit
from raycl.tune import parse_args, resolve

REPO = Path(__file__).resolve().parents[1]


def test_server_command_binds_loopback_with_proxied_artifacts(tmp_path: Path) -> None:
    args = server.parse_args(["--backend-store-uri", f"sqlite:///{tmp_path}/db/mlflow.db",
                              "--artifacts-destination", str(tmp_path / "art"), "--port", "5123"])
    command = server.server_command(args, create=True)
    assert command[:4] == [sys.executable, "-m", "mlflow", "server"]
    options = dict(zip(command[4::2], command[5::2], strict=False))
    assert options["--host"] == "127.0.0.1" and options["--port"] == "5123"
    assert options["--backend-store-uri"] == f"sqlite:///{tmp_path}/db/mlflow.db"
    assert "--serve-artifacts" in command
    assert (tmp_path / "db").is_dir() and (tmp_path / "art").is_dir()


def test_server_relative_paths_become_absolute_without_creating_on_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert server.main(["--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert f"sqlite:///{tmp_path}/mlflow.db" in printed
    assert f"--artifacts-destination {tmp_path}/mlartifacts" in printed
    assert not (tmp_path / "mlartifacts").exists()


@pytest.mark.parametrize(("argv", "expected"), [
    (["--host", "0.0.0.0"], "--host 0.0.0.0: MLflow's server has no authentication"),
    (["--host", "10.0.0.5"], "--host 10.0.0.5: MLflow's server has no authentication"),
    (["--port", "0"], "--port 0: not a TCP port"),
    (["--backend-store-uri", "./mlruns"], "MLflow 3 refuses plain file stores"),
])
def test_server_rejects_in_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture
) -> None:
    assert server.main([*argv, "--dry-run"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {expected}") or expected in error
    assert error.count("\n") == 1


def test_remote_host_only_when_asked() -> None:
    args = server.parse_args(["--host", "0.0.0.0", "--allow-remote"])
    assert "0.0.0.0" in server.server_command(args)
    assert "::1" in server.server_command(server.parse_args(["--host", "::1"]))


def test_tracking_uri_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    search = str(REPO / "searches" / "quickstart.yaml")  # its YAML says sqlite:///mlflow.db
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve(parse_args([search])).mlflow.tracking_uri == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    notices: list[str] = []
    assert resolve(parse_args([search]), notices).mlflow.tracking_uri == "http://127.0.0.1:5000"
    assert any("$MLFLOW_TRACKING_URI" in notice for notice in notices)
    flag = parse_args([search, "--tracking-uri", "http://127.0.0.1:6000"])
    assert resolve(flag).mlflow.tracking_uri == "http://127.0.0.1:6000"


def test_commit_from_the_runtime_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    commit = "89abcdef" * 5
    monkeypatch.setenv(COMMIT_ENV, commit)
    assert git_commit() == commit
    monkeypatch.setenv(COMMIT_ENV, "$(git rev-parse HEAD)")  # quoting gone wrong: not a hash
    assert git_commit() != "$(git rev-parse HEAD)"


def test_trials_log_through_the_drivers_relay(ray_session, tmp_path: Path) -> None:
    """A trial whose node cannot reach the store still gets its metrics and files logged."""
    import ray

    from raycl.tracking.relay import start_relay

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = SearchConfig.model_validate({"name": "relayed", "mlflow": {"tracking_uri": uri}})
    callback = MLflowSweepCallback(config)
    callback.setup()

    callback.on_trial_start(0, [], StubTrial("feed0001", {}, {}, experiment_tag="1"))
    relay_handle = start_relay()
    # Every sweep's tuner starts the relay: a second start keeps the first (a handle looked up
    # by name would not keep the actor alive, and trials would find no relay).
    assert start_relay() is relay_handle

    @ray.remote(num_cpus=0, max_calls=1)  # max_calls: the sabotaged worker process exits after
    def trial_side(config_dict: dict) -> bool:
        import tempfile

        from raycl.tracking import relay, runs

        def unreachable(uri: str) -> None:
            raise ConnectionError(f"this node cannot reach {uri}")

        runs.mlflow_client = unreachable  # what a GPU worker sees of the head's loopback
        directory = Path(tempfile.mkdtemp())
        (directory / "plot.png").write_bytes(b"\x89PNG fake")
        (directory / "sub").mkdir()
        (directory / "sub" / "table.txt").write_text("1 2 3")
        return relay.log_to_trial_run(SearchConfig.model_validate(config_dict), "feed0001",
                                      {"diag/relayed": 0.5}, directory)

    assert ray.get(trial_side.remote(config.to_dict()), timeout=120)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([callback.experiment_id], "tags.`raycl.trial_id` = 'feed0001'")
    assert run.data.metrics["diag/relayed"] == 0.5
    listed = {item.path for item in client.list_artifacts(run.info.run_id, "diagnostics")}
    assert listed == {"diagnostics/plot.png", "diagnostics/sub"}
    assert [item.path for item in client.list_artifacts(
        run.info.run_id, "diagnostics/sub")] == ["diagnostics/sub/table.txt"]
