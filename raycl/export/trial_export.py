"""A finished trial's encoder written out (:func:`export_trial`: one format and its model card,
all or nothing) and registered in MLflow (:func:`register_encoder`): the work of
``python -m raycl.export``, whose door is :mod:`raycl.export.__main__`."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from raycl.results.trials import FinishedTrial

# The name of the MLflow model --register logs on the trial's run: not ``encoder``, the
# artifact the sweep logs the encoder under (MLflow would merge the two into one download).
REGISTERED_ARTIFACT = "model"


@dataclass(frozen=True)
class Exported:
    """What one export wrote: the files (main file first, model card last), the encoder and
    its image channels (for ``--register``), and whether it came from the encoder logged into
    the trial's run (its checkpoint gone)."""

    files: list[Path]
    encoder: nn.Module
    channels: int
    from_run: bool = False


def refuse_existing(paths: list[Path], force: bool) -> None:
    """FileExistsError (one line) for the first of ``paths`` that exists, unless ``force``."""
    if force:
        return
    for path in paths:
        if path.exists():
            raise FileExistsError(f"--out: {path} exists; choose another path or add --force")


def export_trial(trial: FinishedTrial, export_format: str, out: Path,
                 force: bool = False) -> Exported:
    """Write ``trial``'s encoder in ``export_format`` at ``out`` with its model card.

    Everything is written into a scratch folder beside ``out`` first and moved into place only
    when the whole export succeeded: a refused export leaves nothing behind.

    Args:
        trial: the trial (:func:`raycl.results.find_trials`).
        export_format: one of :data:`raycl.export.formats.FORMATS`.
        out: the main output file.
        force: overwrite files that exist.

    Returns:
        The files written (main file first), the encoder and its channels.

    Raises:
        ValueError: the format does not fit the trial's backbone, or its encoder cannot be
            rebuilt (an MCL concat checkpoint of an older raycl; from the run's logged encoder,
            a CLIP trial).
        FileExistsError: an output file exists and ``force`` is off.
        TrialLookupError: its checkpoint is gone and no encoder was logged into its run.
    """
    from raycl.export.formats import check_format, write_encoder
    from raycl.results.run_encoder import card_objective, card_test_scores, trial_encoder

    check_format(trial.config, export_format)
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix=".raycl-export-", dir=out.parent) as scratch:
        encoder, preprocessing, from_run = trial_encoder(trial, Path(scratch) / "checkpoint")
        if from_run:
            _check_reexportable(trial)
        channels = preprocessing.channels
        staged = Path(scratch) / "out"
        staged.mkdir()
        written = write_encoder(encoder, trial.config, export_format, staged / out.name,
                                channels, objective=card_objective(trial),
                                test_scores=card_test_scores(trial))
        targets = [out.parent / path.name for path in written]
        refuse_existing(targets, force)
        for path, target in zip(written, targets, strict=True):
            shutil.move(str(path), str(target))
    return Exported(files=targets, encoder=encoder, channels=channels, from_run=from_run)


def _check_reexportable(trial: FinishedTrial) -> None:
    """A ValueError (one line) for a trial whose run's logged encoder cannot be written in
    another format: a CLIP trial's (an open_clip model, not the method raycl wraps it in)."""
    from raycl.export.formats import encoder_kind

    if encoder_kind(trial.config).kind == "clip":
        raise ValueError(f"trial {trial.label}'s checkpoint is gone and a CLIP trial's logged "
                         f"encoder is not written again in another format; download it as it "
                         f"is: raycl.load_encoder({trial.encoder!r})")


def register_encoder(trial: FinishedTrial, exported: Exported, name: str) -> tuple[int, bool]:
    """Log ``exported``'s encoder as an MLflow PyTorch model on ``trial``'s run, with an input
    example and signature (normalised float images -> features), its model card beside it, and
    register it under ``name``.

    The model logged is :func:`raycl.export.plain_torch.plain_module` of the encoder's
    ``torch.export`` program, pickled: ``mlflow.pytorch.load_model`` gives an ordinary
    ``nn.Module`` (``.eval()`` works; MLflow's own pt2 format gives one whose ``eval()``
    raises, issue 47) that needs torch, not raycl, and takes any batch size.

    Args:
        trial: the trial whose run the model is logged on.
        exported: what :func:`export_trial` wrote (its encoder and model card).
        name: the registered model's name.

    Returns:
        The new version's number, and whether ``name`` was registered before.
    """
    import cloudpickle
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.exceptions import MlflowException

    from raycl.config.sweep import resolve_tracking_uri

    uri = resolve_tracking_uri(trial.tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    try:
        client.get_registered_model(name)
        existed = True
    except MlflowException:
        existed = False
    model, example, signature = _registered_model(exported, trial.config.data.resolution)
    status = client.get_run(trial.run_id).info.status
    with _fluent_tracking_uri(uri):
        # Logging into the finished run reopens it; it is closed again with the status it had.
        mlflow.start_run(run_id=trial.run_id)
        try:
            info = mlflow.pytorch.log_model(
                model, name=REGISTERED_ARTIFACT, input_example=example, signature=signature,
                registered_model_name=name, serialization_format="pickle",
                # Written, not inferred: inferring loads the model in a subprocess (seconds).
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                  f"cloudpickle=={cloudpickle.__version__}"],
                extra_files=[str(exported.files[-1])])
        finally:
            mlflow.end_run(status=status)
    return int(info.registered_model_version), existed


def _registered_model(exported: Exported, resolution: int) -> tuple[nn.Module, Any, Any]:
    """The module ``--register`` logs (the encoder's program as a plain torch module), an input
    example (a batch of 2 images, numpy) and the signature it gives."""
    import torch
    from mlflow.models import infer_signature

    from raycl.export.plain_torch import export_program, plain_module

    example = torch.randn(2, exported.channels, resolution, resolution,
                          generator=torch.Generator().manual_seed(0))
    model = plain_module(export_program(exported.encoder, example))
    with torch.no_grad():
        features = model(example)
    return model, example.numpy(), infer_signature(example.numpy(), features.numpy())


@contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's global tracking URI (which ``log_model`` logs to) set to ``uri`` for a while,
    then back as it was (set or not): a caller in the same process keeps its own."""
    import mlflow

    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)  # type: ignore[arg-type]  (None: unset)
