"""Everything knowable before launch fails before launch: one line, exit 2, nothing started."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raycl.launch.checks import storage_path_problem, tracking_uri_problem

REPO = Path(__file__).resolve().parents[1]


def test_tracking_uri_that_does_not_answer() -> None:
    started = time.monotonic()
    problem = tracking_uri_problem("http://127.0.0.1:1", timeout_s=2.0)
    assert problem is not None and "no MLflow server answers at http://127.0.0.1:1" in problem
    assert time.monotonic() - started < 5.0


def test_tracking_uri_that_answers_with_any_status() -> None:
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert tracking_uri_problem(f"http://127.0.0.1:{server.server_port}") is None
    finally:
        server.shutdown()


def test_sqlite_and_file_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracking_uri_problem(f"sqlite:///{tmp_path / 'mlflow.db'}") is None
    problem = tracking_uri_problem(f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}")
    assert problem is not None and "does not exist" in problem
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    problem = tracking_uri_problem(str(tmp_path / "mlruns"))
    assert problem is not None and "refuses plain file stores" in problem


def test_storage_path(tmp_path: Path) -> None:
    assert storage_path_problem(str(tmp_path / "new" / "deeper")) is None
    assert storage_path_problem("s3://bucket/raycl") is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    problem = storage_path_problem(str(blocker / "ray"))
    assert problem is not None and "is not a directory" in problem


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tracking-uri", "http://127.0.0.1:1"],
         ": mlflow.tracking_uri: no MLflow server answers at http://127.0.0.1:1"),
        (["--set", "train.batch_size=100000"],
         ": train.batch_size: 100000 exceeds the training split (3500 samples)"),
        (["--storage", "/proc/version/ray"], ": tune.storage_path: /proc/version is not a "
         "directory"),
    ],
)
def test_cli_rejects_before_launch(tmp_path: Path, args: list[str], expected: str) -> None:
    search = REPO / "searches" / "quickstart.yaml"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "raycl.tune", str(search), *args],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {search}") and expected in lines[0]
    assert elapsed < 15.0
    assert not (tmp_path / "ray_results").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_trial_the_local_ray_cannot_place_is_refused(ray_session, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Two workers of 2 CPUs on the 2-CPU Ray this process started: nothing will ever add a
    node, so the sweep stops with one line and exit 2 within seconds (it used to warn and wait
    forever; the thread and its timeout turn a hang into a failure)."""
    from raycl.tune import main

    search = REPO / "searches" / "quickstart.yaml"
    args = [str(search), "--set", "scaling.num_workers=2", "--set", "scaling.cpus_per_worker=2",
            "--num-samples", "1", "--storage", str(tmp_path / "ray"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    codes: list[int] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: codes.append(main(args)), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the sweep still waits for a placement after 60 s"
    assert codes == [2] and time.monotonic() - started < 30
    assert capsys.readouterr().err.strip() == (
        f"error: {search}: scaling.num_workers: one trial holds 4.01 CPU at once (2 workers x "
        f"2 CPU + 0.01 CPU for the trial process); this Ray's 1 node (2 CPU) cannot place it, "
        f"and nothing will add a node: the local Ray this command started has no autoscaler; "
        f"ask for less, or run on a larger cluster (--address)")
    assert not (tmp_path / "ray").exists()


def test_every_problem_of_a_yaml_is_reported_at_once(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    """Three independent mistakes in the YAML (an unknown key, a bad search-space entry, a
    missing data.root folder) and one in the environment (storage) come out together, one line
    each, exit 2 (no fix, re-run, next error); a YAML that does not parse: one line."""
    from raycl.tune import main

    search = tmp_path / "three.yaml"
    search.write_text(
        "name: t\n"
        f"data: {{dataset: folder, root: {tmp_path / 'missing'}, resoluton: 32}}\n"
        "tune:\n"
        "  search_space:\n"
        "    train.lr: {loguniform: [0.001, 0.01], uniform: [0, 1]}\n")
    assert main([str(search), "--storage", "/proc/version/ray"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": ")[2] for line in lines] == [
        "data.resoluton", "tune.search_space.train.lr", "data.root", "tune.storage_path"], lines
    assert lines[0] == f"error: {search}: data.resoluton: unknown key (did you mean " \
                       f"data.resolution?)"
    assert lines[2] == f"error: {search}: data.root: not a directory: {tmp_path / 'missing'}"
    assert all(line.startswith(f"error: {search}: ") for line in lines)

    search.write_text("name: t\ntrain: {epochs: [1,\n")
    assert main([str(search)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "invalid YAML" in lines[0]
