"""The tests' fault hook (:mod:`raycl.worker.faults`): a worker that dies once, at a chosen epoch.

:func:`name_fault_file` points ``$RAYCL_TEST_FAULT`` at a file of this process's own before Ray
starts (conftest.py at import; tests/cloud_local.py before its cluster), so every Ray process
of the session, Ray Train's workers included, looks there. :func:`injected_fault` writes the
fault there for the duration of its ``with`` block (one sweep, or one in-process trial) and
removes it after, so the sweeps before and after it run without one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raycl.worker.faults import FAULT_ENV


def name_fault_file(directory: Path | None = None) -> Path:
    """Point ``$RAYCL_TEST_FAULT`` at ``directory`` (default: the temp directory), one file per
    process: two pytest-xdist workers, each with a Ray session of its own, never share one."""
    path = Path(directory or tempfile.gettempdir()) / f"raycl-test-fault-{os.getpid()}.json"
    os.environ[FAULT_ENV] = str(path)
    return path


@contextmanager
def injected_fault(
    after_epoch: int,
    marker: Path | str,
    stage: int = 0,
    mid_epoch: bool = False,
    settle_seconds: float = 0.0,
    pause_seconds: float = 0.0,
    resume: Path | str | None = None,
) -> Iterator[None]:
    """Inside the block, the first worker that finishes epoch ``after_epoch`` of stage ``stage``
    (with ``mid_epoch``: that reaches the middle of the next one) writes ``marker`` and dies: an
    exception in the calling process, a hard exit in a Ray Train worker (after
    ``settle_seconds``), or, with ``pause_seconds``, a pause instead (ended early once the file
    ``resume`` exists)."""
    spec = {"after_epoch": after_epoch, "marker": str(marker), "stage": stage,
            "mid_epoch": mid_epoch, "settle_seconds": settle_seconds,
            "pause_seconds": pause_seconds, "resume": str(resume) if resume else None}
    path = Path(os.environ[FAULT_ENV])
    # Written whole, then renamed: a worker reading at that moment sees no fault or all of it.
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(spec))
    partial.replace(path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
