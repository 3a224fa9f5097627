"""Population-based training (tune.scheduler.type: pbt | pb2): what may mutate, the schedule's
fit, the mutated values winning over a checkpoint's, and one real PBT sweep through MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from raycl.config.schema import ConfigError, Domain
from raycl.config.sweep import SchedulerConfig
from raycl.launch.load import load_search
from raycl.pbt import (
    ClampToDomains,
    copy_run_files,
    exploit_summary,
    mutations,
)
from raycl.tune import main
from raycl.worker.optim import load_optimizer_state

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "searches" / "quickstart.yaml"
PBT = ["tune.scheduler.type=pbt", "eval.every_n_epochs=1"]


def problems_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_search(QUICKSTART, [*PBT, *overrides])
    return str(caught.value)


def test_pbt_mutates_the_float_knobs_of_the_search_space() -> None:
    config = load_search(QUICKSTART, PBT)  # τ and lr: both mutable
    assert config.tune.scheduler.type == "pbt"
    assert set(mutations(config)) == {"simclr.temperature", "train.lr"}


@pytest.mark.parametrize(("key", "domain", "why"), [
    ("model.width", "{choice: [8, 16]}", "model's shape"),
    ("train.batch_size", "{choice: [64, 128]}", "only float knobs are mutable"),
    ("mcl.clusters", "{randint: [2, 5]}", "MCL's stage plan"),
    ("data.resolution", "{choice: [16, 32]}", "the data"),
])
def test_shape_keys_are_refused_as_mutable(key: str, domain: str, why: str) -> None:
    message = problems_of(f"tune.search_space.{key}={domain}")
    line = next(line for line in message.splitlines() if f"tune.search_space.{key}:" in line)
    assert line.startswith(f"{QUICKSTART}: tune.search_space.{key}: not mutable under pbt: ")
    assert why in line


def test_perturbations_need_an_evaluation_and_a_checkpoint() -> None:
    message = problems_of("eval.every_n_epochs=2")
    assert ("tune.scheduler.perturbation_interval: 1 is not a multiple of "
            "eval.every_n_epochs=2") in message
    assert "tune.num_samples: pbt needs a population of at least 2" in problems_of(
        "tune.num_samples=1")
    assert "scaling.num_workers: pbt trains in the trial process only" in problems_of(
        "scaling.num_workers=1")


def test_pb2_takes_continuous_domains_only() -> None:
    load_search(QUICKSTART, [*PBT, "tune.scheduler.type=pb2"])  # loguniform τ and lr
    message = problems_of("tune.scheduler.type=pb2",
                          "tune.search_space.simclr.temperature={choice: [0.1, 0.2]}")
    assert "tune.search_space.simclr.temperature: pb2 models continuous bounds only" in message


def test_scheduler_fields_are_validated() -> None:
    with pytest.raises(ValidationError, match="quantile_fraction"):
        SchedulerConfig(type="pbt", quantile_fraction=0.6)
    with pytest.raises(ValidationError, match="perturbation factors must be above 0"):
        SchedulerConfig(type="pbt", perturbation_factors=(1.2, 0.0))


def test_cli_refuses_a_shape_key_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([str(QUICKSTART), "--set", "tune.scheduler.type=pbt", "--set",
                 "eval.every_n_epochs=1", "--set",
                 "tune.search_space.model.width={choice: [8, 16]}", "--dry-run"])
    assert code == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [f"error: {QUICKSTART}: tune.search_space.model.width: not mutable under "
                      f"pbt: it changes the model's shape or weights (an exploit copies weights "
                      f"of one shape); set it in the YAML, or search it with scheduler asha"]


def test_explored_values_stay_inside_their_domains() -> None:
    clamp = ClampToDomains({"a": Domain(uniform=(0.0, 0.5)), "b": Domain(loguniform=(0.1, 1.0)),
                            "c": Domain(choice=[1, 2])})
    assert clamp({"a": 0.6, "b": 0.05, "c": 2}) == {"a": 0.5, "b": 0.1, "c": 2}
    assert clamp({"a": 0.25}) == {"a": 0.25}


def test_exploit_summary_names_the_source_and_the_changes() -> None:
    assert exploit_summary("abc_00000", 3, {"train.lr": 0.001}, {"train.lr": 0.0012}) == \
        "from trial abc_00000 at epoch 3: train.lr 0.001 -> 0.0012"


def test_an_exploit_copies_the_checkpoint_and_the_stage_features_it_refers_to(
        tmp_path: Path) -> None:
    """MCL's checkpoints refer to earlier stages' features beside them: the copy takes both, so
    the exploiting trial resumes (and checkpoints on) in its own storage."""
    import pyarrow.fs

    source = tmp_path / "better-trial"
    (source / "checkpoint_000001" / "sub").mkdir(parents=True)
    (source / "checkpoint_000001" / "progress.json").write_text("{}")
    (source / "checkpoint_000001" / "sub" / "state.pt").write_text("weights")
    (source / "checkpoint_000002").mkdir()  # a later checkpoint of the better trial: not copied
    (source / "stage_features").mkdir()
    (source / "stage_features" / "stage_0_ab.npz").write_text("features")
    local = pyarrow.fs.LocalFileSystem()
    copy_run_files(local, str(source), str(source / "checkpoint_000001"), local,
                   str(tmp_path / "worse-trial"), "pbt_epoch1")
    copied = tmp_path / "worse-trial"
    assert sorted(str(path.relative_to(copied)) for path in copied.rglob("*") if path.is_file()) \
        == ["pbt_epoch1/progress.json", "pbt_epoch1/sub/state.pt", "stage_features/stage_0_ab.npz"]


def test_mutated_rates_win_over_the_checkpoint() -> None:
    """The cloned checkpoint's optimizer carries its own lr and weight decay; the exploiting
    trial's (mutated) config must win, the momentum buffers must come along."""
    weight = torch.nn.Parameter(torch.ones(2))
    cloned = torch.optim.SGD([{"params": [weight], "initial_lr": 0.1}], lr=0.1, momentum=0.9,
                             weight_decay=0.0)
    weight.grad = torch.ones(2)
    cloned.step()
    state = cloned.state_dict()

    mutated = torch.optim.SGD([{"params": [weight], "initial_lr": 0.12}], lr=0.12,
                              momentum=0.9, weight_decay=2e-4)
    load_optimizer_state(mutated, state)
    group = mutated.param_groups[0]
    assert (group["lr"], group["initial_lr"], group["weight_decay"]) == (0.12, 0.12, 2e-4)
    assert torch.equal(mutated.state[weight]["momentum_buffer"],
                       state["state"][0]["momentum_buffer"])


def test_pbt_sweep_records_exploits_and_logs_every_epoch_once(
        ray_session, data_cache, tmp_path) -> None:
    """Two trials, four epochs, a perturbation after every epoch but the last, the bottom half
    copying the top half: an exploit at epochs 1, 2 and 3, each on the worse trial's run."""
    from mlflow import MlflowClient
    from test_end_to_end import NO_PLOTS, TINY

    from raycl.config.schema import resolve_tracking_uri
    from raycl.pbt import EXPLOIT_TAG, MUTATION_PREFIX
    from raycl.tracking import ROLE_TAG

    overrides = [*TINY, NO_PLOTS, "train.epochs=4", "tune.scheduler.type=pbt",
                 "tune.scheduler.perturbation_interval=1", "tune.scheduler.quantile_fraction=0.5"]
    args = [str(QUICKSTART), *(arg for item in overrides for arg in ("--set", item)),
            "--num-samples", "2", "--name", "e2e-pbt", "--storage", str(tmp_path / "ray"),
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    assert main(args) == 0

    client = MlflowClient(resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    experiment = client.get_experiment_by_name("e2e-pbt")
    runs = [run for run in client.search_runs([experiment.experiment_id])
            if run.data.tags.get(ROLE_TAG) == "trial"]
    assert len(runs) == 2 and all(run.info.status == "FINISHED" for run in runs)
    exploits, factors = {}, []
    for run in runs:
        run_id = run.info.run_id
        assert run.data.tags["raycl.ended"] == "completed"
        # Every epoch once, whichever trial's checkpoint it started from.
        steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
        assert steps == [1, 2, 3, 4]
        lr = {m.step: m.value for m in client.get_metric_history(run_id,
                                                                 MUTATION_PREFIX + "train.lr")}
        assert sorted(lr) == [1, 2, 3, 4]
        # The optimizer ran at the trial's own (mutated) rate times the schedule's factor, which
        # both trials share epoch by epoch: not at the rate stored in a cloned checkpoint.
        trained = {m.step: m.value for m in client.get_metric_history(run_id, "train/lr")}
        factors.append([trained[epoch] / lr[epoch] for epoch in range(1, 5)])
        for key, text in run.data.tags.items():
            if key.startswith(EXPLOIT_TAG):
                epoch = int(key.removeprefix(EXPLOIT_TAG))
                exploits[(run_id, epoch)] = text
                assert text.startswith("from trial ") and f"at epoch {epoch}:" in text
                # "from trial X at epoch 1: simclr.temperature 0.28 -> 0.33; train.lr ... -> ..."
                changes = dict(change.rsplit(" -> ", 1) for change in text.split(": ", 1)[1]
                               .split("; "))
                new = {change.split(" ")[0]: float(value) for change, value in changes.items()}
                assert set(new) == {"simclr.temperature", "train.lr"}
                # The next epoch trained with the new (explored) value.
                assert lr[epoch + 1] == pytest.approx(new["train.lr"], rel=1e-3)
    assert factors[0] == pytest.approx(factors[1], rel=1e-6)
    # Synchronous PBT, 2 trials, quantile 0.5: one exploit at each of epochs 1, 2, 3.
    assert sorted(epoch for _, epoch in exploits) == [1, 2, 3]
