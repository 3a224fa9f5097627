"""MLflow tracking: one parent run per sweep, one nested child run per trial, the leaderboard.

Layered one way, each module importing only those listed before it:

- :mod:`~raycl.tracking.retry`: every call to MLflow waits out a store briefly away (a
  server restarting, a locked sqlite file), up to a bound;
- :mod:`~raycl.tracking.runs`: the tags raycl writes, the client, the experiment, a trial's run
  and logging to it straight;
- :mod:`~raycl.tracking.naming`: a child run's name (``t03 K=5 N=2 τ=0.31``);
- :mod:`~raycl.tracking.relay`: trials log through an actor on the driver's node
  (:func:`log_to_trial_run`);
- :mod:`~raycl.tracking.reference_points` (chance, the untrained backbone, the val split's
  resolution, a stopped trial beside the winner at its epoch) and
  :mod:`~raycl.tracking.terminal_table` (columns fitted to the terminal) ->
  :mod:`~raycl.tracking.trial_table`: a sweep's trials ranked, as a table, CSV, markdown or
  terminal text; :mod:`~raycl.tracking.leaderboard_plot`: the same as ``leaderboard.png``;
  :mod:`~raycl.tracking.importance`: which searched knobs mattered (``importance.csv``);
- :mod:`~raycl.tracking.callback`: :class:`MLflowSweepCallback`, the Tune callback in the
  driver that writes all of the above.

``python -m raycl.leaderboard`` is the command on top (:mod:`raycl.leaderboard`). This face
only re-exports; :class:`MLflowSweepCallback` must stay importable from here, as sweeps pickled
before the package existed name it ``raycl.tracking.MLflowSweepCallback``.
"""

from raycl.tracking.callback import INTERRUPTED, MLflowSweepCallback, best_trial
from raycl.tracking.naming import trial_run_name
from raycl.tracking.relay import log_to_trial_run
from raycl.tracking.runs import (
    COMMIT_ENV,
    COMMIT_TAG,
    PARENT_TAG,
    ROLE_TAG,
    TRIAL_TAG,
    git_commit,
    log_to_trial_run_directly,
)

__all__ = [
    "COMMIT_ENV",
    "COMMIT_TAG",
    "INTERRUPTED",
    "PARENT_TAG",
    "ROLE_TAG",
    "TRIAL_TAG",
    "MLflowSweepCallback",
    "best_trial",
    "git_commit",
    "log_to_trial_run",
    "log_to_trial_run_directly",
    "trial_run_name",
]
