"""MLflow tracking, on the main process only.

Runs: the train stage makes a *training run* (the params it depends on, the loss curves, the model,
checkpoints) and writes its id to ``outputs/train/run.json``; every execution of the evaluate stage
makes an *evaluation run* of its own (all the params it ran with, the ``eval/*`` metrics) tagged
``training_run_id`` with the training run whose model it scored. So a run's params and metrics always
belong together, and re-running only evaluate with other params gives a new run rather than adding to
an earlier one.

Modules, lowest first: :mod:`~pipelines.tracking.wording` (how store failures and counts read),
:mod:`~pipelines.tracking.store` (where the store is, and every call that can wait on it, within bounds),
:mod:`~pipelines.tracking.lineage` (tags, names and notes), :mod:`~pipelines.tracking.tracker` (the
:class:`~pipelines.tracking.tracker.Tracker`, which never stops or stalls a stage) and
:mod:`~pipelines.tracking.run` (a stage's run, :func:`~pipelines.tracking.run.open_run`, and its run file).
"""
