"""Checkpoint transfers wait out unreachable storage (raycl.worker.storage), with a bound.

The end-to-end case (a bucket away for ~20 s mid-trial) is
tests/test_cloud_local.py::test_a_checkpoint_written_while_the_bucket_is_away_waits_for_it; these
pin the rules: which errors are waited out, for how long, and what the error then says.
"""

from __future__ import annotations

import pyarrow.fs
import pytest
from local_servers import free_port

from raycl.worker import storage
from raycl.worker.storage import StorageUnreachable, is_transient, with_storage_retry


def refused_error() -> OSError:
    """What pyarrow raises for an S3 endpoint that refuses connections (nothing listens)."""
    bucket = pyarrow.fs.S3FileSystem(
        endpoint_override=f"127.0.0.1:{free_port()}", scheme="http", region="us-east-1",
        access_key="testing", secret_key="testing",
        retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=1))
    with pytest.raises(OSError) as raised:
        bucket.get_file_info("bucket/raycl/.validate_storage_marker")
    return raised.value


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A fake clock for the back-off: the sleeps it was asked for."""
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(storage.time, "sleep", sleep)
    monkeypatch.setattr(storage.time, "monotonic", lambda: now[0])
    return slept


def test_an_unreachable_bucket_is_waited_out_with_back_off(clock: list[float]) -> None:
    error = refused_error()
    assert is_transient(error), error
    attempts = []

    def upload() -> str:
        attempts.append(1)
        if len(attempts) < 5:
            raise error
        return "persisted"

    assert with_storage_retry(upload, "checkpoint upload", "s3://bucket/run") == "persisted"
    assert clock == [1.0, 2.0, 4.0, 8.0]  # ~15 s of outage ridden out


def test_past_the_bound_the_error_names_the_storage(clock: list[float]) -> None:
    error = refused_error()

    def upload() -> None:
        raise error

    with pytest.raises(StorageUnreachable, match=r"checkpoint upload: the storage "
                       r"s3://bucket/run was unreachable for 60 s \(raycl waits up to 60 s\)"
                       ) as raised:
        with_storage_retry(upload, "checkpoint upload", "s3://bucket/run", bound_s=60)
    assert raised.value.__cause__ is error
    assert sum(clock) <= 60
    # Not pyarrow's text: Ray's own upload retry would match it and wait all over again.
    assert "AWS Error" not in str(raised.value)


@pytest.mark.parametrize("error", [FileNotFoundError("raycl/x/state.pt"),
                                   OSError("AWS Error ACCESS_DENIED during PutObject"),
                                   OSError("AWS Error UNKNOWN (HTTP status 403) during "
                                           "HeadObject operation: No response body."),
                                   ValueError("not a storage problem")])
def test_other_errors_are_not_waited_on(clock: list[float], error: Exception) -> None:
    def upload() -> None:
        raise error

    with pytest.raises(type(error)):
        with_storage_retry(upload, "checkpoint upload", "s3://bucket/run")
    assert clock == []
