"""Where a trial's processes go, checked before launch: two ranks on one GPU (NCCL refuses them),
and a trial no node set of the cluster can hold (it would wait forever where nothing adds
nodes; a warning where an autoscaler can)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from raycl.config.schema import ConfigError
from raycl.launch.load import load_search
from raycl.launch.placement import (
    CLUSTER_CHECKS,
    Cluster,
    check_gpu_sharing,
    check_placement,
    fits,
    node_groups_grow,
    placement_problem,
    placement_warning,
    read_cluster,
    readonly_autoscaler,
)
from raycl.methods import SearchConfig
from raycl.tune import main

BASE = """
name: t
method: simclr
data: {dataset: trifeature, resolution: 32, samples_per_combination: 2}
train: {epochs: 1, batch_size: 64}
tune: {num_samples: 1}
"""
SHARING = ('0.5 GPU per worker with scaling.num_workers={n} lets Ray place two ranks of a trial '
           'on one GPU, which NCCL refuses ("Duplicate GPU detected"); give each worker a whole '
           'GPU (1), or share GPUs between trials with scaling.num_workers: 1 or 0')
LOCAL = "the local Ray this command started has no autoscaler"
TWO_CPUS = "this Ray's 1 node (2 CPU)"


def config(scaling: dict[str, Any], space: dict[str, Any] | None = None) -> SearchConfig:
    return SearchConfig.model_validate({"name": "x", "scaling": scaling,
                                        "tune": {"search_space": space or {}}})


def load_error(tmp_path: Path, extra: str, overrides: list[str] | None = None) -> str:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE) + textwrap.dedent(extra))
    with pytest.raises(ConfigError) as info:
        load_search(path, overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message[len(f"{path}: "):]


# ---------------------------------------------------------------------------------------------
# Finding 5: fractional GPUs with two or more workers.


def test_fractional_gpus_with_two_workers_are_refused_at_load(tmp_path: Path) -> None:
    scaling = "scaling: {num_workers: 2, use_gpu: true, gpus_per_worker: 0.5}\n"
    assert load_error(tmp_path, scaling) == f"scaling.gpus_per_worker: {SHARING.format(n=2)}"


@pytest.mark.parametrize(("scaling", "space", "searched"), [
    ({"num_workers": 2, "use_gpu": True},
     {"scaling.gpus_per_worker": {"choice": [1, 0.5]}}, "scaling.gpus_per_worker=0.5"),
    ({"num_workers": 1, "use_gpu": True, "gpus_per_worker": 0.5},
     {"scaling.num_workers": {"randint": [1, 4]}}, "scaling.num_workers=4"),
    ({"num_workers": 2, "gpus_per_worker": 0.5},
     {"scaling.use_gpu": {"choice": [False, True]}}, "scaling.use_gpu=True"),
    ({"num_workers": 2, "use_gpu": True},
     {"scaling.gpus_per_worker": {"uniform": [0.5, 2.0]}}, "scaling.gpus_per_worker=0.5"),
])
def test_searched_keys_are_checked_in_every_combination(
    scaling: dict[str, Any], space: dict[str, Any], searched: str
) -> None:
    found = list(check_gpu_sharing(config(scaling, space)))
    workers = 4 if "num_workers=4" in searched else 2
    assert [(p.key, p.why) for p in found] == [
        ("scaling.gpus_per_worker", f"with searched {searched}: {SHARING.format(n=workers)}")]


@pytest.mark.parametrize(("scaling", "space"), [
    ({"num_workers": 1, "use_gpu": True, "gpus_per_worker": 0.5}, {}),  # GPUs shared by trials
    ({"num_workers": 0, "use_gpu": True, "gpus_per_worker": 0.25}, {}),
    ({"num_workers": 4, "use_gpu": False, "gpus_per_worker": 0.5}, {}),  # ignored on CPU
    ({"num_workers": 4, "use_gpu": True, "gpus_per_worker": 2}, {}),
    ({"num_workers": 2, "use_gpu": True}, {"scaling.gpus_per_worker": {"choice": [1, 2]}}),
    ({"num_workers": 0, "use_gpu": True, "gpus_per_worker": 0.5},
     {"scaling.num_workers": {"choice": [0, 1]}}),
])
def test_whole_gpus_or_one_worker_are_fine(scaling: dict[str, Any],
                                           space: dict[str, Any]) -> None:
    assert list(check_gpu_sharing(config(scaling, space))) == []


def test_cli_refuses_fractional_gpus_before_launch(tmp_path: Path, capsys) -> None:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE))
    code = main([str(path), "--set", "scaling.num_workers=2", "--set", "scaling.use_gpu=true",
                 "--set", "scaling.gpus_per_worker=0.5", "--storage", str(tmp_path / "ray")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {path}: scaling.gpus_per_worker: {SHARING.format(n=2)}")
    assert not (tmp_path / "ray").exists()


# ---------------------------------------------------------------------------------------------
# Finding 9: a trial that can never be placed.


def test_placement_is_exact_for_identical_workers() -> None:
    one, two = ({"CPU": 2.0},), ({"CPU": 2.0}, {"CPU": 2.0})
    trial = {"CPU": 0.01}
    assert not fits(one, trial, {"CPU": 1.0}, 2)  # 2.01 CPUs on a 2-core machine
    assert fits(one, trial, {"CPU": 0.5}, 2)
    assert not fits(two, trial, {"CPU": 2.0}, 2)  # 4 CPUs in all, but the trial takes a share
    assert fits((*two, {"CPU": 1.0}), trial, {"CPU": 2.0}, 2)
    assert fits(one, {"CPU": 2.0}, {}, 0)  # in-process
    assert not fits(({"CPU": 16.0, "GPU": 1.0},), trial, {"CPU": 1.0, "GPU": 1.0}, 2)
    assert fits(({"CPU": 8.0, "GPU": 1.0},) * 2, trial, {"CPU": 1.0, "GPU": 1.0}, 2)


@pytest.mark.parametrize(("scaling", "space", "key", "why"), [
    ({"num_workers": 2, "cpus_per_worker": 2}, {}, "scaling.num_workers",
     f"one trial holds 4.01 CPU at once (2 workers x 2 CPU + 0.01 CPU for the trial process); "
     f"{TWO_CPUS} cannot place it"),
    ({"num_workers": 0, "cpus_per_worker": 3}, {}, "scaling.cpus_per_worker",
     f"a trial trains in its own process (scaling.num_workers: 0) and needs 3 CPU; none of "
     f"{TWO_CPUS} has that"),
    ({"num_workers": 1, "use_gpu": True}, {}, "scaling.use_gpu",
     "one worker needs 1 CPU, 1 GPU; none of this Ray's 1 node (2 CPU, 0 GPU) has that"),
    ({"num_workers": 1, "cpus_per_worker": 1}, {"scaling.num_workers": {"choice": [1, 2]}},
     "scaling.num_workers", f"with searched scaling.num_workers=2: one trial holds 2.01 CPU at "
     f"once (2 workers x 1 CPU + 0.01 CPU for the trial process); {TWO_CPUS} cannot place it"),
    ({"num_workers": 2}, {"scaling.cpus_per_worker": {"uniform": [0.25, 1.0]}},
     "scaling.num_workers", f"with searched scaling.cpus_per_worker=1.0: one trial holds 2.01 CPU "
     f"at once (2 workers x 1 CPU + 0.01 CPU for the trial process); {TWO_CPUS} cannot place it"),
])
def test_without_an_autoscaler_a_trial_that_cannot_be_placed_is_an_error(
    scaling: dict[str, Any], space: dict[str, Any], key: str, why: str
) -> None:
    cluster = Cluster(({"CPU": 2.0, "memory": 1e9},), False, LOCAL)
    found = list(check_placement(config(scaling, space), cluster))
    assert [(p.key, p.why) for p in found] == [
        (key, f"{why}, and nothing will add a node: {LOCAL}; ask for less, or run on a larger "
              f"cluster (--address)")]
    assert placement_warning(config(scaling, space), cluster) is None


@pytest.mark.parametrize(("can_add", "how"), [
    (True, "its autoscaler can add them"), (None, "if this cluster has none, they wait forever")])
def test_an_autoscaler_that_can_add_nodes_leaves_a_warning_only(can_add: bool | None,
                                                                how: str) -> None:
    cluster = Cluster(({"CPU": 2.0},), can_add, how)
    wide = config({"num_workers": 2, "cpus_per_worker": 2})
    assert list(check_placement(wide, cluster)) == []
    assert placement_warning(wide, cluster) == (
        f"scaling.num_workers: one trial holds 4.01 CPU at once (2 workers x 2 CPU + 0.01 CPU "
        f"for the trial process); {TWO_CPUS} cannot place it; trials wait until an autoscaler "
        f"adds nodes ({how})")


@pytest.mark.parametrize(("scaling", "space"), [
    ({"num_workers": 2, "cpus_per_worker": 0.5}, {}),
    ({"num_workers": 0, "cpus_per_worker": 2}, {}),
    ({"num_workers": 1}, {"scaling.cpus_per_worker": {"loguniform": [0.25, 1.0]}}),
    ({"num_workers": 1, "cpus_per_worker": 0.5}, {"scaling.num_workers": {"randint": [0, 3]}}),
])
def test_trials_that_fit_pass(scaling: dict[str, Any], space: dict[str, Any]) -> None:
    cluster = Cluster(({"CPU": 2.0},), False, LOCAL)
    assert placement_problem(config(scaling, space), cluster) is None


def test_how_an_autoscaler_is_told() -> None:
    node = "b22cbc7d"
    readonly = {"autoscaler_report": {"node_type_mapping": {node: f"node_{node}"}}}
    launched = {"autoscaler_report": {"node_type_mapping": {node: "ray.head.default"}}}
    assert readonly_autoscaler(readonly) is True
    assert readonly_autoscaler(launched) is False
    assert readonly_autoscaler({"load_metrics_report": {}}) is None  # first iteration pending
    assert node_groups_grow([(0, 0), (0, 8)]) and node_groups_grow([(1, -1)])
    assert not node_groups_grow([(2, 2), (0, 0)])


def test_the_session_ray_is_local_and_sized(ray_session) -> None:
    """The Ray a process starts itself (as python -m raycl.tune does) has no autoscaler."""
    cluster = read_cluster()
    assert cluster.can_add_nodes is False and cluster.how == LOCAL
    assert sum(node.get("CPU", 0.0) for node in cluster.nodes) == 2.0
    fitting = config({"num_workers": 2, "cpus_per_worker": 0.5})
    assert [next(iter(check(fitting)), None) for check in CLUSTER_CHECKS] == [None]


def test_an_autoscalers_cluster_config_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node groups an autoscaler reported to the GCS (what Ray Train V2 reads): one that can grow
    leaves a warning; fixed ones are certain once every group is up."""
    from ray._private import worker
    from ray._private.state import state
    from ray.core.generated import autoscaler_pb2

    from raycl.launch import placement

    reported = autoscaler_pb2.ClusterConfig()
    group = reported.node_group_configs.add(name="gpu", min_count=0, max_count=8)
    group.resources["GPU"] = 1
    monkeypatch.setattr(worker, "_global_node", None)  # not a Ray this process started
    monkeypatch.setattr(state, "get_cluster_config", lambda: reported)
    assert placement._autoscaling(1) == (True, "its autoscaler can add them")
    group.min_count = 8
    assert placement._autoscaling(9) == (False, "its autoscaler's node groups are all at their "
                                                "maximum")
    assert placement._autoscaling(8)[0] is None  # one node may still be starting


# ---------------------------------------------------------------------------------------------
# scaling.resources_per_worker: a node type's custom resource (e.g. only GPU nodes declare it).


def test_custom_resources_go_into_every_worker_bundle() -> None:
    from raycl.launch.placement import trial_demand, trial_resources, worker_resources

    workers = config({"num_workers": 2, "cpus_per_worker": 1,
                      "resources_per_worker": {"gpu_node": 1}})
    assert worker_resources(workers) == {"CPU": 1.0, "gpu_node": 1.0}
    assert trial_resources(workers) == {"CPU": 0.01}  # the trial process runs anywhere
    assert trial_demand(workers) == {"CPU": 2.01, "gpu_node": 2.0}
    in_process = config({"num_workers": 0, "resources_per_worker": {"gpu_node": 0.5}})
    assert trial_resources(in_process) == {"CPU": 1.0, "gpu_node": 0.5}


def test_workers_are_placed_only_on_nodes_with_the_resource() -> None:
    head, worker = {"CPU": 4.0}, {"CPU": 1.0, "gpu_node": 1.0}
    bundle = {"CPU": 1.0, "gpu_node": 1.0}
    assert fits((head, worker, worker), {"CPU": 0.01}, bundle, 2)
    assert not fits((head, worker), {"CPU": 0.01}, bundle, 2)  # one node type slot only
    assert not fits(({"CPU": 8.0, "gpu_node": 0.5},), {"CPU": 0.01}, bundle, 1)


def test_a_resource_no_node_declares_is_named_in_one_line() -> None:
    nodes = ({"CPU": 0.0, "memory": 1e9}, {"CPU": 2.0, "gpu_node": 1.0})
    wanted = config({"num_workers": 1, "resources_per_worker": {"gpu_nod": 1}})
    found = list(check_placement(wanted, Cluster(nodes, False, LOCAL)))
    assert [(p.key, p.why) for p in found] == [(
        "scaling.resources_per_worker",
        f"a worker needs 1 'gpu_nod', a resource none of this Ray's 2 nodes declares, and "
        f"nothing will add a node: {LOCAL}; ask for less, or run on a larger cluster (--address)")]
    # An autoscaler may start a node type that declares it: a warning, not an error.
    can_add = Cluster(nodes, True, "its autoscaler can add them")
    assert list(check_placement(wanted, can_add)) == []
    assert placement_warning(wanted, can_add).startswith(
        "scaling.resources_per_worker: a worker needs 1 'gpu_nod'")


def test_too_few_nodes_with_the_resource_names_the_workers() -> None:
    nodes = ({"CPU": 2.0}, {"CPU": 2.0, "gpu_node": 1.0})
    two = config({"num_workers": 2, "resources_per_worker": {"gpu_node": 1}})
    (problem,) = check_placement(two, Cluster(nodes, False, LOCAL))
    assert problem.key == "scaling.num_workers"
    assert problem.why.startswith("one trial holds 2.01 CPU, 2 gpu_node at once (2 workers x "
                                  "1 CPU, 1 gpu_node + 0.01 CPU for the trial process)")
    assert placement_problem(config({"num_workers": 1, "resources_per_worker": {"gpu_node": 1}}),
                             Cluster(nodes, False, LOCAL)) is None


@pytest.mark.parametrize(("resources", "why"), [
    ("{CPU: 1}", "'CPU' is set by scaling.cpus_per_worker, not here"),
    ("{GPU: 1}", "'GPU' is set by scaling.gpus_per_worker, not here"),
    ("{gpu_node: 0}", "'gpu_node': 0 must be above 0"),
])
def test_resources_per_worker_is_checked_at_load(tmp_path: Path, resources: str,
                                                 why: str) -> None:
    extra = f"scaling: {{resources_per_worker: {resources}}}\n"
    assert load_error(tmp_path, extra) == f"scaling.resources_per_worker: {why}"


def test_resources_per_worker_reach_ray_trains_scaling_config(monkeypatch) -> None:
    """What the TorchTrainer is given: the same bundle the placement check reasons about, and
    the default group's watchdog (``scaling.collective_timeout_s``) named, not inherited."""
    from raycl.trial import trainable

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_trainer(*args: Any, scaling_config: Any, torch_config: Any, **kwargs: Any) -> None:
        seen["resources"] = scaling_config.resources_per_worker
        seen["timeout_s"] = torch_config.timeout_s
        raise Stop

    monkeypatch.setattr(trainable, "TorchTrainerWithoutDatasets", fake_trainer)
    wanted = config({"num_workers": 2, "resources_per_worker": {"gpu_node": 1},
                     "collective_timeout_s": 600})
    with pytest.raises(Stop):
        trainable.fit_trial(wanted, "/tmp/unused")
    assert seen == {"resources": {"CPU": 1.0, "gpu_node": 1.0}, "timeout_s": 600}


def test_a_storage_uri_keeps_its_options_after_the_sweeps_directory() -> None:
    """``--storage s3://b/raycl?endpoint_override=...``: the sweep's and Ray Train's directories
    go before the query, which pyarrow reads the S3 options from."""
    from raycl.launch.sweep_plan import storage_child

    uri = "s3://b/raycl?endpoint_override=127.0.0.1:9000&scheme=http"
    assert storage_child(uri, "sweep-train") == (
        "s3://b/raycl/sweep-train?endpoint_override=127.0.0.1:9000&scheme=http")
    assert storage_child("s3://b/raycl/", "sweep") == "s3://b/raycl/sweep"
    assert storage_child("/data/ray_results", "sweep") == "/data/ray_results/sweep"


def test_a_trainer_without_datasets_starts_no_dataset_actor() -> None:
    """raycl passes Ray Train no datasets: its trainer leaves out the callback that starts a
    DatasetManager actor per worker-group start (raycl.trial.torch_trainer); given datasets, the
    trainer is Ray's own, callback included."""
    from ray.train.v2._internal.callbacks import DatasetsCallback

    from raycl.trial.torch_trainer import TorchTrainerWithoutDatasets

    def kinds(**datasets: Any) -> set[str]:
        trainer = TorchTrainerWithoutDatasets(lambda: None, datasets=datasets or None)
        return {type(callback).__name__ for callback in trainer._create_default_callbacks()}

    without, given = kinds(), kinds(train=[1, 2, 3])
    assert DatasetsCallback.__name__ not in without
    assert DatasetsCallback.__name__ in given
    # nothing else is dropped: the placement-group cleaner and the backend setup stay
    assert given - without == {DatasetsCallback.__name__}
    assert {"PlacementGroupCleanerCallback", "BackendSetupCallback"} <= without
