"""A sweep logged by raycl, as a person sees it in a real ``mlflow ui``, in headless Chromium.

The store is filled by raycl's own tracking callback (stub trials, no Ray), ``mlflow ui`` serves
it on loopback, and Playwright drives Debian's ``/usr/bin/chromium`` through the DevTools
protocol: the experiment must open on its training runs, the parent run must expand to every
child run, the best child's objective must be readable on the page, the metric behind
``objective`` must be named by a column, and a trial ASHA stopped must not look failed (a failed
trial beside it does). A screenshot is kept
(see :func:`_keep`). Skipped, with the reason, only where Chromium or Playwright is missing
(``make test`` installs both as root on Debian).

What MLflow 3.17's UI does, found while writing this (it is a hash-router SPA):

* Which view an experiment opens on is decided by the UI's global *workflow type*: the
  ``workflowType`` query parameter of the link, else the browser's localStorage
  (``mlflow.workflowType``), else ``genai``, which redirects to the GenAI traces overview
  (``#/experiments/<id>/overview/usage?workflowType=genai``). The experiment's
  ``mlflow.experimentKind`` tag is not consulted by this version of the UI, so a link that opens
  on the runs needs ``?workflowType=machine_learning`` (:data:`RUNS_VIEW_QUERY`).
* Child runs are collapsed under their parent; the parent row's expander is a button rendered
  by the run-name cell (``data-component-id`` ending in ``runnamecellrenderer.tsx_46``).
* No metric column is shown by default, the experiment's primary metric
  (``mlflow.experiment.primaryMetric.name``) included. Sorting by a metric (``orderByKey`` in
  the link) flattens the nesting and still shows no metric column, so the column is turned on
  the way a person does: the "Columns" button, "Search columns", then the metric's checkbox.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from local_servers import free_port, spawn, wait_for_http

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps trying to reach Google, which fails on
# a closed network (and slows the start-up).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
VIEWPORT = {"width": 1920, "height": 1080}
# The link query that opens an experiment on its training runs in MLflow 3.17 (module docstring).
RUNS_VIEW_QUERY = "workflowType=machine_learning"
# Bounded waits, generous for a busy 2-core machine (the first page load compiles the bundle).
LOAD_MS = 30_000
STEP_MS = 15_000
SERVER_START_S = 60.0
METRIC = "val/linear/mean"
# raycl's alias of the sweep objective on every child run, once logged; else the metric itself.
OBJECTIVE_ALIAS = "objective"

_MISSING = [what for what, missing in [
    (f"Debian's chromium at {CHROMIUM} (as root: apt-get install chromium; `make test` does it)",
     not CHROMIUM.is_file()),
    ("the Python package playwright (the dev extra: pip install -e '.[dev]')",
     importlib.util.find_spec("playwright") is None),
] if missing]
pytestmark = [
    pytest.mark.skipif(bool(_MISSING), reason="needs " + " and ".join(_MISSING)),
    # One xdist worker, so the sweep, the server and the browser (module fixtures) start once.
    pytest.mark.xdist_group("mlflow-ui"),
]


@dataclass
class StubTrial:
    """What the callback reads of a Tune trial."""

    trial_id: str
    config: dict
    last_result: dict = field(default_factory=dict)
    error_file: str | None = None
    metric_analysis: dict = field(default_factory=dict)
    status: str = "TERMINATED"

    def __str__(self) -> str:
        return f"run_trial_{self.trial_id}"


EPOCHS = 2
# (trial id, searched values, last objective, epochs run, how it ended): the second is the best;
# ASHA stops the fourth after 2 of its 4 epochs, the fifth fails (an error) after its first.
TRIALS = [
    ("abcd1234_00001", {"mcl.clusters": 2, "mcl.stages": 1, "simclr.temperature": 0.12}, 0.4125,
     EPOCHS, "completed"),
    ("abcd1234_00002", {"mcl.clusters": 5, "mcl.stages": 2, "simclr.temperature": 0.31}, 0.7375,
     2 * EPOCHS, "completed"),
    ("abcd1234_00003", {"mcl.clusters": 10, "mcl.stages": 1, "simclr.temperature": 0.47}, 0.5875,
     EPOCHS, "completed"),
    ("abcd1234_00004", {"mcl.clusters": 2, "mcl.stages": 2, "simclr.temperature": 0.2}, 0.3125,
     EPOCHS, "stopped"),
    ("abcd1234_00005", {"mcl.clusters": 10, "mcl.stages": 2, "simclr.temperature": 0.4}, 0.25,
     1, "failed"),
]


@dataclass
class Child:
    run_id: str
    name: str
    objective_key: str
    objective: float
    ended: str  # the tag raycl.ended


@dataclass
class Sweep:
    """What is really stored, read back with MlflowClient (names are raycl's to choose)."""

    db: Path
    experiment_id: str
    parent_id: str
    parent_name: str
    children: list[Child]

    @property
    def best(self) -> Child:
        return max(self.children, key=lambda child: child.objective)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """A three-trial sweep logged through raycl's MLflowSweepCallback into a sqlite store."""
    from mlflow import MlflowClient

    from raycl.methods import SearchConfig
    from raycl.tracking import ROLE_TAG, MLflowSweepCallback

    db = tmp_path_factory.mktemp("mlflow-ui") / "mlflow.db"
    uri = f"sqlite:///{db}"
    config = SearchConfig.model_validate({
        "name": "ui_sweep", "method": "mcl", "train": {"epochs": EPOCHS},
        "mcl": {"stages": 1, "clusters": 2},
        "tune": {"metric": METRIC, "mode": "max", "num_samples": len(TRIALS),
                 "search_space": {"mcl.clusters": {"choice": [2, 5, 10]},
                                  "mcl.stages": {"choice": [1, 2]},
                                  "simclr.temperature": {"loguniform": [0.1, 0.5]}}},
        "mlflow": {"tracking_uri": uri}})
    callback = MLflowSweepCallback(config)
    callback.setup()
    trials = []
    for trial_id, searched, objective, epochs_run, ended in TRIALS:
        trial = StubTrial(trial_id, searched)
        callback.on_trial_start(0, trials, trial)
        for step in range(1, epochs_run + 1):
            # Rising to the objective at the last epoch run.
            result = {"epoch": (step - 1) % EPOCHS + 1, "stage": (step - 1) // EPOCHS,
                      "global_epoch": step, "training_iteration": step,
                      "train/loss": 2.0 / step, METRIC: objective - 0.0625 * (epochs_run - step)}
            if ended == "completed" and step == epochs_run:
                result["test/linear/mean"] = objective - 0.03125
            callback.on_trial_result(0, trials, trial, result)
            trial.last_result = result
        trial.metric_analysis = {METRIC: {"last": objective}}
        if ended == "failed":
            trial.status = "ERROR"
            callback.on_trial_error(0, trials, trial)
        else:
            callback.on_trial_complete(0, trials, trial)
        trials.append(trial)
    callback.on_experiment_end(trials=trials)

    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(callback.parent_run_id)
    runs = client.search_runs([callback.experiment_id], f"tags.`{ROLE_TAG}` = 'trial'")
    children = []
    for run in runs:
        key = OBJECTIVE_ALIAS if OBJECTIVE_ALIAS in run.data.metrics else METRIC
        children.append(Child(run.info.run_id, run.info.run_name, key, run.data.metrics[key],
                              run.data.tags["raycl.ended"]))
    assert len(children) == len(TRIALS)
    assert {child.objective for child in children} == {trial[2] for trial in TRIALS}
    return Sweep(db, callback.experiment_id, parent.info.run_id, parent.info.run_name, children)


@pytest.fixture(scope="module")
def mlflow_ui(sweep: Sweep) -> Iterator[str]:
    """``mlflow ui`` on a free loopback port, serving the sweep's store; its base URL."""
    workdir = sweep.db.parent  # its cwd: nothing (./mlruns, ./mlartifacts) lands in the repo
    log = workdir / "mlflow-ui.log"
    port = free_port()
    # raycl's experiments carry their own artifact location (file://, beside the database),
    # which the server reads directly; the default root only matters for other experiments.
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{sweep.db}",
               "--default-artifact-root", (workdir / "mlartifacts").as_uri(),
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    # No job runner (it starts seven huey consumer processes the UI pages here never use).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    server = spawn(command, cwd=workdir, env=env, log=log)
    try:
        assert server.process is not None
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for_http(f"{base}/health", server.process, SERVER_START_S, any_status=False)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"mlflow ui: {exc}:\n{log.read_text(errors='replace')[-3000:]}")
        yield base
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                              args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh profile per test: no workflow type or column choice remembered in localStorage."""
    context = browser.new_context(viewport=VIEWPORT)
    yield context.new_page()
    context.close()


def _screenshot_dir() -> Path:
    return Path(os.environ.get("RAYCL_UI_SCREENSHOT_DIR") or REPO / ".pytest-artifacts")


def _keep(page: Any, tmp_path: Path, name: str) -> Path:
    """A screenshot under the test's tmp_path, copied to a stable place to look at:
    $RAYCL_UI_SCREENSHOT_DIR, else .pytest-artifacts/ in the repository (git-ignored)."""
    path = tmp_path / name
    page.screenshot(path=str(path))
    kept = _screenshot_dir()
    kept.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, kept / name)
    return path


def _forget(name: str) -> None:
    """A failure screenshot kept from an earlier run would outlive its failure."""
    (_screenshot_dir() / name).unlink(missing_ok=True)


def _close_assistant(page: Any) -> None:
    """MLflow 3.17 opens an "MLflow Assistant" side panel; closed for a wider runs table."""
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close.count():
        close.first.click()


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (VIEWPORT["width"], VIEWPORT["height"])
    assert len(data) > 20_000, f"{path}: {len(data)} bytes, too small for a rendered table"


def test_experiment_opens_on_runs_and_the_parent_expands_to_its_trials(
    sweep: Sweep, mlflow_ui: str, page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    _forget("mlflow_ui_failed.png")
    try:
        page.goto(f"{mlflow_ui}/#/experiments/{sweep.experiment_id}?{RUNS_VIEW_QUERY}")

        # The training runs table, not the GenAI traces overview.
        expect(page).to_have_url(re.compile(rf"#/experiments/{sweep.experiment_id}/runs\b"),
                                 timeout=LOAD_MS)
        parent_row = page.locator(f'[role="row"][row-id="{sweep.parent_id}"]')
        parent_link = parent_row.locator(f'a[href$="/runs/{sweep.parent_id}"]')
        expect(parent_link).to_have_text(sweep.parent_name, timeout=LOAD_MS)
        expect(page.locator('[role="columnheader"][col-id="attributes.`Run Name`"]')
               ).to_be_visible()
        expect(page.get_by_text("No data available for the selected time range")).to_have_count(0)
        _close_assistant(page)

        # Children are collapsed under the parent until its expander is clicked.
        def child_link(child: Child) -> Any:
            return page.locator(f'[role="row"][row-id="{child.run_id}"] '
                                f'a[href$="/runs/{child.run_id}"]')

        for child in sweep.children:
            expect(child_link(child)).to_have_count(0)
        parent_row.locator('button[data-component-id*="runnamecellrenderer"]').first.click()
        for child in sweep.children:
            expect(child_link(child)).to_have_text(child.name, timeout=STEP_MS)

        _assert_png(_keep(page, tmp_path, "mlflow_ui_expanded.png"))

        # MLflow 3.17 shows no metric column by default (not the experiment's primary metric
        # either). The link raycl prints opens the sweep's saved leaderboard view: the
        # objective, its test counterpart and the searched params as columns, best first.
        from raycl.tracking.trial_table import runs_page

        page.goto(f"{mlflow_ui}/{runs_page(sweep.experiment_id, 'max', with_view=True)}")
        best = sweep.best
        column = f"metrics.`{best.objective_key}`"
        cell = page.locator(f'[role="row"][row-id="{best.run_id}"] [col-id="{column}"]')
        for shown_column in (column, "metrics.`objective_test`", "params.`mcl.clusters`"):
            expect(page.locator(f'[role="columnheader"][col-id="{shown_column}"]')
                   ).to_be_visible(timeout=LOAD_MS)
        _close_assistant(page)
        expect(page.locator(f'[role="columnheader"][col-id="{column}"]')).to_be_visible(
            timeout=STEP_MS)
        expect(cell).to_have_text(re.compile(r"^\s*-?\d"), timeout=STEP_MS)
        shown = float(cell.inner_text())
        # Compared as numbers: the table may round for display (it shows 0.7375 as is).
        assert shown == pytest.approx(best.objective, abs=5e-3), (cell.inner_text(), best)
        for child in sweep.children:
            other = page.locator(f'[role="row"][row-id="{child.run_id}"] [col-id="{column}"]')
            assert float(other.inner_text()) == pytest.approx(child.objective, abs=5e-3)
        cell.scroll_into_view_if_needed()
        _assert_png(_keep(page, tmp_path, "mlflow_ui.png"))
    except BaseException:
        with contextlib.suppress(Exception):
            _keep(page, tmp_path, "mlflow_ui_failed.png")
        raise


def _status_icon(page: Any, child: Child) -> str:
    """The status icon MLflow draws in a run's "Created" cell (a check for FINISHED, a cross for
    FAILED and KILLED; no text, no test id), as its drawing and colour."""
    icon = page.locator(f'[role="row"][row-id="{child.run_id}"] [col-id="runDateAndNestInfo"] '
                        '[role="img"]').first
    return icon.evaluate("el => el.querySelector('svg').innerHTML + ' ' "
                         "+ getComputedStyle(el).color")


def test_leaderboard_view_names_the_objective_and_no_stopped_trial_is_failed(
    sweep: Sweep, mlflow_ui: str, page: Any, tmp_path: Path
) -> None:
    """A trial ASHA stopped is no failure: its row carries a completed trial's icon, not the
    failed trial's cross, and says how and when it ended (``raycl.ended``,
    ``stopped_at_epoch``). The metric behind ``objective`` is named by a column of its own."""
    from playwright.sync_api import expect

    from raycl.tracking.trial_table import runs_page

    _forget("mlflow_ui_ended_failed.png")
    try:
        page.goto(f"{mlflow_ui}/{runs_page(sweep.experiment_id, 'max', with_view=True)}")
        named = page.locator(f'[role="columnheader"][col-id="metrics.`{METRIC}`"]')
        expect(named).to_be_visible(timeout=LOAD_MS)
        expect(named).to_contain_text(METRIC)
        _close_assistant(page)

        def cell(child: Child, column: str) -> Any:
            return page.locator(f'[role="row"][row-id="{child.run_id}"] [col-id="{column}"]')

        by_end: dict[str, list[Child]] = {}
        for child in sweep.children:
            by_end.setdefault(child.ended, []).append(child)
            # The named column holds the very numbers of `objective`.
            expect(cell(child, f"metrics.`{METRIC}`")).to_have_text(
                cell(child, "metrics.`objective`").inner_text(), timeout=STEP_MS)
        assert sorted(by_end) == ["completed", "error", "stopped_by_scheduler"]
        finished = {_status_icon(page, child) for child in by_end["completed"]}
        failed = _status_icon(page, by_end["error"][0])
        assert len(finished) == 1 and failed not in finished  # the two icons tell apart
        for child in by_end["stopped_by_scheduler"]:
            assert _status_icon(page, child) in finished, child.name
            expect(cell(child, "tags.`raycl.ended`")).to_contain_text("stopped_by")
            expect(cell(child, "metrics.`stopped_at_epoch`")).to_have_text(str(EPOCHS))
        for child in by_end["completed"]:
            expect(cell(child, "metrics.`stopped_at_epoch`")).to_have_text("-")
        _assert_png(_keep(page, tmp_path, "mlflow_ui_ended.png"))
    except BaseException:
        with contextlib.suppress(Exception):
            _keep(page, tmp_path, "mlflow_ui_ended_failed.png")
        raise


def test_parent_run_lists_the_leaderboard_artifact(
    sweep: Sweep, mlflow_ui: str, page: Any, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    _forget("mlflow_ui_artifacts_failed.png")
    try:
        page.goto(f"{mlflow_ui}/#/experiments/{sweep.experiment_id}/runs/{sweep.parent_id}"
                  f"?{RUNS_VIEW_QUERY}")
        page.get_by_role("tab", name="Artifacts").click(timeout=LOAD_MS)

        def artifact(name: str) -> Any:
            return page.locator(f'[data-testid="artifact-tree-node"][artifact-name="{name}"]')

        # Artifacts resolve at all: the search file raycl has always logged on the parent.
        expect(artifact("search.yaml")).to_be_visible(timeout=STEP_MS)
        # LEADERBOARD ARTIFACT: the parent run's leaderboard.csv (raycl/tracking/callback.py logs
        # it at the end of the sweep), listed where a person looks for it.
        expect(artifact("leaderboard.csv")).to_be_visible(timeout=STEP_MS)
    except BaseException:
        with contextlib.suppress(Exception):
            _keep(page, tmp_path, "mlflow_ui_artifacts_failed.png")
        raise
