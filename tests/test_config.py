"""Config validation: every bad input is one line naming the file and the key, exit code 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raycl.config.schema import ConfigError, reported_test_metric
from raycl.config.search_config import (
    CONFIG_KEYS,
    SearchConfig,
    apply_overrides,
    flatten,
    schema_markdown,
)
from raycl.launch.feasibility import max_reports, stage_budget_problem
from raycl.launch.load import load_search
from raycl.tune import main

REPO = Path(__file__).resolve().parents[1]

BASE = """
name: t
method: simclr
data: {dataset: trifeature, resolution: 32, samples_per_combination: 2}
train: {epochs: 2, batch_size: 64}
tune:
  num_samples: 2
  search_space:
    simclr.temperature: {loguniform: [0.1, 0.5]}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_search(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_valid_file_loads_with_defaults(tmp_path: Path) -> None:
    config = load_search(write(tmp_path, BASE))
    assert config.train.epochs == 2
    assert config.simclr.temperature == 0.5
    assert config.tune.search_space["simclr.temperature"].kind == "loguniform"


@pytest.mark.parametrize(
    ("snippet", "key", "why"),
    [
        ("train: {epochs: 2, batch_size: 64, epoch: 3}", "train.epoch", "unknown key"),
        ("train: {epochs: ten, batch_size: 64}", "train.epochs", "valid integer"),
        ("train: {epochs: 0, batch_size: 64}", "train.epochs", "greater than or equal to 1"),
        ("data: {dataset: cifar}", "data.dataset", "'trifeature'"),
        ("simclr: {temperature: -1}", "simclr.temperature", "greater than 0"),
        ("augment: {crop_scale: [0.9, 0.2]}", "augment.crop_scale", "low <= high"),
        ("data: {dataset: folder}", "data", "data.root is required"),
    ],
)
def test_bad_values_name_file_and_key(tmp_path: Path, snippet: str, key: str, why: str) -> None:
    text = BASE + snippet + "\n"
    message = error_of(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'search.yaml'}: {key}")
    assert why in message


def test_unknown_method(tmp_path: Path) -> None:
    message = error_of(tmp_path, BASE.replace("method: simclr", "method: simclrr"))
    assert ": method: unknown method 'simclrr'" in message
    assert "simclr" in message.split("known:")[1]


def test_search_space_key_must_exist(tmp_path: Path) -> None:
    text = BASE.replace("simclr.temperature: {loguniform", "simclr.temprature: {loguniform")
    message = error_of(tmp_path, text)
    assert "tune.search_space.simclr.temprature: not a searchable config key" in message


def test_search_space_values_are_type_checked(tmp_path: Path) -> None:
    text = BASE + "    train.epochs: {choice: [1, -2]}\n"
    message = error_of(tmp_path, text)
    assert "tune.search_space.train.epochs: value -2 is invalid" in message


def test_search_domain_needs_exactly_one_kind(tmp_path: Path) -> None:
    text = BASE.replace("{loguniform: [0.1, 0.5]}", "{loguniform: [0.1, 0.5], uniform: [0, 1]}")
    message = error_of(tmp_path, text)
    assert "tune.search_space.simclr.temperature" in message


def test_overrides_are_type_checked(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    assert load_search(path, ["train.epochs=5"]).train.epochs == 5
    assert load_search(path, ["tune.search_space={}"]).tune.search_space == {}
    with pytest.raises(ConfigError, match=r"^--set train\.epoch: unknown key \(did you mean "
                                          r"train\.epochs\?\)$"):
        load_search(path, ["train.epoch=5"])
    # A bad value is the --set's error, not the file's.
    with pytest.raises(ConfigError, match=r"^--set train\.epochs=many: train\.epochs: Input "
                                          r"should be a valid integer"):
        load_search(path, ["train.epochs=many"])
    with pytest.raises(ConfigError, match=r"^--set tune\.search_space\.train\.lr=\{uniform: "
                                          r"\[1, x\]\}: tune\.search_space\.train\.lr"):
        load_search(path, ["tune.search_space.train.lr={uniform: [1, x]}"])
    # A bad value in the file is still the file's, with a --set of another key.
    message = error_of(tmp_path, BASE + "data: {dataset: cifar}\n", ["train.epochs=3"])
    assert message.startswith(f"{path}: data.dataset: ")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_search(path, ["train.epochs"])


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, "name: t\ntrain: {epochs: [1,\n")
    assert "invalid YAML" in message and "line" in message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_search(tmp_path / "nope.yaml")


def test_mcl_budget_rejected_when_not_searched(tmp_path: Path) -> None:
    # Trifeature with 2 per combination: 2000 images, 200 per shape of which 40 test and 20
    # validation -> M = 1400 training samples, b=64 -> M/b = 21.9 < 5^3.
    text = BASE.replace("method: simclr", "method: mcl") + "mcl: {stages: 3, clusters: 5}\n"
    message = error_of(tmp_path, text)
    assert "mcl.clusters/mcl.stages" in message and "K=5, N=3" in message
    assert "M/b = 1400/64" in message


def test_mcl_budget_left_to_trials_when_searched(tmp_path: Path) -> None:
    text = (BASE.replace("method: simclr", "method: mcl") + "mcl: {stages: 3, clusters: 5}\n")
    text = text.replace("    simclr.temperature:", "    mcl.clusters: {choice: [2, 5]}\n"
                        "    simclr.temperature:")
    config = load_search(write(tmp_path, text))
    assert config.mcl.clusters == 5


def test_an_empty_validation_or_test_split_is_refused_before_launch(tmp_path: Path) -> None:
    # 2 per combination: 200 images per shape; 0.001 of 200 rounds to no validation image.
    message = error_of(tmp_path, BASE, ["data.val_fraction=0.001"])
    assert message.endswith("data.val_fraction: leaves the val split empty (1600 train images; "
                            "shares are rounded per class): raise it or use more data")
    searched = BASE.replace("    simclr.temperature:",
                            "    data.test_fraction: {choice: [0.2, 0.001]}\n"
                            "    simclr.temperature:")
    message = error_of(tmp_path, searched)
    assert "data.test_fraction: with searched data.test_fraction=0.001: leaves the test" in message


def test_stage_budget_formula() -> None:
    assert stage_budget_problem(2, 3, 1000, 100) is None  # 8 <= 10
    assert stage_budget_problem(5, 2, 1000, 100) is not None  # 25 > 10
    # One stage never clusters: K cannot make it infeasible.
    assert stage_budget_problem(50, 1, 1000, 100) is None


def test_apply_overrides_and_flatten() -> None:
    config = SearchConfig(name="x")
    changed = apply_overrides(config, {"simclr.temperature": 0.2, "mcl.clusters": 3})
    assert changed.simclr.temperature == 0.2 and changed.mcl.clusters == 3
    assert config.simclr.temperature == 0.5
    flat = flatten(changed.to_dict())
    assert flat["simclr.temperature"] == 0.2 and "train.epochs" in flat
    assert set(flat) - {"tune.search_space"} <= set(CONFIG_KEYS)


def test_schema_documents_every_key() -> None:
    table = schema_markdown()
    for key in ("train.epochs", "simclr.temperature", "scaling.num_workers", "mcl.negatives",
                "tune.metric", "data.resolution"):
        assert f"`{key}`" in table
    # A choice shows its allowed values, never the word Literal.
    assert "Literal" not in table
    assert "| `tune.scheduler.type` | 'asha' \\| 'none' \\| 'pbt' \\| 'pb2' | 'asha' |" in table
    assert "| `data.dataset` | 'trifeature' \\| " in table


@pytest.mark.parametrize(("key", "hint"), [
    ("train.epoch", "train.epochs"), ("trian", "train"), ("simclr.temprature",
                                                         "simclr.temperature"),
    ("epochs", "train.epochs"), ("nothing.like.it", None)])
def test_unknown_keys_get_a_suggestion(key: str, hint: str | None) -> None:
    from raycl.config.search_config import did_you_mean

    assert did_you_mean(key) == (f" (did you mean {hint}?)" if hint else "")


def test_unknown_keys_in_the_yaml_get_a_suggestion(tmp_path: Path) -> None:
    assert error_of(tmp_path, BASE + "trian: {epochs: 2}\n").endswith(
        ": trian: unknown key (did you mean train?)")
    text = BASE.replace("simclr.temperature: {loguniform", "simclr.temprature: {loguniform")
    assert error_of(tmp_path, text).endswith(
        "not a searchable config key (did you mean simclr.temperature?)")


def test_max_reports_uses_largest_stage_count(tmp_path: Path) -> None:
    config = SearchConfig.model_validate({
        "name": "x", "method": "mcl", "train": {"epochs": 3},
        "tune": {"search_space": {"mcl.stages": {"choice": [1, 2, 4]}}}})
    assert max_reports(config) == 12


def test_cli_exit_code_2_and_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path, BASE + "train: {epochs: 2, batch_size: 64, epoch: 3}\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {path}: train.epoch: unknown key (did you mean train.epochs?)"


def test_cli_subprocess_exits_2_without_launching(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    done = subprocess.run(
        [sys.executable, "-m", "raycl.tune", str(path), "--set", "simclr.temperature=hot",
         "--storage", str(tmp_path / "ray")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --set simclr.temperature=hot: simclr.temperature: ")
    assert not (tmp_path / "ray").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "searches").glob("*.yaml")))
def test_shipped_searches_are_valid(name: str, tmp_path: Path) -> None:
    if name == "folder.yaml":  # the user's folder comes from the command line
        test_folder_search_needs_only_a_root(tmp_path)
        return
    load_search(REPO / "searches" / name)


def test_folder_search_needs_only_a_root(tmp_path: Path) -> None:
    """searches/folder.yaml: SimCLR on your folder with one --set; without it, one line that
    says how to give it."""
    import numpy as np
    from PIL import Image

    search = REPO / "searches" / "folder.yaml"
    with pytest.raises(ConfigError) as info:
        load_search(search)
    assert str(info.value) == (f"{search}: data: data.root is required when data.dataset is "
                               f"'folder' (give it in the YAML or with --set data.root=...)")
    for label in range(2):
        (tmp_path / "images" / f"c{label}").mkdir(parents=True)
        for index in range(60):
            Image.fromarray(np.full((8, 8, 3), 40 * index % 256, np.uint8)).save(
                tmp_path / "images" / f"c{label}" / f"{index}.png")
    config = load_search(search, [f"data.root={tmp_path / 'images'}"])
    assert (config.method, config.data.dataset, config.model.backbone) == (
        "simclr", "folder", "small_cnn")
    assert config.eval.transfer == [] and config.scaling.use_gpu is False
    assert config.tune.search_space  # a search, not seed repeats


def test_schema_choices_match_what_exists() -> None:
    """The Literal choices in the schema are the datasets that exist; model.backbone takes the
    backbones raycl builds and any timm/<name> (whose name the launch checks), nothing else."""
    from typing import get_args

    from pydantic import ValidationError

    from raycl.config.schema import DataConfig, ModelConfig
    from raycl.data import DATASETS
    from raycl.models import BACKBONES

    assert set(get_args(DataConfig.model_fields["dataset"].annotation)) == set(DATASETS)
    for name in (*BACKBONES, "timm/convnext_tiny"):
        assert ModelConfig(backbone=name).backbone == name
    for name in ("resnet34", "timm/", "vit_small_patch16_224"):
        with pytest.raises(ValidationError, match="small_cnn, resnet18, resnet50 or timm/"):
            ModelConfig(backbone=name)


def test_trial_resources_and_demand() -> None:
    from raycl.launch.placement import trial_demand, trial_resources

    in_process = SearchConfig.model_validate(
        {"name": "x", "scaling": {"num_workers": 0, "cpus_per_worker": 2}})
    assert trial_resources(in_process) == {"CPU": 2} == trial_demand(in_process)
    workers = SearchConfig.model_validate(
        {"name": "x", "scaling": {"num_workers": 4, "cpus_per_worker": 2, "use_gpu": True},
         "tune": {"trial_cpus": 0.5}})
    assert trial_resources(workers) == {"CPU": 0.5}
    assert trial_demand(workers) == {"CPU": 8.5, "GPU": 4.0}


def test_fresh_sets_the_old_sweep_aside(tmp_path: Path) -> None:
    from raycl.launch.sweep_plan import set_aside

    old = tmp_path / "sweep"
    old.mkdir()
    (old / "experiment_state.json").write_text("{}")
    set_aside(str(old))
    assert not old.exists()
    (aside,) = tmp_path.glob("sweep.*")
    assert (aside / "experiment_state.json").read_text() == "{}"
    with pytest.raises(ConfigError, match="remote"):
        set_aside("s3://bucket/sweep")


# --- what the command line means beyond values --------------------------------------------


def test_set_of_a_searched_key_pins_it(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "    train.lr: {loguniform: [0.001, 0.01]}\n")
    notices: list[str] = []
    config = load_search(path, ["simclr.temperature=0.2"], notices=notices)
    assert config.simclr.temperature == 0.2
    assert list(config.tune.search_space) == ["train.lr"]
    assert notices == ["--set simclr.temperature=0.2 pins a searched key: removed from "
                       "tune.search_space"]
    # Setting a domain is not pinning: the key is searched, under its dotted name.
    config = load_search(path, ["tune.search_space.train.epochs={choice: [1, 3]}"])
    assert config.tune.search_space["train.epochs"].choice == [1, 3]
    assert "train.lr" in config.tune.search_space


def test_empty_space_means_seed_repeats(tmp_path: Path) -> None:
    notices: list[str] = []
    load_search(write(tmp_path, BASE), ["tune.search_space={}", "seed=4"], notices=notices)
    assert notices == ["tune.search_space is empty: the 2 trials are repeats that differ only "
                       "by seed (4..5), each run to the end"]


def test_asha_grace_period_is_clamped_to_the_run(tmp_path: Path) -> None:
    notices: list[str] = []
    config = load_search(REPO / "searches" / "quickstart.yaml", ["train.epochs=1"],
                         notices=notices)
    assert config.tune.scheduler.grace_period == 1
    assert notices == ["tune.scheduler.grace_period=2 exceeds the 1 report(s) of the longest "
                       "trial: clamped to 1"]
    config = load_search(REPO / "searches" / "quickstart.yaml", ["train.epochs=3"])
    assert config.tune.scheduler.grace_period == 2


@pytest.mark.parametrize(
    ("metric", "why"),
    [
        ("eval/linear/mean", "'eval/linear/mean' was renamed to 'val/linear/mean'"),
        ("stage1/eval/knn/shape", "renamed to 'stage1/val/knn/shape'"),
        ("test/linear/mean", "is a test metric"),
        ("transfer/digits/linear/mean", "is a transfer metric"),
        ("val/linear/colour", "trifeature has no attribute 'colour'"),
    ],
)
def test_objective_must_be_a_validation_metric(tmp_path: Path, metric: str, why: str) -> None:
    message = error_of(tmp_path, BASE.replace("  num_samples: 2", f"  metric: {metric}\n"
                                              "  num_samples: 2"))
    assert ": tune.metric: " in message and why in message


def test_reported_test_metric() -> None:
    assert reported_test_metric("val/linear/mean") == "test/linear/mean"
    assert reported_test_metric("stage2/val/knn/shape") == "stage2/test/knn/shape"
    assert reported_test_metric("train/loss") is None


@pytest.mark.parametrize(
    ("override", "key", "why"),
    [
        ("train.batch_size=100000", "train.batch_size",
         "100000 exceeds the training split (1400 samples)"),
        ("data.val_fraction=0.8", "data", "val_fraction + data.test_fraction must be < 1"),
        ("tune.search_space={train.epochs: {uniform: [1, 4]}}", "tune.search_space.train.epochs",
         "is an integer: search it with randint or choice"),
        ("tune.search_space={data.val_fraction: {uniform: [0.1, 0.2]}}",
         "tune.search_space.data.val_fraction", "not searchable"),
        ("tune.search_space={train.batch_size: {choice: [5000, 100000]}}", "tune.search_space",
         "no combination of train.batch_size can train"),
    ],
)
def test_knowable_problems_are_caught_at_load(
    tmp_path: Path, override: str, key: str, why: str
) -> None:
    message = error_of(tmp_path, BASE, [override])
    assert message.startswith(f"{tmp_path / 'search.yaml'}: {key}: ")
    assert why in message


def test_searched_batch_size_keeps_only_feasible_choices(tmp_path: Path) -> None:
    from raycl.launch.feasibility import joint_domain

    config = load_search(write(tmp_path, BASE),
                         ["tune.search_space={train.batch_size: {choice: [64, 100000]}}"])
    joint = joint_domain(config)
    assert joint is not None and joint.keys == ("train.batch_size",)
    assert joint.combinations == ((64,),)


# ---------------------------------------------------------------- method-owned sections

HSCL = """
name: h
method: hscl
data: {dataset: trifeature, resolution: 32, samples_per_combination: 2}
train: {epochs: 2, batch_size: 64}
tune:
  num_samples: 4
  search_space:
    hscl.filter_exponent: {choice: [0.0, 0.1, 0.3, 0.5]}
"""


def test_method_sections_are_schema_keys(tmp_path: Path) -> None:
    """Declared in raycl/methods/<name>.py, documented, settable, searchable, validated."""
    schema = schema_markdown()
    for key in ("hscl.filter_exponent", "hscl.eigenvalue_floor", "spectral.mu",
                "simclr.temperature"):
        assert key in CONFIG_KEYS and f"`{key}`" in schema
    path = write(tmp_path, HSCL)
    assert load_search(path, ["hscl.mu=2"]).hscl.mu == 2.0
    message = error_of(tmp_path, HSCL, ["hscl.filter_exponent=-1"])
    assert "hscl.filter_exponent" in message and "greater than or equal to 0" in message
    message = error_of(tmp_path, HSCL.replace("0.0, 0.1", "-0.5, 0.1"))
    assert "tune.search_space.hscl.filter_exponent: value -0.5 is invalid" in message
    assert "unknown key" in error_of(tmp_path, HSCL + "hscl: {filter: 0.3}\n")


def test_moved_keys_say_where_they_went(tmp_path: Path) -> None:
    renamed = "renamed to simclr.temperature"
    assert renamed in error_of(tmp_path, BASE + "loss: {temperature: 0.2}\n")
    assert renamed in error_of(tmp_path, BASE.replace("simclr.temperature:", "loss.temperature:"))
    assert renamed in error_of(tmp_path, BASE, ["loss.temperature=0.2"])


def test_a_section_the_method_does_not_use_is_a_notice(tmp_path: Path) -> None:
    notices: list[str] = []
    load_search(write(tmp_path, HSCL + "spectral: {mu: 2}\n"), notices=notices)
    assert notices == ["section spectral not used: method is hscl"]
    notices.clear()
    mcl = HSCL.replace("method: hscl", "method: mcl\nmcl: {base: hscl, stages: 2, clusters: 2}")
    load_search(write(tmp_path, mcl + "hscl: {mu: 2}\n"), notices=notices)
    assert not any("not used" in notice for notice in notices)
    notices.clear()  # FGVR's base method is used too: its section is no notice
    load_search(REPO / "searches" / "fgvr_eps.yaml", notices=notices)
    assert not any("not used" in notice for notice in notices)


def test_mlflow_params_carry_only_the_sections_trials_use() -> None:
    hscl = SearchConfig(name="x", method="hscl")
    assert {"hscl", "simclr", "spectral"} <= set(hscl.to_dict())
    assert "hscl" in hscl.to_dict(used_sections_only=True)
    assert not {"simclr", "spectral"} & set(hscl.to_dict(used_sections_only=True))
    mcl = SearchConfig(name="x", method="mcl", mcl={"base": "spectral"})
    assert "spectral" in mcl.to_dict(used_sections_only=True)
    fgvr = SearchConfig(name="x", method="fgvr", fgvr={"base": "simsiam"})
    assert {"fgvr", "simsiam"} <= set(fgvr.to_dict(used_sections_only=True))
    assert "mocov2" not in fgvr.to_dict(used_sections_only=True)


def test_registering_a_method_adds_its_section(tmp_path: Path) -> None:
    """The whole contract of a new method file: a Section and @register(name, section=...)."""
    from pydantic import Field

    from raycl.config import search_config as config_module
    from raycl.config.schema import Section
    from raycl.config.section import METHOD_SECTIONS
    from raycl.methods import METHODS, Method, register

    class ToyConfig(Section):
        knob: int = Field(3, ge=1, description="A toy knob.")

    @register("toy", section=ToyConfig)
    class Toy(Method):
        pass

    try:  # the schema is rebuilt for the new registry
        assert "toy.knob" in config_module.config_keys()
        assert "`toy.knob`" in schema_markdown()
        loaded = load_search(write(tmp_path, HSCL.replace("method: hscl", "method: toy")),
                             ["toy.knob=5"])
        assert loaded.section(ToyConfig).knob == 5
        assert "toy.knob" in error_of(tmp_path, HSCL, ["toy.knob=0"])
    finally:
        METHODS.pop("toy")
        METHOD_SECTIONS.pop("toy")
    assert "toy.knob" not in config_module.config_keys()
    with pytest.raises(ValueError, match="cannot name a method"):
        register("train")
    with pytest.raises(ValueError, match="Section subclass"):
        register("toy2", section=dict)  # type: ignore[arg-type]


def test_transfer_entries_are_validated(tmp_path: Path) -> None:
    ok = load_search(write(tmp_path, HSCL + "eval: {transfer: [{dataset: digits}]}\n"))
    assert ok.eval.transfer[0].label == "digits"
    twice = HSCL + "eval: {transfer: [{dataset: digits}, {dataset: digits}]}\n"
    assert "transfer names must be distinct" in error_of(tmp_path, twice)
    missing = HSCL + f"eval: {{transfer: [{{dataset: folder, root: {tmp_path / 'nope'}}}]}}\n"
    assert ": eval.transfer.0.root: not a directory" in error_of(tmp_path, missing)


def test_a_pickled_config_unpickles_in_a_process_that_imported_no_method() -> None:
    """A config travels to Ray workers pickled: the class resolves in raycl.methods (which
    registers every method on import), while raycl.config alone says what to import."""
    import pickle

    from raycl.methods import SearchConfig

    config = SearchConfig(name="t", method="hscl", hscl={"filter_exponent": 2.0})
    read_back = textwrap.dedent("""
        import pickle, sys
        config = pickle.loads(sys.stdin.buffer.read())
        print(type(config).__module__, type(config).__name__, config.hscl.filter_exponent)
    """)
    result = subprocess.run([sys.executable, "-c", read_back], input=pickle.dumps(config),
                            capture_output=True, timeout=120, check=True)
    assert result.stdout.decode().split() == ["raycl.methods", "SearchConfig", "2.0"]
    # raycl.config alone knows no method: it says where the whole schema comes from.
    only_config = "from raycl.config.search_config import SearchConfig"
    failed = subprocess.run([sys.executable, "-c", only_config], capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 1
    assert "from raycl.methods import SearchConfig" in failed.stderr


def test_train_coordinator_is_pinned_only_for_sweeps_with_train_workers(tmp_path: Path) -> None:
    """raycl.tune pins Ray Train's coordinator actor (ray-project/ray#58481) only where a trial
    may start a Train controller: scaling.num_workers > 0, or searched with such a value."""
    from raycl.sweep.tuner import _trains_with_workers

    path = write(tmp_path, BASE)
    assert not _trains_with_workers(load_search(path, ["scaling.num_workers=0"]))
    assert _trains_with_workers(load_search(path, ["scaling.num_workers=1"]))
    text = BASE + "    scaling.num_workers: {choice: [0, 2]}\n"
    searched = load_search(write(tmp_path, text))
    assert _trains_with_workers(searched)
