"""Checkpoints at paper scale (issue 33, finding 11): an MCL stage's frozen features are written
once, beside the checkpoints, and every later checkpoint refers to them, so a checkpoint does not
grow with the stage count every epoch; on a restore the ranks other than 0 read only what they
need; the trial process reads only the diagnostics of the final checkpoint.

What is read is counted on a pyarrow filesystem that records every byte a reader takes
(:class:`CountingFiles`), the way Ray hands a checkpoint in storage to the workers.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow
import pyarrow.fs
import pytest
import ray.train
import torch
from torch import nn

import raycl.trial.trainable
import raycl.worker.checkpoints as checkpoints
from raycl.methods import SearchConfig
from raycl.worker.checkpoints import restore, write_checkpoint
from raycl.worker.stage_integration import (
    DIAGNOSTICS_FILE,
    FEATURES_FILE,
    STAGE_FEATURES_DIR,
    STAGE_INPUTS_FILE,
    Features,
    StageInputs,
    next_stage_inputs,
)
from raycl.worker.storage import StoredDirectory

ROWS, DIM, CLUSTERS = 3000, 64, 4
SPLITS = {"train": ROWS, "val": ROWS // 4, "test": ROWS // 4}
MCL = SimpleNamespace(mcl=SimpleNamespace(clusters=CLUSTERS))  # what next_stage_inputs reads


class _CountingReader:
    """A local file that adds every byte read from it to ``counts[path]``."""

    def __init__(self, path: str, counts: Counter[str]) -> None:
        self.file, self.path, self.counts = open(path, "rb"), path, counts  # noqa: SIM115
        self.closed = False

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.counts[self.path] += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def close(self) -> None:
        self.file.close()
        self.closed = True


class CountingFiles(pyarrow.fs.FileSystemHandler):
    """The local filesystem, counting the bytes read per file (``counts``)."""

    def __init__(self) -> None:
        self.local = pyarrow.fs.LocalFileSystem()
        self.counts: Counter[str] = Counter()

    def filesystem(self) -> pyarrow.fs.FileSystem:
        return pyarrow.fs.PyFileSystem(self)

    def read_names(self) -> set[str]:
        """The base names of the files something was read from."""
        return {Path(path).name for path, count in self.counts.items() if count}

    def get_type_name(self) -> str:
        return "counting"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pyarrow.fs.FileInfo]:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pyarrow.fs.FileSelector) -> Any:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise NotImplementedError

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str) -> pyarrow.NativeFile:
        return pyarrow.PythonFile(_CountingReader(path, self.counts), mode="r")

    def open_input_file(self, path: str) -> pyarrow.NativeFile:
        return pyarrow.PythonFile(_CountingReader(path, self.counts), mode="r")

    def open_output_stream(self, path: str, metadata: Any) -> pyarrow.NativeFile:
        return self.local.open_output_stream(path)

    def open_append_stream(self, path: str, metadata: Any) -> pyarrow.NativeFile:
        return self.local.open_append_stream(path)


class RunSession:
    """A session of rank ``rank`` that resumes from the newest ``root/checkpoint_*``, read
    through ``filesystem``; its checkpoints are persisted into ``root`` (as Ray's are)."""

    device = torch.device("cpu")

    def __init__(self, root: Path, rank: int = 0, world_size: int = 1,
                 filesystem: pyarrow.fs.FileSystem | None = None) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size
        self.filesystem = filesystem or pyarrow.fs.LocalFileSystem()

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        stored = sorted(self.root.glob("checkpoint_*"))
        return (ray.train.Checkpoint(str(stored[-1]), filesystem=self.filesystem)
                if stored else None)

    def run_storage(self) -> StoredDirectory:
        return StoredDirectory(self.filesystem, str(self.root))


def stage_features(stage: int) -> Features:
    rng = np.random.default_rng(stage)
    return {split: rng.standard_normal((rows, DIM)).astype(np.float32)
            for split, rows in SPLITS.items()}


def write_epoch(root: Path, inputs: StageInputs, epoch: int, stage_complete: bool = False,
                keep: int = 2, run: bool = True) -> tuple[Path, int]:
    """One epoch's checkpoint of ``inputs.stage``, persisted as ``root/checkpoint_<n>``, and
    its size in bytes; only the newest ``keep`` are kept (Ray's ``num_to_keep``). ``run``:
    False writes it as a session without run storage does (features inline)."""
    count = len(list(root.glob("checkpoint_*"))) + len(list(root.glob(".deleted_*")))
    directory = root / f"checkpoint_{count:06d}"
    directory.mkdir(parents=True)
    model = nn.Linear(DIM, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    progress = {"stage": inputs.stage, "phase": "train", "epoch": epoch,
                "stage_complete": stage_complete}
    write_checkpoint(directory, model, optimizer,  # type: ignore[arg-type]
                     torch.amp.GradScaler("cpu", enabled=False), progress, inputs,
                     stage_features(inputs.stage) if stage_complete else None,
                     {"train/loss": 1.0 / (epoch + 1)}, None, None,
                     StoredDirectory.local(root) if run else None)
    size = sum(path.stat().st_size for path in directory.iterdir())
    for old in sorted(root.glob("checkpoint_*"))[:-keep]:
        shutil.rmtree(old)
        (root / f".deleted_{old.name}").touch()  # keeps the numbering going
    return directory, size


def three_stages(root: Path) -> list[tuple[int, int]]:
    """An MCL run of three stages, two epoch checkpoints each (before the stage's end): the
    stage and size of each."""
    inputs, written = StageInputs(), []
    for stage in range(3):
        for epoch in (1, 2):
            written.append((stage, write_epoch(root, inputs, epoch)[1]))
        inputs = next_stage_inputs(MCL, inputs, stage_features(stage),  # type: ignore[arg-type]
                                   {f"stage{stage}/test/linear/mean": 0.5},
                                   np.arange(ROWS) % CLUSTERS)
    return written


def test_a_checkpoint_does_not_grow_with_the_stage_count(tmp_path, monkeypatch) -> None:
    """Finding 11: stage 2's epoch checkpoints hold no features of stages 0 and 1 (each written
    once, beside the checkpoints, where Ray's num_to_keep deletes nothing), so they are about as
    large as stage 0's; every stage's features file is uploaded once, not every epoch."""
    uploads: list[str] = []
    original = StoredDirectory.upload
    monkeypatch.setattr(StoredDirectory, "upload",
                        lambda self, source, name: (uploads.append(name),
                                                    original(self, source, name))[1])
    root = tmp_path / "run"
    written = three_stages(root)
    kept = sorted(root.glob("checkpoint_*"))
    assert len(kept) == 2  # num_to_keep deleted stage 0's and 1's checkpoints
    for directory in kept:
        with np.load(directory / STAGE_INPUTS_FILE) as arrays:
            assert not [name for name in arrays.files if name.startswith("features_")]
            refs = json.loads(str(arrays["feature_refs"]))
        assert [ref["stage"] for ref in refs] == [0, 1]
        for ref in refs:  # the referenced files outlive the checkpoints that first named them
            assert (root / ref["file"]).is_file()

    # Stage 2's checkpoints add pseudo labels and two assignments to stage 0's (8 bytes a row
    # each), where the old format added two stages' features (1 KB a row here).
    features_bytes = sum(rows * DIM * 4 for rows in SPLITS.values())
    stage_0 = min(size for stage, size in written if stage == 0)
    stage_2 = max(size for stage, size in written if stage == 2)
    assert stage_2 - stage_0 < 0.1 * features_bytes, (stage_0, stage_2)
    assert sorted(uploads) == sorted(set(uploads)) and len(uploads) == 2  # once per stage
    assert len(list((root / STAGE_FEATURES_DIR).iterdir())) == 2


def test_the_new_format_resumes_with_the_same_stage_inputs(tmp_path) -> None:
    """After a restart, rank 0 reads back the stage inputs stage 2 trained with, the earlier
    stages' features included, from the referenced files; a referenced file that changed
    disqualifies the checkpoint (the older one is tried, then the trial fails in one line)."""
    root = tmp_path / "run"
    three_stages(root)
    expected = StageInputs()
    for stage in range(2):
        expected = next_stage_inputs(MCL, expected, stage_features(stage),  # type: ignore[arg-type]
                                     {f"stage{stage}/test/linear/mean": 0.5},
                                     np.arange(ROWS) % CLUSTERS)

    restored = restore(RunSession(root))  # type: ignore[arg-type]
    assert restored is not None
    got = restored.inputs
    assert (got.stage, restored.progress["epoch"]) == (2, 2)
    np.testing.assert_array_equal(got.pseudo_labels, expected.pseudo_labels)
    assert got.stage_metrics == expected.stage_metrics
    assert len(got.assignments) == 2 and len(got.features) == 2
    for j in range(2):
        np.testing.assert_array_equal(got.assignments[j], expected.assignments[j])
        assert sorted(got.features[j]) == sorted(SPLITS)
        for split in SPLITS:
            np.testing.assert_array_equal(got.features[j][split], expected.features[j][split])
    assert got.feature_refs.keys() == {0, 1}
    shutil.rmtree(restored.directory)

    stage_1 = root / got.feature_refs[1].file
    np.savez(stage_1, **{split: np.zeros((rows, DIM), np.float32)
                         for split, rows in SPLITS.items()})
    with pytest.raises(checkpoints.CheckpointError, match="SHA-256"):
        restore(RunSession(root))  # type: ignore[arg-type]


def test_a_rank_other_than_0_reads_no_features_on_restore(tmp_path, monkeypatch) -> None:
    """Finding 11: rank 1 resumes from the checkpoint rank 0 chose, reading its state, its stage
    inputs' small members and its metrics, never a features file: not the referenced ones, not
    the finished stage's, not the inline ones of an old-format checkpoint."""
    told: list[int] = []

    def from_rank0(tensor: torch.Tensor) -> torch.Tensor:
        told.append(int(tensor.item()))
        return torch.tensor([0])  # rank 0 chose the newest checkpoint

    monkeypatch.setattr(checkpoints, "broadcast_from_rank0", from_rank0, raising=False)
    new, old = tmp_path / "new", tmp_path / "old"
    three_stages(new)
    # A stage-complete checkpoint in the old format (inline features of stages 0 and 1).
    inputs = StageInputs()
    for stage in range(2):
        inputs = next_stage_inputs(MCL, inputs, stage_features(stage),  # type: ignore[arg-type]
                                   {}, np.arange(ROWS) % CLUSTERS)
    write_epoch(old, inputs, 2, stage_complete=True, run=False)  # as old raycl wrote it

    for root, inline in ((new, False), (old, True)):
        counting = CountingFiles()
        restored = restore(RunSession(root, rank=1, world_size=2,  # type: ignore[arg-type]
                                      filesystem=counting.filesystem()))
        assert restored is not None and told  # rank 1 took rank 0's choice
        assert restored.inputs.stage == 2
        assert restored.inputs.features == [{}, {}]
        np.testing.assert_array_equal(restored.inputs.pseudo_labels, inputs.pseudo_labels)
        assert set(restored.state) == {"model", "optimizer", "scaler"}
        read = counting.read_names()
        assert read <= {"progress.json", "state.pt", "stage_inputs.npz", "metrics.json"}, read
        assert FEATURES_FILE not in read and DIAGNOSTICS_FILE not in read
        assert not [path for path in counting.counts if STAGE_FEATURES_DIR in path]
        archive = next(path for path in counting.counts if path.endswith(STAGE_INPUTS_FILE))
        stored_inline = sum(rows * DIM * 4 for rows in SPLITS.values()) * 2
        assert counting.counts[archive] < 0.1 * stored_inline, inline
        assert list(restored.directory.iterdir()) == []

        # Rank 0 of the same run reads the features (what the counting shows is real).
        rank0 = CountingFiles()
        full = restore(RunSession(root, filesystem=rank0.filesystem()))  # type: ignore[arg-type]
        assert full is not None and sorted(full.inputs.features[1]) == sorted(SPLITS)
        assert sum(rank0.counts.values()) > stored_inline


def test_the_trial_process_reads_only_the_diagnostics_of_the_final_checkpoint(
    tmp_path, monkeypatch
) -> None:
    """Finding 11: after ``trainer.fit()`` the trial process plots the worker's diagnostics; it
    no longer downloads the final checkpoint's state and features to do so."""
    final = tmp_path / "run" / "checkpoint_000009"
    final.mkdir(parents=True)
    (final / "state.pt").write_bytes(b"\0" * 100_000)
    np.savez(final / FEATURES_FILE, train=np.zeros((1000, 64), np.float32))
    np.savez(final / DIAGNOSTICS_FILE, spectrum=np.ones(8))
    counting = CountingFiles()

    class Trainer:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def fit(self) -> Any:
            return SimpleNamespace(metrics={"epoch": 1}, checkpoint=ray.train.Checkpoint(
                str(final), filesystem=counting.filesystem()))

    monkeypatch.setattr(raycl.trial.trainable, "TorchTrainerWithoutDatasets", Trainer)
    config = SearchConfig.model_validate({"name": "final", "scaling": {"num_workers": 1}})
    output = raycl.trial.trainable.fit_trial(config, str(tmp_path / "storage"))
    assert output.checkpoint_dir is not None
    assert counting.read_names() == {DIAGNOSTICS_FILE}
    with np.load(output.checkpoint_dir / DIAGNOSTICS_FILE) as arrays:
        np.testing.assert_array_equal(arrays["spectrum"], np.ones(8))
    shutil.rmtree(output.checkpoint_dir)


def test_a_trial_resumes_from_the_new_format_as_from_the_old(
    data_cache, tmp_path, one_torch_thread
) -> None:
    """Through the worker loop: an old MCL checkpoint (stage 0 complete, its features inline)
    resumes with run storage, stage 1's checkpoints refer to stage 0's features written once,
    and a second restart from stage 1's first checkpoint trains its last epoch as the old,
    uninterrupted run did (same loss, same batches of the same pseudo labels)."""
    from test_checkpoint_compat import FIXTURES, trial
    from test_reliability import StoredSession

    from raycl.worker.context import TrialContext
    from raycl.worker.loop import run_trial_loop

    class RunStoredSession(StoredSession):
        def run_storage(self) -> StoredDirectory:
            return StoredDirectory.local(self.root)

    old = trial("mcl")
    config = SearchConfig.model_validate(old["config"])
    root = tmp_path / "run"
    root.mkdir()
    shutil.copytree(FIXTURES / "mcl" / "checkpoint_000001", root / "checkpoint_000000")
    run_trial_loop(TrialContext(config=config), RunStoredSession(root))
    written = sorted(root.glob("checkpoint_*"))[1:]
    assert len(written) == 2
    for directory in written:
        with np.load(directory / STAGE_INPUTS_FILE) as arrays:
            assert "feature_refs" in arrays.files
            assert not [name for name in arrays.files if name.startswith("features_")]
    assert len(list((root / STAGE_FEATURES_DIR).iterdir())) == 1

    shutil.rmtree(written[-1])  # the restart comes after stage 1's first epoch
    session = RunStoredSession(root)
    run_trial_loop(TrialContext(config=config), session)
    want = old["reports"][3]
    [got] = session.reports
    assert (got["stage"], got["epoch"], got["resumed_from_epoch"]) == (1, 2, 1)
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4)
    for key in [key for key in want if key.startswith("train/sampler_")]:
        assert got[key] == want[key], key
    for key in ("val/linear/mean", "test/linear/mean", "test/knn/mean"):
        assert got[key] == pytest.approx(want[key], abs=0.02), key


def test_stage_features_and_a_rank_share_round_trip_through_a_bucket(tmp_path, monkeypatch) -> None:
    """The same on S3 (moto's server): stage features uploaded once under the run's prefix, a
    checkpoint there restored by rank 0 with them and by rank 1 without them."""
    import boto3
    from local_servers import free_port
    from moto.server import ThreadedMotoServer

    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=f"http://{endpoint}").create_bucket(Bucket="runs")
        bucket = pyarrow.fs.S3FileSystem(endpoint_override=endpoint, scheme="http",
                                         region="us-east-1")
        local = tmp_path / "run"
        three_stages(local)
        newest = sorted(local.glob("checkpoint_*"))[-1]
        trial = StoredDirectory(bucket, "runs/trial")
        for folder in (newest, local / STAGE_FEATURES_DIR):
            for file in folder.iterdir():
                trial.upload(file, f"{folder.name}/{file.name}")

        class BucketSession(RunSession):
            def latest_checkpoint(self) -> ray.train.Checkpoint:
                return ray.train.Checkpoint(f"runs/trial/{newest.name}", filesystem=bucket)

        monkeypatch.setattr(checkpoints, "broadcast_from_rank0", lambda t: torch.tensor([0]))
        rank0 = restore(BucketSession(local))  # type: ignore[arg-type]
        rank1 = restore(BucketSession(local, rank=1, world_size=2))  # type: ignore[arg-type]
        assert rank0 is not None and rank1 is not None
        np.testing.assert_array_equal(rank0.inputs.features[1]["train"],
                                      stage_features(1)["train"])
        assert rank1.inputs.features == [{}, {}] and rank1.inputs.feature_refs.keys() == {0, 1}
        np.testing.assert_array_equal(rank1.inputs.pseudo_labels, rank0.inputs.pseudo_labels)
    finally:
        server.stop()


def stored_features(root: Path) -> list[Path]:
    """Every stage-features file under ``root``: a checkpoint's ``features.npz`` or a file of
    ``stage_features/``."""
    return sorted([*root.glob(f"checkpoint_*/{FEATURES_FILE}"),
                   *root.glob(f"{STAGE_FEATURES_DIR}/*")])


def test_a_checkpoint_holds_only_the_features_something_reads(
    data_cache, tmp_path, one_torch_thread
) -> None:
    """Issue 46, finding 4: a single-stage trial's checkpoints hold no features (nothing reads
    them: at ImageNet scale ~11 GB uploaded per trial), and the finished trial restarted still
    reports its result; a 2-stage MCL (concat) trial keeps stage 0's features, every split,
    in stage 0's last checkpoint (a trial resumed there clusters them for stage 1, whose
    evaluation integrates them), referenced once from stage 1's, and none of stage 1's."""
    from test_reliability import TINY, StoredSession

    from raycl.worker.context import TrialContext
    from raycl.worker.loop import run_trial_loop

    class RunStoredSession(StoredSession):
        def run_storage(self) -> StoredDirectory:
            return StoredDirectory.local(self.root)

    def run(root: Path, extra: dict[str, Any]) -> RunStoredSession:
        session = RunStoredSession(root)
        config = SearchConfig.model_validate({**TINY, **extra,
                                              "train": {**TINY["train"], "epochs": 2}})
        run_trial_loop(TrialContext(config=config), session)
        return session

    single = tmp_path / "single"
    final = run(single, {}).reports[-1]
    assert len(list(single.glob("checkpoint_*"))) == 2
    assert stored_features(single) == []
    again = run(single, {})  # restarted after its last checkpoint: nothing to train
    assert [report["test/linear/mean"] for report in again.reports] == [final["test/linear/mean"]]

    mcl = tmp_path / "mcl"
    extra = {"method": "mcl", "mcl": {"stages": 2, "clusters": 2, "integration": "concat"}}
    reference = run(mcl, extra).reports[-1]
    checkpoints = [(json.loads((path / "progress.json").read_text()), path)
                   for path in sorted(mcl.glob("checkpoint_*"))]
    [boundary] = [path for progress, path in checkpoints
                  if progress["stage"] == 0 and progress["stage_complete"]]
    assert [path for path in stored_features(mcl) if path.parent.name != STAGE_FEATURES_DIR] \
        == [boundary / FEATURES_FILE]
    with np.load(boundary / FEATURES_FILE) as arrays:
        assert {"train", "val", "test"} <= set(arrays.files)
    assert len(list((mcl / STAGE_FEATURES_DIR).iterdir())) == 1  # stage 0's, referenced
    # A restart at the stage boundary clusters the stored features and ends as before.
    for _, path in checkpoints:
        if path.name > boundary.name:
            shutil.rmtree(path)
    resumed = run(mcl, extra).reports[-1]
    assert resumed["stage"] == 1
    assert resumed["train/loss"] == pytest.approx(reference["train/loss"], rel=1e-4)
    assert resumed["test/linear/mean"] == pytest.approx(reference["test/linear/mean"], abs=0.02)


def test_a_finished_stage_keeps_what_its_integration_reads() -> None:
    """Issue 46, finding 4: after the last stage (a single stage's too) no features go into a
    checkpoint; before another, ``concat`` keeps every split (the later stages integrate them)
    and a ``soup`` only ``train`` (the next stage's clustering): it integrates the stages'
    weights, so stage 1 carries (and stores beside its checkpoints) none of stage 0's."""
    from raycl.worker.stage_integration import checkpointed_features

    features = stage_features(0)
    single = SearchConfig.model_validate({"name": "single"})
    assert checkpointed_features(single, 0, features) is None
    for integration, kept in (("concat", sorted(SPLITS)), ("soup", ["train"])):
        config = SearchConfig.model_validate({
            "name": integration, "method": "mcl",
            "mcl": {"stages": 2, "clusters": CLUSTERS, "integration": integration}})
        assert checkpointed_features(config, 1, features) is None
        assert sorted(checkpointed_features(config, 0, features) or {}) == kept
        weights = {"w": torch.zeros(2)}
        inputs = next_stage_inputs(config, StageInputs(), features, {},
                                   np.arange(ROWS) % CLUSTERS, weights)
        assert sorted(inputs.features[0]) == (sorted(SPLITS) if integration == "concat" else [])
        # Without kept weights (older raycl) a soup is integrated as concat: features kept.
        inputs = next_stage_inputs(config, StageInputs(), features, {},
                                   np.arange(ROWS) % CLUSTERS)
        assert sorted(inputs.features[0]) == sorted(SPLITS)
