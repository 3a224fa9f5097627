"""``python -m raycl.evaluate``: a finished trial's encoder scored on a new image folder, the
scores logged into the trial's own MLflow run, its features written as ``.npy``, and bad input
refused in one line (exit 2).

The finished sweep is tests/finished_sweep.py's (no Ray, no training), shared with
tests/test_export_cli.py: each test logs under a ``--name`` of its own, so none sees another's
scores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from raycl.evaluate import main, print_table
from raycl.results.reevaluate import as_transfer
from tests.data_fixtures import write_imagenet
from tests.finished_sweep import (
    CLASSES,
    EXPERIMENT,
    PER_CLASS,
    Sweep,
    shared_sweep,
    storage_moved_away,
)


@pytest.fixture(scope="session")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    return shared_sweep(tmp_path_factory)


def _transfer(sweep: Sweep, name: str) -> dict[str, float]:
    """The ``transfer/...`` metrics of trial ``name``'s run."""
    metrics = MlflowClient(sweep.uri).get_run(sweep.run_ids[name]).data.metrics
    return {key: value for key, value in metrics.items() if key.startswith("transfer/")}


def _args(sweep: Sweep, *extra: str) -> list[str]:
    return ["--experiment", EXPERIMENT, "--tracking-uri", sweep.uri, "--no-ray",
            "--set", "data.dataset=folder", "--set", f"data.root={sweep.folder}", *extra]


def test_best_trial_scored_on_a_new_folder_into_its_own_run(
        sweep: Sweep, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "features"
    code = main(_args(sweep, "--trial", "best", "--name", "colours", "--features-out", str(out),
                      "--set", "eval.label_fractions=[0.5]"))
    assert code == 0, capsys.readouterr().err
    client = MlflowClient(sweep.uri)
    winner = client.get_run(sweep.run_ids["t02"]).data.metrics
    # Colour classes are linearly separable even by an untrained encoder's features.
    assert winner["transfer/colours/linear/mean"] >= 0.8
    for key in ("transfer/colours/knn/mean", "transfer/colours/retrieval/map",
                "transfer/colours/linear_50pct/mean"):
        assert 0.0 <= winner[key] <= 1.0, key
    assert winner["val/linear/mean"] == 0.7  # the sweep's own metrics stay as they were
    for other in ("t01", "t03"):
        assert not any(key.startswith("transfer/colours/") for key in _transfer(sweep, other))
    printed = capsys.readouterr().out
    assert "t02" in printed and "linear" in printed and "t01" not in printed
    # Features of every image, split into the probe's share and the held-out share (30 %).
    train = np.load(out / "t02" / "train_features.npy")
    test = np.load(out / "t02" / "test_features.npy")
    assert train.dtype == np.float32 and train.ndim == 2 and test.shape[1] == train.shape[1]
    assert len(train) + len(test) == len(CLASSES) * PER_CLASS
    labels = np.load(out / "t02" / "test_labels_class.npy")
    assert labels.shape == (len(test),)
    assert np.bincount(labels).tolist() == [len(test) // len(CLASSES)] * len(CLASSES)

    # --top 2 scores the two best; eval.linear_sgd (the papers' protocol) joins the scores.
    sgd = "eval.linear_sgd={epochs: 1, batch_size: 8, lrs: [0.1, 1.0]}"
    assert main(_args(sweep, "--top", "2", "--name", "top2", "--set", sgd,
                      "--no-references")) == 0, \
        capsys.readouterr().err
    for name in ("t02", "t03"):
        scores = _transfer(sweep, name)
        assert 0.0 <= scores["transfer/top2/linear_sgd/mean"] <= 1.0
        assert "transfer/top2/linear/mean" in scores
    assert not any(key.startswith("transfer/top2/") for key in _transfer(sweep, "t01"))
    # Any dataset raycl reads, also one eval.transfer does not list (an ImageNet layout).
    imagenet = write_imagenet(tmp_path / "imagenet", ["n01", "n02", "n03"], per_class_train=6)
    assert main(["--experiment", EXPERIMENT, "--tracking-uri", sweep.uri, "--no-ray",
                 "--trial", "t01", "--set", "data.dataset=imagenet",
                 "--set", f"data.root={imagenet}", "--no-references"]) == 0, \
        capsys.readouterr().err
    assert "transfer/imagenet/linear/mean" in _transfer(sweep, "t01")
    assert "transfer/imagenet/linear/mean" not in _transfer(sweep, "t02")


def test_the_logged_encoder_is_scored_once_ray_results_is_gone(
        sweep: Sweep, capsys: pytest.CaptureFixture[str]) -> None:
    with storage_moved_away(sweep):
        assert main(_args(sweep, "--trial", "t03", "--name", "no_storage")) == 0, \
            capsys.readouterr().err
        # A trial whose encoder was never logged: one line, before anything runs.
        assert main(_args(sweep, "--trial", "t05", "--name", "never")) == 2
    assert "t05 has no checkpoint" in capsys.readouterr().err
    assert _transfer(sweep, "t03")["transfer/no_storage/linear/mean"] >= 0.8
    assert not _transfer(sweep, "t05")


@pytest.mark.parametrize(("extra", "says"), [
    (["--experiment", "no-such-sweep"], "no MLflow experiment named 'no-such-sweep'"),
    (["--trial", "t09"], "has no trial 't09'"),
    (["--trial", "t05"], "t05 has no checkpoint"),  # tagged, removed since, nothing logged
    (["--set", "data.resolution=64"], "--set data.resolution: not a key of the new data"),
    (["--set", "eval.knn_k=0"], "--set eval.knn_k:"),
    (["--set", "train.lr=0.1"], "--set train.lr: not a data.* or eval.* key"),
    (["--set", "eval.transfer=[]"], "--set eval.transfer: give the data to evaluate on"),
    (["--set", "data.dataset=imagenet22k"], "--set data.dataset: expected one of"),
    (["--set", "data.root=/no/such/folder"], "--set data.root:"),
    (["--set", "data.test_fraction=1.5"], "--set data.test_fraction:"),
])
def test_bad_input_is_one_line_and_exit_2(
        sweep: Sweep, extra: list[str], says: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    before = {name: _transfer(sweep, name) for name in sweep.run_ids}
    assert main([*_args(sweep), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert {name: _transfer(sweep, name) for name in sweep.run_ids} == before  # nothing logged


@pytest.mark.parametrize(("data", "says"), [
    ([], "--set data.dataset: required"),
    (["--set", "data.dataset=folder"], "--set data: root is required when dataset is 'folder'"),
])
def test_the_new_data_is_required(sweep: Sweep, data: list[str], says: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--experiment", EXPERIMENT, "--tracking-uri", sweep.uri,
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
    args = [arg for arg in _args(sweep, "--name", "by_ray", "--features-out", str(tmp_path / "f"))
            if arg != "--no-ray"]
    assert main(args) == 0, capsys.readouterr().err
    assert "transfer/by_ray/linear/mean" in _transfer(sweep, "t02")
    assert "transfer/by_ray/linear/mean" not in _transfer(sweep, "t03")
    assert np.load(tmp_path / "f" / "t02" / "test_features.npy").ndim == 2


def test_the_papers_probe_on_new_data_reads_views_of_its_rows(monkeypatch) -> None:
    """Issue 46, finding 9: ``eval.linear_sgd`` of ``raycl.evaluate`` reads its training and
    selection rows as views of the new data's array (a memory-mapped cache in real use), never
    a copy of the whole set: an ImageNet-size folder would be copied twice inside a Ray task."""
    import raycl.eval.linear_sgd as linear_sgd
    from raycl.data import DatasetSplits, ImageRows, ImageSet
    from raycl.methods import SearchConfig
    from raycl.results.reevaluate import _linear_sgd_scores

    base = np.zeros((40, 1, 2, 2), dtype=np.uint8)
    base.setflags(write=False)
    labels = np.arange(40) % 2
    train = ImageSet(ImageRows(base, np.arange(30)), {"parity": labels[:30]})
    test = ImageSet(ImageRows(base, np.arange(30, 40)), {"parity": labels[30:]})
    splits = DatasetSplits("new", train, test, test, ["parity"], {"parity": 2}, 1, 2)
    seen: dict[str, object] = {}

    def record(encoder, train, val, load_test, *args):
        seen.update(train=train.images, val=val.images)
        return {}

    monkeypatch.setattr(linear_sgd, "evaluate_linear_sgd", record)
    config = SearchConfig.model_validate({"name": "new", "method": "simclr",
                                          "eval": {"linear_sgd": {"epochs": 1}}})
    _linear_sgd_scores(config, torch.nn.Identity(), splits, torch.device("cpu"))
    for images in (seen["train"], seen["val"]):
        assert isinstance(images, ImageRows) and images.base is base
    assert len(seen["train"]) + len(seen["val"]) == 30


# --- issue 47: the references beside a trial's score, and the rows' image ids ---------------


def test_the_untrained_encoder_and_the_pixels_are_scored_beside_the_trial(
        sweep: Sweep, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "features"
    assert main(_args(sweep, "--trial", "t01", "--name", "refs", "--features-out",
                      str(out))) == 0, capsys.readouterr().err
    scores = _transfer(sweep, "t01")
    # The fixture's t01 checkpoint is a fresh build seeded 0, its trial's seed: the untrained
    # encoder built here is that network, so it scores exactly the same.
    for family in ("linear/mean", "knn/mean", "retrieval/map"):
        assert scores[f"transfer/refs/at_init/{family}"] == scores[f"transfer/refs/{family}"]
        assert 0.0 <= scores[f"transfer/refs/pixels/{family}"] <= 1.0
    # Colour classes: their pixels alone separate them.
    assert scores["transfer/refs/pixels/linear/mean"] >= 0.8
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["trial", "t01", "t01/at_init", "pixels"]
    # Every image's id, its path under the folder, beside its features' row.
    files = sorted(path.relative_to(sweep.folder).as_posix()
                   for path in sweep.folder.rglob("*.png"))
    ids = {split: np.load(out / "t01" / f"{split}_ids.npy") for split in ("train", "test")}
    assert sorted([*ids["train"], *ids["test"]]) == files
    classes = sorted(CLASSES)  # a folder's class index: its sorted class names
    for split, names in ids.items():
        labels = np.load(out / "t01" / f"{split}_labels_class.npy")
        assert len(names) == len(labels) == len(np.load(out / "t01" / f"{split}_features.npy"))
        assert [classes.index(name.split("/")[0]) for name in names] == labels.tolist()

    # Another trial's untrained encoder is its own (seeded as its trial; t02's weights differ).
    assert main(_args(sweep, "--trial", "t02", "--name", "refs2")) == 0
    assert "transfer/refs2/at_init/linear/mean" in _transfer(sweep, "t02")


def test_no_references_scores_the_trial_alone(
        sweep: Sweep, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(sweep, "--trial", "t02", "--name", "alone", "--no-references")) == 0
    scores = _transfer(sweep, "t02")
    assert "transfer/alone/linear/mean" in scores
    assert not any(key.startswith(("transfer/alone/at_init/", "transfer/alone/pixels/"))
                   for key in scores)
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == ["trial", "t02"]


def test_pixels_over_the_limit_are_skipped_with_a_note(
        sweep: Sweep, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import raycl.results.references as references

    monkeypatch.setattr(references, "PIXEL_VALUES_LIMIT", 100)
    assert main(_args(sweep, "--trial", "t02", "--name", "few_pixels")) == 0
    scores = _transfer(sweep, "t02")
    assert "transfer/few_pixels/at_init/linear/mean" in scores
    assert not any(key.startswith("transfer/few_pixels/pixels/") for key in scores)
    out = capsys.readouterr().out
    images = len(CLASSES) * PER_CLASS
    assert f"pixels: not scored ({images} images x 768 pixel values" in out  # 3 x 16 x 16


def test_packaged_data_ids_are_rows_of_the_set_raycl_reads(sweep: Sweep) -> None:
    from raycl.data import load_image_set
    from raycl.eval.transfer import transfer_data_config
    from raycl.results.new_data import load_new_data
    from raycl.results.reevaluate import evaluation_config
    from raycl.results.trials import find_trials

    # As raycl.evaluate reads --set data.dataset=digits (sklearn's 1 797 images), without
    # embedding them: the ids are what --features-out writes beside the rows.
    (trial,) = find_trials(sweep.uri, EXPERIMENT, "t01", None)
    config = evaluation_config(trial.config, {"dataset": "digits"}, {}, "digit_ids")
    data = load_new_data(config, 3, with_ids=True)
    ids = data.ids
    assert all(values.dtype == np.int64 for values in ids.values())
    assert sorted([*ids["train"], *ids["test"]]) == list(range(1797))  # each row once
    whole = load_image_set(transfer_data_config(config, config.eval.transfer[0]),
                           config.data_seed)
    for split, rows in ids.items():
        part = data.splits.split(split)
        assert whole.labels["digit"][rows].tolist() == part.labels["digit"].tolist()
        # The same images, converted to the encoder's 3 channels.
        assert np.array_equal(np.repeat(whole.images[rows[:5]], 3, axis=1), part.images[:5])


def test_table_rows_put_each_reference_under_its_trial() -> None:
    from raycl.results.references import table_rows

    def scored(value: float) -> dict[str, float]:
        return {"transfer/x/linear/mean": value, "transfer/x/at_init/linear/mean": value / 2,
                "transfer/x/pixels/linear/mean": 0.3}

    rows = table_rows([("t01", scored(0.8)), ("t02", scored(0.6))], "x")
    assert rows == [("t01", {"transfer/x/linear/mean": 0.8}),
                    ("t01/at_init", {"transfer/x/linear/mean": 0.4}),
                    ("t02", {"transfer/x/linear/mean": 0.6}),
                    ("t02/at_init", {"transfer/x/linear/mean": 0.3}),
                    ("pixels", {"transfer/x/linear/mean": 0.3})]
