"""``python -m raycl.export``: a finished trial's trained encoder, out of its checkpoint into a
file that plain PyTorch, torchvision, timm, safetensors or open_clip code loads.

    python -m raycl.export --experiment quickstart --trial best --format small_cnn \\
        --out best.pt2 [--register quickstart-encoder]

The trial is found from what its MLflow run records (:func:`raycl.results.find_trials`: its
config, and its last checkpoint, local or in a bucket; once the checkpoint is gone, the encoder
the sweep logged into the run, :mod:`raycl.results.run_encoder`); the file and its model card
(``<file>.model_card.json``) are written by :mod:`raycl.export.formats`. ``--register NAME``
also logs the encoder as an MLflow PyTorch model on the trial's run and registers it, so that
``mlflow.pytorch.load_model("models:/NAME/<version>")`` embeds images.

Bad input (an experiment or trial that does not exist, a trial without a checkpoint, a format
that does not fit its backbone, an output that exists without ``--force``) is one line on
stderr and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from raycl.config.sweep import add_tracking_uri_option
from raycl.export.formats import FORMATS
from raycl.export.model_card import card_path

if TYPE_CHECKING:
    from torch import nn

    from raycl.results.trials import FinishedTrial

# Exit code of bad input, as raycl.tune's and raycl.leaderboard's.
BAD_INPUT = 2
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of ``python -m raycl.export``."""
    parser = argparse.ArgumentParser(prog="python -m raycl.export",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", required=True, help="the sweep's MLflow experiment")
    parser.add_argument("--trial", default="best",
                        help="best (by the sweep's validation objective), a trial name (t07) "
                             "or an MLflow run id (default: best)")
    add_tracking_uri_option(parser)
    parser.add_argument("--format", dest="export_format", required=True, choices=FORMATS,
                        help="the file's format")
    parser.add_argument("--out", required=True, type=Path, help="the file to write")
    parser.add_argument("--register", metavar="MODEL_NAME",
                        help="also log the encoder on the trial's run and register it in the "
                             "MLflow Model Registry under this name (a new version if it exists)")
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m raycl.export``; returns the exit code (2: bad input, nothing written)."""
    from raycl.results.trials import TrialLookupError
    from raycl.tracking.retry import RETRY_ENV, TrackingUnavailableError

    args = parse_args(argv)
    # A person waiting at a terminal: a store that is away is said within seconds.
    os.environ.setdefault(RETRY_ENV, "10")
    try:
        trial = _trial(args)
        exported = export_trial(trial, args.export_format, args.out, args.force)
    except (TrialLookupError, ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except TrackingUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    source = f" from its run's {trial.encoder} (its checkpoint is gone)" if exported.from_run \
        else ""
    print(f"raycl: trial {trial.label} of {trial.experiment} ({_objective_text(trial)}) "
          f"exported as {args.export_format}{source}: {', '.join(map(str, exported.files))}")
    if args.register:
        version, existed = register_encoder(trial, exported, args.register)
        again = "exists; added as" if existed else "registered as"
        print(f"raycl: model {args.register!r} {again} version {version}: "
              f"mlflow.pytorch.load_model('models:/{args.register}/{version}')")
    return 0


def _trial(args: argparse.Namespace) -> FinishedTrial:
    """The trial ``--trial`` names; the output checked first (nothing is looked up for an
    output that would not be written)."""
    from raycl.results.trials import find_trials

    _refuse_existing([args.out, card_path(args.out)], args.force)
    if not args.out.parent.is_dir():
        raise ValueError(f"--out {args.out}: its directory {args.out.parent} does not exist")
    return find_trials(args.tracking_uri, args.experiment, args.trial)[0]


def _refuse_existing(paths: list[Path], force: bool) -> None:
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
        _refuse_existing(targets, force)
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


def _objective_text(trial: FinishedTrial) -> str:
    """``val/linear/mean 0.6123`` (or that it has none), for the printed line."""
    metric = trial.config.tune.metric
    value = trial.metrics.get(metric)
    return f"no {metric}" if value is None else f"{metric} {value:.4g}"


def register_encoder(trial: FinishedTrial, exported: Exported, name: str) -> tuple[int, bool]:
    """Log ``exported``'s encoder as an MLflow PyTorch model on ``trial``'s run, with an input
    example and signature (normalised float images -> features), its model card beside it, and
    register it under ``name``.

    Args:
        trial: the trial whose run the model is logged on.
        exported: what :func:`export_trial` wrote (its encoder and model card).
        name: the registered model's name.

    Returns:
        The new version's number, and whether ``name`` was registered before.
    """
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.exceptions import MlflowException
    from mlflow.models import infer_signature

    from raycl.config.sweep import resolve_tracking_uri

    uri = resolve_tracking_uri(trial.tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    try:
        client.get_registered_model(name)
        existed = True
    except MlflowException:
        existed = False
    resolution = trial.config.data.resolution
    example = torch.randn(2, exported.channels, resolution, resolution,
                          generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = exported.encoder(example)
    signature = infer_signature(example.numpy(), features.numpy())
    status = client.get_run(trial.run_id).info.status
    with _fluent_tracking_uri(uri):
        # Logging into the finished run reopens it; it is closed again with the status it had.
        mlflow.start_run(run_id=trial.run_id)
        try:
            info = mlflow.pytorch.log_model(
                exported.encoder, name=REGISTERED_ARTIFACT, input_example=example.numpy(),
                signature=signature, registered_model_name=name,
                # Written, not inferred: inferring loads the model in a subprocess (seconds).
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
                extra_files=[str(exported.files[-1])])
        finally:
            mlflow.end_run(status=status)
    return int(info.registered_model_version), existed


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


if __name__ == "__main__":
    sys.exit(main())
