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
from .lineage import (NOTE_TAG, TRAINING_RUN_TAG, baseline_params, evaluation_note, run_name, stage_tags,
                      training_note)
from .store import close_run, tracking_uri
from .tracker import Tracker

FINGERPRINT_TAG = "train.fingerprint"  # on every training run
CONTINUES_TAG = "train.continues_run"  # on a run that resumed another run's checkpoint (its run file was lost)


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
def stage_run(tracker: Tracker, run_file: str | Path | None, *, experiment: str, output: str | Path | None = None,
              **fields: Any) -> Iterator[Tracker]:
    """The life of a stage's MLflow run, as MLflow's ``ActiveRun.__exit__`` ends one: ``run_file`` says
    ``running`` while the block runs (so that a launcher whose processes die can close the run, see
    :func:`close_run_file`); when the block ends, the file says ``finished`` (and so does ``output``, a
    copy that is a stage's output) and the run ends FINISHED; FAILED on an exception, KILLED on a stop
    signal (:class:`~pipelines.errors.Stopped`). ``fields`` go into the run file (e.g. the train stage's
    fingerprint). Processes other than the main one pass no run file and a tracker without a run."""
    def record(path: str | Path | None, status: str) -> None:
        if path is not None and run_file is not None:
            write_run_file(path, run_id=tracker.run_id, experiment=experiment, **fields, status=status)

    record(run_file, "running")
    try:
        yield tracker
    except Stopped:
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED")
        raise
    record(output, "finished")
    record(run_file, "finished")
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


def open_training_run(*, experiment: str, params: dict[str, Any], compute: dict[str, str], fingerprint: str,
                      previous: dict[str, Any], resumed_from: str | None, params_file: str | Path,
                      cache: str | Path) -> tuple[Tracker, int]:
    """The MLflow run of a training, and the last step it has logged.

    A training that resumes from a checkpoint (``resumed_from``: the run that wrote it, "" if the
    checkpoint does not say; None for a training from iteration 0) continues the run that the run file
    of the start before (``previous``) names, where that file agrees: same run, same fingerprint, left
    RUNNING. Otherwise a new run with the lineage tags, the fingerprint, ``params`` (dotted keys; the
    ``evaluate`` section's left to evaluation runs) and ``compute`` (the resolved precision and layout)
    and a readable name; a resumed one is linked to the
    run it continues (tag :data:`CONTINUES_TAG`). A run left RUNNING that is not continued is closed as
    KILLED."""
    interrupted = previous.get("run_id") if previous.get("status") == "running" else None
    if (resumed_from is not None and interrupted and previous.get("fingerprint") == fingerprint
            and resumed_from in ("", interrupted)):
        tracker = Tracker.resume(interrupted)
        return tracker, tracker.last_step("train/loss")
    for run_id in {interrupted, resumed_from} - {None, ""}:
        close_run(run_id, "KILLED")
    params = {k: v for k, v in params.items() if not k.startswith("evaluate.")}
    tags = {**stage_tags("train", params_file=params_file, cache=cache), FINGERPRINT_TAG: fingerprint}
    if resumed_from is not None:
        tags[CONTINUES_TAG] = resumed_from or "unknown (a checkpoint without a run id)"
    tracker = Tracker.start(experiment=experiment, params={**params, **compute}, tags=tags,
                            run_name=run_name("train", params, baseline_params(params_file)))
    if tracker.run_id:
        tracker.set_tag(NOTE_TAG, training_note(tracker.run_id))
        tracker.log_artifact(params_file)
    return tracker, 0


def open_evaluation_run(*, experiment: str, params: dict[str, Any], compute: dict[str, str],
                        training_run_id: str | None, run_file: str | Path, params_file: str | Path,
                        cache: str | Path) -> Tracker:
    """A new evaluation run: ``params`` (dotted keys) and ``compute``, the lineage tags, linked to the
    training run whose model it scores; a run that an earlier, killed evaluation left open in ``run_file``
    is closed as KILLED."""
    close_stale_run(read_run_file(run_file))
    tags = stage_tags("evaluate", params_file=params_file, cache=cache)
    if training_run_id:
        tags[TRAINING_RUN_TAG] = training_run_id
    tracker = Tracker.start(experiment=experiment, params={**params, **compute}, tags=tags,
                            run_name=run_name("evaluate", params, baseline_params(params_file),
                                             first=("evaluate.",)))
    if tracker.run_id:
        tracker.set_tag(NOTE_TAG, evaluation_note(training_run_id, tracker.experiment_id))
        tracker.log_artifact(params_file)
    return tracker


def open_search_run(*, experiment: str, params: dict[str, Any], fingerprint: str, previous: dict[str, Any],
                    params_file: str | Path) -> Tracker:
    """The parent MLflow run of a policy search: the run of the start before (``previous``, its run file)
    continued where it was left RUNNING with the same fingerprint, else a new one (the other closed as KILLED)."""
    interrupted = previous.get("run_id") if previous.get("status") == "running" else None
    if interrupted and previous.get("fingerprint") == fingerprint:
        return Tracker.resume(interrupted)
    if interrupted:
        close_run(interrupted, "KILLED")
    tags = {**stage_tags("search", params_file=params_file, cache=None), FINGERPRINT_TAG: fingerprint}
    tracker = Tracker.start(experiment=experiment, params=params, tags=tags,
                            run_name=run_name("search", params, baseline_params(params_file), first=("search.",)))
    if tracker.run_id:
        tracker.log_artifact(params_file)
    return tracker
