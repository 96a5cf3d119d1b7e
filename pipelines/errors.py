"""Typed errors for bad user input.

Every message is one line that names the offending file, field or parameter and says what was
expected. Stages print it without a traceback (see :mod:`pipelines.cli`).
"""


class PipelineError(Exception):
    """Base class of the errors a user can cause and fix."""


class ConfigError(PipelineError):
    """A parameter in ``params.yaml`` is unknown, of the wrong type or out of range."""


class DatasetError(PipelineError):
    """A dataset (annotation JSON or image files) is malformed."""


class CacheError(PipelineError):
    """An annotation cache is missing, corrupt, truncated or of another format version."""


class CheckpointError(PipelineError):
    """A checkpoint or model file cannot be used."""


class TrackingError(PipelineError):
    """The MLflow run that an earlier stage recorded cannot be found."""
