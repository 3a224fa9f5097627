"""``python -m raycl.export`` and ``raycl.results``: a finished trial found from MLflow, its
encoder written out, registered, read back from the encoder the sweep logged into its run (once
``ray_results/`` is gone), and every bad input refused in one line with nothing written.

The finished sweep is tests/finished_sweep.py's, shared with tests/test_evaluate_cli.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import mlflow
import mlflow.pytorch
import pytest
import torch
import torchvision
from mlflow import MlflowClient
from torch import nn

import raycl
from raycl.export.__main__ import main
from raycl.export.encoder import trained_encoder
from raycl.export.run_artifact import ENCODER_TAG
from raycl.results import TrialLookupError, find_trials, local_checkpoint
from raycl.tracking.runs import (
    ENDED_TAG,
    PARENT_TAG,
    ROLE_TAG,
    TRIAL_TAG,
    checkpoint_location,
)
from tests.finished_sweep import (
    EXPERIMENT,
    METRIC,
    Sweep,
    shared_sweep,
    storage_moved_away,
)


@pytest.fixture(scope="session")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    return shared_sweep(tmp_path_factory)


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
    ("finished-typo", "best", "no MLflow experiment named 'finished-typo'"),
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


def test_best_among_no_finished_trial_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every trial failed, was killed or still runs: none may be ranked, whatever its last
    objective; ``--trial best`` of raycl.export and raycl.evaluate says so in one line naming the
    experiment, exit 2, nothing written."""
    from raycl.evaluate import main as evaluate_main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("unfinished")
    parent = client.create_run(experiment_id, tags={
        ROLE_TAG: "sweep", "raycl.metric": METRIC, "raycl.mode": "max"}).info.run_id
    for index, (status, ended) in enumerate((("FAILED", "diverged"), ("KILLED", "interrupted"),
                                             ("RUNNING", None)), start=1):
        run_id = client.create_run(experiment_id, run_name=f"t0{index}", tags={
            ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: f"bb00{index}",
            **({ENDED_TAG: ended} if ended else {})}).info.run_id
        client.log_metric(run_id, METRIC, 0.9)
        if status != "RUNNING":
            client.set_terminated(run_id, status=status)
    said = (f"error: no finished trial of experiment 'unfinished''s latest sweep has reported "
            f"{METRIC} yet (3 failed, killed or still running: never ranked)\n")
    common = ["--experiment", "unfinished", "--tracking-uri", uri]
    assert main([*common, "--format", "torchvision", "--out", str(tmp_path / "best.pt")]) == 2
    assert capsys.readouterr().err == said
    assert evaluate_main([*common, "--no-ray", "--set", "data.dataset=folder",
                          "--set", f"data.root={tmp_path}"]) == 2
    assert capsys.readouterr().err == said
    assert evaluate_main([*common, "--top", "2", "--no-ray", "--set", "data.dataset=folder",
                          "--set", f"data.root={tmp_path}"]) == 2
    assert capsys.readouterr().err == said
    assert not (tmp_path / "best.pt").exists()


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
    assert f"trial t02 of {EXPERIMENT} (val/linear/mean 0.7)" in capsys.readouterr().out
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


# ---------------------------------------------------------------------------------------------
# The encoder logged into each trial's run


def test_trials_that_ended_with_a_checkpoint_have_their_encoder_in_their_run(
        sweep: Sweep, tmp_path: Path) -> None:
    client = MlflowClient(tracking_uri=sweep.uri)
    # t01, t02 completed, t03 stopped early by ASHA (its checkpoint found in storage: no tag).
    for name, objective, lr in (("t01", 0.40, 0.1), ("t02", 0.70, 0.2), ("t03", 0.55, 0.3)):
        run_id = sweep.run_ids[name]
        assert client.get_run(run_id).data.tags[ENCODER_TAG] == f"runs:/{run_id}/encoder"
        assert {item.path for item in client.list_artifacts(run_id, "encoder")} == {
            "encoder/encoder.safetensors", "encoder/encoder.safetensors.model_card.json"}
        card = json.loads(Path(client.download_artifacts(
            run_id, "encoder/encoder.safetensors.model_card.json", str(tmp_path))).read_text())
        assert card["format"] == "safetensors" and card["backbone"] == "resnet18"
        assert card["validation_objective"] == {"metric": METRIC, "mode": "max",
                                                "value": objective}
        assert card["test_scores"] == {"test/linear/mean": pytest.approx(objective - 0.05)}
        assert card["config"]["train"]["lr"] == lr and card["preprocessing"]["resolution"] == 16
    # t04 failed; t05's checkpoint was gone before its end: nothing logged, nothing tagged.
    for name in ("t04", "t05"):
        run = client.get_run(sweep.run_ids[name])
        assert ENCODER_TAG not in run.data.tags
        assert not client.list_artifacts(run.info.run_id, "encoder")


def test_a_trial_whose_encoder_cannot_be_logged_is_one_warning(
        sweep: Sweep, caplog: pytest.LogCaptureFixture) -> None:
    from raycl.results.run_encoder import log_ended_trial_encoder

    with caplog.at_level("WARNING"):
        assert log_ended_trial_encoder(sweep.uri, EXPERIMENT, "aa005") is None  # t05: gone
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "aa005" in warnings[0].getMessage()
    assert "not logged" in warnings[0].getMessage()


def test_the_logged_encoder_outlives_ray_results(
        sweep: Sweep, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    (best,) = find_trials(sweep.uri, EXPERIMENT, "best")
    images = torch.rand(4, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        expected = trained_encoder(sweep.checkpoints["t02"], best.config)(images)
    uri = f"runs:/{sweep.run_ids['t02']}/encoder"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sweep.uri)
    with storage_moved_away(sweep):
        encoder, pre = raycl.load_encoder(uri)
        with torch.no_grad():
            assert torch.allclose(encoder(images), expected, atol=1e-6)
        assert (pre.resolution, pre.channels, pre.mean, pre.std) == (16, 3, (0.5,) * 3,
                                                                    (0.5,) * 3)
        # A downloaded copy of the artifact folder loads the same.
        folder = mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path))
        with torch.no_grad():
            assert torch.allclose(raycl.load_encoder(folder)[0](images), expected, atol=1e-6)
        # The export command finds the trial's checkpoint gone and exports from its run.
        out = tmp_path / "from_run.pt"
        assert export(sweep, "--format", "torchvision", "--out", str(out)) == 0
        assert f"from its run's {uri} (its checkpoint is gone)" in capsys.readouterr().out
        model = torchvision_resnet18_cifar()
        model.load_state_dict(torch.load(out, weights_only=True), strict=True)
        with torch.no_grad():
            assert torch.allclose(model.eval()(images), expected, atol=1e-5)
        # A trial without a logged encoder is still one line.
        assert export(sweep, "--trial", "t05", "--format", "torchvision",
                      "--out", str(tmp_path / "t05.pt")) == 2
        assert "trial t05 has no checkpoint" in capsys.readouterr().err


def test_log_encoder_false_logs_no_encoder(sweep: Sweep, tmp_path: Path) -> None:
    from raycl.config.search_config import apply_overrides
    from raycl.results.run_encoder import RunEncoderCallback
    from tests.finished_sweep import trial_config

    config = apply_overrides(trial_config(tmp_path, 0.1, "resnet18", EXPERIMENT),
                             {"mlflow.tracking_uri": sweep.uri})
    on = RunEncoderCallback(config)
    off = RunEncoderCallback(apply_overrides(config, {"mlflow.log_encoder": False}))
    for callback in (on, off):
        callback.on_trial_complete(0, [], SimpleNamespace(trial_id="aa004"))  # t04: failed
    assert len(on._pending) == 1 and not off._pending  # nothing started when turned off
    assert on.wait(60) == 0  # t04 failed: nothing to log, and nothing logged
    assert ENCODER_TAG not in MlflowClient(sweep.uri).get_run(sweep.run_ids["t04"]).data.tags


def test_a_bucket_checkpoint_is_downloaded_whole_or_only_what_the_encoder_needs(
        sweep: Sweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from raycl.results.run_encoder import ENCODER_INPUTS
    from tests.local_servers import moto_s3

    with moto_s3(monkeypatch) as (client, port):
        client.create_bucket(Bucket="raycl-checkpoints")
        for name in ("state.pt", "features.npz", "progress.json"):
            client.put_object(Bucket="raycl-checkpoints", Key=f"q/t/checkpoint_000002/{name}",
                              Body=b"stand-in")
        (best,) = find_trials(sweep.uri, EXPERIMENT, "best")
        trial = replace(best, checkpoint="s3://raycl-checkpoints/q/t/checkpoint_000002"
                        f"?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1")
        # Into folders that do not exist yet: they are made.
        only = local_checkpoint(trial, tmp_path / "encoder", ENCODER_INPUTS)
        assert only == tmp_path / "encoder" / "checkpoint_000002"
        assert files_in(only) == {"state.pt", "progress.json"}  # no features, no stage weights
        assert files_in(local_checkpoint(trial, tmp_path / "whole")) == {
            "state.pt", "features.npz", "progress.json"}
