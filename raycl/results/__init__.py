"""What a finished sweep left behind: its trials, their configs and checkpoints, found from
MLflow (:mod:`raycl.results.trials`)."""

from raycl.results.trials import FinishedTrial, TrialLookupError, find_trials, local_checkpoint

__all__ = ["FinishedTrial", "TrialLookupError", "find_trials", "local_checkpoint"]
