"""``python -m raycl.evaluate``: a finished trial's encoder scored on a new image folder, the
scores logged into the trial's own MLflow run, its features written as ``.npy``, and bad input
refused in one line (exit 2).

The sweep is built by hand (no Ray, no training): an MLflow store with a parent run and two
trial runs, each with its ``config.yaml`` artifact and a checkpoint of a tiny SimCLR.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from PIL import Image

from raycl.config.sweep import resolve_tracking_uri
from raycl.evaluate import as_transfer, main, print_table
from raycl.launch.load import load_search
from tests.data_fixtures import class_images, write_imagenet

REPO = Path(__file__).resolve().parents[1]
# tests/test_end_to_end.py's tiny sizes.
TINY = ["data.samples_per_combination=1", "data.resolution=16", "model.width=8",
        "model.projector_hidden_dim=32", "model.projector_dim=16", "eval.linear_max_iter=50"]
EXPERIMENT = "evaluate-me"
CLASSES = ("red", "green", "blue")
PER_CLASS = 8


@dataclass
class Sweep:
    """A hand-built finished sweep: its store, its trials' run ids by name, the new folder."""

    tracking_uri: str
    runs: dict[str, str]
    checkpoints: dict[str, Path]
    folder: Path


def _write_folder(root: Path) -> None:
    """PER_CLASS noisy PNGs of each class's colour, one sub-folder per class."""
    rng = np.random.default_rng(0)
    for index, name in enumerate(CLASSES):
        images = class_images(np.full(PER_CLASS, index), 12, 12, rng)
        (root / name).mkdir(parents=True)
        for row, image in enumerate(images):
            Image.fromarray(image.transpose(1, 2, 0)).save(root / name / f"{row}.png")


def build_sweep(tmp_path: Path, experiment: str = EXPERIMENT) -> Sweep:
    """Two finished trials of ``experiment``, t00 (val 0.4) and t01 (val 0.6, the best), and a
    new image folder, under ``tmp_path`` (tests/test_docs_commands.py runs the docs' commands
    on it too)."""
    import raycl.methods  # noqa: F401
    from raycl.methods.registry import build_method

    tracking_uri = resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = load_search(REPO / "searches" / "quickstart.yaml", [
        *TINY, f"mlflow.tracking_uri={tracking_uri}",
        f"tune.storage_path={tmp_path / 'ray'}"], check_references=False)
    client = MlflowClient(tracking_uri)
    experiment_id = client.create_experiment(experiment)
    parent = client.create_run(experiment_id, run_name="sweep", tags={
        "raycl.role": "sweep", "raycl.metric": "val/linear/mean", "raycl.mode": "max"})
    runs, checkpoints = {}, {}
    for index, objective in enumerate((0.4, 0.6)):
        name = f"t{index:02d}"
        torch.manual_seed(index)
        checkpoint = tmp_path / "ray" / name / "checkpoint_000001"
        checkpoint.mkdir(parents=True)
        torch.save({"model": build_method(config, 3).state_dict()}, checkpoint / "state.pt")
        run = client.create_run(experiment_id, run_name=f"{name} lr=0.1", tags={
            "raycl.role": "trial", "mlflow.parentRunId": parent.info.run_id,
            "raycl.trial_id": f"trial{index}", "raycl.checkpoint": str(checkpoint)})
        client.log_metric(run.info.run_id, "val/linear/mean", objective)
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        client.log_artifact(run.info.run_id, str(config_file))
        client.set_terminated(run.info.run_id)
        runs[name], checkpoints[name] = run.info.run_id, checkpoint
    client.set_terminated(parent.info.run_id)
    folder = tmp_path / "new_images"
    _write_folder(folder)
    return Sweep(tracking_uri, runs, checkpoints, folder)


@pytest.fixture
def sweep(tmp_path: Path, data_cache: Path) -> Sweep:
    """A sweep of this test's own (it logs into the runs, removes files)."""
    return build_sweep(tmp_path)


@pytest.fixture(scope="module")
def read_only_sweep(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Sweep:
    """One sweep for the tests that change nothing (bad input writes nothing)."""
    return build_sweep(tmp_path_factory.mktemp("read-only-sweep"))


def _args(sweep: Sweep, *extra: str) -> list[str]:
    return ["--experiment", EXPERIMENT, "--tracking-uri", sweep.tracking_uri, "--no-ray",
            "--set", "data.dataset=folder", "--set", f"data.root={sweep.folder}", *extra]


def test_best_trial_scored_on_a_new_folder_into_its_own_run(
        sweep: Sweep, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "features"
    code = main(_args(sweep, "--trial", "best", "--name", "colours", "--features-out", str(out),
                      "--set", "eval.label_fractions=[0.5]"))
    assert code == 0, capsys.readouterr().err
    client = MlflowClient(sweep.tracking_uri)
    winner = client.get_run(sweep.runs["t01"]).data.metrics
    # Colour classes are linearly separable even by an untrained encoder's features.
    assert winner["transfer/colours/linear/mean"] >= 0.8
    for key in ("transfer/colours/knn/mean", "transfer/colours/retrieval/map",
                "transfer/colours/linear_50pct/mean"):
        assert 0.0 <= winner[key] <= 1.0, key
    assert winner["val/linear/mean"] == 0.6  # the sweep's own metrics stay as they were
    other = client.get_run(sweep.runs["t00"]).data.metrics
    assert not any(key.startswith("transfer/") for key in other)
    printed = capsys.readouterr().out
    assert "t01" in printed and "linear" in printed and "t00" not in printed
    # Features of every image, split into the probe's share and the held-out share (30 %).
    train = np.load(out / "t01" / "train_features.npy")
    test = np.load(out / "t01" / "test_features.npy")
    assert train.dtype == np.float32 and train.ndim == 2 and test.shape[1] == train.shape[1]
    assert len(train) + len(test) == len(CLASSES) * PER_CLASS
    labels = np.load(out / "t01" / "test_labels_class.npy")
    assert labels.shape == (len(test),)
    assert np.bincount(labels).tolist() == [len(test) // len(CLASSES)] * len(CLASSES)

    # --top 2 scores both trials; eval.linear_sgd (the papers' protocol) joins the scores.
    sgd = "eval.linear_sgd={epochs: 1, batch_size: 8, lrs: [0.1, 1.0]}"
    assert main(_args(sweep, "--top", "2", "--set", sgd)) == 0, capsys.readouterr().err
    for run_id in sweep.runs.values():
        scores = client.get_run(run_id).data.metrics
        assert 0.0 <= scores["transfer/folder/linear_sgd/mean"] <= 1.0
        assert "transfer/folder/linear/mean" in scores
    # Any dataset raycl reads, also one eval.transfer does not list (an ImageNet layout).
    imagenet = write_imagenet(tmp_path / "imagenet", ["n01", "n02", "n03"], per_class_train=6)
    assert main(["--experiment", EXPERIMENT, "--tracking-uri", sweep.tracking_uri, "--no-ray",
                 "--trial", "t00", "--set", "data.dataset=imagenet",
                 "--set", f"data.root={imagenet}"]) == 0, capsys.readouterr().err
    assert "transfer/imagenet/linear/mean" in client.get_run(sweep.runs["t00"]).data.metrics
    assert "transfer/imagenet/linear/mean" not in client.get_run(sweep.runs["t01"]).data.metrics



@pytest.mark.parametrize(("extra", "says"), [
    (["--experiment", "no-such-sweep"], "no MLflow experiment named 'no-such-sweep'"),
    (["--trial", "t09"], "has no trial 't09'"),
    (["--set", "data.resolution=64"], "--set data.resolution: not a key of the new data"),
    (["--set", "eval.knn_k=0"], "--set eval.knn_k:"),
    (["--set", "train.lr=0.1"], "--set train.lr: not a data.* or eval.* key"),
    (["--set", "eval.transfer=[]"], "--set eval.transfer: give the data to evaluate on"),
    (["--set", "data.dataset=imagenet22k"], "--set data.dataset: expected one of"),
    (["--set", "data.root=/no/such/folder"], "--set data.root:"),
    (["--set", "data.test_fraction=1.5"], "--set data.test_fraction:"),
])
def test_bad_input_is_one_line_and_exit_2(
        read_only_sweep: Sweep, extra: list[str], says: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_args(read_only_sweep), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    client = MlflowClient(read_only_sweep.tracking_uri)
    for run_id in read_only_sweep.runs.values():  # nothing logged
        assert not any(key.startswith("transfer/") for key in client.get_run(run_id).data.metrics)


def test_removed_checkpoint_is_one_line_before_anything_runs(
        sweep: Sweep, capsys: pytest.CaptureFixture[str]) -> None:
    (sweep.checkpoints["t01"] / "state.pt").unlink()
    assert main(_args(sweep)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t01 has no checkpoint" in err[0], err


@pytest.mark.parametrize(("data", "says"), [
    ([], "--set data.dataset: required"),
    (["--set", "data.dataset=folder"], "--set data: root is required when dataset is 'folder'"),
])
def test_the_new_data_is_required(read_only_sweep: Sweep, data: list[str], says: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--experiment", EXPERIMENT, "--tracking-uri", read_only_sweep.tracking_uri,
                 "--no-ray", *data])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_held_out_scores_are_renamed_to_the_transfer_set() -> None:
    metrics = {"test/linear/shape": 0.5, "test/linear_10pct/mean": 0.3, "val/linear/mean": 0.1,
               "test/knn/mean": 0.4, "test/retrieval/rank1": 0.2, "test/linear_sgd/mean": 0.7,
               "diag/linear_sgd_lr/shape": 0.1, "stage1/test/linear/mean": 0.6}
    assert as_transfer(metrics, "pets") == {
        "transfer/pets/linear/shape": 0.5, "transfer/pets/linear_10pct/mean": 0.3,
        "transfer/pets/knn/mean": 0.4, "transfer/pets/retrieval/rank1": 0.2,
        "transfer/pets/linear_sgd/mean": 0.7, "stage1/transfer/pets/linear/mean": 0.6}


def test_table_has_a_row_per_trial_and_a_column_per_family(
        capsys: pytest.CaptureFixture[str]) -> None:
    print_table([("t01", {"transfer/x/linear/mean": 0.91234, "transfer/x/knn/mean": 0.5,
                          "transfer/x/retrieval/map": 0.25, "transfer/x/linear/shape": 0.1}),
                 ("t00", {"transfer/x/linear/mean": 0.25})], "x")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["trial", "knn", "linear", "retrieval/map"]
    assert lines[1].split() == ["t01", "0.5000", "0.9123", "0.2500"]
    assert lines[2].split() == ["t00", "-", "0.2500", "-"]


def test_a_ray_task_scores_the_trial_into_its_run(
        sweep: Sweep, ray_session: object, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A Ray task per trial (CPU here: the session has no GPU); the features come back to the
    # driver, which logs and writes them.
    args = [arg for arg in _args(sweep, "--features-out", str(tmp_path / "f"))
            if arg != "--no-ray"]
    assert main(args) == 0, capsys.readouterr().err
    client = MlflowClient(sweep.tracking_uri)
    assert "transfer/folder/linear/mean" in client.get_run(sweep.runs["t01"]).data.metrics
    assert "transfer/folder/linear/mean" not in client.get_run(sweep.runs["t00"]).data.metrics
    assert np.load(tmp_path / "f" / "t01" / "test_features.npy").ndim == 2
