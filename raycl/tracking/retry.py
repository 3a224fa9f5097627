"""The one place raycl waits out a tracking store that is briefly away: every call the sweep's
callback and the trials' relay make to MLflow passes through :class:`RetryingClient`.

A server restarting, a network blip, or a sqlite file another process holds locked make a call
fail for seconds. The call is retried, with backoff, for up to ``$RAYCL_MLFLOW_RETRY_S``
seconds (default 300) from its first failure; past that :class:`TrackingUnavailableError` says
which store stayed away, for how long, and how to go on. While a call waits the sweep's driver
waits with it (trials pause at their next report; none fails), and nothing is queued in memory:
what MLflow holds is always at least what Tune's saved state holds, which is what lets a
resumed sweep log every epoch exactly once (:mod:`raycl.tracking.callback`).

Retried calls must be idempotent. Metrics carry the timestamp of their first attempt (MLflow
keeps one row of a metric with the same key, step, timestamp and value), tags and params are
set to the same value again, and a run is created only when a retry finds no run with its
``raycl.trial_id`` (or sweep uid) tag yet: the first attempt may have reached the store before
the connection broke.

Imports nothing of raycl; MLflow is imported where it is used.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

logger = logging.getLogger(__name__)

RETRY_ENV = "RAYCL_MLFLOW_RETRY_S"
DEFAULT_RETRY_S = 300.0
# MLflow's HTTP client retries every request itself (7 times over ~4 minutes by default, a
# warning with each) and blocks meanwhile, which would hide the bound above: in raycl's
# processes it does not, and the call waits here instead. A value the user set is kept.
_MLFLOW_HTTP_RETRIES = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
# MLflow logs every failed SQL statement with its traceback before raising it; a locked
# database is reported here once instead (with_retries' warning).
_SQL_ERROR_LOGGER = "mlflow.store.db.utils"
# What a store that is only briefly away fails with (lowercase parts of the message): a server
# down or restarting, a sqlite database another connection holds locked.
_TRANSIENT = ("database is locked", "database is busy", "connection refused",
              "max retries exceeded", "connection aborted", "connection reset",
              "remote end closed", "temporarily unavailable", "temporarily_unavailable",
              "too many 5", "bad gateway", "service unavailable", "timed out")
# Tags that name a run uniquely: a retried create_run first looks for a run carrying one.
_IDENTITY_TAGS = ("raycl.trial_id", "raycl.sweep_uid")

T = TypeVar("T")


class _DropLockedTraceback(logging.Filter):
    """Drops MLflow's traceback of a locked sqlite database: it is retried, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "database is locked" not in record.getMessage()


_LOCKED_FILTER = _DropLockedTraceback()


class TrackingUnavailableError(RuntimeError):
    """The tracking store stayed unreachable (or locked) longer than the retry bound."""


def retry_bound_s() -> float:
    """How long a call to MLflow is retried: ``$RAYCL_MLFLOW_RETRY_S``, else 300 s."""
    value = os.environ.get(RETRY_ENV, "")
    try:
        return max(0.0, float(value)) if value.strip() else DEFAULT_RETRY_S
    except ValueError:
        logger.warning("$%s=%r is not a number of seconds; %.0f s used", RETRY_ENV, value,
                       DEFAULT_RETRY_S)
        return DEFAULT_RETRY_S


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a store briefly away (retry) rather than a request it refuses."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    code = getattr(exc, "error_code", "")
    if code == "TEMPORARILY_UNAVAILABLE":  # MLflow's code for a sqlite/SQL OperationalError
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _TRANSIENT)


def with_retries(call: Callable[[], T], what: str, tracking_uri: str,
                 bound_s: float | None = None) -> T:
    """``call()``, retried on transient failures for ``bound_s`` (default
    :func:`retry_bound_s`) from the first one; then :class:`TrackingUnavailableError`."""
    bound = retry_bound_s() if bound_s is None else bound_s
    started: float | None = None
    delay = 0.5
    while True:
        try:
            result = call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            now = time.monotonic()
            if started is None:
                started = now
                logger.warning("MLflow at %s unavailable (%s: %s); retrying for up to %.0f s",
                               tracking_uri, what, _first_line(exc), bound)
            if now - started >= bound:
                raise TrackingUnavailableError(
                    f"MLflow at {tracking_uri} stayed unavailable for {now - started:.0f} s "
                    f"({what}: {_first_line(exc)}). Bring the tracking store back and run "
                    f"the same command again (a sweep resumes where it stopped); ${RETRY_ENV} "
                    f"sets how long to wait (now {bound:.0f} s)") from exc
            time.sleep(min(delay, max(0.0, started + bound - now)))
            delay = min(delay * 2, 10.0)
            continue
        if started is not None:
            logger.warning("MLflow at %s back after %.0f s (%s)", tracking_uri,
                           time.monotonic() - started, what)
        return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class RetryingClient:
    """An ``MlflowClient`` whose every call goes through :func:`with_retries` (see the module
    docstring for why each retried call is safe to repeat)."""

    def __init__(self, client: MlflowClient, tracking_uri: str) -> None:
        self._client = client
        self._uri = tracking_uri

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute) or name.startswith("_"):
            return attribute

        def retried(*args: Any, **kwargs: Any) -> Any:
            return with_retries(lambda: attribute(*args, **kwargs), name, self._uri)

        return retried

    def log_metric(self, run_id: str, key: str, value: float, timestamp: int | None = None,
                   step: int | None = None) -> None:
        """One metric, its timestamp fixed before the first attempt (a retry is one row)."""
        stamp = timestamp if timestamp is not None else int(time.time() * 1000)
        with_retries(lambda: self._client.log_metric(run_id, key, value, stamp, step or 0),
                     "log_metric", self._uri)

    def create_run(self, experiment_id: str, start_time: int | None = None,
                   tags: dict[str, str] | None = None, run_name: str | None = None) -> Run:
        """A new run, or after a failed attempt the run that attempt may have created."""
        identity = next(((key, tags[key]) for key in _IDENTITY_TAGS if tags and key in tags),
                        None)
        attempts = 0

        def attempt() -> Run:
            nonlocal attempts
            attempts += 1
            if attempts > 1 and identity is not None:
                found = self._client.search_runs(
                    [experiment_id], filter_string=f"tags.`{identity[0]}` = '{identity[1]}'",
                    max_results=1)
                if found:
                    return found[0]
            return self._client.create_run(experiment_id, start_time=start_time, tags=tags,
                                           run_name=run_name)

        return with_retries(attempt, "create_run", self._uri)


def retrying_client(tracking_uri: str) -> MlflowClient:
    """A client of ``tracking_uri`` that waits out a store briefly away (typed as the client it
    wraps: it answers every call an ``MlflowClient`` does)."""
    from mlflow import MlflowClient

    os.environ.setdefault(*_MLFLOW_HTTP_RETRIES)
    logging.getLogger(_SQL_ERROR_LOGGER).addFilter(_LOCKED_FILTER)  # once: the same filter
    # A client opens its store when made (a sqlite file's tables are read): retried too.
    made = with_retries(lambda: MlflowClient(tracking_uri=tracking_uri), "open the store",
                        tracking_uri)
    client: Any = RetryingClient(made, tracking_uri)
    return client
