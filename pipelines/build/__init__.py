"""The one edge from validated params to objects (detectron2's ``from_config`` idea, without a registry).

Each function takes the :class:`~pipelines.config.schema.Params` that :func:`~pipelines.config.load.load_params`
validated and calls the core with explicit keyword arguments; nothing else in the project maps params
to arguments. Split by what consumes the objects, so a stage imports only what it builds:
:mod:`.model` (the detector and how it computes), :mod:`.data` (transforms, augmentation, the test
loader, the preview) and :mod:`.train` (optimizer, schedule, train loaders, reporter, DDP). Evaluation
needs only the first two, so editing the training loop does not re-run it.
"""
