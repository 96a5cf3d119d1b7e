"""Typed errors for bad user input.

Every message is one line that names the offending file, field or parameter and says what was
expected. Stages print it without a traceback (see :mod:`pipelines.cli`).
"""

import signal


class PipelineError(Exception):
    """Base class of the errors a user can cause and fix; the process exits with ``exit_code``."""

    exit_code = 2


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


class TrainingError(PipelineError):
    """Training cannot go on (a non-finite loss)."""


class SearchError(PipelineError):
    """A policy search's result is missing, unfinished, or its files are of different searches."""


class TeamError(PipelineError):
    """A ``team.env`` (``make team-join``) or a joined clone's team settings file cannot be used."""


class OutputError(PipelineError):
    """An output folder cannot be written: not a folder, not writable, or not enough free space."""


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message, at most ``limit`` characters; "" if it has none. The part
    of a library's error that fits in a one-line message."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else ""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # read alike everywhere: stop, keep the work


class Stopped(BaseException):
    """A stage was asked to stop (SIGTERM, SIGINT or SIGHUP); training does so at an iteration boundary,
    after a checkpoint. The exit code is 128 + the signal's number, as a shell reports a process the signal
    killed. Like :class:`KeyboardInterrupt` it is not an :class:`Exception`, so that no ``except Exception``
    (ours, PIL's, MLflow's) can swallow a stop and let the stage run on."""

    def __init__(self, message: str, *, signum: int = 15):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


_STOPS: list[Stopped] = []  # the stops this process was asked for (see :func:`request_stop`)


def request_stop(signum: int) -> Stopped:
    """Record a stop signal and return the :class:`Stopped` to raise for it.

    A signal handler's exception can be lost: Python runs the handler between any two bytecodes, also
    inside a finaliser (``__del__``, a weakref callback), where an exception is printed as "ignored" and
    the program runs on. The record survives that: :func:`raise_if_stopped` raises it again where an
    output is about to be put in place, and :func:`pipelines.cli.run` exits with it."""
    stop = Stopped(f"stopped by {signal.Signals(signum).name}", signum=signum)
    _STOPS.append(stop)
    return stop


def pending_stop() -> Stopped | None:
    """The first stop this process was asked for, if any."""
    return _STOPS[0] if _STOPS else None


def clear_stops() -> None:
    """Forget the recorded stops (a new run in the same process starts without them)."""
    _STOPS.clear()


def raise_if_stopped() -> None:
    """Raise the stop this process was asked for, if any (a stop a finaliser swallowed)."""
    if _STOPS:
        raise Stopped(str(_STOPS[0]), signum=_STOPS[0].exit_code - 128)


class ImageError(DatasetError):
    """An image file is missing, is not a regular file, or cannot be decoded.

    The message is ``<file>: <reason>``; ``file`` and ``reason`` are also kept apart for callers that
    add context (validation adds the image id). Built from one argument (as the data loader re-raises a
    worker's error), the message is that argument.
    """

    def __init__(self, file: str, reason: str = ""):
        super().__init__(f"{file}: {reason}" if reason else str(file))
        self.file, self.reason = str(file), reason

    def __reduce__(self):
        return type(self), (self.file, self.reason)
