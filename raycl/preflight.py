"""Checks of the environment a sweep writes to, run before Ray or MLflow start.

A config can be valid and the sweep still doomed: an MLflow server that does not answer (MLflow
retries for minutes, then the driver dies), a sqlite database in a directory that does not exist,
storage that cannot be written. Each problem is one :class:`~raycl.config.ConfigError` line naming
the file and the key, like every other bad input.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from raycl.config import ConfigError, CoreConfig, resolve_tracking_uri

TRACKING_TIMEOUT_S = 5.0


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_location(path: Path) -> str | None:
    """Why files cannot be created at ``path`` (which may not exist yet), or None."""
    existing = _nearest_existing(path)
    if existing == path and not path.is_dir():
        return f"{path} exists and is not a directory"
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def check_tracking_uri(uri: str, timeout_s: float = TRACKING_TIMEOUT_S) -> str | None:
    """Why MLflow could not log to ``uri``, or None. http(s): the server must answer within
    ``timeout_s`` (any HTTP status counts as an answer); sqlite: the database's directory must
    exist and be writable; plain file stores are refused by MLflow 3 unless allowed."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):
                return None
        except urllib.error.HTTPError:
            return None  # it answered; authentication and routing are MLflow's business
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"no MLflow server answers at {uri} within {timeout_s:g} s ({reason})"
    if parsed.scheme == "sqlite":
        database = Path(resolve_tracking_uri(uri)[len("sqlite:///"):])
        if not database.parent.is_dir():
            return f"directory {database.parent} of the sqlite database does not exist"
        # sqlite writes a journal beside the database: the directory must be writable too.
        for target in (database.parent, database):
            if target.exists() and not os.access(target, os.W_OK):
                return f"{target} is not writable"
        return None
    if parsed.scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE") != "true":
        return (f"MLflow 3 refuses plain file stores ({uri}); use sqlite:///mlflow.db or an "
                f"http server (or set MLFLOW_ALLOW_FILE_STORE=true)")
    return None


def check_storage_path(path: str) -> str | None:
    """Why Ray could not write sweep state under ``path``, or None (remote URIs pass)."""
    if "://" in path:
        return None  # s3://, gs://: credentials and buckets are checked by Ray's pyarrow
    return _writable_location(Path(path).expanduser().resolve())


def preflight(config: CoreConfig, source: str) -> None:
    """Raise ConfigError when the sweep could not record its results."""
    problem = check_storage_path(config.tune.storage_path)
    if problem:
        raise ConfigError(f"{source}: tune.storage_path: {problem}")
    problem = check_tracking_uri(config.mlflow.tracking_uri)
    if problem:
        raise ConfigError(f"{source}: mlflow.tracking_uri: {problem}")
