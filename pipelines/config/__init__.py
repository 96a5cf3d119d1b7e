"""Typed schemas for ``params.yaml`` and the one loader that validates it, one job per module.

``conf/`` is composed by Hydra (through DVC) into ``params.yaml``; stages read only ``params.yaml``
through :func:`pipelines.config.load.load_params`, which checks it against the structured configs of
:mod:`~pipelines.config.schema` and then checks values (:mod:`~pipelines.config.validate`). Every
problem stops the stage with one line naming the key and what was expected. ``python -m
pipelines.config --params FILE`` runs that check alone. Nothing here imports torch.
"""
