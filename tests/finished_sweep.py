"""One finished sweep, built once per test process and shared by tests/test_export_cli.py and
tests/test_evaluate_cli.py (and, per command, tests/test_docs_commands.py).

Built without Ray: an MLflow parent run and trial runs with the tags, metrics and
``config.yaml`` artifact raycl's sweep callback writes, checkpoints (``state.pt`` of a freshly
built tiny ResNet-18 method) where Tune keeps them, and each ended trial's encoder logged into
its run by the driver's callback itself (:class:`raycl.results.run_encoder.RunEncoderCallback`,
called as Tune calls it). The end-to-end sweep's runs are checked in tests/test_end_to_end.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from mlflow import MlflowClient
from PIL import Image

from raycl.config.search_config import SearchConfig
from raycl.launch.load import load_search
from raycl.methods import build_method
from raycl.results.run_encoder import RunEncoderCallback
from raycl.tracking.runs import (
    CHECKPOINT_TAG,
    ENDED_TAG,
    PARENT_TAG,
    ROLE_TAG,
    TRIAL_TAG,
    get_or_create_experiment,
)
from tests.data_fixtures import class_images

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = "finished"
METRIC = "val/linear/mean"
# tests/test_end_to_end.py's tiny sizes.
TINY = ["data.samples_per_combination=1", "data.resolution=16", "model.width=8",
        "model.projector_hidden_dim=32", "model.projector_dim=16", "eval.linear_max_iter=50"]
# (run name, trial id, validation objective, checkpoint, how it ended). Checkpoint: "tag"
# (the run's raycl.checkpoint tag), "storage" (only in the sweep's storage: a run logged before
# the tag existed), "gone" (tagged, deleted before its encoder was logged) or None.
TRIALS = [("t01 lr=0.1", "aa001", 0.40, "tag", "completed"),
          ("t02 lr=0.2", "aa002", 0.70, "tag", "completed"),
          ("t03 lr=0.3", "aa003", 0.55, "storage", "stopped_by_scheduler"),
          ("t04 lr=0.4", "aa004", 0.20, None, "error"),
          ("t05 lr=0.5", "aa005", 0.10, "gone", "completed")]
# The new image folder raycl.evaluate scores on: colour classes, PER_CLASS images each.
CLASSES = ("red", "green", "blue")
PER_CLASS = 8


@dataclass
class Sweep:
    """The finished sweep: where it is and what each trial holds."""

    uri: str
    storage: Path
    experiment: str
    run_ids: dict[str, str]  # "t01" -> run id
    checkpoints: dict[str, Path]  # "t01" -> its checkpoint directory
    folder: Path  # new images


def trial_config(tmp: Path, lr: float, backbone: str, experiment: str) -> SearchConfig:
    return load_search(REPO / "searches" / "quickstart.yaml", [
        *TINY, f"model.backbone={backbone}", f"train.lr={lr}", f"mlflow.experiment={experiment}",
        f"tune.storage_path={tmp / 'ray'}", f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"],
        check_references=False)


def write_folder(root: Path) -> None:
    """PER_CLASS noisy PNGs of each class's colour, one sub-folder per class."""
    rng = np.random.default_rng(0)
    for index, name in enumerate(CLASSES):
        images = class_images(np.full(PER_CLASS, index), 12, 12, rng)
        (root / name).mkdir(parents=True)
        for row, image in enumerate(images):
            Image.fromarray(image.transpose(1, 2, 0)).save(root / name / f"{row}.png")


def sweep_store(tmp: Path, experiment: str) -> tuple[str, MlflowClient, str, str]:
    """``(uri, client, experiment id, parent run id)``: a sqlite store in ``tmp`` with the
    sweep's parent run, tagged as the sweep's callback tags it (objective METRIC, max)."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = get_or_create_experiment(client, experiment, uri)
    parent = client.create_run(experiment_id, run_name=experiment, tags={
        ROLE_TAG: "sweep", "raycl.metric": METRIC, "raycl.mode": "max"}).info.run_id
    return uri, client, experiment_id, parent


def log_trial_config(client: MlflowClient, run_id: str, tmp: Path, trial_id: str,
                     config: SearchConfig) -> None:
    """The trial's resolved config as its run's ``config.yaml`` artifact, as the sweep logs it."""
    path = tmp / trial_id / "config.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    client.log_artifact(run_id, str(path))


def make_sweep(tmp: Path, experiment: str = EXPERIMENT, backbone: str = "resnet18",
               log_encoders: bool = True) -> Sweep:
    """A finished sweep of :data:`TRIALS` in ``tmp`` (its trials train ``backbone``; a ResNet
    with the CIFAR stem at 16 px), each ended trial's encoder logged into its run when
    ``log_encoders``, and a new image folder."""
    uri, client, experiment_id, parent = sweep_store(tmp, experiment)
    run_ids, checkpoints = {}, {}
    config = None
    for index, (name, trial_id, objective, kept, ended) in enumerate(TRIALS):
        lr = float(name.split("=")[1])
        config = trial_config(tmp, lr, backbone, experiment)
        directory = tmp / "ray" / experiment / f"run_trial_{trial_id}_00000" / "checkpoint_000001"
        directory.mkdir(parents=True)
        if kept in ("tag", "storage"):
            torch.manual_seed(index)
            torch.save({"model": build_method(config, 3).state_dict()}, directory / "state.pt")
        (directory.with_name("checkpoint_000000")).mkdir()  # an older one: never chosen
        run = client.create_run(experiment_id, run_name=name, tags={
            PARENT_TAG: parent, ROLE_TAG: "trial", TRIAL_TAG: trial_id,
            "raycl.searched": f"train.lr={lr}", ENDED_TAG: ended})
        run_id = run.info.run_id
        client.log_metric(run_id, METRIC, objective)
        client.log_metric(run_id, "test/linear/mean", objective - 0.05)
        log_trial_config(client, run_id, tmp, trial_id, config)
        if kept in ("tag", "gone"):
            client.set_tag(run_id, CHECKPOINT_TAG, str(directory))
        if kept in (None, "gone"):
            shutil.rmtree(directory.parent)
        client.set_terminated(run_id)
        run_ids[name.split()[0]] = run_id
        checkpoints[name.split()[0]] = directory
    client.set_terminated(parent)
    if log_encoders:  # as the sweep's driver does when each trial ends
        assert config is not None
        logger = RunEncoderCallback(config)
        for _, trial_id, *_ in TRIALS:
            logger.on_trial_complete(0, [], SimpleNamespace(trial_id=trial_id))
        logger.on_experiment_end([])
    write_folder(tmp / "new_images")
    return Sweep(uri, tmp / "ray", experiment, run_ids, checkpoints, tmp / "new_images")


_SHARED: dict[str, Sweep] = {}


def shared_sweep(factory: pytest.TempPathFactory) -> Sweep:
    """The one sweep of this test process (built on first use): tests that read it share it;
    what they log into its runs is under names of their own."""
    if "sweep" not in _SHARED:
        _SHARED["sweep"] = make_sweep(factory.mktemp("finished-sweep"))
    return _SHARED["sweep"]


@contextmanager
def storage_moved_away(sweep: Sweep) -> Iterator[Path]:
    """The sweep's ``ray_results`` storage moved elsewhere for a while (as if deleted), then
    back."""
    away = sweep.storage.with_name(sweep.storage.name + "-moved-away")
    sweep.storage.rename(away)
    try:
        yield away
    finally:
        away.rename(sweep.storage)
