"""A stage's MLflow run (:func:`open_run`, a :class:`StageRun`) and its run file (``run.json``: which run the
stage writes to, read by the next start, by the launcher and, for the train stage's, by evaluate)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import Stopped, TrackingError
from ..fileio import write_json
from .lineage import (NOTE_TAG, TRAINING_RUN_TAG, baseline_params, evaluation_note, run_name, stage_tags,
                      training_note)
from .store import close_run, tracking_uri
from .tracker import Tracker
from .wording import address

FINGERPRINT_TAG = "train.fingerprint"  # on every training run
CONTINUES_TAG = "train.continues_run"  # on a run that resumed another run's checkpoint (its run file was lost)
STAGES = ("train", "evaluate", "search")
_NAME_FIRST = {"train": (), "evaluate": ("evaluate.",), "search": ("search.",)}  # params named first in run names

Artifacts = Iterable[tuple[str | Path, str | None]]  # (path, folder in the run's artifacts or None)


def write_run_file(path: str | Path, *, run_id: str | None, experiment: str, **fields: Any) -> None:
    """Record which MLflow run a pipeline run writes to (the train stage's output, read by evaluate),
    with more ``fields`` (e.g. the train stage's fingerprint and status).

    ``run_id`` is None (written as ``null``) when the train stage ran without tracking; the store's URI is
    written without a user or password in it (the file is a DVC output, maybe committed)."""
    write_json(path, {"run_id": run_id, "tracking_uri": address(tracking_uri()), "experiment": experiment, **fields})


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


class StageRun:
    """A stage's MLflow run, as MLflow's ``ActiveRun``: one owner of its life, ``with run as tracker:``.

    While the block runs, ``run_file`` says ``running`` (so that a launcher whose processes die can close
    the run, see :func:`close_run_file`). When the block ends without error, the ``artifacts`` declared
    are logged (a generator is iterated only then), the file says ``finished`` (and so does ``output``, a
    copy that is a stage's output) and the run ends FINISHED; FAILED on an exception, KILLED on a stop
    signal (:class:`~pipelines.errors.Stopped`). ``fields`` go into the run file (e.g. the train stage's
    fingerprint). ``tracked_until``: the last step of the training loss a continued run has logged.
    ``StageRun()``, without a tracker or run file, is the no-op run of processes other than the main one."""

    def __init__(self, tracker: Tracker | None = None, run_file: str | Path | None = None, *, experiment: str = "",
                 fields: dict[str, Any] | None = None, output: str | Path | None = None, artifacts: Artifacts = (),
                 tracked_until: int = 0):
        self.tracker, self.tracked_until = tracker or Tracker(), tracked_until
        self._run_file, self._output, self._artifacts = run_file, output, artifacts
        self._experiment, self._fields = experiment, fields or {}

    def __enter__(self) -> Tracker:
        self._record(self._run_file, "running")
        return self.tracker

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if kind is None:
            try:
                for path, folder in self._artifacts:
                    self.tracker.log_artifact(path, folder)
            except BaseException as late:
                self._end(type(late))
                raise
            self._record(self._output, "finished")
            self._record(self._run_file, "finished")
        self._end(kind)

    def _end(self, kind: type[BaseException] | None) -> None:
        self.tracker.finish("FINISHED" if kind is None else "KILLED" if issubclass(kind, Stopped) else "FAILED")

    def _record(self, path: str | Path | None, status: str) -> None:
        if path is not None and self._run_file is not None:
            write_run_file(path, run_id=self.tracker.run_id, experiment=self._experiment, **self._fields,
                           status=status)


def open_run(stage: str, run_file: str | Path, *, experiment: str, params: dict[str, Any], params_file: str | Path,
             cache: str | Path | None = None, compute: dict[str, str] | None = None, fingerprint: str | None = None,
             resumed_from: str | None = None, training_run_id: str | None = None, output: str | Path | None = None,
             artifacts: Artifacts = ()) -> StageRun:
    """The MLflow run of ``stage`` (one of :data:`STAGES`) in ``experiment``, to use as ``with open_run(...)
    as tracker:``; on processes other than the main one, the no-op ``StageRun()``.

    It continues the run that ``run_file`` names where :func:`_run_to_continue` says so (``fingerprint``,
    ``resumed_from``), else it starts a new one (:func:`_start`). ``output`` and ``artifacts``: see
    :class:`StageRun`; an evaluation's run file also keeps ``training_run_id``."""
    from .. import distributed  # imports torch: only a stage that opens its run needs it

    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    if not distributed.is_main_process():
        return StageRun()
    fields = {} if fingerprint is None else {"fingerprint": fingerprint}
    if stage == "evaluate":
        fields["training_run_id"] = training_run_id
    tracked_until = 0
    if (run_id := _run_to_continue(read_run_file(run_file), fingerprint, resumed_from)) is not None:
        tracker = Tracker.resume(run_id)
        if stage == "train":
            tracked_until = tracker.last_step("train/loss")
    else:
        tracker = _start(stage, experiment=experiment, params=params, params_file=params_file, cache=cache,
                         compute=compute, fingerprint=fingerprint, resumed_from=resumed_from,
                         training_run_id=training_run_id)
    return StageRun(tracker, run_file, experiment=experiment, fields=fields, output=output, artifacts=artifacts,
                    tracked_until=tracked_until)


def _run_to_continue(previous: dict[str, Any], fingerprint: str | None, resumed_from: str | None) -> str | None:
    """The run that ``previous`` (the run file of the start before) names, if this start continues it: left
    RUNNING with the same ``fingerprint`` by a start whose saved progress this one resumes (``resumed_from``:
    the run that saved it, "" if the progress does not say, None if there is none, e.g. a training from
    iteration 0). Otherwise None, and that run and the one ``resumed_from`` names are closed as KILLED if
    they are still RUNNING (their processes were killed)."""
    run_id = previous.get("run_id")
    interrupted = run_id if previous.get("status") == "running" and isinstance(run_id, str) else None
    if (resumed_from is not None and interrupted and fingerprint is not None
            and previous.get("fingerprint") == fingerprint and resumed_from in ("", interrupted)):
        return interrupted
    for stale in {interrupted, resumed_from} - {None, ""}:
        close_run(stale, "KILLED")
    return None


def _start(stage: str, *, experiment: str, params: dict[str, Any], params_file: str | Path,
           cache: str | Path | None, compute: dict[str, str] | None, fingerprint: str | None,
           resumed_from: str | None, training_run_id: str | None) -> Tracker:
    """A new run of ``stage``: the lineage tags, the ``fingerprint``, ``params`` (dotted keys; a training
    leaves the ``evaluate`` section to evaluation runs) and ``compute`` (the resolved precision and
    layout), a readable name, a note and ``params_file`` as an artifact. A training that resumed another
    run's checkpoint is linked to it (tag :data:`CONTINUES_TAG`), an evaluation to the training run whose
    model it scores (``training_run_id``)."""
    if stage == "train":
        params = {k: v for k, v in params.items() if not k.startswith("evaluate.")}
    tags = stage_tags(stage, params_file=params_file, cache=cache)
    if fingerprint is not None:
        tags[FINGERPRINT_TAG] = fingerprint
    if stage == "train" and resumed_from is not None:
        tags[CONTINUES_TAG] = resumed_from or "unknown (a checkpoint without a run id)"
    if training_run_id:
        tags[TRAINING_RUN_TAG] = training_run_id
    tracker = Tracker.start(experiment=experiment, params={**params, **(compute or {})}, tags=tags,
                            run_name=run_name(stage, params, baseline_params(params_file), first=_NAME_FIRST[stage]))
    if tracker.run_id:
        if stage == "train":
            tracker.set_tag(NOTE_TAG, training_note(tracker.run_id))
        elif stage == "evaluate":
            tracker.set_tag(NOTE_TAG, evaluation_note(training_run_id, tracker.experiment_id))
        tracker.log_artifact(params_file)
    return tracker
