"""How a trial's checkpoints reach its storage (``tune.storage_path``, e.g. a bucket) and come
back, waiting out a storage that is unreachable for a while (a network blip, an S3 endpoint
restarting) instead of failing the trial.

Every transfer between a worker and the run's storage goes through :func:`with_storage_retry`:
the upload of each reported checkpoint (:func:`persist_checkpoint`, given to
``ray.train.report``) and the download of one to resume from or to finish with
(:func:`download`). What Ray does outside the workers (Ray Train's controller writing its
checkpoint list, Tune's driver syncing the sweep's state) is Ray's own: Tune logs a failed sync
and tries again at the next one.
"""

from __future__ import annotations

import logging
import posixpath
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # Ray is imported where it is used: checkpoints are read without it too
    import pyarrow.fs
    import ray.train

logger = logging.getLogger(__name__)

T = TypeVar("T")

STORAGE_RETRY_S = 180.0  # how long a checkpoint waits for unreachable storage to come back
_MAX_BACKOFF_S = 15.0
# What pyarrow says when storage cannot be reached for now: S3's transient errors (those Ray's
# own upload retry matches) and connection-level failures of any remote filesystem.
_TRANSIENT = ("AWS Error SLOW_DOWN", "AWS Error INTERNAL_FAILURE", "AWS Error SERVICE_UNAVAILABLE",
              "AWS Error NETWORK_CONNECTION", "AWS Error UNKNOWN", "Connection refused",
              "Could not connect", "Connection reset", "timed out")


class StorageUnreachable(RuntimeError):
    """The run's storage stayed unreachable longer than :data:`STORAGE_RETRY_S`."""


# A client error (HEAD requests' 403s read "AWS Error UNKNOWN (HTTP status 403)") will not go
# away by waiting; a timeout (408) or throttling (429) will.
_CLIENT_ERROR = re.compile(r"HTTP status 4(?!08|29)\d\d")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage is unreachable for now (not: missing, corrupt, denied)."""
    text = str(exc)
    return (isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)
            and any(token in text for token in _TRANSIENT) and not _CLIENT_ERROR.search(text))


def with_storage_retry(action: Callable[[], T], what: str, where: str,
                       bound_s: float = STORAGE_RETRY_S) -> T:
    """``action()``, repeated with exponential back-off (1 s doubling to 15 s) while it fails
    because the storage at ``where`` is unreachable, for up to ``bound_s``; then
    :class:`StorageUnreachable` naming ``where``. Any other error is raised at once.

    ``action`` must be safe to repeat (an upload overwrites what a failed attempt left).
    """
    started, delay = time.monotonic(), 1.0
    while True:
        try:
            result = action()
        except Exception as exc:
            waited = time.monotonic() - started
            if not is_transient(exc):
                raise
            if waited + delay > bound_s:
                # The pyarrow error goes in the cause: its text would make Ray's own upload retry
                # (which matches "AWS Error ...") repeat the whole wait.
                raise StorageUnreachable(
                    f"{what}: the storage {where} was unreachable for {waited:.0f} s (raycl "
                    f"waits up to {bound_s:.0f} s); check that this node reaches it") from exc
            if delay == 1.0:  # one line per outage, not per attempt
                logger.warning("%s: the storage %s is unreachable, retrying for up to %.0f s: %s",
                               what, where, bound_s, str(exc).splitlines()[0][:300])
            time.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF_S)
            continue
        if delay > 1.0:
            logger.warning("%s: the storage %s is back after %.0f s", what, where,
                           time.monotonic() - started)
        return result


def storage_location(checkpoint: ray.train.Checkpoint) -> str:
    """Where ``checkpoint`` lives, as a URI (``s3://bucket/path``), for messages."""
    return f"{checkpoint.filesystem.type_name}://{checkpoint.path}"


def persist_checkpoint(checkpoint: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
    """Ray Train's own upload of a reported checkpoint into the run's storage (what
    ``ray.train.report`` does without ``checkpoint_upload_fn``), waiting out an outage.

    Ray 2.60 retries the upload only 3 times, 1 s and 2 s apart (not configurable:
    ray-project/ray#55350, #47939): a bucket refusing connections for longer fails the report,
    and the worker group restarts, charged to ``scaling.max_failures``, and must read its
    checkpoint back from that same bucket. (A ``storage_filesystem`` with a longer pyarrow
    ``retry_strategy`` is no way round: the strategy is lost when the filesystem is pickled to
    the workers, apache/arrow#47348.)
    """
    import ray.train

    storage = ray.train.get_context().get_storage()
    where = f"{storage.storage_filesystem.type_name}://{storage.experiment_fs_path}"
    return with_storage_retry(lambda: storage.persist_current_checkpoint(checkpoint, name),
                              "checkpoint upload", where)


def download(
    checkpoint: ray.train.Checkpoint, directory: Path, only: Iterable[str] | None = None
) -> Path:
    """``checkpoint``'s files into ``directory``, waiting out an unreachable storage; ``only``:
    just these files of it (those it holds), not the whole checkpoint."""
    if only is None:
        with_storage_retry(lambda: checkpoint.to_directory(str(directory)),
                           "checkpoint download", storage_location(checkpoint))
        return directory
    stored = StoredDirectory(checkpoint.filesystem, checkpoint.path)
    for name in only:
        if stored.exists(name):
            stored.download(name, directory / name)
    return directory


@dataclass(frozen=True)
class StoredDirectory:
    """A directory of the run's storage (a bucket, a shared or a local filesystem), read and
    written one file at a time, so that a reader takes only the files it needs; every transfer
    waits out an outage (:func:`with_storage_retry`).

    Attributes:
        filesystem: the pyarrow filesystem it is on (a checkpoint's ``filesystem``).
        path: its path on that filesystem (a checkpoint's ``path``).
    """

    filesystem: pyarrow.fs.FileSystem
    path: str

    @classmethod
    def local(cls, directory: Path) -> StoredDirectory:
        import pyarrow.fs

        return cls(pyarrow.fs.LocalFileSystem(), str(directory))

    def parent(self) -> StoredDirectory:
        return StoredDirectory(self.filesystem, posixpath.dirname(self.path.rstrip("/")))

    def location(self, name: str = "") -> str:
        """``name`` in this directory as a URI (``s3://bucket/path/name``), for messages."""
        return f"{self.filesystem.type_name}://{posixpath.join(self.path, name)}"

    def exists(self, name: str) -> bool:
        import pyarrow.fs

        info = with_storage_retry(
            lambda: self.filesystem.get_file_info(posixpath.join(self.path, name)),
            f"looking up {name}", self.location(name))
        return info.type == pyarrow.fs.FileType.File

    def read(self, name: str, parse: Callable[[Any], T]) -> T:
        """``parse`` of the file ``name``, opened for random access: a reader that seeks (a
        ``.npz`` archive) takes only the members it reads. Repeated whole while the storage is
        unreachable."""
        def action() -> T:
            with self.filesystem.open_input_file(posixpath.join(self.path, name)) as file:
                return parse(file)

        return with_storage_retry(action, f"reading {name}", self.location(name))

    def read_bytes(self, name: str) -> bytes:
        return self.read(name, lambda file: file.read())

    def download(self, name: str, target: Path) -> None:
        """The file ``name`` into the local file ``target``."""
        import pyarrow.fs

        with_storage_retry(
            lambda: pyarrow.fs.copy_files(posixpath.join(self.path, name), str(target),
                                          source_filesystem=self.filesystem,
                                          destination_filesystem=pyarrow.fs.LocalFileSystem()),
            f"downloading {name}", self.location(name))

    def upload(self, source: Path, name: str) -> None:
        """The local file ``source`` as ``name`` here (its folders made as needed); a retry
        overwrites what a failed attempt left."""
        import pyarrow.fs

        target = posixpath.join(self.path, name)

        def action() -> None:
            self.filesystem.create_dir(posixpath.dirname(target), recursive=True)
            pyarrow.fs.copy_files(str(source), target,
                                  source_filesystem=pyarrow.fs.LocalFileSystem(),
                                  destination_filesystem=self.filesystem)

        with_storage_retry(action, f"uploading {name}", self.location(name))


__all__ = ["STORAGE_RETRY_S", "StorageUnreachable", "StoredDirectory", "download",
           "is_transient", "persist_checkpoint", "storage_location", "with_storage_retry"]
