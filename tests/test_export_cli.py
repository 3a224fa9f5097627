"""``python -m raycl.export`` and ``raycl.results``: a finished trial found from MLflow, its
encoder written out, registered, and every bad input refused in one line with nothing written.

The "finished sweep" is built by hand (no Ray): an MLflow parent run and trial runs with the
tags, metrics and ``config.yaml`` artifact raycl's sweep callback writes, and checkpoints
(``state.pt`` of a freshly built tiny method) where Tune keeps them. The end-to-end sweep's
runs are checked in tests/test_end_to_end.py::test_quickstart_sweep_lands_in_mlflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import mlflow
import mlflow.pytorch
import pytest
import torch
import torchvision
import yaml
from mlflow import MlflowClient
from torch import nn

from raycl.config.search_config import SearchConfig
from raycl.export.__main__ import main
from raycl.export.encoder import trained_encoder
from raycl.launch.load import load_search
from raycl.methods import build_method
from raycl.results import TrialLookupError, find_trials, local_checkpoint
from raycl.tracking.runs import (
    CHECKPOINT_TAG,
    PARENT_TAG,
    ROLE_TAG,
    TRIAL_TAG,
    checkpoint_location,
    get_or_create_experiment,
)

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = "exported"
METRIC = "val/linear/mean"
# (run name, trial id, validation objective, checkpoint: "tag", "storage" (only in the sweep's
# storage: a run logged before the tag existed), "gone" (tagged, deleted since) or None)
TRIALS = [("t01 lr=0.1", "aa001", 0.40, "tag"), ("t02 lr=0.2", "aa002", 0.70, "tag"),
          ("t03 lr=0.3", "aa003", 0.55, "storage"), ("t04 lr=0.4", "aa004", 0.20, None),
          ("t05 lr=0.5", "aa005", 0.10, "gone")]


@dataclass
class Sweep:
    """The hand-made sweep: where it is and what each trial holds."""

    uri: str
    storage: Path
    config: SearchConfig
    run_ids: dict[str, str]  # "t01" -> run id
    checkpoints: dict[str, Path]  # "t01" -> its checkpoint directory


def trial_config(tmp: Path, lr: float, backbone: str) -> SearchConfig:
    return load_search(REPO / "searches" / "quickstart.yaml", [
        "data.samples_per_combination=1", "data.resolution=16", "model.width=8",
        f"model.backbone={backbone}", f"train.lr={lr}", f"tune.storage_path={tmp / 'ray'}",
        f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"])


def make_sweep(tmp: Path, experiment: str = EXPERIMENT, backbone: str = "resnet18") -> Sweep:
    """A finished sweep of :data:`TRIALS` in ``tmp`` (its trials train ``backbone``; a ResNet
    with the CIFAR stem at 16 px). Also the docs test's (tests/test_docs_commands.py)."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = get_or_create_experiment(client, experiment, uri)
    parent = client.create_run(experiment_id, run_name=experiment, tags={
        ROLE_TAG: "sweep", "raycl.metric": METRIC, "raycl.mode": "max"}).info.run_id
    run_ids, checkpoints = {}, {}
    best = max(range(len(TRIALS)), key=lambda i: TRIALS[i][2])
    for index, (name, trial_id, objective, kept) in enumerate(TRIALS):
        lr = float(name.split("=")[1])
        config = trial_config(tmp, lr, backbone)
        directory = tmp / "ray" / experiment / f"run_trial_{trial_id}_00000" / "checkpoint_000001"
        directory.mkdir(parents=True)
        if index == best:  # the only one whose weights are read; the others' are stand-ins
            torch.manual_seed(0)
            torch.save({"model": build_method(config, 3).state_dict()}, directory / "state.pt")
        else:
            torch.save({}, directory / "state.pt")
        older = directory.with_name("checkpoint_000000")  # an older checkpoint: never chosen
        older.mkdir()
        run = client.create_run(experiment_id, run_name=name, tags={
            PARENT_TAG: parent, ROLE_TAG: "trial", TRIAL_TAG: trial_id,
            "raycl.searched": f"train.lr={lr}", "raycl.ended": "completed"})
        run_id = run.info.run_id
        client.log_metric(run_id, METRIC, objective)
        client.log_metric(run_id, "test/linear/mean", objective - 0.05)
        path = tmp / trial_id / "config.yaml"
        path.parent.mkdir()
        path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        client.log_artifact(run_id, str(path))
        if kept in ("tag", "gone"):
            client.set_tag(run_id, CHECKPOINT_TAG, str(directory))
        if kept in (None, "gone"):
            for stale in directory.parent.iterdir():
                (stale / "state.pt").unlink(missing_ok=True)
                stale.rmdir()
        client.set_terminated(run_id)
        run_ids[name.split()[0]] = run_id
        checkpoints[name.split()[0]] = directory
    client.set_terminated(parent)
    return Sweep(uri, tmp / "ray", config, run_ids, checkpoints)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    return make_sweep(tmp_path_factory.mktemp("sweep"))


def export(sweep: Sweep, *args: str) -> int:
    return main(["--experiment", EXPERIMENT, "--tracking-uri", sweep.uri, *args])


def files_in(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


# ---------------------------------------------------------------------------------------------
# Finding trials


def test_best_is_the_highest_validation_objective_and_carries_its_config(sweep: Sweep) -> None:
    (best,) = find_trials(sweep.uri, EXPERIMENT, "best")
    assert best.run_id == sweep.run_ids["t02"] and best.label == "t02"
    assert best.checkpoint == str(sweep.checkpoints["t02"])
    assert best.config.train.lr == 0.2 and best.config.model.backbone == "resnet18"
    assert best.metrics[METRIC] == 0.70
    assert local_checkpoint(best, Path("unused")) == sweep.checkpoints["t02"]


def test_top_k_by_name_and_by_run_id(sweep: Sweep) -> None:
    # t04 and t05, the lowest, have no checkpoint: the top 3 stop before them.
    assert [t.label for t in find_trials(sweep.uri, EXPERIMENT, top=3)] == ["t02", "t03", "t01"]
    (named,) = find_trials(sweep.uri, EXPERIMENT, "t01")
    assert named.run_id == sweep.run_ids["t01"] and named.config.train.lr == 0.1
    (by_id,) = find_trials(sweep.uri, EXPERIMENT, sweep.run_ids["t01"])
    assert by_id.label == "t01"


def test_a_run_without_the_checkpoint_tag_finds_its_newest_checkpoint_in_storage(
        sweep: Sweep) -> None:
    (found,) = find_trials(sweep.uri, EXPERIMENT, "t03")
    assert found.checkpoint == str(sweep.checkpoints["t03"])  # checkpoint_000001, not ..000


@pytest.mark.parametrize(("experiment", "trial", "expected"), [
    ("exported-typo", "best", "no MLflow experiment named 'exported-typo'"),
    (EXPERIMENT, "t09", "has no trial 't09' (it has t01, t02, t03, t04, t05)"),
    (EXPERIMENT, "0" * 32, "no MLflow run 000"),
    (EXPERIMENT, "t04", "trial t04 has no checkpoint"),
    (EXPERIMENT, "latest", "expected best, a trial name (t07) or a run id"),
])
def test_lookup_errors_are_one_line(sweep: Sweep, experiment: str, trial: str,
                                    expected: str) -> None:
    with pytest.raises(TrialLookupError) as raised:
        find_trials(sweep.uri, experiment, trial)
    assert expected in str(raised.value) and "\n" not in str(raised.value)
    if experiment != EXPERIMENT:
        assert f"did you mean {EXPERIMENT}" in str(raised.value)


def test_bucket_checkpoints_keep_the_storage_scheme_and_query() -> None:
    storage = "s3://bucket/raycl?endpoint_override=localhost:9000&scheme=http"
    assert checkpoint_location("bucket/raycl/q/run_trial_1/checkpoint_000002", storage) == (
        "s3://bucket/raycl/q/run_trial_1/checkpoint_000002"
        "?endpoint_override=localhost:9000&scheme=http")
    assert checkpoint_location("/data/ray/q/c", "/data/ray") == "/data/ray/q/c"
    assert checkpoint_location("/data/ray/q/c", "file:///data/ray") == "/data/ray/q/c"


# ---------------------------------------------------------------------------------------------
# The command


def torchvision_resnet18_cifar() -> nn.Module:
    """torchvision's resnet18 built as docs/after_the_sweep.md and the model card say."""
    model = torchvision.models.resnet18()
    model.fc = nn.Identity()
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


def test_torchvision_export_loads_strictly_and_embeds_as_raycl(sweep: Sweep, tmp_path: Path,
                                                               capsys) -> None:
    out = tmp_path / "best.pt"
    assert export(sweep, "--format", "torchvision", "--out", str(out)) == 0
    assert files_in(tmp_path) == {"best.pt", "best.pt.model_card.json"}
    assert "trial t02 of exported (val/linear/mean 0.7)" in capsys.readouterr().out
    model = torchvision_resnet18_cifar()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    images = torch.rand(4, 3, 16, 16) * 2 - 1
    (best,) = find_trials(sweep.uri, EXPERIMENT, "best")
    expected = trained_encoder(sweep.checkpoints["t02"], best.config)(images)
    assert torch.allclose(model.eval()(images), expected, atol=1e-5)


def test_register_makes_a_model_that_embeds_a_batch(
        sweep: Sweep, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    client = MlflowClient(tracking_uri=sweep.uri)
    # A name that exists (its versions deleted, say) is no error: a new version, said in a line.
    client.create_registered_model("enc")
    out = tmp_path / "reg.pt"
    assert export(sweep, "--format", "safetensors", "--out", str(out), "--register", "enc") == 0
    assert "model 'enc' exists; added as version 1" in capsys.readouterr().out
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sweep.uri)
    model = mlflow.pytorch.load_model("models:/enc/1")
    images = torch.rand(3, 3, 16, 16)
    (best,) = find_trials(sweep.uri, EXPERIMENT, "best")
    expected = trained_encoder(sweep.checkpoints["t02"], best.config)(images)
    # A torch.export program (MLflow 3's pt2): any batch size, no raycl needed to load it.
    assert torch.allclose(model(images), expected, atol=1e-5)
    version = client.get_model_version("enc", "1")
    assert version.run_id == sweep.run_ids["t02"]  # logged on the trial's own run
    assert client.get_run(sweep.run_ids["t02"]).info.status == "FINISHED"  # closed as it was


@pytest.mark.parametrize(("args", "expected"), [
    (["--experiment", "nope"], "no MLflow experiment named 'nope'"),
    (["--tracking-uri", "sqlite:///{tmp}/elsewhere.db"], "elsewhere.db (no such file)"),
    (["--trial", "t09"], "has no trial 't09'"),
    (["--trial", "t04"], "trial t04 has no checkpoint"),
    (["--trial", "t05"], "trial t05 has no checkpoint ("),
    (["--format", "small_cnn"], "--format small_cnn does not fit a resnet18 trial"),
    (["--format", "open_clip"], "--format open_clip does not fit a resnet18 trial"),
    (["--out", "{tmp}/exists.pt"], "exists.pt exists; choose another path or add --force"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(sweep: Sweep, tmp_path: Path, capsys,
                                                     args: list[str], expected: str) -> None:
    (tmp_path / "exists.pt").write_text("mine")
    defaults = {"--experiment": EXPERIMENT, "--tracking-uri": sweep.uri,
                "--format": "torchvision", "--out": str(tmp_path / "new.pt")}
    given = dict(zip(args[::2], [a.format(tmp=tmp_path) for a in args[1::2]], strict=True))
    argv = [item for key, value in {**defaults, **given}.items() for item in (key, value)]
    assert main([*argv, "--register", "never"]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
    assert files_in(tmp_path) == {"exists.pt"} and (tmp_path / "exists.pt").read_text() == "mine"
    client = MlflowClient(tracking_uri=sweep.uri)
    assert not [m for m in client.search_registered_models() if m.name == "never"]


def test_force_overwrites(sweep: Sweep, tmp_path: Path) -> None:
    out = tmp_path / "best.pt"
    out.write_text("old")
    assert export(sweep, "--format", "torchvision", "--out", str(out), "--force") == 0
    assert math.isfinite(float(next(iter(torch.load(out, weights_only=True).values())).sum()))
