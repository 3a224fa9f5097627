"""Issue 33, findings 5 and 10: stream mode's decoders sit in their own worker's bundle (same node
as the GPU they feed, their Ray Data tasks scheduled there), ``tune.max_concurrent_trials``
trials are packed onto the cluster's nodes before launch (an error where they can never all run,
a warning where an autoscaler may help), and ``data.loader: auto`` is decided on the nodes that
can run trials, not on a ``CPU: 0`` head's memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_end_to_end import tiny_config
from test_stream import CLASSES, PER_CLASS, write_folder

from raycl.config.schema import ConfigError
from raycl.config.search_config import apply_overrides, search_config_class
from raycl.launch.checks import run_checks
from raycl.launch.placement import (
    Cluster,
    check_placement,
    placement_warning,
    trial_resources,
    worker_resources,
)
from raycl.sweep.run import settle_loader

LOCAL = "the local Ray this command started has no autoscaler"
GPU_NODE = {"CPU": 64.0, "GPU": 8.0, "memory": 400e9}  # a p4d/p5-like 8-GPU node
HEAD = {"CPU": 0.0, "memory": 8e9}  # runs no trials (clusters/*.yaml)


def sweep(loader: str, **scaling: Any) -> Any:
    """A sweep of 2-worker GPU trials, 4 at once, reading a folder with ``loader``."""
    return search_config_class().model_validate({
        "name": "x", "data": {"dataset": "folder", "root": "/images", "loader": loader},
        "scaling": {"num_workers": 2, "use_gpu": True, **scaling},
        "tune": {"max_concurrent_trials": 4}})


# ---------------------------------------------------------------------------------------------
# Finding 5: decoders in their worker's bundle; max_concurrent_trials trials checked at once.


def test_four_two_worker_trials_on_an_8_gpu_node_bundle_by_bundle() -> None:
    """Each worker's bundle holds its training CPUs and its decoders' on one node (no decoder
    bundle beside the trial process, which may land on another node); 4 trials of 2 workers
    fill the node's 8 GPUs, and their trial processes take the CPUs left."""
    from raycl.launch.packing import bundles_per_node, pack_trials

    streamed = sweep("stream", cpus_per_worker=6)  # data.stream_cpus: 1 (the default)
    assert worker_resources(streamed) == {"CPU": 7.0, "GPU": 1.0}
    assert trial_resources(streamed) == {"CPU": 0.01}
    placed = pack_trials((HEAD, GPU_NODE), trial_resources(streamed),
                         worker_resources(streamed), 2, 4)
    assert placed is not None
    head, node = bundles_per_node(placed)
    assert head == []
    assert node == [{"CPU": 7.0, "GPU": 1.0}] * 8 + [{"CPU": 0.01}] * 4
    assert sorted({(p.trial, p.part) for p in placed[1]}) == sorted(
        {(t, part) for t in range(4) for part in ("worker 0", "worker 1", "trial process")})
    assert list(check_placement(streamed, Cluster((HEAD, GPU_NODE), False, LOCAL))) == []


def test_four_trials_that_cannot_all_run_are_an_error_where_nothing_adds_nodes() -> None:
    """all4one_imagenet100.yaml's workers (8 CPUs, 1 GPU each; memory mode) x 2 x 4 trials need
    64 CPUs plus the trial processes' 0.04 on a 64-CPU node: the fourth trial's worker group
    would wait while its trial holds a slot. One line naming the key, before launch; a warning
    where an autoscaler may add a node that holds them; an error where its node types cannot."""
    all4one = sweep("memory", cpus_per_worker=8)
    alone = Cluster((HEAD, GPU_NODE), False, LOCAL)
    [problem] = check_placement(all4one, alone)
    assert problem.key == "tune.max_concurrent_trials"
    assert problem.why.startswith(
        "4 trials at once hold 64.04 CPU, 8 GPU (2 workers x 8 CPU, 1 GPU + 0.01 CPU for the "
        "trial process); this Ray's 2 nodes (0 CPU, 0 GPU; 64 CPU, 8 GPU) hold 3 of them at "
        "once")
    assert problem.why.endswith(f"and nothing will add a node: {LOCAL}; lower "
                                f"tune.max_concurrent_trials, or ask less per trial")
    with pytest.raises(ConfigError) as info:
        run_checks(all4one, "all4one_imagenet100.yaml", (lambda c: check_placement(c, alone),))
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("all4one_imagenet100.yaml: tune.max_concurrent_trials: 4 trials")
    # Three at once fit; so do four with a 7-CPU worker (the trial processes take 0.04).
    assert list(check_placement(apply_overrides(all4one, {"tune.max_concurrent_trials": 3}),
                                alone)) == []
    assert list(check_placement(sweep("memory", cpus_per_worker=7), alone)) == []
    # An autoscaler that may add a second 8-GPU node: a warning only.
    from raycl.launch.ray_nodes import NodeType

    gpu_type = NodeType("gpu", dict(GPU_NODE), 2)
    growing = Cluster((HEAD, GPU_NODE), True, "its autoscaler can add them", (gpu_type,))
    assert list(check_placement(all4one, growing)) == []
    assert placement_warning(all4one, growing).startswith("tune.max_concurrent_trials: 4 trials")
    # Node types that can never hold them (one 8-GPU node at most): an error again.
    capped = Cluster((HEAD,), True, "its autoscaler can add them",
                     (NodeType("gpu", dict(GPU_NODE), 1),))
    [problem] = check_placement(all4one, capped)
    assert "not even the node types its autoscaler may add, at their maximum, can: gpu " \
           "(64 CPU, 8 GPU) x 1" in problem.why
    assert placement_warning(all4one, capped) is None


def test_a_workers_bundle_holds_its_decoders_and_tune_holds_the_trial_process_only(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """What Ray is given: the worker group's bundles (ScalingConfig.resources_per_worker) hold
    training's CPUs plus data.stream_cpus; the trial's own placement group one bundle."""
    from raycl.sweep.tuner import sweep_trainable
    from raycl.trial import trainable

    config = sweep("stream", cpus_per_worker=1, use_gpu=False)
    config = apply_overrides(config, {"data.stream_cpus": 0.5})
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def fake_trainer(*args: Any, scaling_config: Any, **kwargs: Any) -> None:
        seen["worker"] = scaling_config.resources_per_worker
        raise Stop

    monkeypatch.setattr(trainable, "TorchTrainerWithoutDatasets", fake_trainer)
    with pytest.raises(Stop):
        trainable.fit_trial(config, "/tmp/unused")
    assert seen["worker"] == {"CPU": 1.5}

    import ray.tune

    monkeypatch.setattr(ray.tune, "with_resources",
                        lambda trainable, resources: seen.update(trial=resources))
    sweep_trainable(config, "/tmp/unused")
    assert seen["trial"] == {"CPU": 0.01}


def test_decoders_run_in_their_workers_own_bundle(ray_session, tmp_path: Path) -> None:
    """A process holding all of its bundle (as a Ray Train worker does) streams an epoch: its
    decoding tasks are scheduled into that bundle (same node), ask for no CPU of their own (the
    bundle has none free, so they would wait forever otherwise), run at most data.stream_cpus at
    once, and decode the pixels memory mode reads; evaluation's row batches are decoded there
    too, in order."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    folder = write_folder(tmp_path / "images")
    config = tiny_config(tmp_path, "quickstart.yaml", "data.dataset=folder",
                         f"data.root={folder}", "data.resolution=16", "data.loader=stream",
                         "train.batch_size=16", "data.stream_cpus=1")
    group = placement_group([{"CPU": 0.25}, {"CPU": 0.5}])
    ray.get(group.ready(), timeout=120)

    @ray.remote
    class Worker:
        def epoch(self, settings: dict[str, Any]) -> dict[str, Any]:
            import raycl.methods  # noqa: F401  (the schema's method sections)
            from raycl.config.search_config import search_config_class
            from raycl.data import load_dataset
            from raycl.worker.evaluate import file_decoder
            from raycl.worker.loader import batch_sampler
            from raycl.worker.stage_integration import StageInputs
            from raycl.worker.stream_loader import FileStreamLoader, decoded_row_batches

            trial = search_config_class().model_validate(settings)
            images = load_dataset(trial.data, trial.seed).train.images
            sampler = batch_sampler(trial, StageInputs(), len(images), 0, 1)
            loader = FileStreamLoader(trial, images, StageInputs(), 0, 1, sampler)
            strategy = loader.remote_args["scheduling_strategy"]
            loader.set_epoch(2)
            torch.manual_seed(3)
            batches = [(batch.index, batch.images) for batch in loader]
            # Evaluation's decoding (the stretch of finding 3): the same tasks, the same bundle.
            evaluated = list(decoded_row_batches(images, 0, len(images), 24,
                                                 trial.data.stream_cpus))
            return {"group": strategy.placement_group.id.hex(),
                    "bundle": strategy.placement_group_bundle_index,
                    "num_cpus": loader.remote_args["num_cpus"],
                    "tasks_at_once": loader.remote_args["compute"].size,
                    "limit": loader.reserved_cpus, "batches": batches, "evaluated": evaluated,
                    # what evaluate_epoch embeds stream mode's files with, in this bundle
                    "evaluation_decodes_here": file_decoder(trial) is not None}

    try:
        worker = Worker.options(num_cpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=1)).remote()
        seen = ray.get(worker.epoch.remote(config.to_dict()), timeout=300)
    finally:
        remove_placement_group(group)
    assert (seen["group"], seen["bundle"]) == (group.id.hex(), 1)
    assert seen["num_cpus"] == 0 and seen["tasks_at_once"] == 1 and seen["limit"] == 1.0
    assert seen["evaluation_decodes_here"]
    from raycl.worker.evaluate import file_decoder

    assert file_decoder(config) is None  # the driver holds no bundle: it decodes in-process
    from raycl.data import load_dataset
    from raycl.worker.loader import IndexedImages

    train = load_dataset(config.data, config.seed).train.images
    decoded = IndexedImages(train)
    assert len(seen["batches"]) == len(train) // 16 > 0
    for index, images in seen["batches"]:
        reference, _ = decoded.__getitems__(index.tolist())
        assert torch.equal(images, reference)
    assert [len(rows) for rows, _ in seen["evaluated"]] == [24] * (len(train) // 24) + (
        [len(train) % 24] if len(train) % 24 else [])
    assert all(bad == [] for _, bad in seen["evaluated"])
    assert np.array_equal(np.concatenate([rows for rows, _ in seen["evaluated"]]),
                          train.decode(0, len(train)).images)


# ---------------------------------------------------------------------------------------------
# Finding 10: data.loader: auto decided on the nodes that can run trials.


def _nodes(*resources: dict[str, float]) -> list[dict[str, Any]]:
    return [{"Alive": True, "Resources": dict(node)} for node in resources]


def test_auto_decides_on_the_nodes_that_run_trials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    """A CPU-0 head too small for the decoded set no longer decides for the GPU nodes: the
    smallest node that can hold a worker does (GPUs when the workers need them, else enough
    CPUs), or, before any such node is up, the node types an autoscaler may add."""
    import ray
    from ray._private import worker
    from ray._private.state import state
    from ray.core.generated import autoscaler_pb2

    folder = write_folder(tmp_path / "images")
    decoded = CLASSES * PER_CLASS * 3 * 16 * 16  # the set's bytes at 16 px
    config = tiny_config(tmp_path, "quickstart.yaml", "data.dataset=folder",
                         f"data.root={folder}", "data.resolution=16", "scaling.num_workers=1",
                         "scaling.use_gpu=true")
    assert config.data.loader == "auto"
    small, large = {"memory": float(decoded)}, {"memory": 4.0 * decoded}
    reported = autoscaler_pb2.ClusterConfig()
    monkeypatch.setattr(worker, "_global_node", None)  # a cluster, not a local Ray
    monkeypatch.setattr(state, "get_cluster_config", lambda: reported)

    def settled(*nodes: dict[str, float]) -> str:
        monkeypatch.setattr(ray, "nodes", lambda: _nodes(*nodes))
        return settle_loader(config).data.loader

    # The head (small, CPU 0) and a GPU node (large): the GPU node decides.
    assert settled({"CPU": 0.0, **small}, {"CPU": 8.0, "GPU": 1.0, **large}) == "memory"
    assert "of the smallest node that runs trials (0.0 GB)" in capsys.readouterr().out
    # A small GPU node still streams.
    assert settled({"CPU": 0.0, **large}, {"CPU": 8.0, "GPU": 1.0, **small}) == "stream"
    # Only the head is up: the GPU node type the autoscaler may add decides.
    group = reported.node_group_configs.add(name="gpu", min_count=0, max_count=4)
    group.resources.update({"CPU": 8, "GPU": 1, "memory": 4 * decoded})
    assert settled({"CPU": 0.0, **small}) == "memory"
    # CPU workers: a node with the worker's CPUs decides, the CPU-0 head does not.
    cpus = apply_overrides(config, {"scaling.use_gpu": False, "scaling.cpus_per_worker": 2})
    monkeypatch.setattr(ray, "nodes", lambda: _nodes({"CPU": 0.0, **small},
                                                     {"CPU": 1.0, **small},
                                                     {"CPU": 4.0, **large}))
    assert settle_loader(cpus).data.loader == "memory"
