"""Two-worker trials on CPU without Ray: the worker loop in two spawned processes over gloo.

:class:`WorkerPair` starts two processes once; they join a gloo group through a rendezvous file
and then run one trial after another, each with :func:`raycl.worker.loop.run_trial_loop` and an
in-process session of its rank (which wraps the model in plain DDP). A Ray Train worker group
costs 10-25 s to start and the processes' imports several seconds; a trial of a tiny config
costs about a second. A collective entered by one rank only, or a rank that fails, fails the
test within the timeout (the pair is killed, and the next trial starts a new one) instead of
hanging the suite.
"""

from __future__ import annotations

import queue
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import raycl.methods  # noqa: F401  (fills the schema's method sections; spawned ranks too)
from raycl.methods import SearchConfig
from raycl.worker.checkpoints import DIAGNOSTICS_FILE
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop
from raycl.worker.session import InProcessSession

WORLD_SIZE = 2
# Seconds a pair may take to start (imports, the group's rendezvous), and a rank to finish
# once its peer has failed.
START_TIMEOUT = 90.0
GRACE = 5.0


class RecordingSession(InProcessSession):
    """An in-process session that keeps every report and the diagnostic arrays' names of the
    newest checkpoint (rank 0 writes them), and removes each checkpoint once read."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.reports: list[dict[str, Any]] = []
        self.diagnostics: list[str] = []
        self.batchnorm_layers: set[str] = set()

    def wrap_model(self, model: torch.nn.Module, sync_bn: bool = False) -> torch.nn.Module:
        """Also keeps the class names of the BatchNorm layers DDP received."""
        wrapped = super().wrap_model(model, sync_bn)
        self.batchnorm_layers |= {type(layer).__name__ for layer in model.modules()
                                  if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm)}
        return wrapped

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        self.reports.append(metrics)
        self.last_report = metrics
        if checkpoint_dir:
            path = Path(checkpoint_dir) / DIAGNOSTICS_FILE
            if path.exists():
                with np.load(path) as arrays:
                    self.diagnostics = sorted(arrays.files)
            shutil.rmtree(checkpoint_dir, ignore_errors=True)


@dataclass
class RankResult:
    """What one rank reported: every report in order, and the names of the diagnostic arrays
    in its newest checkpoint (rank 0 only)."""

    rank: int
    world_size: int
    reports: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: list[str] = field(default_factory=list)
    batchnorm_layers: set[str] = field(default_factory=set)  # what DDP wrapped

    @property
    def final(self) -> dict[str, Any]:
        """The last report that carries an evaluation (rank 0), else the last report."""
        scored = [report for report in self.reports if "perf/eval_seconds" in report]
        return scored[-1] if scored else self.reports[-1]


def _serve(rank: int, rendezvous: str, jobs: Any, results: Any) -> None:
    """One rank: join the group, then run each trial config from ``jobs`` (None ends) and put
    ``(rank, RankResult or a traceback)`` on ``results``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=120))
    results.put((rank, "ready"))
    try:
        while (config := jobs.get()) is not None:
            try:
                session = RecordingSession()
                context = TrialContext(config=SearchConfig.model_validate(config),
                                       started_at=time.time())
                run_trial_loop(context, session)
                outcome: Any = RankResult(session.rank, session.world_size, session.reports,
                                          session.diagnostics, session.batchnorm_layers)
            except Exception:  # reported to the test, which fails with the traceback
                outcome = traceback.format_exc()
            results.put((rank, outcome))
    finally:
        dist.destroy_process_group()


class WorkerPair:
    """Two spawned ranks that run trials on request (:meth:`run`); restarted after a failure."""

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.directory: str | None = None

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self.directory = tempfile.mkdtemp(prefix="raycl-two-workers-")
        self.results = context.Queue()
        self.jobs = [context.Queue() for _ in range(WORLD_SIZE)]
        self.processes = [context.Process(target=_serve, daemon=True, args=(
            rank, f"{self.directory}/rendezvous", self.jobs[rank], self.results))
            for rank in range(WORLD_SIZE)]
        for process in self.processes:
            process.start()
        ready = self._collect(START_TIMEOUT, "start")
        assert all(value == "ready" for value in ready), ready

    def _collect(self, timeout: float, what: str) -> list[Any]:
        """One message per rank, in rank order; fails the test (and stops the pair) when a rank
        reports a traceback or the ranks have not all answered within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        answers: dict[int, Any] = {}
        while len(answers) < WORLD_SIZE:
            try:
                rank, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            answers[rank] = value
            if isinstance(value, str) and value != "ready":
                deadline = min(deadline, time.monotonic() + GRACE)  # its peer may be stuck
        failures = [f"rank {rank}:\n{value}" for rank, value in sorted(answers.items())
                    if isinstance(value, str) and value != "ready"]
        missing = sorted(set(range(WORLD_SIZE)) - set(answers))
        if failures or missing:
            self.stop()
            hang = (f"rank(s) {missing} did not finish within {timeout:.0f} s (a collective "
                    "that not every rank entered?)\n" if missing else "")
            pytest.fail(f"two-worker {what} failed: {hang}" + "\n".join(failures))
        return [answers[rank] for rank in range(WORLD_SIZE)]

    def run(self, config: dict[str, Any], timeout: float = 60.0) -> list[RankResult]:
        """The trial ``config`` (a validated config's dict) on both ranks: their results, in
        rank order."""
        if not self.processes:
            self._start()
        for jobs in self.jobs:
            jobs.put(config)
        return self._collect(timeout, f"trial of {config.get('method')}")

    def stop(self) -> None:
        """Ends both ranks (politely when they are idle, else killed) and removes the
        rendezvous."""
        for jobs in getattr(self, "jobs", []):
            jobs.put(None)
        for process in self.processes:
            process.join(timeout=GRACE)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
