"""Fault injection for the reliability tests: a worker that dies once, at a chosen epoch.

``loop_config["fault"]`` (tests only; see :func:`raycl.pipeline.run_trial` and
:func:`raycl.tune.build_tuner`): ``after_epoch``, ``marker`` (a file: the fault happens once),
optional ``stage`` (default 0), ``settle_seconds`` and ``pause_seconds`` (instead of dying, the
worker waits that long: a test then preempts or kills its node, tests/test_cloud_local.py), and
``mid_epoch`` (die halfway through the epoch after ``after_epoch``, between two steps, instead of
right after its report: stream mode's decoders are then mid-pipeline).
"""

from __future__ import annotations

import os
import time
from typing import Any


def maybe_inject_fault(
    loop_config: dict[str, Any], stage: int, completed: int, local_mode: bool,
    mid_epoch: bool = False,
) -> None:
    """Test hook: die once after epoch ``after_epoch`` of stage ``stage`` (default 0), or with
    ``mid_epoch`` halfway through the next one (``completed`` epochs done); the marker file
    records that we did. ``settle_seconds`` waits first, so Ray Train's controller
    has polled the epoch's report (without it the crash races the checkpoint's registration).

    In process (``local_mode``) the fault is an exception; in a Ray worker a hard exit.
    """
    fault = loop_config.get("fault")
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
    if local_mode:
        raise RuntimeError("injected fault")
    time.sleep(float(fault.get("settle_seconds", 0)))
    if fault.get("pause_seconds"):
        # Not a crash: hold still (the marker says where) while the test takes the node away.
        time.sleep(float(fault["pause_seconds"]))
        return
    os._exit(1)  # a hard worker crash, not an exception Ray could see coming


__all__ = ["maybe_inject_fault"]
