"""What a sweep prints: one line per trial event and a short periodic summary, in raycl's names.

:class:`ProgressDisplay` is a ``ray.tune.Callback`` in the driver (Tune's public event
interface; Ray 2.60's new output engine ignores ``RunConfig(progress_reporter=...)``, ray
issue #38202), so it never parses Ray's output. A trial is called what MLflow and the
leaderboard call it (``t03 τ=0.31 lr=0.0026``, :func:`raycl.tracking.naming.trial_run_name`).
It prints plain, flushed lines to stdout: the same text in a terminal, in ``tee`` and in
``ray job logs -f`` on a cluster.

:func:`quiet_ray` turns Ray's, Tune's and Optuna's own chatter down to warnings for the length
of a sweep (``python -m raycl.tune -v`` keeps it); errors and tracebacks still reach the
terminal, while other processes' chatter that Ray forwards is left out
(:mod:`raycl.sweep.quiet_lines`). A failure inside the display is logged once, never fatal.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ray.tune import Callback

from raycl.config.compare import trials_phrase
from raycl.config.schema import CoreConfig, active_values
from raycl.config.search_config import apply_overrides
from raycl.config.sweep import trial_values
from raycl.launch.feasibility import max_reports
from raycl.sweep.quiet_lines import DROPPED_LINES, DropLines
from raycl.tracking.closed_stdout import stdout_closed
from raycl.tracking.naming import format_value, trial_index, trial_run_name
from raycl.worker.outcome import FAIL_REASON_KEY, SKIP_REASON_KEY, trial_ending

if TYPE_CHECKING:
    from ray.tune.experiment import Trial

logger = logging.getLogger(__name__)

# Reported by raycl.trial.trainable for a trial that cannot train (MCL's K^N > M/b).
SUMMARY_INTERVAL_S = 30.0
RUNNING_SHOWN = 4  # running trials whose position the summary names
_F = TypeVar("_F", bound=Callable[..., Any])


def _never_raises(method: _F) -> _F:
    """A display hook that logs its first failure and swallows every failure: a progress line
    is never worth a sweep."""

    @functools.wraps(method)
    def guarded(self: ProgressDisplay, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception:
            if not self._failed_once:
                self._failed_once = True
                logger.warning("raycl's progress display failed; the sweep goes on",
                               exc_info=True)
            return None

    return guarded  # type: ignore[return-value]


def fmt_objective(value: Any) -> str:
    """An objective or loss to 4 significant digits, "-" when there is none."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return f"{value:.4g}"


def fmt_value(value: Any) -> str:
    """A searched value in a trial's start line: a float to 4 significant digits (the name
    shows 2), anything else as written."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return format_value(value)


def fmt_duration(seconds: float) -> str:
    """``45s``, ``4m05s``, ``1h02m``."""
    total = max(0, round(seconds))
    seconds = int(total)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def error_line(trial: Trial) -> str:
    """The last line of a failed trial's traceback (``RuntimeError: boom``), else where its
    error file is."""
    path = getattr(trial, "error_file", None)
    try:
        if path and Path(path).is_file():
            lines = [line.strip() for line in Path(path).read_text().splitlines()
                     if line.strip()]
            if lines:
                return lines[-1][:300]
    except OSError:
        pass
    return f"see {path}" if path else "no error message"


class ProgressDisplay(Callback):
    """Tune callback that prints each trial's start, evaluations and end, and a summary every
    ``interval_s`` seconds and at the end. Tune pickles it with the sweep's state; what it
    measures is reset in :meth:`setup` (a resumed sweep starts its clock again). A trial's
    ending is one line: a trial Tune starts again after it ended (its worker replays its last
    report, then Tune completes it again) prints nothing more, and a restored sweep's trial
    that had reported its last epoch before the stop says so once instead of a second
    ``finished:``."""

    def __init__(self, config: CoreConfig, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.config = config
        self.metric = config.tune.metric
        self.interval_s = interval_s
        self.total = config.tune.num_samples
        self._names: dict[str, str] = {}
        self._ended: dict[str, str] = {}  # trial id -> "done" | "failed" | "stopped" | ...
        self._met: set[str] = set()  # trials this driver has had an event of
        self._failed_once = False
        self._reports_seen = 0  # epochs reported while this driver ran: the sweep's pace
        self._start = time.monotonic()
        self._last_summary = self._start

    def setup(self, **info: Any) -> None:
        self._ended, self._failed_once, self._reports_seen = {}, False, 0
        self._met = set()
        self._start = self._last_summary = time.monotonic()
        total = info.get("total_num_samples")
        if isinstance(total, int) and 0 < total < sys.maxsize:
            self.total = max(self.total, total)
        scheduler = self.config.tune.scheduler
        stops = (f"ASHA stops weak trials from epoch {scheduler.grace_period}"
                 if scheduler.type == "asha" and self.config.tune.search_space
                 else "every trial runs to its end")
        trials = trials_phrase(self.config.tune, self.total, self.config.method)
        self._print(f"sweep {self.config.name!r}: {trials}, "
                    f"objective {self.metric} ({self.config.tune.mode}); {stops}")

    # -- names and lines ------------------------------------------------------------------------

    def name(self, trial: Trial) -> str:
        """The trial's raycl name (the MLflow run name), the same for every line."""
        if trial.trial_id not in self._names:
            index = trial_index(trial)
            if index is None:
                index = len(self._names) + 1
            self._names[trial.trial_id] = trial_run_name(
                index, self._values(trial), self.config.tune.search_space)
        return self._names[trial.trial_id]

    def _print(self, text: str) -> None:
        elapsed = fmt_clock(time.monotonic() - self._start)
        try:
            print(f"[{elapsed}] {text}", flush=True)
        except BrokenPipeError:  # the reader stopped (`| head`): the sweep goes on, unprinted
            stdout_closed()

    def _values(self, trial: Trial) -> dict[str, Any]:  # what the trial's own method reads
        return active_values(self.config, trial_values(trial.config))

    def _resolved(self, trial: Trial) -> CoreConfig:
        return apply_overrides(self.config, self._values(trial))

    def _where(self, trial: Trial, result: dict[str, Any]) -> str:
        """``epoch 4/8``, ``stage 2/3 epoch 4/8``, ``decoder epoch 2``: where a report is."""
        resolved = self._resolved(trial)
        epoch = result.get("epoch", result.get("training_iteration", "?"))
        phase = result.get("phase", "train")
        where = (f"epoch {epoch}/{resolved.train.epochs}" if phase == "train"
                 else f"{phase} epoch {epoch}")
        if resolved.num_stages > 1 and "stage" in result:
            where = f"stage {int(result['stage']) + 1}/{resolved.num_stages} {where}"
        return where

    # -- Tune's events --------------------------------------------------------------------------

    @_never_raises
    def on_trial_start(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        # One ending line a trial: a trial Tune starts again after it ended here is quiet.
        if trial.trial_id in self._ended:
            return
        last = trial.last_result or {}
        ran_to_its_end = self._had_run_to_its_end(trial)
        self._met.add(trial.trial_id)
        if ran_to_its_end:
            # A resumed sweep whose saved state predates the trial's end runs it again: its
            # worker hands its last checkpoint back. The driver before said how it ended.
            self._ended[trial.trial_id] = "finished"
            self._print(f"{self.name(trial)}: had run to its end before the sweep stopped "
                        f"({self.metric} {fmt_objective(self._objective(trial))}); resumed "
                        f"only to hand its result back")
            return
        searched = ", ".join(f"{k}={fmt_value(v)}" for k, v in self._values(trial).items())
        resumed = " (resumed from its checkpoint)" if last.get("training_iteration") else ""
        self._print(f"{self.name(trial)}: started{resumed}"
                    + (f" with {searched}" if searched else ""))

    def _had_run_to_its_end(self, trial: Trial) -> bool:
        """Whether a trial this driver has not met yet reported its last epoch before: a
        restored sweep's (within one driver, a PBT trial paused at its last epoch is met)."""
        last = trial.last_result or {}
        if trial.trial_id in self._met or self.metric not in last:
            return False
        resolved = self._resolved(trial)
        return trial_ending(last, resolved.num_stages, resolved.train.epochs) == "completed"

    @_never_raises
    def on_trial_result(
        self, iteration: int, trials: list, trial: Trial, result: dict, **info: Any
    ) -> None:
        self._met.add(trial.trial_id)
        if "training_iteration" in result:
            self._reports_seen += 1
        if self.metric in result and trial.trial_id not in self._ended:  # not a replay
            loss = result.get("train/loss")
            loss_text = f", train/loss {fmt_objective(loss)}" if loss is not None else ""
            self._print(f"{self.name(trial)}: {self._where(trial, result)}: {self.metric} "
                        f"{fmt_objective(result[self.metric])}{loss_text}")

    @_never_raises
    def on_trial_complete(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        if trial.trial_id in self._ended:  # its ending is said: once a trial
            return
        last = trial.last_result or {}
        took = f" ({fmt_duration(last['time_total_s'])})" if "time_total_s" in last else ""
        objective = self._objective(trial)
        resolved = self._resolved(trial)
        collapsed = resolved.tune.collapse and resolved.tune.collapse.reason(last)
        ending = trial_ending(last, resolved.num_stages, resolved.train.epochs, bool(collapsed))
        if ending in ("skipped", "collapsed"):
            self._ended[trial.trial_id] = ending
            text = f"{ending}: {collapsed or last.get(SKIP_REASON_KEY, 'infeasible')}"
        elif ending == "diverged":
            self._ended[trial.trial_id] = "failed"
            text = f"failed: {last.get(FAIL_REASON_KEY, 'no reason reported')}"
        elif ending == "completed":
            self._ended[trial.trial_id] = "finished"
            text = f"finished: {self.metric} {fmt_objective(objective)}{took}"
        else:
            self._ended[trial.trial_id] = "stopped"
            by = "ASHA" if self.config.tune.scheduler.type == "asha" else "the scheduler"
            text = (f"stopped early by {by} after {self._where(trial, last)}: {self.metric} "
                    f"{fmt_objective(objective)}{took}")
        self._print(f"{self.name(trial)}: {text}")

    @_never_raises
    def on_trial_error(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        if trial.trial_id in self._ended:  # a re-run of an ended trial: its ending stands
            logger.info("%s, run again after it had ended, failed: %s", self.name(trial),
                        error_line(trial))
            return
        self._ended[trial.trial_id] = "failed"
        self._print(f"{self.name(trial)}: failed: {error_line(trial)}")

    @_never_raises
    def on_trial_recover(self, iteration: int, trials: list, trial: Trial, **info: Any) -> None:
        failures = getattr(trial, "num_failures", 0)
        self._print(f"{self.name(trial)}: crashed ({error_line(trial)}); retrying from its last "
                    f"checkpoint (failure {failures} of {self.config.tune.max_failures} allowed)")

    @_never_raises
    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        now = time.monotonic()
        if now - self._last_summary >= self.interval_s:
            self._last_summary = now
            self._print(self.summary(trials))

    @_never_raises
    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self._print(self.summary(trials))

    # -- the summary ----------------------------------------------------------------------------

    def _objective(self, trial: Trial) -> float | None:
        """The trial's last reported objective (None before its first evaluation)."""
        value = (getattr(trial, "metric_analysis", None) or {}).get(self.metric, {}).get("last")
        if value is None:
            value = (trial.last_result or {}).get(self.metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
        return None

    def _is_done(self, trial: Trial) -> bool:
        return trial.trial_id in self._ended or getattr(trial, "status", "") in (
            "TERMINATED", "ERROR")

    def summary(self, trials: list[Trial]) -> str:
        """``2 done, 1 running, 3 pending of 6 · best val/linear/mean 0.5123 (t02 τ=0.31) ·
        elapsed 4m10s · about 6m left · now t03 τ=0.2 epoch 3/8``: the last part says where each
        running trial is (its last report's stage and epoch; the first few of many)."""
        done = [trial for trial in trials if self._is_done(trial)]
        running = [trial for trial in trials
                   if not self._is_done(trial) and getattr(trial, "status", "") == "RUNNING"]
        total = max(self.total, len(trials))
        pending = max(0, total - len(done) - len(running))
        parts = [f"{len(done)} done, {len(running)} running, {pending} pending of {total}"]
        scored = [(value, trial) for trial in trials
                  if (value := self._objective(trial)) is not None]
        if scored:
            sign = 1.0 if self.config.tune.mode == "max" else -1.0
            value, best = max(scored, key=lambda item: sign * item[0])
            parts.append(f"best {self.metric} {fmt_objective(value)} ({self.name(best)})")
        parts.append(f"elapsed {fmt_duration(time.monotonic() - self._start)}")
        left = self.estimate_left(done, running, pending)
        if left is not None and (running or pending):
            parts.append(f"about {fmt_duration(left)} left{self._estimate_basis()}")
        if running:
            parts.append(self._positions(running))
        return " · ".join(parts)

    def _positions(self, running: list[Trial]) -> str:
        """``now t03 τ=0.2 epoch 3/8, t04 τ=0.4 starting (+2 more)``."""
        shown = []
        for trial in running[:RUNNING_SHOWN]:
            last = trial.last_result or {}
            where = self._where(trial, last) if "training_iteration" in last else "starting"
            shown.append(f"{self.name(trial)} {where}")
        more = len(running) - RUNNING_SHOWN
        return "now " + ", ".join(shown) + (f" (+{more} more)" if more > 0 else "")

    def _reports(self, trial: Trial) -> int:
        """The reports (epochs over all stages and phases) the trial makes if never stopped."""
        from raycl.methods import stage_epochs

        resolved = self._resolved(trial)
        try:
            return max(1, stage_epochs(resolved) * resolved.num_stages)
        except ValueError:  # an unknown method: refused before launch, never here
            return max_reports(self.config)

    def _asha(self) -> tuple[int, float] | None:
        """ASHA's ``(grace period, reduction factor)`` when it stops this sweep's trials."""
        scheduler = self.config.tune.scheduler
        if scheduler.type != "asha" or not self.config.tune.search_space:
            return None  # nothing searched: seed repeats, each run to its end (FIFO)
        return scheduler.grace_period, scheduler.reduction_factor

    def estimate_left(
        self, done: list[Trial], running: list[Trial], pending: int,
        elapsed: float | None = None,
    ) -> float | None:
        """Seconds left: the sweep's own pace (wall-clock seconds per epoch reported since this
        driver started, so trial start-up, evaluation and trials running side by side count)
        times the epochs to come. Under ASHA most trials stop at its first rungs: a trial's
        epochs to come are what ASHA leaves it on average (:func:`asha_expected_reports`, from
        where it is); otherwise a running trial's run to its end, and a pending trial makes as
        many as the ended trials made on average, else the most a trial makes. None before
        the first report."""
        if self._reports_seen == 0:
            return None
        elapsed = time.monotonic() - self._start if elapsed is None else elapsed
        per_report = elapsed / self._reports_seen
        asha = self._asha()
        if asha is not None:
            left = pending * asha_expected_reports(*asha, max_reports(self.config))
            left += sum(asha_expected_reports(*asha, self._reports(trial), _reached(trial))
                        for trial in running)
            return left * per_report
        ended = [_reached(trial) for trial in done
                 if self._ended.get(trial.trial_id) != "skipped"]
        ended = [count for count in ended if count > 0]
        per_trial = sum(ended) / len(ended) if ended else max_reports(self.config)
        left = sum(max(0, self._reports(trial) - _reached(trial)) for trial in running)
        left += pending * per_trial
        return left * per_report

    def _estimate_basis(self) -> str:
        """What the time left assumes, where it is not every trial to its end."""
        asha = self._asha()
        if asha is None:
            return ""
        longest = max_reports(self.config)
        expected = asha_expected_reports(*asha, longest)
        if expected > longest - 0.05:
            return ""  # no rung before the end: every trial runs to it
        return f" (ASHA: ~{expected:.1f} of {longest} epochs a trial)"


def _reached(trial: Trial) -> int:
    """Reports (epochs over all stages) the trial has made."""
    return int((trial.last_result or {}).get("training_iteration", 0))


def asha_expected_reports(grace: int, reduction: float, max_t: int, reached: int = 0) -> float:
    """Reports a trial makes from ``reached`` on, on average, under ASHA (FinishingASHA runs
    Ray's): its rungs are ``grace x reduction^k`` below ``max_t``, and past each rung only
    ``1/reduction`` of the trials that reached it go on (its cutoff, once the rung has
    results). Grace 2, reduction 2, 8 epochs: rungs 2 and 4, so 2 + 2/2 + 4/4 = 4 of 8."""
    rungs = []
    rung = float(grace)
    while rung < max_t:
        rungs.append(rung)
        rung *= reduction
    return sum(reduction ** -sum(1 for r in rungs if reached < r < epoch)
               for epoch in range(reached + 1, max_t + 1))


def fmt_clock(seconds: float) -> str:
    """Elapsed time as ``mm:ss`` (``h:mm:ss`` from an hour on): each line's prefix."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    if hours:
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{rest // 60:02d}:{rest % 60:02d}"


# -- Ray's, Tune's and Optuna's own output -------------------------------------------------------

# Messages raycl says better itself (or that only restate a sane default).
_DROPPED = (
    # raycl prints "run the same command again to resume it" instead of Tuner.restore(...).
    "has been interrupted, but the most recent state was saved",
    # raycl's display prints each failed trial with its reason, under raycl's name.
    "Trials did not complete",
    # Ray 2.60 enables token authentication for a new local cluster and says so on every run;
    # only this notice goes ("is disabled" warnings stay). Nothing about security changes.
    "Token authentication is enabled for this Ray cluster",
    # Tune times its own bookkeeping; on a busy laptop a step takes over 0.5 s now and then.
    "which may be a performance bottleneck",
)
_FILTERED_LOGGERS = ("ray.tune.tune", "ray._private.authentication.authentication_token_setup",
                     "ray.tune.search.optuna.optuna_search", "ray.tune.utils.util")
# Loggers whose INFO lines are Ray's or MLflow's chatter in the driver.
_QUIET_LOGGERS = ("ray", "ray.tune", "ray.train", "ray.air", "ray.data", "mlflow", "alembic")


class _DropMessages(logging.Filter):
    """Drops the records :data:`_DROPPED` names, and the chatter
    :data:`raycl.sweep.quiet_lines.DROPPED_LINES` matches when the driver logs it itself (Optuna's
    ``Study.stop`` warning, through Tune's logger); everything else passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        return not (any(text in message for text in _DROPPED)
                    or DROPPED_LINES.search(message))


def quiet_env() -> dict[str, str]:
    """Environment for a quiet sweep, in the driver: Tune's legacy output engine at verbosity 0
    prints nothing (the new engine prints its configuration table and a TensorBoard hint even
    at ``verbose=0``), and no hint about how often the sweep's state is saved (raycl keeps two
    checkpoints on purpose)."""
    return {"RAY_AIR_NEW_OUTPUT": "0",
            "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "0"}


@contextlib.contextmanager
def quiet_ray(verbose: bool = False) -> Iterator[None]:
    """For the sweep's length: Ray, Tune, MLflow and Optuna log warnings and errors only in
    the driver, the messages raycl replaces are dropped, and so are the lines of other
    processes' chatter Ray forwards (:class:`raycl.sweep.quiet_lines.DropLines`). ``verbose``
    changes nothing (Ray's full output, as before). Everything is restored afterwards."""
    if verbose:
        yield
        return
    import optuna

    saved_env = {key: os.environ.get(key) for key in quiet_env()}
    saved_levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    optuna_level = optuna.logging.get_verbosity()
    drop = _DropMessages()
    for key, value in quiet_env().items():
        os.environ.setdefault(key, value)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _FILTERED_LOGGERS:
        logging.getLogger(name).addFilter(drop)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = DropLines(sys.stdout), DropLines(sys.stderr)
    try:
        yield
    finally:
        for filtered in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing left to write
                filtered.flush()
        sys.stdout, sys.stderr = streams
        optuna.logging.set_verbosity(optuna_level)
        for name in _FILTERED_LOGGERS:
            logging.getLogger(name).removeFilter(drop)
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
