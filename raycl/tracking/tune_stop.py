"""Whether a sweep's ``Tuner.fit`` ended because it was told to stop (Ctrl+C, SIGINT, SIGUSR1).

Tune (Ray 2.60, ``ray.tune.tune._setup_signal_catching``) turns the first SIGINT or SIGUSR1 of a
``tune.run`` into a ``threading.Event`` (``experiment_interrupted_event``) that ends its loop,
saves the sweep and calls the callbacks' ``on_experiment_end`` as at a normal end; it hands the
callbacks neither the event nor the reason. Trials left unfinished tell a stop apart only when
one was running: a Ctrl+C between two trials of a searcher-driven sweep (the next one not yet
created) leaves none, and the sweep looked finished (exit 0, parent run FINISHED). A count of
trials cannot tell either (a grid or a searcher may end before ``num_samples``). So the event
is read where Tune keeps it: in the closure of the handler it installed. Tune installs that
handler for SIGUSR1 at every ``tune.run`` on the main thread and never puts the old one back
(for SIGINT it does, once the signal came), so SIGUSR1's handler is the current run's.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from typing import Any

# The name of Tune's handler and of the event in its closure (ray/tune/tune.py).
_TUNE_HANDLER = "_setup_signal_catching.<locals>.signal_interrupt_tune_run"
_TUNE_EVENT = "experiment_interrupted_event"


def handler_event(handler: Any) -> threading.Event | None:
    """The stop event of a Tune signal handler, or None when ``handler`` is not Tune's.

    Args:
        handler: what ``signal.getsignal`` returned (a function, ``SIG_DFL``, None...).

    Returns:
        The ``threading.Event`` Tune's handler sets, read from its closure.
    """
    if getattr(handler, "__qualname__", None) != _TUNE_HANDLER:
        return None
    names = handler.__code__.co_freevars
    if _TUNE_EVENT not in names or handler.__closure__ is None:
        return None
    event = handler.__closure__[names.index(_TUNE_EVENT)].cell_contents
    return event if isinstance(event, threading.Event) else None


def tune_stop_requested() -> bool:
    """Whether the ``tune.run`` in progress was told to stop (its first SIGINT or SIGUSR1).

    Call it from a callback's ``on_experiment_end``. False off the main thread: Tune installs
    no handler there, and one found would be an earlier run's.

    Returns:
        True when Tune's stop event of this run is set.
    """
    if threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "SIGUSR1"):
        return False
    event = handler_event(signal.getsignal(signal.SIGUSR1))
    return event is not None and event.is_set()


def unfinished_trials(trials: Iterable[Any], started: set[str], ended: set[str]) -> list[Any]:
    """The trials a stopped sweep leaves unfinished: pending ones, and those this driver started
    and saw no end of (Tune stops a running trial silently).

    Args:
        trials: the sweep's Tune trials (``trial_id``, ``status``).
        started: ids of the trials this driver started; ``ended``: of those it saw end.

    Returns:
        Those trials, in order.
    """
    return [trial for trial in trials if trial.status == "PENDING" or (
        trial.trial_id in started and trial.trial_id not in ended)]


__all__ = ["handler_event", "tune_stop_requested", "unfinished_trials"]
