"""Fault injection for the reliability tests: a worker that dies once, at a chosen epoch.

Nothing in raycl sets a fault. A test installs one (tests/faults.py) by writing its spec, a JSON
object, to the file that ``$RAYCL_TEST_FAULT`` names, for the duration of one sweep or one
in-process trial; without the variable, or without the file, there is none. The variable is set
before Ray starts, so every process of the test's Ray session inherits it (Ray's workers take the
environment of the process that started Ray; Ray Train's workers are Ray actors too), while the
file's content changes from test to test.

The spec: ``after_epoch``, ``marker`` (a file: the fault happens once), optional ``stage``
(default 0), ``settle_seconds`` and ``pause_seconds`` (instead of dying, the worker waits that
long: a test then preempts or kills its node, tests/cloud_local.py), ``resume`` (a file whose
appearance ends the pause early), and ``mid_epoch`` (die halfway through the epoch after
``after_epoch``, between two steps, instead of right after its report: stream mode's decoders
are then mid-pipeline).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raycl.worker.session import Session

# The file holding the installed fault's spec (tests only).
FAULT_ENV = "RAYCL_TEST_FAULT"


def installed_fault() -> dict[str, Any] | None:
    """The spec a test installed, or None (no ``$RAYCL_TEST_FAULT``, or no file there)."""
    path = os.environ.get(FAULT_ENV)
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def maybe_inject_fault(
    session: Session, stage: int, completed: int, mid_epoch: bool = False
) -> None:
    """Test hook: die once after epoch ``after_epoch`` of stage ``stage`` (default 0), or with
    ``mid_epoch`` halfway through the next one (``completed`` epochs done); the marker file
    records that we did. ``settle_seconds`` waits first, so Ray Train's controller
    has polled the epoch's report (without it the crash races the checkpoint's registration).

    In the calling process (:class:`InProcessSession`) the fault is an exception; in a Ray
    Train worker a hard exit.
    """
    fault = installed_fault()
    if not fault or stage != fault.get("stage", 0) or completed != fault["after_epoch"]:
        return
    if bool(fault.get("mid_epoch")) != mid_epoch:
        return
    # Created exclusively: of several trials or ranks that reach the epoch, exactly one dies.
    try:
        handle = os.open(fault["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    with os.fdopen(handle, "w") as marker:
        marker.write(str(completed))
    # Imported here: the tests import this module (for FAULT_ENV) before Ray or torch.
    from raycl.worker.session import InProcessSession

    if isinstance(session, InProcessSession):
        raise RuntimeError("injected fault")
    time.sleep(float(fault.get("settle_seconds", 0)))
    if fault.get("pause_seconds"):
        # Not a crash: hold still (the marker says where) while the test takes the node away,
        # or until the file ``resume`` names exists (the test did what the pause waited for).
        deadline = time.monotonic() + float(fault["pause_seconds"])
        resume = fault.get("resume")
        while time.monotonic() < deadline and not (resume and os.path.exists(resume)):
            time.sleep(0.1)
        return
    os._exit(1)  # a hard worker crash, not an exception Ray could see coming


__all__ = ["FAULT_ENV", "installed_fault", "maybe_inject_fault"]
