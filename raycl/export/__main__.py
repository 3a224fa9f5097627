"""``python -m raycl.export``: a finished trial's trained encoder, out of its checkpoint into a
file that plain PyTorch, torchvision, timm, safetensors or open_clip code loads.

    python -m raycl.export --experiment quickstart --trial best --format small_cnn \\
        --out best.pt2 [--register quickstart-encoder]

The trial is found from what its MLflow run records (:func:`raycl.results.find_trials`: its
config, and its last checkpoint, local or in a bucket; once the checkpoint is gone, the encoder
the sweep logged into the run, :mod:`raycl.results.run_encoder`); the file and its model card
(``<file>.model_card.json``) are written by :mod:`raycl.export.formats`. ``--register NAME``
also logs the encoder as an MLflow PyTorch model on the trial's run and registers it, so that
``mlflow.pytorch.load_model("models:/NAME/<version>")`` embeds images. This module is the
command's door: the work is :mod:`raycl.export.trial_export`'s.

Bad input (an experiment or trial that does not exist, a trial without a checkpoint, a format
that does not fit its backbone, an output that exists without ``--force``) is one line on
stderr and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from raycl.config.sweep import add_tracking_uri_option
from raycl.export.formats import FORMATS
from raycl.export.model_card import card_path
from raycl.export.trial_export import export_trial, refuse_existing, register_encoder

if TYPE_CHECKING:
    from raycl.results.trials import FinishedTrial

# Exit code of bad input, as raycl.tune's and raycl.leaderboard's.
BAD_INPUT = 2


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

    refuse_existing([args.out, card_path(args.out)], args.force)
    if not args.out.parent.is_dir():
        raise ValueError(f"--out {args.out}: its directory {args.out.parent} does not exist")
    return find_trials(args.tracking_uri, args.experiment, args.trial)[0]


def _objective_text(trial: FinishedTrial) -> str:
    """``val/linear/mean 0.6123`` (or that it has none), for the printed line."""
    metric = trial.config.tune.metric
    value = trial.metrics.get(metric)
    return f"no {metric}" if value is None else f"{metric} {value:.4g}"


if __name__ == "__main__":
    sys.exit(main())
