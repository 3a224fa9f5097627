"""Stream mode's image files (issue 23): FileRows decodes the rows it is indexed by, a bad file's
row is filled and named, and image folders / ImageNet roots are listed and decoded from a bucket
(moto's S3 server on loopback) exactly as from the same tree on disk. No Ray."""

from __future__ import annotations

import logging
import pickle
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from data_fixtures import write_imagenet
from PIL import Image

from raycl.config.training import DataConfig
from raycl.data.decode import decode_square
from raycl.data.sources.folders import (
    READER,
    folder_class_counts,
    folder_fingerprint,
    image_folder_files,
    resolve_layout,
)
from raycl.data.sources.imagenet import IMAGENET_READER
from raycl.data.stream.files import FileRows, decode_batch, decode_paths, spare_batches
from raycl.data.unreadable import unreadable_images_problem

RESOLUTION = 8
BUCKET = "raycl-stream"


def write_folder(root: Path, classes: dict[str, int], seed: int = 0) -> list[Path]:
    """``root/<class>/<n>.png`` (and one JPEG per class), random pixels, not square (the decode
    crops); the files in listing order."""
    rng = np.random.default_rng(seed)
    files = []
    for name, count in sorted(classes.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for n in range(count):
            pixels = rng.integers(0, 256, (11 + n, 14, 3), dtype=np.uint8)
            path = root / name / (f"{n}.jpg" if n == 0 else f"{n}.png")
            Image.fromarray(pixels).save(path)
            files.append(path)
    return sorted(files)


def decoded_one_by_one(paths: list[Path]) -> np.ndarray:
    return np.stack([decode_square(path.read_bytes(), RESOLUTION) for path in paths])


@pytest.fixture
def folder(tmp_path: Path) -> list[Path]:
    return write_folder(tmp_path / "flat", {"cat": 3, "dog": 3})


# --- FileRows and decode_paths ----------------------------------------------------------------

def test_file_rows_indexing_decodes_exactly_those_files(folder: list[Path]) -> None:
    expected = decoded_one_by_one(folder)
    rows = FileRows([str(path) for path in folder], RESOLUTION, threads=2)
    assert rows.shape == (6, 3, RESOLUTION, RESOLUTION) == expected.shape
    assert len(rows) == 6 and rows.dtype == np.uint8 and rows.nbytes == expected.nbytes
    np.testing.assert_array_equal(rows[4], expected[4])
    np.testing.assert_array_equal(rows[np.int64(-1)], expected[-1])
    np.testing.assert_array_equal(rows[1:5:2], expected[1:5:2])
    picks = np.array([5, 0, 0, 3])
    np.testing.assert_array_equal(rows[picks], expected[picks])
    mask = np.array([True, False, False, True, True, False])
    np.testing.assert_array_equal(rows[mask], expected[mask])
    np.testing.assert_array_equal(rows[2:4, 1], expected[2:4, 1])
    np.testing.assert_array_equal(np.asarray(rows), expected)
    np.testing.assert_array_equal(np.stack(list(rows)), expected)
    np.testing.assert_array_equal(rows.subset(picks)[:], expected[picks])
    np.testing.assert_array_equal(rows.concat(rows.subset(picks))[:],
                                  np.concatenate([expected, expected[picks]]))
    assert rows.skipped == []


def test_a_corrupt_file_is_left_blank_and_named(folder: list[Path], caplog: Any) -> None:
    bad = folder[0].parent / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    paths = [folder[0], bad, folder[4]]
    rows = FileRows([str(path) for path in paths], RESOLUTION)
    with caplog.at_level(logging.WARNING, logger="raycl.data.stream.files"):
        images = rows[:]
    assert not images[1].any()  # blank: the row stays aligned with its label
    np.testing.assert_array_equal(images[[0, 2]], decoded_one_by_one([folder[0], folder[4]]))
    assert rows.skipped == [str(bad)]
    assert "broken.png" in caplog.text
    rows[1]  # each indexing that meets it counts it again
    assert rows.skipped == [str(bad), str(bad)]


def test_a_training_batch_fills_unreadable_files_from_spares_never_copies(
        folder: list[Path], tmp_path: Path) -> None:
    """Issue 33 finding 6: a failed read used to become a copy of another image of the batch (a
    false negative pair). Now its row is a spare (another sample), its index the spare's."""
    bad = tmp_path / "empty.png"
    bad.write_bytes(b"")
    missing = tmp_path / "missing.png"
    paths = [str(folder[1]), str(bad), str(folder[2]), str(missing)]
    blank = decode_paths(paths, RESOLUTION, threads=2)
    assert not blank.images[[1, 3]].any() and blank.rows == [1, 3]
    assert blank.skipped == [str(bad), str(missing)] and "missing.png" in blank.reasons[1]
    spares = [str(missing), str(folder[4]), str(folder[5])]  # the first spare fails too
    batch = decode_batch(paths, np.array([1, 90, 2, 91]), spares, np.array([92, 4, 5]),
                         RESOLUTION)
    np.testing.assert_array_equal(batch.images, decoded_one_by_one(
        [folder[1], folder[4], folder[2], folder[5]]))
    assert batch.index.tolist() == [1, 4, 2, 5]  # captions and pseudo labels follow the pixels
    assert len({image.tobytes() for image in batch.images}) == 4  # no row a copy of another
    assert batch.skipped == [str(bad), str(missing), str(missing)]
    with pytest.raises(RuntimeError, match=r"more than its 1 spares.*empty\.png"):
        decode_batch(paths, np.arange(4), [str(folder[4])], np.array([4]), RESOLUTION)
    assert [spare.tolist() for spare in spare_batches([np.array([0, 1]), np.array([2, 3]),
                                                       np.array([4, 5])])] == [[2, 3], [4, 5],
                                                                               [2, 3]]


def test_file_rows_pickle_as_their_file_names(folder: list[Path]) -> None:
    many = [str(path) for path in folder] * 200  # 1200 rows: decoded, 230 kB at 8 px
    rows = FileRows(many, RESOLUTION, threads=3)
    pickled = pickle.dumps(rows)
    assert len(pickled) < 2 * sum(map(len, set(many))) + 40 * len(many) < rows.nbytes
    back = pickle.loads(pickled)
    assert isinstance(back, FileRows) and back.shape == rows.shape and back.threads == 3
    assert list(back.paths) == many
    np.testing.assert_array_equal(back[:6], decoded_one_by_one(folder))


# --- Folders in a bucket (moto's S3 server) ---------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """moto's S3 server with one bucket holding a flat folder, a train_test folder and an
    ImageNet root (each also on disk): ``local`` (directory), ``uri`` (prefix; the endpoint in
    the URI's query, as pyarrow reads it), ``endpoint``."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    local = tmp_path_factory.mktemp("bucket")
    write_folder(local / "flat", {"cat": 3, "dog": 2, "emu": 1})
    write_folder(local / "split" / "train", {"cat": 3, "dog": 2}, seed=1)
    write_folder(local / "split" / "test", {"cat": 1, "dog": 2}, seed=2)
    write_imagenet(local / "imagenet", ["n01440764", "n02102040", "n02979186"],
                   per_class_train=2, per_class_val=1, size=8)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.delenv("AWS_ENDPOINT_URL", raising=False)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
        port = _free_port()
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        try:
            client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
            client.create_bucket(Bucket=BUCKET)
            for path in sorted(local.rglob("*")):
                if path.is_file():
                    client.upload_file(str(path), BUCKET, path.relative_to(local).as_posix())
            query = f"?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
            yield SimpleNamespace(local=local, endpoint=f"http://127.0.0.1:{port}",
                                  uri=lambda name: f"s3://{BUCKET}/{name}{query}")
        finally:
            server.stop()


def _relative(path: Any, root: str) -> str:
    """A row's path relative to its root: the part after the root, for a URI or a Path."""
    text = str(path).split("?")[0]
    return text.split(f"/{root}/", 1)[1]


@pytest.mark.parametrize(("name", "layout"), [("flat", "flat"), ("split", "train_test")])
def test_a_folder_in_a_bucket_lists_and_decodes_as_on_disk(bucket: SimpleNamespace, name: str,
                                                           layout: str) -> None:
    uri, local = bucket.uri(name), bucket.local / name
    assert resolve_layout(uri) == resolve_layout(local) == layout
    assert folder_class_counts(uri) == folder_class_counts(local)
    remote, on_disk = image_folder_files(uri), image_folder_files(local)
    assert all(isinstance(path, str) and path.startswith(f"s3://{BUCKET}/{name}/")
               for path in remote.paths)
    assert ([_relative(path, name) for path in remote.paths]
            == [_relative(path, name) for path in on_disk.paths])
    np.testing.assert_array_equal(remote.labels["class"], on_disk.labels["class"])
    if layout == "train_test":
        np.testing.assert_array_equal(remote.test_mask, on_disk.test_mask)
    # Stream mode decodes from the bucket; memory mode's cache build reads it too.
    from_bucket = FileRows(remote.paths, RESOLUTION, threads=2)[:]
    np.testing.assert_array_equal(from_bucket, FileRows(on_disk.paths, RESOLUTION)[:])
    np.testing.assert_array_equal(decode_square(remote.paths[0], RESOLUTION),
                                  decode_square(on_disk.paths[0], RESOLUTION))
    # The memory-mode cache key: the listing's relative paths and sizes (no object read).
    fingerprint = folder_fingerprint(uri)
    assert [entry[:2] for entry in fingerprint] == [entry[:2]
                                                    for entry in folder_fingerprint(local)]
    assert all(entry[2] > 0 for entry in fingerprint)
    key = READER.content_key(DataConfig(dataset="folder", root=uri), seed=0)
    assert key["root"] == uri and key["files"] == fingerprint


def test_an_imagenet_root_in_a_bucket_reads_as_on_disk(bucket: SimpleNamespace) -> None:
    remote_cfg = DataConfig(dataset="imagenet", root=bucket.uri("imagenet"))
    local_cfg = DataConfig(dataset="imagenet", root=str(bucket.local / "imagenet"))
    assert IMAGENET_READER.check(remote_cfg) is None
    assert IMAGENET_READER.class_counts(remote_cfg) == IMAGENET_READER.class_counts(local_cfg)
    remote, on_disk = IMAGENET_READER.read(remote_cfg, 0), IMAGENET_READER.read(local_cfg, 0)
    np.testing.assert_array_equal(remote.labels["class"], on_disk.labels["class"])
    np.testing.assert_array_equal(remote.test_mask, on_disk.test_mask)
    assert ([_relative(path, "imagenet") for path in remote.paths]
            == [_relative(path, "imagenet") for path in on_disk.paths])
    np.testing.assert_array_equal(FileRows(remote.paths, RESOLUTION)[:],
                                  FileRows(on_disk.paths, RESOLUTION)[:])
    assert IMAGENET_READER.content_key(remote_cfg, 0)["root"] == remote_cfg.root


def test_the_endpoint_may_come_from_aws_endpoint_url(bucket: SimpleNamespace,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    plain = f"s3://{BUCKET}/flat"
    files = image_folder_files(plain)
    assert files.paths[0] == f"{plain}/cat/0.jpg"
    assert folder_class_counts(plain) == folder_class_counts(bucket.local / "flat")
    np.testing.assert_array_equal(FileRows(files.paths[:2], RESOLUTION)[:],
                                  decoded_one_by_one(sorted((bucket.local / "flat").rglob(
                                      "*.*"))[:2]))


def test_an_unreadable_bucket_is_one_line(bucket: SimpleNamespace) -> None:
    uri = bucket.uri("flat").replace(BUCKET, "no-such-bucket")
    for listing in (folder_class_counts, image_folder_files, resolve_layout):
        with pytest.raises(ValueError, match=r"^cannot list 's3://no-such-bucket/"
                                             r"flat\?[^']*': .*bucket does not exist") as error:
            listing(uri)
        assert "\n" not in str(error.value)
    with pytest.raises(FileNotFoundError, match=r"image folder 's3://raycl-stream/nothing"):
        folder_class_counts(bucket.uri("nothing"))


def test_an_unreadable_bucket_fails_the_config_before_launch(bucket: SimpleNamespace,
                                                             tmp_path: Path) -> None:
    from raycl.config.schema import ConfigError
    from raycl.launch.load import load_search

    uri = bucket.uri("flat").replace(BUCKET, "no-such-bucket")
    search = tmp_path / "search.yaml"
    search.write_text(f"name: t\nmethod: simclr\ntrain: {{epochs: 1, batch_size: 4}}\n"
                      f"tune: {{num_samples: 1}}\n"
                      f"data: {{dataset: folder, loader: stream, root: '{uri}'}}\n")
    with pytest.raises(ConfigError) as error:
        load_search(search)
    assert str(error.value).startswith(f"{search}: data.root: cannot list '{uri}': ")
    assert "\n" not in str(error.value)


def test_headers_of_a_bucket_are_sampled(bucket: SimpleNamespace, tmp_path: Path) -> None:
    remote = image_folder_files(bucket.uri("flat")).paths
    assert unreadable_images_problem(remote) is None
    broken = bucket.uri("flat").replace("/flat?", "/flat/emu/zz.png?")
    many = remote * 12 + [broken]  # 73 files: 64 read, evenly spread, the last one included
    problem = unreadable_images_problem(many)
    assert problem is not None and "zz.png" in problem
    assert "(1 of 64 sampled of 73 image files unreadable): set data.skip_unreadable" \
        in problem
    # Local files are all read, as before.
    local = sorted((bucket.local / "flat").rglob("*.*"))
    (tmp_path / "bad.png").write_bytes(b"nope")
    assert "(1 of 7 image files unreadable)" in unreadable_images_problem(
        [*local, tmp_path / "bad.png"])
