"""The Ray Train side of a trial: the worker loop shared by every method.

Modules, each one responsibility; import them directly (this package face imports nothing):

- :mod:`raycl.worker.context`: the trial's context (config, trial id, start time, the data's
  placement), handed to the loop once.
- :mod:`raycl.worker.loop`: ``train_loop_per_worker`` / ``run_trial_loop``: a whole trial, its
  stages in one worker group, the step between MCL stages, resuming, the finished-trial report.
- :mod:`raycl.worker.stage`: training one stage: its method, phases, epochs' reports and the
  checkpoint decision.
- :mod:`raycl.worker.epoch`: one epoch's optimizer steps, the NaN/inf check of the loss, and
  the epoch's report.
- :mod:`raycl.worker.loader`: the batch sampler and data loader of a stage.
- :mod:`raycl.worker.optim`: the optimizer of a phase, the learning-rate schedule, autocast.
- :mod:`raycl.worker.lars`: the LARS optimizer (torch only).
- :mod:`raycl.worker.checkpoints`: write, read, fall back to an older one, restore.
- :mod:`raycl.worker.embed`: features across the workers, the stages integrated (concat, soup).
- :mod:`raycl.worker.evaluate`: scoring an epoch: probes, kNN, retrieval, transfer, diagnostics.
- :mod:`raycl.worker.stage_integration`: what one MCL stage hands the next (StageInputs,
  clustering, soup
  weights) and the checkpoint's file names.
- :mod:`raycl.worker.session`: the loop's runtime: a Ray Train worker or the trial process.
- :mod:`raycl.worker.perf`: the start-up clock and peak memory (``perf/*``).
- :mod:`raycl.worker.outcome`: the keys a worker reports when a trial fails, and why.
"""
