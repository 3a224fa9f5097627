"""``ray job submit`` against a real local head, as a user submits to a cluster.

The head is started by this test (``ray start --head --block`` on loopback, its own temp dir,
token authentication turned on the way Ray does it), an MLflow server runs beside it through
``python -m raycl.server`` on loopback, and a shrunk quickstart is submitted with
``--working-dir`` from a clean copy of the repository (no ``.git``, as Ray uploads it), the
commit passed through the job's runtime environment; ``ray job submit`` waits for the job,
tailing its logs. Everything started is stopped through tests/local_servers.py (its process
groups, and whatever carries its spawn's marker): never ``ray stop``, which would also stop the
test session's own Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from local_servers import TRAIN_POLL, free_port, short_temp_dir, spawn, wait_for_http
from mlflow import MlflowClient

from raycl.tracking import COMMIT_TAG, PARENT_TAG, ROLE_TAG

# One xdist worker, so both tests share one head (its module fixture: ~20 s up, ~5 s down).
pytestmark = pytest.mark.xdist_group("job-submit")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = 420
# eval.linear_backend=torch: the trial process never imports scikit-learn (~1.5 s of CPU).
SHRUNK = ["data.samples_per_combination=1", "data.resolution=16", "train.batch_size=64",
          "model.width=8", "model.projector_hidden_dim=32", "model.projector_dim=16",
          "eval.linear_max_iter=50", "eval.linear_backend=torch", "train.epochs=1",
          "eval.every_n_epochs=1", "scaling.cpus_per_worker=1", "eval.baseline=false",
          "mlflow.log_encoder=false"]


def clean_copy(destination: Path) -> Path:
    """The files git knows (tracked, and new ones not ignored), without ``.git``: what a user's
    ``--working-dir .`` uploads, minus their local clutter."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


@dataclass
class Head:
    dashboard: str
    tracking_uri: str
    env: dict[str, str]  # a shell with the token, as the docs tell a user to set it up
    root: Path

    def ray(self, *args: str, env: dict[str, str] | None = None,
            timeout_s: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "ray"), *args], env=env or self.env, text=True,
                              capture_output=True, timeout=timeout_s, check=False)

    def submit(self, *args: str, wait_s: float = 120,
               timeout_s: float = 120) -> subprocess.CompletedProcess:
        """``ray job submit``, again while the head's job agent is still starting (its
        dashboard answers first; a loaded machine takes a while for the agent)."""
        deadline = time.monotonic() + wait_s
        while True:
            done = self.ray("job", "submit", "--address", self.dashboard, *args,
                            timeout_s=timeout_s)
            if ("No available agent" not in done.stdout + done.stderr
                    or time.monotonic() > deadline):
                return done
            time.sleep(1)


@pytest.fixture(scope="module")
def head(data_cache: Path) -> Iterator[Head]:
    # Short: Ray's unix sockets live under the temp dir (a path limit of ~107 bytes).
    root = short_temp_dir("rayjob-")
    home = root / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("RAY_", "MLFLOW_"))}
    # RAY_TMPDIR: what the head, the job's driver and the CLI write outside --temp-dir (the
    # address file) stays under root too.
    env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               RAYCL_CACHE=str(data_cache), RAY_TMPDIR=str(root))
    gcs_port, dashboard_port, mlflow_port = free_port(), free_port(), free_port()
    logs = root / "logs"
    logs.mkdir()
    # MLflow first: it starts up while Ray's token is made.
    mlflow = spawn(
        [sys.executable, "-m", "raycl.server", "--port", str(mlflow_port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow' / 'mlflow.db'}",
         "--artifacts-destination", str(root / "mlflow" / "artifacts")],
        env=env, cwd=root, log=logs / "mlflow.log")
    ray_head = None
    try:
        # Ray's own steps: a token in ~/.ray/auth_token, and RAY_AUTH_MODE=token.
        generated = subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"],
                                   env=env, capture_output=True, text=True, timeout=60,
                                   check=False)
        assert generated.returncode == 0, generated.stderr
        assert (home / ".ray" / "auth_token").is_file()
        env["RAY_AUTH_MODE"] = "token"
        env.update([TRAIN_POLL])
        # Ray's other fixed default ports (the dashboard agent's 52365 above all) are taken by
        # the test session's own Ray: without a port of its own the head's job agent never
        # starts and every submission answers "No available agent".
        own_ports = [f"--{option}={free_port()}" for option in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
            "runtime-env-agent-port", "ray-client-server-port", "node-manager-port",
            "object-manager-port")]
        ray_head = spawn(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard_port}", "--include-dashboard=true", "--num-cpus=2",
             "--num-gpus=0", *own_ports, f"--temp-dir={root / 'ray'}",
             "--disable-usage-stats"],
            env=env, cwd=root, log=logs / "ray_start.log")
        assert mlflow.process is not None and ray_head.process is not None
        wait_for_http(f"http://127.0.0.1:{mlflow_port}/health", mlflow.process, 90)
        wait_for_http(f"http://127.0.0.1:{dashboard_port}/api/version", ray_head.process, 120)
        yield Head(f"http://127.0.0.1:{dashboard_port}", f"http://127.0.0.1:{mlflow_port}",
                   env, root)
    finally:
        mlflow.stop()
        if ray_head is not None:
            # A throwaway head in its own temp dir: its graceful drain (~28 s) keeps nothing,
            # and it outlasted a 3 s grace every time (measured), so SIGKILL follows at once.
            ray_head.stop(grace_s=0.5)
        for log in sorted(logs.iterdir()):  # shown by pytest when a test failed
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")
        shutil.rmtree(root, ignore_errors=True)


def test_head_refuses_a_submission_without_the_token(head: Head) -> None:
    stranger = {**head.env, "HOME": str(head.root / "stranger")}
    stranger.pop("RAY_AUTH_MODE")
    refused = head.ray("job", "submit", "--address", head.dashboard, "--no-wait", "--",
                       "echo", "hello", env=stranger)
    assert refused.returncode != 0
    assert "auth" in (refused.stdout + refused.stderr).lower()


def ended(text: str, submission: str) -> bool:
    """Whether ``text`` has Ray's line on how job ``submission`` ended."""
    return any(f"Job '{submission}' {how}" in text
               for how in ("succeeded", "failed", "was stopped"))


def job_status_and_logs(head: Head, submission: str,
                        submitted: subprocess.CompletedProcess) -> tuple[str, str]:
    """How the job ended (\"Job 'raycl-test-1' succeeded\") and its logs: what the waiting
    ``ray job submit`` printed, or, should its log tail have closed before the job ended, what
    ``ray job status`` says once it has (and ``ray job logs``)."""
    printed = submitted.stdout + submitted.stderr
    if ended(printed, submission) or "submitted successfully" not in printed:
        return printed, printed
    deadline, status = time.monotonic() + JOB_TIMEOUT_S, ""
    while time.monotonic() < deadline and not ended(status, submission):
        time.sleep(1)
        status = head.ray("job", "status", "--address", head.dashboard, submission).stdout
    logs = head.ray("job", "logs", "--address", head.dashboard, submission).stdout
    return status, f"{printed}\n{logs}"


def test_ray_job_submit_runs_a_sweep_into_mlflow(head: Head, tmp_path: Path) -> None:
    source = clean_copy(tmp_path / "src")
    assert not (source / ".git").exists() and (source / "raycl" / "tune.py").is_file()
    commit = "0123456789abcdef0123456789abcdef01234567"  # what `git rev-parse HEAD` would give
    runtime_env = {"env_vars": {"RAYCL_GIT_COMMIT": commit, "RAYCL_CACHE": head.env["RAYCL_CACHE"]}}
    overrides = [arg for key in SHRUNK for arg in ("--set", key)]
    submission = f"raycl-test-{os.getpid()}"
    # Without --no-wait: one CLI process tails the job's logs and prints how it ended (polling
    # `ray job status` started a CLI, ~2 s of CPU, every second of the job).
    submitted = head.submit(
        "--submission-id", submission,
        "--working-dir", str(source), "--runtime-env-json", json.dumps(runtime_env), "--",
        "python", "-m", "raycl.tune", "searches/quickstart.yaml", "--name", "job-submit",
        "--num-samples", "2", "--storage", str(tmp_path / "ray_results"),
        "--tracking-uri", head.tracking_uri, *overrides, timeout_s=JOB_TIMEOUT_S)
    status, logs = job_status_and_logs(head, submission, submitted)
    assert submitted.returncode == 0, f"{status}\n{logs[-6000:]}"
    assert f"Job '{submission}' succeeded" in status, f"{status}\n{logs[-6000:]}"
    assert "job-submit: 2 trial(s)" in logs  # the leaderboard the driver prints at the end

    client = MlflowClient(tracking_uri=head.tracking_uri)
    experiment = client.get_experiment_by_name("job-submit")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [run for run in runs if run.data.tags.get(ROLE_TAG) == "sweep"]
    children = [run for run in runs if run.data.tags.get(ROLE_TAG) == "trial"]
    assert len(children) == 2
    assert {run.data.tags[PARENT_TAG] for run in children} == {parent.info.run_id}
    # .git was not uploaded: the commit came through the runtime environment.
    assert parent.data.tags[COMMIT_TAG] == commit
    assert all(run.data.tags[COMMIT_TAG] == commit for run in children)
    assert parent.data.metrics["best/val/linear/mean"] == max(
        run.data.metrics["val/linear/mean"] for run in children)
    assert all("test/linear/mean" in run.data.metrics for run in children)
    # Logged by the trial processes through the driver's relay, over the server's HTTP API.
    best = next(run for run in children if run.info.status == "FINISHED")
    diagnostics = [item.path for item in client.list_artifacts(best.info.run_id, "diagnostics")]
    assert "diagnostics/spectrum.png" in diagnostics, logs[-8000:]
