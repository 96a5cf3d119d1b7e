"""The life of a stage's MLflow run (:func:`stage_run`) and its run file (``run.json``: which run the stage
writes to, read by the next start, by the launcher and, for the train stage's, by evaluate)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import Stopped, TrackingError
from ..fileio import write_json
from .store import close_run, tracking_uri
from .tracker import Tracker


def write_run_file(path: str | Path, *, run_id: str | None, experiment: str, **fields: Any) -> None:
    """Record which MLflow run a pipeline run writes to (the train stage's output, read by evaluate),
    with more ``fields`` (e.g. the train stage's fingerprint and status).

    ``run_id`` is None (written as ``null``) when the train stage ran without tracking."""
    write_json(path, {"run_id": run_id, "tracking_uri": tracking_uri(), "experiment": experiment, **fields})


def read_run_file(path: str | Path) -> dict[str, Any]:
    """What a run file of an earlier start holds: ``{}`` if there is none or it is unreadable (a
    stage then starts a new run)."""
    if not Path(path).is_file():  # none, or a special file that would block the read
        return {}
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def read_run_id(path: str | Path) -> str | None:
    """The run id in a file written by :func:`write_run_file`, None if it holds ``null`` (the train
    stage ran without tracking); a :class:`TrackingError` if the file is unusable."""
    if Path(path).exists() and not Path(path).is_file():
        raise TrackingError(f"{path}: not a regular file; expected the run file of the train stage")
    try:
        run_id = json.loads(Path(path).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TrackingError(f"{path}: not a run file of the train stage ({type(err).__name__}: {err})") from None
    if run_id is None:
        return None
    if not isinstance(run_id, str) or not run_id:
        raise TrackingError(f"{path}: run_id must be a non-empty string or null, got {run_id!r}")
    return run_id


@contextlib.contextmanager
def stage_run(tracker: Tracker, run_file: str | Path | None, *, experiment: str, **fields: Any) -> Iterator[Tracker]:
    """The life of a stage's MLflow run, as MLflow's ``ActiveRun.__exit__`` ends one: ``run_file`` says
    ``running`` while the block runs (so that a launcher whose processes die can close the run, see
    :func:`close_run_file`); the run ends FINISHED and the file says ``finished`` when the block ends,
    FAILED on an exception, KILLED on a stop signal (:class:`~pipelines.errors.Stopped`). ``fields`` go
    into the run file (e.g. the train stage's fingerprint). No run file on processes other than the main
    one (``run_file`` None) and a tracker without a run: only what there is, is done."""
    def record(status: str) -> None:
        if run_file is not None:
            write_run_file(run_file, run_id=tracker.run_id, experiment=experiment, **fields, status=status)

    record("running")
    try:
        yield tracker
    except Stopped:
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED")
        raise
    record("finished")
    tracker.finish()


def close_stale_run(previous: dict[str, Any], *, keep: str | None = None) -> None:
    """Close as KILLED the run that the run file of an earlier start (``previous``, from
    :func:`read_run_file`) left ``running`` (its process was killed), unless it is ``keep`` (continued)."""
    run_id = previous.get("run_id")
    if previous.get("status") == "running" and run_id and run_id != keep:
        close_run(run_id, "KILLED")


def close_run_file(path: str | Path | None, status: str) -> None:
    """For a launcher whose processes died: end the run that ``path`` names with ``status`` if it is still
    RUNNING (an unusable file: nothing to do)."""
    if not path or not Path(path).is_file():
        return
    try:
        run_id = read_run_id(path)
    except TrackingError:
        return
    if run_id:
        close_run(run_id, status)
