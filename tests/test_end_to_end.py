"""Real runs through Ray Tune -> Ray Train -> MLflow, at tiny sizes, checked by querying MLflow."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from faults import injected_fault
from mlflow import MlflowClient

from raycl.config.schema import resolve_tracking_uri
from raycl.config.search_config import SearchConfig, apply_overrides
from raycl.launch.feasibility import max_reports
from raycl.launch.identity import read_identity
from raycl.launch.load import load_search
from raycl.results import find_trials
from raycl.sweep.tuner import build_tuner
from raycl.tracking import PARENT_TAG, ROLE_TAG
from raycl.tracking.trial_table import leaderboard_rows
from raycl.tune import main

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "data.samples_per_combination=1", "data.resolution=16", "train.batch_size=64",
    "model.width=8", "model.projector_hidden_dim=32", "model.projector_dim=16",
    "eval.linear_max_iter=50", "eval.every_n_epochs=1",
    # The sweep's baseline is one more Ray task (~5 s of a 2-CPU sweep: the first trial waits
    # for its CPU), and each ended trial's encoder is rebuilt and logged by the driver: both on
    # where a test reads them (test_quickstart_sweep_lands_in_mlflow).
    "eval.baseline=false", "mlflow.log_encoder=false",
]
# For the runs that read no end-of-trial plot: the spectrum and its figures take seconds a trial.
NO_PLOTS = "eval.diagnostics=false"


def tiny_config(tmp_path: Path, search: str, *extra: str) -> SearchConfig:
    return load_search(REPO / "searches" / search, [
        *TINY, f"tune.storage_path={tmp_path / 'ray'}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *extra])


def runs_of(tmp_path: Path, experiment: str) -> tuple[MlflowClient, list, list]:
    client = MlflowClient(tracking_uri=resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment}"
    runs = client.search_runs([found.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get(ROLE_TAG) == "sweep"]
    children = [r for r in runs if r.data.tags.get(ROLE_TAG) == "trial"]
    return client, parents, children


def quickstart_args(tmp_path: Path, *extra: str) -> list[str]:
    # Evaluation only at epoch 2: epoch 1's report has no objective (Optuna and ASHA must cope).
    overrides = [arg for override in [*TINY, "train.epochs=2", "eval.every_n_epochs=2", *extra]
                 for arg in ("--set", override)]
    return [str(REPO / "searches" / "quickstart.yaml"), *overrides, "--num-samples", "2",
            "--name", "e2e-quick", "--storage", str(tmp_path / "ray"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]


def test_quickstart_sweep_lands_in_mlflow(ray_session, data_cache, tmp_path, capsys) -> None:
    code = main(quickstart_args(tmp_path, "eval.baseline=true", "mlflow.log_encoder=true"))
    assert code == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "e2e-quick: 2 trial(s)" in printed and "val/linear/mean" in printed
    assert "at init" in printed and "chance (majority class on val)" in printed

    client, parents, children = runs_of(tmp_path, "e2e-quick")
    assert len(parents) == 1 and len(children) == 2
    assert_progress_display(printed, captured.err, [c.info.run_name for c in children])
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["raycl.version"]
    # The untrained backbone, scored once for the sweep (eval.baseline, raycl.sweep.baseline),
    # is on the parent run with chance on val and its size: what the leaderboard reads first.
    assert 0.0 <= parent.data.metrics["baseline/val/linear/mean"] <= 1.0
    assert parent.data.metrics["data/val_size"] > 0
    assert 0.0 < parent.data.metrics["data/chance/color"] <= 1.0
    # ... and in the parent's last leaderboard (its description), written after it was logged.
    assert "Random init (the same backbone untrained, the same probes): " in \
        parent.data.tags["mlflow.note.content"]
    # Two trials of two knobs: too few for parameter importance, and the parent says so.
    assert parent.data.tags["raycl.importance"] == \
        "importance: needs ≥ 4 finished trials with val/linear/mean, have 2"
    for child in children:
        assert child.data.tags[PARENT_TAG] == parent.info.run_id
        assert child.info.status in ("FINISHED", "KILLED")
        params = child.data.params
        assert params["train.epochs"] == "2" and params["data.dataset"] == "trifeature"
        assert params["seed"] == "0"
        assert float(params["simclr.temperature"]) != 0.5  # sampled, not the YAML default
        history = client.get_metric_history(child.info.run_id, "train/loss")
        assert [m.step for m in history] == list(range(1, len(history) + 1))
        metrics = child.data.metrics
        assert not any(key.startswith("eval/") for key in metrics)
        if child.data.tags["raycl.ended"] == "completed":
            assert len(history) == 2
            for split in ("val", "test"):
                for attribute in ("shape", "texture", "color", "mean"):
                    assert 0.0 <= metrics[f"{split}/linear/{attribute}"] <= 1.0
                    assert 0.0 <= metrics[f"{split}/knn/{attribute}"] <= 1.0
                assert math.isclose(metrics[f"{split}/linear/mean"], sum(
                    metrics[f"{split}/linear/{a}"] for a in ("shape", "texture", "color")) / 3)
            # The test split is scored once, at the end; validation at every evaluation.
            assert len(client.get_metric_history(child.info.run_id, "test/linear/mean")) == 1
            # Chance on val and its size, with every evaluation; the baseline is the sweep's
            # (on the parent run), not each trial's.
            assert metrics["data/val_size"] > 0 and 0.0 < metrics["data/chance/color"] <= 1.0
            assert not any(key.startswith("baseline/") for key in metrics)
            # Logged by the trial after its last report (ASHA must not stop it there), through
            # the driver's relay.
            plots = {a.path for a in client.list_artifacts(child.info.run_id, "diagnostics")}
            assert "diagnostics/spectrum.png" in plots
        artifacts = [a.path for a in client.list_artifacts(child.info.run_id)]
        assert "config.yaml" in artifacts
        if child.info.status == "FINISHED":  # its encoder, logged by the driver (issue 35)
            assert child.data.tags["raycl.encoder"] == f"runs:/{child.info.run_id}/encoder"
            assert "encoder" in artifacts
    # Chance is 0.1: even two tiny epochs learn colour.
    best = max(c.data.metrics.get("val/linear/color", 0) for c in children)
    assert best > 0.3

    # The parent records the winner (chosen on validation) and that trial's test numbers.
    (winner,) = [c for c in children if c.info.run_id == parent.data.tags["raycl.best_run"]]
    for key in ("val/linear/mean", "test/linear/mean", "test/linear/shape"):
        assert parent.data.metrics[f"best/{key}"] == winner.data.metrics[key]
    assert winner.data.metrics["val/linear/mean"] == max(
        c.data.metrics.get("val/linear/mean", -1) for c in children)
    # Every trial's run says where its last checkpoint is: the winner's encoder is found from
    # MLflow alone (python -m raycl.export).
    assert all(c.data.tags.get("raycl.checkpoint") for c in children)
    (found,) = find_trials(f"sqlite:///{tmp_path / 'mlflow.db'}", "e2e-quick", "best")
    assert found.run_id == winner.info.run_id
    assert (Path(found.checkpoint) / "state.pt").is_file()

    header, rows, _ = leaderboard_rows(f"sqlite:///{tmp_path / 'mlflow.db'}", "e2e-quick")
    assert header[3:5] == ["val/linear/mean", "test/linear/mean"]
    assert "simclr.temperature" in header and "test/linear/shape" in header
    assert len(rows) == 2

    # The sweep's identity holds its data (Trifeature's key: its settings), which the re-run
    # below finds unchanged: running the same sweep again resumes it, nothing new is launched.
    assert read_identity(str(tmp_path / "ray" / "e2e-quick"))["data"] == {"data": {
        "dataset": "trifeature", "samples_per_combination": 1, "seed": 0}}
    again = main(quickstart_args(tmp_path, "eval.baseline=true", "mlflow.log_encoder=true"))
    assert again == 0
    resumed = capsys.readouterr().out
    assert "resuming sweep 'e2e-quick'" in resumed and "at init" in resumed
    _, parents, children = runs_of(tmp_path, "e2e-quick")
    assert len(parents) == 1 and len(children) == 2
    # The resumed sweep's parent had its baseline: not scored again.
    assert len(client.get_metric_history(parents[0].info.run_id,
                                         "baseline/val/linear/mean")) == 1


def assert_progress_display(out: str, err: str, names: list[str]) -> None:
    """raycl's own progress lines, in MLflow's trial names, instead of Ray's and Optuna's
    chatter (raycl.sweep.display)."""
    lines = out.splitlines()
    for name in names:
        assert sum(f"] {name}: started with " in line for line in lines) == 1, name
        assert sum(bool(re.search(rf"\] {re.escape(name)}: (finished|stopped early by ASHA)",
                                  line)) for line in lines) == 1, name
        # Evaluated at epoch 2 only: the objective to at most 4 significant digits.
        assert any(re.search(rf"\] {re.escape(name)}: epoch 2/2: val/linear/mean "
                             r"\d\.\d{1,4}, train/loss \d", line) for line in lines), name
    assert re.search(r"2 done, 0 running, 0 pending of 2 · best val/linear/mean \d\.\d{1,4} "
                     r"\(t0[12] τ=", out)
    for chatter in ("Trial status", "Checkpoint successfully created", "A new study created",
                    "tensorboard", "Tuner.restore", "╭", "run_trial_"):
        assert chatter not in out + err, chatter
    assert len(lines) < 40, out


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def assert_each_epoch_logged_once(client: MlflowClient, run_id: str, epochs: int,
                                  evaluated: list[int] | None = None) -> None:
    """A restarted trial replays epochs, yet MLflow holds every epoch exactly once (and the
    validation score of each ``evaluated`` epoch, by default every one)."""
    for key in ("train/loss", "train/lr", "train/epoch"):
        steps = [step for step, _ in _history(client, run_id, key)]
        assert steps == list(range(1, epochs + 1)), key
    steps = [step for step, _ in _history(client, run_id, "val/linear/mean")]
    assert steps == (evaluated or list(range(1, epochs + 1)))


def test_a_crashed_trial_resumes_and_a_diverged_one_fails_while_the_sweep_goes_on(
    ray_session, data_cache, tmp_path
) -> None:
    """One in-process sweep of three trials (one of them at lr=1e30), two behaviours:

    - A crash right after a report, with no checkpoint at that epoch: the restarted trial
      replays epoch 1, MLflow holds every epoch exactly once, and the trial finishes. (A Ray
      Train worker killed after a report, where the controller may or may not have registered
      that checkpoint, is test_all4one_under_data_parallelism_survives_a_worker_crash.)
    - lr=1e30 overflows within the first epoch: that trial is FAILED in MLflow with the step and
      the loss value, is not retried, and the sweep's other trials finish."""
    config = tiny_config(tmp_path, "quickstart.yaml", "train.epochs=3", "tune.num_samples=3",
                         "tune.searcher=random", "tune.scheduler.type=none",
                         "tune.search_space={train.lr: {choice: [1.0e+30, 0.002]}}",
                         "scaling.num_workers=0", "train.checkpoint_every=2",
                         "scaling.cpus_per_worker=1", "name=e2e-crash-nan", NO_PLOTS)
    marker = tmp_path / "crashed"
    with injected_fault(after_epoch=1, marker=marker):  # the first healthy trial, once
        results = build_tuner(config, None).fit()
    assert marker.read_text() == "1"
    assert all(result.error is None for result in results)
    finished = [result for result in results if result.metrics.get("epoch") == 3]
    assert len(finished) == 2
    # No checkpoint at epoch 1: the crashed trial started over, and nothing else resumed.
    assert all(result.metrics["resumed_from_epoch"] == 0 for result in finished)

    client, _, children = runs_of(tmp_path, "e2e-crash-nan")
    assert len(children) == 3
    diverged = [c for c in children if float(c.data.params["train.lr"]) > 1]
    healthy = [c for c in children if float(c.data.params["train.lr"]) < 1]
    # The seeded random sampler draws both (0.002, 1e30, 0.002).
    assert len(diverged) == 1 and len(healthy) == 2
    for child in diverged:
        assert child.info.status == "FAILED"
        assert child.data.tags["raycl.ended"] == "diverged"
        reason = child.data.tags["raycl.error"]
        assert "non-finite loss at stage 0, epoch 1, step" in reason
        assert "loss=nan" in reason or "loss=inf" in reason
        assert "train/loss" not in child.data.metrics  # no epoch was reported as trained
    for child in healthy:  # the crashed one among them
        assert child.info.status == "FINISHED"
        assert_each_epoch_logged_once(client, child.info.run_id, 3)
        assert "val/linear/mean" in child.data.metrics
        assert "test/linear/mean" in child.data.metrics


def test_quickstart_shortened_to_one_epoch(ray_session, data_cache, tmp_path, capsys) -> None:
    """The README's way to shrink a sweep: ASHA's grace period is clamped, not asserted. The
    sweep also runs issue 34's recipe (its end to end, on this sweep rather than one more):
    LARS, BYOL's per-view blur and solarization and eval.linear_sgd={epochs: 2}, through Ray
    and MLflow; each run holds the protocol's val and test scores and the learning rate each
    attribute kept."""
    args = quickstart_args(tmp_path)
    args[args.index("train.epochs=2")] = "train.epochs=1"
    args[args.index("e2e-quick")] = "e2e-one-epoch"
    for override in (NO_PLOTS, "train.optimizer=lars", "augment.blur_prob=[1.0, 0.1]",
                     "augment.solarize_prob=[0.0, 0.2]", "eval.linear_sgd={epochs: 2}"):
        args += ["--set", override]
    assert main(args) == 0
    assert "grace_period=2 exceeds the 1 report(s)" in capsys.readouterr().out
    _, _, children = runs_of(tmp_path, "e2e-one-epoch")
    assert len(children) == 2
    for child in children:
        params, metrics = child.data.params, child.data.metrics
        assert (params["train.optimizer"], params["augment.blur_prob"],
                params["augment.solarize_prob"], params["eval.linear_sgd.epochs"]) == (
            "lars", "[1.0, 0.1]", "[0.0, 0.2]", "2")
        assert math.isfinite(metrics["train/loss"])
        for split in ("val", "test"):
            for attribute in ("shape", "texture", "color", "mean"):
                assert 0.0 <= metrics[f"{split}/linear_sgd/{attribute}"] <= 1.0
        assert metrics["diag/linear_sgd_lr/shape"] == 0.1  # the one default rate
        assert "test/linear/mean" in metrics  # the closed-form probe is reported beside it


def test_fgvr_trial_pretrains_its_decoder_then_logs_retrieval_and_pictures(
    ray_session, data_cache, tmp_path
) -> None:
    """searches/fgvr_eps.yaml, shortened: the decoder phase's epochs are logged (without
    evaluation) before the joint ones, the trial counts as completed, and MLflow gets the
    retrieval metrics, the few-label probes and the reconstruction pictures."""
    config = tiny_config(tmp_path, "fgvr_eps.yaml", "train.epochs=1", "fgvr.decoder_epochs=1",
                         "fgvr.memory_size=64", "mocov2.queue_size=128", "tune.num_samples=1",
                         "tune.search_space={}", "name=e2e-fgvr")
    assert max_reports(config) == 2
    build_tuner(config, None).fit()
    client, _, children = runs_of(tmp_path, "e2e-fgvr")
    (child,) = children
    assert child.data.tags["raycl.ended"] == "completed"
    losses = client.get_metric_history(child.info.run_id, "train/reconstruction_loss")
    assert [m.step for m in losses] == [1, 2]
    assert [m.step for m in client.get_metric_history(child.info.run_id, "val/linear/mean")] == [2]
    for key in ("val/retrieval/rank1", "val/retrieval/rank5", "val/retrieval/map",
                "test/retrieval/map", "val/linear_50pct/mean", "test/linear_20pct/mean",
                "train/pair_loss"):
        assert key in child.data.metrics, key
    pictures = {a.path for a in client.list_artifacts(child.info.run_id, "diagnostics")}
    assert {"diagnostics/fgvr_triples.png", "diagnostics/fgvr_scores.png"} <= pictures


def test_clip_mcl_sweep_logs_mmvp_per_stage_and_integrated(
    ray_session, data_cache, tmp_path
) -> None:
    """searches/clip_mcl.yaml, shrunk, with a searched trainable-block count and the soup: each
    stage's and the integration's MMVP-style pairs, zero-shot and caption retrieval reach
    MLflow, selected on validation."""
    config = tiny_config(tmp_path, "clip_mcl.yaml", "train.epochs=1", "mcl.stages=2",
                         "mcl.integration=soup", "clip.tiny_width=32", "clip.tiny_layers=2",
                         "eval.mmvp_pairs=4", "tune.num_samples=1", "name=e2e-clip",
                         "tune.search_space={clip.trainable_blocks: {choice: [1, 2]}}",
                         NO_PLOTS)
    build_tuner(config, None).fit()
    _, _, children = runs_of(tmp_path, "e2e-clip")
    (child,) = children
    assert child.data.tags["raycl.ended"] == "completed"
    metrics = child.data.metrics
    for key in ("val/mmvp/mean", "test/mmvp/mean", "test/mmvp/texture", "stage0/test/mmvp/mean",
                "stage1/test/mmvp/mean", "test/zeroshot/mean", "stage0/test/zeroshot/color",
                "test/i2t/r1", "test/t2i/r10", "train/logit_scale"):
        assert key in metrics, key
        assert 0.0 <= metrics[key] <= 100.0, key
    assert child.data.params["clip.trainable_blocks"] in ("1", "2")


def test_mcl_trial_logs_every_stage_and_ami_under_data_parallelism(
    ray_session, data_cache, tmp_path, capsys, monkeypatch
) -> None:
    """The issue's command: --set pins K and N although the YAML searches them. Run as a user
    does, with the YAML's relative ``sqlite:///mlflow.db`` and storage: trials run in their own
    directories, yet their diagnostics (AMI) land in the driver's database. The trial runs MCL
    over HSCL on two Ray Train workers (DDP over gloo): the pseudo-label sampler, the
    all-reduced Bmat, the gathered loss and the sharded embedding (transfer set included) all
    run for real, every stage reports, and the trial's diagnostics and plots land in MLflow.

    A worker dies halfway through stage 1 and there are no worker retries: the trial fails, Tune
    restarts it, stage 0 (its trainer has the same run name) is restored from storage instead
    of retrained, and the trial finishes. (One trial for both: each of its worker-group starts
    costs a trial process, a controller and two workers.)"""
    monkeypatch.chdir(tmp_path)
    overrides = [*TINY, "train.epochs=1", "mcl.clusters=2", "mcl.stages=2", "mcl.base=hscl",
                 "eval.transfer=[{dataset: digits}]", "scaling.num_workers=2",
                 "scaling.cpus_per_worker=0.5", "scaling.max_failures=0", "tune.max_failures=1"]
    marker = tmp_path / "crashed"
    with injected_fault(stage=1, after_epoch=0, mid_epoch=True, marker=marker):
        code = main([str(REPO / "searches" / "mcl_k_n.yaml"),
                     *[arg for override in overrides for arg in ("--set", override)],
                     "--num-samples", "1", "--name", "e2e-mcl", "--storage", "ray"])
    assert marker.exists()
    assert code == 0
    printed = capsys.readouterr().out
    assert "--set mcl.clusters=2 pins a searched key" in printed
    client, _, children = runs_of(tmp_path, "e2e-mcl")
    (child,) = children
    assert child.info.status == "FINISHED"
    # The restarted trial ended in stage 1, having logged stage 0's one epoch once.
    assert (child.data.metrics["stage"], child.data.metrics["epoch"]) == (1, 1)
    assert len(client.get_metric_history(child.info.run_id, "stage0/train/loss")) == 1
    # Ray Train's worker group reports its checkpoints' paths: the run records the last one.
    assert (Path(child.data.tags["raycl.checkpoint"]) / "state.pt").is_file()
    assert child.data.params["mcl.clusters"] == "2" and child.data.params["mcl.stages"] == "2"
    # The YAML searches SimCLR's τ, but this MCL trial's base is HSCL: a knob its trial does
    # not read is not sampled (issue 47's conditional space), nor tagged, nor a param.
    assert "simclr.temperature" not in child.data.tags["raycl.searched"]
    assert "simclr.temperature" not in child.data.params
    metrics = child.data.metrics
    for stage in (0, 1):
        for split in ("val", "test"):
            for attribute in ("shape", "texture", "color", "mean"):
                assert f"stage{stage}/{split}/linear/{attribute}" in metrics
    # The integrated representation: validation at every stage, test once at the very end.
    assert "val/linear/mean" in metrics and "test/linear/mean" in metrics
    assert len(client.get_metric_history(child.info.run_id, "test/linear/mean")) == 1
    # Adjusted for chance: about 0 for unrelated clusterings (MCL's stages are meant to find
    # other features), slightly below 0 as often as above, and at most 1.
    assert -0.1 <= metrics["mcl/ami/stage0_stage1"] <= 1.0
    assert metrics["mcl/groups"] == 2
    # Stage 1 used the pseudo-label sampler; how groups filled batches is logged.
    assert metrics["stage1/train/sampler_groups"] == 2
    assert metrics["stage1/train/sampler_pure_batches"] >= 1
    for key in ("transfer/digits/linear/digit", "stage1/transfer/digits/linear/digit",
                "diag/effective_rank", "diag/projection_effective_rank"):
        assert math.isfinite(metrics[key]), key
    artifacts = {a.path for a in client.list_artifacts(child.info.run_id, "diagnostics")}
    assert {"diagnostics/ami_matrix.json", "diagnostics/mcl_diagnostics.png",
            "diagnostics/group_sizes.txt", "diagnostics/spectrum.png",
            "diagnostics/principal_angles.png"} <= artifacts
    ami = json.loads(Path(client.download_artifacts(
        child.info.run_id, "diagnostics/ami_matrix.json", str(tmp_path))).read_text())
    assert len(ami) == 2 and ami[0][0] == pytest.approx(1.0)
    assert_concat_exports_as_evaluated(tmp_path, Path(child.data.tags["raycl.checkpoint"]))


def assert_concat_exports_as_evaluated(tmp_path: Path, checkpoint: Path) -> None:
    """Issue 35: the trial's last checkpoint keeps stage 0's backbone, so the exported concat
    encoder embeds val as raycl's evaluation integrated it (the stages' stored features)."""
    import numpy as np

    from raycl.data import load_dataset
    from raycl.data.augment import to_float
    from raycl.export.encoder import StageConcat, trained_encoder
    from raycl.worker.checkpoints import read_checkpoint
    from raycl.worker.stage_integration import integrate

    (trial,) = find_trials(f"sqlite:///{tmp_path / 'mlflow.db'}", "e2e-mcl", "best")
    encoder = trained_encoder(checkpoint, trial.config)
    assert isinstance(encoder, StageConcat) and len(encoder.stages) == 2
    restored = read_checkpoint(checkpoint)  # stage 0's features from the run's storage
    # Issue 46: the last stage's features are in no checkpoint (nothing reads them): stage 1's
    # are its own encoder's, which the last checkpoint's state holds.
    assert restored.features is None
    val = to_float(torch.from_numpy(np.asarray(
        load_dataset(trial.config.data, trial.config.seed).split("val").images)))
    with torch.no_grad():
        features = encoder(val).numpy()
        last = encoder.stages[1](val).numpy()
    expected = integrate([restored.inputs.features[0]["val"], last])
    assert np.allclose(features, expected, atol=1e-5)


def test_mcl_trial_over_budget_is_skipped_not_crashed(ray_session, data_cache, tmp_path) -> None:
    """The safety net behind the loader and the searcher: a trial that cannot train (here
    built without the loader's checks) is pruned before any training."""
    # 700 training images, b=64: M/b = 10.9 < 5^2.
    config = apply_overrides(
        tiny_config(tmp_path, "mcl_k_n.yaml", "train.epochs=1", "tune.num_samples=1",
                    "tune.search_space={}", "mcl.stages=2", "name=e2e-skip", NO_PLOTS),
        {"mcl.clusters": 5})
    results = build_tuner(config, None).fit()
    assert results[0].error is None
    assert results[0].metrics["raycl/skipped"] == 1.0
    _, _, children = runs_of(tmp_path, "e2e-skip")
    (child,) = children
    assert child.data.tags["raycl.ended"] == "skipped"
    assert "K=5, N=2" in child.data.tags["raycl.skipped"]
    assert "stage0/train/loss" not in child.data.metrics


def test_all4one_under_data_parallelism_survives_a_worker_crash(
    ray_session, data_cache, tmp_path
) -> None:
    """Two Ray Train workers (DDP over gloo) train All4One; a worker dies halfway through epoch 2
    and Ray Train restarts the group from epoch 1's checkpoint. The support set is global (each
    step enqueues both ranks' samples: 64 entries, not 32) and comes back with the checkpoint,
    so the final queue holds both epochs' samples; NN-retrieval accuracy lands in MLflow. The
    controller may not have registered epoch 1's checkpoint before the crash (a race, unlikely
    half an epoch later), so epochs may be replayed: MLflow still holds each epoch exactly once.
    Evaluated at the end only: a replayed epoch's report is dropped whole, scores included (the
    in-process crash test above replays an evaluated epoch)."""
    config = tiny_config(tmp_path, "all4one_weights.yaml", "train.epochs=2",
                         "tune.num_samples=1", "tune.search_space={}", "eval.every_n_epochs=2",
                         NO_PLOTS, "all4one.queue_size=4096", "all4one.predictor_hidden_dim=32",
                         "all4one.transformer_heads=4", "all4one.transformer_feedforward=32",
                         "scaling.num_workers=2", "scaling.cpus_per_worker=0.5",
                         "name=e2e-all4one")
    marker = tmp_path / "crashed"
    # Mid-epoch rather than right after the report: the half epoch gives the controller's 0.25 s
    # poll (tests/local_servers.TRAIN_POLL) time to register epoch 1's checkpoint, with no
    # settling sleep; either outcome passes (see below).
    with injected_fault(after_epoch=1, mid_epoch=True, marker=marker):
        results = build_tuner(config, None).fit()
    assert marker.read_text() == "1"
    result = results[0]
    assert result.error is None and result.metrics["epoch"] == 2
    # Normally the group resumes from epoch 1's checkpoint. If the crash beat its registration
    # (on a loaded machine Ray Train's controller can miss that report before the worker dies),
    # the group replays from the start (0). The queue count below holds in both cases, and
    # would not if a resumed group started from an empty queue (only 640 entries); the exact
    # restore is pinned by test_reliability's in-process run.
    assert result.metrics["resumed_from_epoch"] in (0, 1)
    # Ray Train's checkpoints sort by time: the newest is the trial's last.
    newest = max((tmp_path / "ray").glob("e2e-all4one-train/*/checkpoint_*/state.pt"))
    state = torch.load(newest, weights_only=True)["model"]
    indices = state["queue.sample_index"]
    # 700 training samples, 10 global batches of 64 per epoch, 2 epochs; none lost or repeated
    # within an epoch, and the epochs draw different samples.
    assert int((indices >= 0).sum()) == 2 * 640 and int(state["queue.pointer"]) == 2 * 640
    assert len(set(indices[indices >= 0].tolist())) > 640

    client, _, children = runs_of(tmp_path, "e2e-all4one")
    (child,) = children
    metrics = child.data.metrics
    assert child.info.status == "FINISHED"
    for split in ("val", "test"):
        for key in ("color", "shape", "texture", "mean"):
            assert 0.0 <= metrics[f"{split}/nn_retrieval/{key}"] <= 1.0
    assert child.data.params["all4one.queue_size"] == "4096"
    assert len(client.get_metric_history(child.info.run_id, "train/redundancy_loss")) == 2
    assert_each_epoch_logged_once(client, child.info.run_id, 2, evaluated=[2])


def test_two_concurrent_mcl_trials_share_one_sqlite_store_and_one_resumes_in_stage_1(
    ray_session, data_cache, tmp_path
) -> None:
    """Two MCL trials at once: the driver logs both trials' metrics while each trial process
    writes its diagnostics into the same sqlite file. Nothing is lost to 'database is locked'.
    The first trial to finish stage 1's first epoch crashes once and resumes there: stage 0 is
    not trained again, its clustering survives the restart, and each epoch is logged once."""
    # Evaluated at each stage's end (the YAML's own setting) and without the spectrum's plots:
    # MCL's summary figure, read below, is drawn without them.
    config = tiny_config(tmp_path, "mcl_k_n.yaml", "train.epochs=2", "tune.num_samples=2",
                         "tune.search_space={}", "mcl.stages=2", "mcl.clusters=2",
                         "tune.max_concurrent_trials=2", "scaling.cpus_per_worker=1",
                         "eval.every_n_epochs=0", NO_PLOTS, "name=e2e-concurrent")
    marker = tmp_path / "crashed"
    with injected_fault(stage=1, after_epoch=1, marker=marker):
        results = build_tuner(config, None).fit()
    assert marker.exists()
    assert all(result.error is None for result in results)
    assert all(result.metrics["stage"] == 1 for result in results)
    # One trial resumed inside stage 1; the other never crashed.
    assert sorted(result.metrics["resumed_from_epoch"] for result in results) == [0, 1]
    client, _, children = runs_of(tmp_path, "e2e-concurrent")
    assert len(children) == 2
    spans = [(c.info.start_time, c.info.end_time) for c in children]
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # they overlapped
    for child in children:
        assert child.info.status == "FINISHED"
        run_id = child.info.run_id
        assert [s for s, _ in _history(client, run_id, "train/epoch")] == [1, 2, 3, 4]
        for stage in (0, 1):  # two epochs each, logged once: stage 0 was not retrained
            assert len(_history(client, run_id, f"stage{stage}/train/loss")) == 2
            assert f"stage{stage}/test/linear/mean" in child.data.metrics
        assert "mcl/ami/stage0_stage1" in child.data.metrics
        artifacts = {a.path for a in client.list_artifacts(run_id, "diagnostics")}
        assert "diagnostics/mcl_diagnostics.png" in artifacts

