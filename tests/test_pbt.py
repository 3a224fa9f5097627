"""Population-based training (tune.scheduler.type: pbt | pb2): what may mutate, the schedule's
fit, the mutated values winning over a checkpoint's, and two real PBT sweeps through MLflow."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from raycl.config.schema import ConfigError, Domain
from raycl.config.sweep import SchedulerConfig
from raycl.launch.load import load_search
from raycl.sweep.population import (
    ClampToDomains,
    copy_run_files,
    exploit_summary,
    mutations,
    next_sync_epoch,
    perturbs_at,
)
from raycl.tracking import TRIAL_TAG
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
    # Ray Train workers train a population too (raycl.trial.population_workers): no refusal.
    assert load_search(QUICKSTART, [*PBT, "scaling.num_workers=1"]).scaling.num_workers == 1


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


def test_an_exploit_reaches_the_sweeps_saved_state_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exploiting trial's run metadata as Tune saves it names the donor's copied checkpoint
    right after the exploit, not its own older one from Tune's cached JSON (a Ctrl+C then lost
    the exploit's weights while its config and MLflow tag stayed)."""
    from types import SimpleNamespace

    from ray.train import Checkpoint
    from ray.train._internal.session import _TrainingResult
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import PopulationBasedTraining

    from raycl.methods import SearchConfig
    from raycl.sweep.pbt import RayclPBT

    config = SearchConfig.model_validate({"name": "pbt", "tune": {
        "scheduler": {"type": "pbt", "perturbation_interval": 1},
        "search_space": {"train.lr": {"loguniform": [0.0001, 0.01]}}}})
    scheduler = RayclPBT(raycl={"config": config, "last_epoch": 4}, time_attr="epoch",
                         perturbation_interval=1, hyperparam_mutations={"train.lr": [0.001]})
    trial, donor = (Trial("trainable", stub=True, config={"train.lr": 0.001}) for _ in range(2))
    def saved_checkpoint() -> str:  # what a snapshot of the sweep's state holds
        metadata = type(trial.run_metadata).from_json_state(trial.run_metadata.get_json_state())
        return metadata.checkpoint_manager.latest_checkpoint_result.checkpoint.path

    trial.run_metadata.checkpoint_manager._latest_checkpoint_result = _TrainingResult(
        checkpoint=Checkpoint(str(tmp_path / "own")), metrics={"epoch": 1})
    assert saved_checkpoint() == str(tmp_path / "own")  # and cached as JSON now
    scheduler._trial_state[donor] = SimpleNamespace(
        last_result={"epoch": 1}, last_checkpoint=Checkpoint(str(tmp_path / "donor")))
    copied = str(tmp_path / "copied")
    monkeypatch.setattr(PopulationBasedTraining, "_exploit", lambda *args: None)
    monkeypatch.setattr(RayclPBT, "_copy", lambda *args: Checkpoint(copied))
    monkeypatch.setattr(RayclPBT, "_record", lambda *args: None)
    scheduler._exploit(None, trial, donor)
    assert saved_checkpoint() == copied


def test_an_exploit_keeps_only_the_trials_newest_copy(tmp_path: Path) -> None:
    """Issue 46, finding 10: Ray's checkpoint manager never sees the exploits' copies, so each
    exploit deletes the trial's earlier ones (one full checkpoint per exploit otherwise, for
    the sweep's life); the trial's own checkpoints and its stage features stay."""
    import pyarrow.fs

    from raycl.sweep.population import drop_earlier_copies

    names = ["pbt_epoch2_from_a_00001_checkpoint_000001", "pbt_epoch4_from_b_00002_checkpoint_3",
             "checkpoint_000004", "stage_features"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_text(name)
    dropped = drop_earlier_copies(pyarrow.fs.LocalFileSystem(), str(tmp_path), keep=names[1])
    assert dropped == [names[0]]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(names[1:])


class _S3Like:
    """A local directory that calls itself S3 (what decides a server-side copy), recording how
    each file was copied."""

    type_name = "s3"

    def __init__(self) -> None:
        import pyarrow.fs

        self.local = pyarrow.fs.LocalFileSystem()
        self.streamed: list[str] = []

    def equals(self, other: object) -> bool:
        return other is self

    def create_dir(self, path: str, recursive: bool = True) -> None:
        self.local.create_dir(path, recursive=recursive)

    def open_input_stream(self, path: str) -> Any:
        return self.local.open_input_stream(path)

    def open_output_stream(self, path: str) -> Any:
        self.streamed.append(Path(path).name)
        return self.local.open_output_stream(path)


def test_objects_above_s3s_single_copy_limit_are_streamed(tmp_path: Path, monkeypatch) -> None:
    """Issue 46, finding 10: within one S3 store pyarrow copies an object with one CopyObject,
    which S3 refuses above 5 GiB; such objects are streamed (a multipart upload) instead."""
    import pyarrow.fs

    from raycl.sweep import population

    server_side: list[str] = []
    monkeypatch.setattr(pyarrow.fs, "copy_files",
                        lambda source, target, **kwargs: server_side.append(Path(source).name))
    (tmp_path / "big.pt").write_bytes(bytes(range(100)))
    (tmp_path / "small.json").write_text("{}")
    store = _S3Like()
    for name, size in (("big.pt", 100), ("small.json", 2)):
        population.copy_file(store, str(tmp_path / name), store, str(tmp_path / "copy" / name),
                             size, single_copy_limit=10)
    assert store.streamed == ["big.pt"] and server_side == ["small.json"]
    assert (tmp_path / "copy" / "big.pt").read_bytes() == bytes(range(100))


def test_a_trial_start_brings_the_stage_features_its_checkpoint_refers_to(
        tmp_path: Path) -> None:
    """With workers, each start of a PBT trial is a new Ray Train run: the MCL stage features
    beside the checkpoint it starts from go into that run (its checkpoints refer to them) and
    beside Tune's copy of each checkpoint; only the files missing there are copied."""
    import pyarrow.fs

    from raycl.sweep.population import copy_missing_files
    from raycl.trial.population_workers import generation_run_name

    source, target = tmp_path / "run-a" / "stage_features", tmp_path / "run-b" / "stage_features"
    source.mkdir(parents=True)
    (source / "stage_0_ab.npz").write_text("stage 0")
    (source / "stage_1_cd.npz").write_text("stage 1")
    target.mkdir(parents=True)
    (target / "stage_0_ab.npz").write_text("already there")
    local = pyarrow.fs.LocalFileSystem()
    assert copy_missing_files(local, str(source), local, str(target)) == ["stage_1_cd.npz"]
    assert (target / "stage_1_cd.npz").read_text() == "stage 1"
    assert (target / "stage_0_ab.npz").read_text() == "already there"
    assert copy_missing_files(local, str(tmp_path / "none"), local, str(target)) == []
    names = {generation_run_name("sweep-abc_00000") for _ in range(3)}
    assert len(names) == 3 and all(name.startswith("sweep-abc_00000-") for name in names)


def test_a_start_deletes_only_its_own_trials_earlier_train_runs(tmp_path: Path) -> None:
    """Each start begins from Tune's copy of the checkpoint: the trial's earlier Train runs are
    deleted, never this start's, another trial's (a longer trial id too) or anything else."""
    import pyarrow.fs

    from raycl.trial.population_workers import drop_earlier_runs, generation_run_name

    trial = "pbt-ab12_00001"
    earlier, this = generation_run_name(trial), generation_run_name(trial)
    kept = [this, f"{trial}0-0123abcd", "pbt-ab12_00002-0123abcd", trial, f"{trial}-notahexid"]
    for name in [earlier, *kept]:
        (tmp_path / name / "checkpoint_000000").mkdir(parents=True)
    (tmp_path / f"{trial}-89abcdef").write_text("a file, not a run")
    local = pyarrow.fs.LocalFileSystem()
    assert drop_earlier_runs(local, str(tmp_path), trial, keep=this) == [earlier]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*kept,
                                                                        f"{trial}-89abcdef"])
    assert drop_earlier_runs(local, str(tmp_path / "absent"), trial, keep=this) == []


def test_every_worker_process_names_its_cluster(ray_session) -> None:
    """Ray Train's placement-group cleaner asks the State API about its controller without an
    address: with two Rays on the machine it fails, and a paused PBT trial's workers stay
    reserved for good. Every worker of raycl's Ray has RAY_ADDRESS set to its own cluster
    (raycl.sweep.worker_setup), the nested ones too."""
    import os

    import ray

    @ray.remote(num_cpus=0)
    def address(depth: int) -> str | None:
        return ray.get(address.remote(depth - 1)) if depth else os.environ.get("RAY_ADDRESS")

    assert ray.get(address.remote(1)) == ray.get_runtime_context().gcs_address


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


@pytest.fixture
def sigint_handler_kept() -> Iterator[None]:
    """SIGINT's handler as it was: the in-process sweep installs Tune's."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


class PbtSweep:
    """One tiny PBT sweep of the quickstart (2 trials, a perturbation after every epoch but the
    last, the bottom half copying the top half) and what it left in MLflow."""

    def __init__(self, tmp_path: Path, epochs: int, *extra: str) -> None:
        from mlflow import MlflowClient
        from test_end_to_end import NO_PLOTS, TINY

        from raycl.config.schema import resolve_tracking_uri

        overrides = [*TINY, NO_PLOTS, f"train.epochs={epochs}", "tune.scheduler.type=pbt",
                     "tune.scheduler.perturbation_interval=1",
                     "tune.scheduler.quantile_fraction=0.5", *extra]
        self.epochs = epochs
        self.storage = tmp_path / "ray"
        self.args = [str(QUICKSTART), *(arg for item in overrides for arg in ("--set", item)),
                     "--num-samples", "2", "--name", "e2e-pbt", "--storage", str(self.storage),
                     "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
        self.client = MlflowClient(resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"))

    def trial_runs(self) -> list:
        from raycl.tracking import ROLE_TAG

        experiment = self.client.get_experiment_by_name("e2e-pbt")
        return [run for run in self.client.search_runs([experiment.experiment_id])
                if run.data.tags.get(ROLE_TAG) == "trial"]

    def exploit_tags(self) -> dict[tuple[str, str], str]:
        from raycl.sweep.population import EXPLOIT_TAG

        return {(run.info.run_id, key): text for run in self.trial_runs()
                for key, text in run.data.tags.items() if key.startswith(EXPLOIT_TAG)}

    def check_population(self) -> dict[tuple[str, int], str]:
        """Every trial finished with every epoch logged once; each exploit names its donor and
        the values it changed, the next epoch trained with them, and the mutated values change
        at exploits only. Returns each exploit's text by (exploiting run id, epoch)."""
        from raycl.sweep.population import EXPLOIT_TAG, MUTATION_PREFIX

        epochs = list(range(1, self.epochs + 1))
        runs = self.trial_runs()
        assert len(runs) == 2 and all(run.info.status == "FINISHED" for run in runs)
        exploits, factors = {}, []
        for run in runs:
            run_id = run.info.run_id
            assert run.data.tags["raycl.ended"] == "completed"
            # Every epoch once, whichever trial's checkpoint it started from.
            steps = [m.step for m in self.client.get_metric_history(run_id, "train/loss")]
            assert steps == epochs
            lr = {m.step: m.value for m in self.client.get_metric_history(
                run_id, MUTATION_PREFIX + "train.lr")}
            assert sorted(lr) == epochs
            # The optimizer ran at the trial's own (mutated) rate times the schedule's factor,
            # which both trials share epoch by epoch: not at the rate of a cloned checkpoint.
            trained = {m.step: m.value for m in self.client.get_metric_history(run_id,
                                                                               "train/lr")}
            factors.append([trained[epoch] / lr[epoch] for epoch in epochs])
            exploited = set()
            for key, text in run.data.tags.items():
                if key.startswith(EXPLOIT_TAG):
                    epoch = int(key.removeprefix(EXPLOIT_TAG))
                    exploits[(run_id, epoch)] = text
                    exploited.add(epoch)
                    assert text.startswith("from trial ") and f"at epoch {epoch}:" in text
                    # "from trial X at epoch 1: simclr.temperature 0.28 -> 0.33; train.lr ..."
                    changes = dict(change.rsplit(" -> ", 1) for change in text.split(": ", 1)[1]
                                   .split("; "))
                    new = {change.split(" ")[0]: float(value) for change, value in
                           changes.items()}
                    assert set(new) == {"simclr.temperature", "train.lr"}
                    # The next epoch trained with the new (explored) value.
                    assert lr[epoch + 1] == pytest.approx(new["train.lr"], rel=1e-3)
            # Mutated values are kept (through a resume too): they change at exploits only.
            assert all(lr[epoch + 1] == lr[epoch] for epoch in epochs[:-1]
                       if epoch not in exploited)
        assert factors[0] == pytest.approx(factors[1], rel=1e-6)
        # Synchronous PBT, 2 trials, quantile 0.5: one exploit per perturbation epoch, at most
        # (a resumed scheduler starts its ranking over), at multiples of the interval only.
        exploit_epochs = [epoch for _, epoch in exploits]
        assert exploit_epochs and len(exploit_epochs) == len(set(exploit_epochs))
        assert set(exploit_epochs) <= set(epochs[:-1])
        return exploits


def test_pbt_sweep_records_exploits_and_keeps_them_through_ctrl_c(
        ray_session, data_cache, tmp_path, capsys, sigint_handler_kept) -> None:
    """Trials in their Tune process, three epochs; Ctrl+C once the first exploit is on MLflow
    (epoch 1's, so the resumed population meets again at epoch 2's perturbation), then the
    same command. Each exploit stays on the worse trial's run as it was, each trial goes on
    with its mutated values, every trial finishes with every epoch logged once."""
    import threading

    from test_confirm import sigint_once

    sweep = PbtSweep(tmp_path, 3, "scaling.num_workers=0")
    stop = threading.Event()
    watcher = sigint_once(lambda: bool(sweep.exploit_tags()), stop)
    try:
        assert main(sweep.args) == 130
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert "interrupted; run the same command again" in capsys.readouterr().err
    before = sweep.exploit_tags()
    assert before
    assert main(sweep.args) == 0
    after = sweep.exploit_tags()
    assert {key: after.get(key) for key in before} == before  # the lineage kept as it was
    sweep.check_population()


def test_pbt_sweep_with_workers_starts_the_exploiting_trial_from_the_donors_checkpoint(
        ray_session, data_cache, tmp_path) -> None:
    """Trials of one Ray Train worker each, side by side, two epochs, one perturbation (after
    epoch 1): the worse trial exploits the better one, whose epoch-1 checkpoint is copied whole
    into its trial directory, and its epoch 2 trains in a fresh Train run started from a Tune
    checkpoint (a restarted trial never resumes its own Train storage, ray-project/ray#28509)."""
    import json

    sweep = PbtSweep(tmp_path, 2,
                     # Both trials at once on 2 CPUs (0.01 + 0.99 each): their epoch-2 starts
                     # need the paused epoch-1 workers' CPUs back (a paused trial keeping its
                     # workers hangs the sweep, ray-project/ray#18808).
                     "scaling.num_workers=1", "scaling.cpus_per_worker=0.99",
                     # No assertion reads a probe's score: the torch head spares each worker
                     # scikit-learn's import and lbfgs (~2 s of CPU).
                     "eval.linear_backend=torch")
    assert main(sweep.args) == 0
    exploits = sweep.check_population()
    assert [epoch for _, epoch in exploits] == [1]
    ((run_id, _), text), = exploits.items()
    donor = text.removeprefix("from trial ").split(" ")[0]
    exploiter = next(run.data.tags[TRIAL_TAG] for run in sweep.trial_runs()
                     if run.info.run_id == run_id)

    def epoch_of(checkpoint: Path) -> int:
        return json.loads((checkpoint / "progress.json").read_text())["epoch"]

    # The exploit made a whole copy of the donor's epoch-1 checkpoint (Tune's copy of its
    # report) the exploiting trial's checkpoint...
    trial_dirs = {trial: next((sweep.storage / "e2e-pbt").glob(f"run_trial_{trial}_*"))
                  for trial in (donor, exploiter)}
    donor_epoch1 = next(path for path in trial_dirs[donor].glob("checkpoint_*/")
                        if epoch_of(path) == 1)
    copy, = trial_dirs[exploiter].glob(f"pbt_epoch1_from_{donor}_{donor_epoch1.name}")
    assert (copy / "state.pt").read_bytes() == (donor_epoch1 / "state.pt").read_bytes()
    # ...and the exploiting trial's epoch 2 trained in a fresh Train run of its own that
    # started from a Tune checkpoint of epoch 1 (its first checkpoint is epoch 2's).
    starts = [start for start in (sweep.storage / "e2e-pbt-train").glob(f"e2e-pbt-{exploiter}-*")
              if any(start.glob("checkpoint_*/"))]
    last_start = max(starts, key=lambda start: min(path.stat().st_mtime for path in
                                                  start.glob("checkpoint_*/")))
    assert sorted(epoch_of(path) for path in last_start.glob("checkpoint_*/")) == [2]


def test_perturbations_fall_on_multiples_of_the_interval_before_the_last_epoch() -> None:
    assert [epoch for epoch in range(1, 9) if perturbs_at(epoch, 2, 8)] == [2, 4, 6]
    assert [epoch for epoch in range(1, 5) if perturbs_at(epoch, 1, 4)] == [1, 2, 3]


def test_a_resumed_population_meets_at_the_next_epoch_of_its_furthest_behind_trial() -> None:
    """Ray's synchronous PBT starts its clock at max(interval, burn-in) and a resumed sweep's
    scheduler forgets it: trials already past it would wait for each other forever."""
    assert next_sync_epoch([0, 0], interval=2, burn_in=0) == 2  # a fresh population: Ray's
    assert next_sync_epoch([0, 0], interval=1, burn_in=3) == 3
    assert next_sync_epoch([2, 1], interval=1, burn_in=0) == 2  # one trial waits at 2
    assert next_sync_epoch([2, 2], interval=1, burn_in=0) == 3
    assert next_sync_epoch([4, 5], interval=2, burn_in=0) == 6


def test_explorations_repeat_with_the_seed_whatever_else_draws() -> None:
    """Ray's PBT draws from the global random streams; raycl's from its own, seeded by seed."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from raycl.sweep.pbt import population_scheduler

    def explorations(seed: int, outside: int) -> list[dict]:
        config = load_search(QUICKSTART, [*PBT, f"seed={seed}",
                                          "tune.scheduler.resample_probability=0.5"])
        scheduler = population_scheduler(config)
        random.seed(outside)  # other code drawing in between, differently each time
        np.random.seed(outside)
        donor = SimpleNamespace(config={"simclr.temperature": 0.2, "train.lr": 0.001})
        drawn = []
        for _ in range(6):
            drawn.append(scheduler._get_new_config(donor, donor)[0])
            random.random()
            np.random.random()
        return drawn

    assert explorations(7, outside=1) == explorations(7, outside=2)
    assert explorations(7, outside=1) != explorations(8, outside=1)
