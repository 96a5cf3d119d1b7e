"""The :class:`Tracker`: one MLflow run on the main process, logged within the store's bounds
(:mod:`pipelines.tracking.store`), kept in memory while the store fails and retried once when the run ends."""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import TrackingError, first_line
from . import lineage, store
from .wording import address, host_refusal, host_refused, plural, reason

log = logging.getLogger("pipelines.tracking")
_BATCH_METRICS = 1000  # MLflow's limits per log_batch
_BATCH_PARAMS = 100


class _Kind(enum.StrEnum):
    """What a logging request does."""

    PARAMS = "params"
    METRICS = "metrics"
    TAG = "tag"
    ARTIFACT = "artifact"
    TEXT = "text"
    REOPEN = "reopen"
    STATUS = "status"


@dataclass(eq=False)
class _Op:
    """One logging request: kept until the store has it."""

    kind: _Kind
    args: tuple
    count: int = 1
    name: str = ""
    size: int = 0  # bytes an artifact uploads
    attempt: store.Attempt | None = field(default=None, repr=False)

    @property
    def timeout(self) -> float:
        """Seconds the stage waits on this call: ``store.CALL_TIMEOUT``, and for an artifact also its upload at
        ``store.ARTIFACT_RATE`` (a checkpoint through a tracking server on a slow link)."""
        return store.CALL_TIMEOUT + self.size / store.ARTIFACT_RATE

    @property
    def recorded(self) -> bool:
        return self.attempt is not None and self.attempt.ended.is_set() and self.attempt.ok

    @property
    def in_flight(self) -> bool:
        return self.attempt is not None and not self.attempt.ended.is_set()


def _apply(client, run_id: str, ops: list[_Op]) -> None:
    """Send ``ops`` (consecutive metric values merged into batches) to the store."""
    import mlflow

    if ops[0].kind is _Kind.METRICS:
        metrics = [m for op in ops for m in op.args[0]]
        for i in range(0, len(metrics), _BATCH_METRICS):
            client.log_batch(run_id, metrics=metrics[i : i + _BATCH_METRICS])
        return
    (op,) = ops
    if op.kind is _Kind.PARAMS:
        items = [mlflow.entities.Param(k, v) for k, v in op.args[0]]
        for i in range(0, len(items), _BATCH_PARAMS):
            client.log_batch(run_id, params=items[i : i + _BATCH_PARAMS])
    elif op.kind is _Kind.TAG:
        client.set_tag(run_id, *op.args)
    elif op.kind is _Kind.ARTIFACT:
        client.log_artifact(run_id, *op.args)
    elif op.kind is _Kind.TEXT:
        client.log_text(run_id, *op.args)
    elif op.kind is _Kind.REOPEN:
        client.update_run(run_id, status="RUNNING")
    elif op.kind is _Kind.STATUS:
        client.set_terminated(run_id, status=op.args[0], end_time=op.args[1])
    else:
        raise AssertionError(op.kind)


def _describe(ops: list[_Op]) -> tuple[str, bool]:
    """``"35 metric values, 2 artifacts (a, b) and the run status"`` and whether it is plural."""
    count = lambda kind: sum(op.count for op in ops if op.kind is kind)  # noqa: E731
    names = [op.name for op in ops if op.kind in (_Kind.ARTIFACT, _Kind.TEXT)]
    parts = []
    if n := count(_Kind.PARAMS):
        parts.append(plural(n, "param"))
    if n := count(_Kind.METRICS):
        parts.append(plural(n, "metric value"))
    if n := count(_Kind.TAG):
        parts.append(plural(n, "tag"))
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{plural(len(names), 'artifact')} ({shown})")
    if statuses := [op.args[0] for op in ops if op.kind is _Kind.STATUS]:
        parts.append(f"the run status {statuses[-1]}")
    if not parts:
        return "the run's reopening", False
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    many = len(parts) > 1 or (bool(parts) and not parts[0].startswith(("1 ", "the ")))
    return text, many


class Tracker:
    """An MLflow run on the main process; ``Tracker()``, without a run, is the no-op of other processes.

    Use :meth:`start` (a new run) or :meth:`resume` (a run to continue, e.g. an interrupted training),
    then ``log_*`` and :meth:`finish`. No
    method raises for store problems or waits more than :data:`store.CALL_TIMEOUT` on one (see the module
    docstring); ``run_id`` is None when there is no run to log to (not the main process, or the
    store could not create or find it).
    """

    def __init__(self, run_id: str | None = None, *, uri: str | None = None):
        self.run_id = run_id
        self.experiment_id: str | None = None  # known after start()
        self.uri = uri or store.tracking_uri()
        self._client_obj = None
        self._kept: list[_Op] = []  # not (yet) recorded, in order
        self._offline = False  # after a store failure: keep everything for finish()
        self._offline_since = 0.0  # monotonic time of going offline, or of the last attempt to come back
        self._reconnecting = False
        self._error: BaseException | None = None  # the last store failure
        self._stalled: _Op | None = None  # the op whose call was still running at its deadline
        self._steps: dict[str, int] = {}  # the largest step this tracker logged, per metric
        self._rejected: set[str] = set()
        self._unknown_steps: set[str] = set()  # metrics whose last_step the store could not tell
        self._finished = False

    @property
    def shown(self) -> str:
        """The store's URI as logged: without a user or password in it."""
        return address(self.uri)

    @property
    def active(self) -> bool:
        return self.run_id is not None

    # construction

    @classmethod
    def start(cls, *, experiment: str, params: dict[str, Any], run_name: str | None = None,
              tags: dict[str, str] | None = None) -> "Tracker":
        """Create the run with params (dotted keys) and tags: git commit, DVC experiment name and
        baseline (when DVC sets ``DVC_EXP_NAME``, ``DVC_EXP_BASELINE_REV``), then ``tags``.

        If the store fails, the returned tracker is offline with ``run_id`` None and a warning says so.

        Raises:
            TrackingError: the store refused the credentials (HTTP 401 or 403): the one store failure that
                stops the stage, at its start, since running untracked under a wrong identity would lose
                the team's record silently; likewise ``MLFLOW_TRACKING_URI`` naming MLflow's file store
                (:func:`store.refuse_file_store`).
        """
        tracker = cls()
        store.refuse_file_store(tracker.uri)
        all_tags = {**lineage.environment_tags(store.repo_root()), **(tags or {})}
        name = run_name or os.environ.get("DVC_EXP_NAME")
        try:
            client = tracker._get_client()
            tracker.run_id, tracker.experiment_id = cls._create_run(client, experiment, name, all_tags)
        except Exception as err:
            if host_refused(err):
                raise TrackingError(f"MLflow store {tracker.shown} {host_refusal(tracker.uri)}") from None
            if store.refused_credentials(err):
                user = os.environ.get("MLFLOW_TRACKING_USERNAME")
                who = f"user {user!r}" if user else "no user (MLFLOW_TRACKING_USERNAME is not set)"
                raise TrackingError(f"MLflow store {tracker.shown} refused {who}: set MLFLOW_TRACKING_USERNAME and "
                                    f"MLFLOW_TRACKING_PASSWORD to a user with EDIT on experiment {experiment!r} "
                                    "(docs/team.md)") from None
            tracker._offline, tracker._error = True, err
            log.debug("creating the MLflow run failed", exc_info=True)
            log.warning("MLflow store %s %s: this run is not tracked (no MLflow run was created; its params, "
                        "metrics, artifacts and status are not recorded)", tracker.shown, reason(err))
            return tracker
        tracker._submit(_Op(_Kind.PARAMS, ([(k, str(v)) for k, v in params.items()],), count=len(params)))
        log.info("MLflow run %s in experiment %r at %s", tracker.run_id, experiment, tracker.shown)
        return tracker

    @staticmethod
    def _create_run(client, experiment: str, run_name: str | None, tags: dict[str, str]) -> tuple[str, str]:
        """The new run's id and its experiment's id, within ``store.CALL_TIMEOUT``; a run created after the caller
        gave up is ended at once (KILLED) rather than left RUNNING."""
        lock, state = threading.Lock(), {"gave_up": False, "claimed": False}

        def create() -> str:
            exp_id = store.experiment_id(client, experiment,
                                         artifact_location=store.artifact_location(experiment, client.tracking_uri))
            run_id = client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
            with lock:
                state["claimed"] = not state["gave_up"]
            if not state["claimed"]:
                client.set_terminated(run_id, status="KILLED")
            return run_id, exp_id

        attempt = store.Attempt(create)
        try:
            return attempt.wait(store.CALL_TIMEOUT)
        except store.NoAnswer:
            with lock:
                state["gave_up"] = not state["claimed"]
            if state["gave_up"]:
                raise
            return attempt.wait(store.CALL_TIMEOUT)  # created just now: returns at once

    @classmethod
    def resume(cls, run_id: str) -> "Tracker":
        """Reopen an existing run (an interrupted training's) to add to it.

        A run the store does not have: an offline tracker with ``run_id`` None and one warning. A store
        that fails: the tracker keeps ``run_id``, goes offline and :meth:`finish` retries what was logged."""
        tracker = cls(run_id)
        store.refuse_file_store(tracker.uri)
        reopen = _Op(_Kind.REOPEN, (), count=0)
        tracker._kept.append(reopen)  # kept in order, so that a late RUNNING never follows the final status
        try:
            client = tracker._get_client()
            reopen.attempt = store.Attempt(lambda: client.update_run(run_id, status="RUNNING"))
            reopen.attempt.wait(store.CALL_TIMEOUT)
            tracker._kept.remove(reopen)
        except Exception as err:
            if tracker._refused(err, f"resuming MLflow run {run_id}", stalled=reopen):
                tracker.run_id, tracker._offline, tracker._kept = None, True, []
                log.warning("MLflow store %s has no run %s to add to (%s): these results are not recorded in MLflow",
                            tracker.shown, run_id, first_line(err, 200))
        return tracker

    # logging

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.active:
            return
        import mlflow

        now, step = int(time.time() * 1000), step or 0
        values = [mlflow.entities.Metric(k, float(v), now, step) for k, v in metrics.items()]
        for key in metrics:
            self._steps[key] = max(self._steps.get(key, step), step)
        if values:
            self._submit(_Op(_Kind.METRICS, (values,), count=len(values)))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.active and self._exists(path):
            name = "/".join(filter(None, [artifact_path, Path(path).name]))
            files = [Path(path)] if Path(path).is_file() else [f for f in Path(path).rglob("*") if f.is_file()]
            size = sum(f.stat().st_size for f in files)
            self._submit(_Op(_Kind.ARTIFACT, (str(path), artifact_path), name=name, size=size))

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.active:
            self._submit(_Op(_Kind.TEXT, (text, artifact_file), name=artifact_file))

    def set_tag(self, key: str, value: str) -> None:
        if self.active:
            self._submit(_Op(_Kind.TAG, (key, value)))

    def last_step(self, key: str) -> int:
        """The largest step logged for metric ``key`` in this run (0 if none, or if offline and this
        tracker logged none), so that a resumed training can skip the steps it already logged.

        Asked while the store fails, it answers from what this tracker logged; the retry at
        :meth:`finish` then first asks the store and drops the kept values of ``key`` at steps the
        store already has, so that no step is recorded twice."""
        local = self._steps.get(key, 0)
        if not self.active:
            return local
        if self._offline:
            self._unknown_steps.add(key)
            return local
        try:
            client = self._get_client()
            history = self._call(lambda: client.get_metric_history(self.run_id, key))
        except Exception as err:
            if not self._refused(err, f"asking for the steps of {key}"):
                self._unknown_steps.add(key)
            return local
        return max([local, *(m.step for m in history)])

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (FINISHED, FAILED or KILLED) after one retry of what was kept;
        logs one warning naming what could still not be recorded."""
        status = str(status).upper()
        if status not in store.RUN_STATUSES:
            raise ValueError(f"status must be one of {', '.join(store.RUN_STATUSES)}, got {status!r}")
        if not self.active or self._finished:
            return
        self._finished = True
        self._kept.append(_Op(_Kind.STATUS, (status, int(time.time() * 1000))))
        if self._offline:
            log.debug("retrying %d kept MLflow calls", len(self._kept))
        if not self._unknown_steps or self._drop_logged_steps():
            self._flush(retry=True)
        self._kept = [op for op in self._kept if not op.recorded]
        if self._kept:
            what, many = _describe(self._kept)
            log.warning("MLflow store %s %s: %s %s not recorded (run %s)", self.shown,
                        reason(self._error) if self._error else "failing", what, "were" if many else "was",
                        self.run_id)

    # internals

    def _drop_logged_steps(self) -> bool:
        """After :meth:`last_step` could not ask the store: drop the kept metric values (of every key,
        as a resumed training re-logs them all) at steps the store already has. False if the store
        failed (one call, at most ``store.CALL_TIMEOUT``)."""
        run_id = self.run_id
        keys = sorted({m.key for op in self._kept if op.kind is _Kind.METRICS for m in op.args[0]})

        def logged(client) -> dict[str, int]:
            steps = {k: [m.step for m in client.get_metric_history(run_id, k)] for k in keys}
            return {k: max(v) for k, v in steps.items() if v}

        try:
            client = self._get_client()
            last = store.Attempt(lambda: logged(client)).wait(store.CALL_TIMEOUT)
        except Exception as err:
            return self._refused(err, "asking for the logged steps")
        self._unknown_steps.clear()
        for op in list(self._kept):
            if op.kind is _Kind.METRICS and not op.in_flight and not op.recorded:
                values = [m for m in op.args[0] if m.step > last.get(m.key, -1 << 62)]
                if len(values) < op.count:
                    log.debug("dropping %d kept metric values at steps the store has", op.count - len(values))
                    op.args, op.count = (values,), len(values)
                    if not values:
                        self._kept.remove(op)
        return True

    def _get_client(self):
        if self._client_obj is None:
            self._client_obj = store.open_client(self.uri, store.OPEN_TIMEOUT)
        return self._client_obj

    def _call(self, fn: Callable[[], Any]) -> Any:
        return store.Attempt(fn).wait(store.CALL_TIMEOUT)

    def _exists(self, path: str | Path) -> bool:
        if Path(path).exists():
            return True
        self._reject(f"{path}: no such file or folder to log as an MLflow artifact")
        return False

    def _reject(self, message: str, key: str | None = None) -> None:
        """One warning per kind of refusal (``key``, else the message): a caller's or a store's bug."""
        if (key or message) not in self._rejected:
            self._rejected.add(key or message)
            log.warning("%s", message)

    def _refused(self, err: BaseException, what: str, *, stalled: _Op | None = None) -> bool:
        """The failure policy, after a store call failed: True if the store answered and refused the request
        (retrying cannot help; the caller drops it); otherwise the tracker goes offline, remembering the call
        ``stalled`` if it was still running at its deadline, and False."""
        log.debug("%s failed", what, exc_info=err)
        if store.rejected(err):
            return True
        if stalled is not None and isinstance(err, store.NoAnswer):
            self._stalled = stalled
        self._go_offline(err)
        return False

    def _go_offline(self, err: BaseException) -> None:
        self._error = err
        self._offline_since = time.monotonic()
        was_online, self._offline = not self._offline and not self._reconnecting, True
        if was_online:
            log.info("MLflow store %s %s: tracking goes on offline, and what it keeps is retried when the stage "
                     "ends", self.shown, reason(err))

    def _submit(self, op: _Op) -> None:
        self._kept.append(op)
        if self._offline and self._stalled is not None and self._stalled.recorded and \
                not any(o.in_flight for o in self._kept):
            # the call that missed its deadline went through after all: the store is back
            self._offline, self._stalled = False, None
            log.info("MLflow store %s answers again: tracking is back online", self.shown)
        if not self._offline:
            self._flush(retry=False)
        elif time.monotonic() - self._offline_since >= store.RECONNECT_INTERVAL and \
                not any(o.in_flight for o in self._kept):
            self._reconnect()

    def _reconnect(self) -> None:
        """While offline, at most once per ``store.RECONNECT_INTERVAL``: send what was kept, in order (a
        database restarted under a tracking server, a server back after a restart). Failing, it stays
        offline and costs one call (at most its deadline); succeeding, tracking is back online."""
        self._offline_since = time.monotonic()
        if self._unknown_steps and not self._drop_logged_steps():
            return
        self._offline, self._reconnecting = False, True
        try:
            self._flush(retry=False)
        finally:
            self._reconnecting = False
        if self._offline:  # failed again; _go_offline said nothing new
            return
        self._stalled = None
        log.info("MLflow store %s answers again: tracking is back online, %s sent", self.shown,
                 "what was kept" if self._kept == [] else "part of what was kept")

    def _flush(self, *, retry: bool) -> None:
        """Send the kept ops in order, stopping at the first store failure (which puts the tracker offline).

        In the retry at :meth:`finish`, a call still running from earlier is waited on first (at most
        ``store.CALL_TIMEOUT``) rather than sent twice at once."""
        i = 0
        while i < len(self._kept):
            op = self._kept[i]
            if op.recorded:
                i += 1
                continue
            if op.in_flight:
                if not retry:
                    return
                try:
                    op.attempt.wait(op.timeout)
                    i += 1
                    continue
                except store.NoAnswer as err:
                    self._error = err
                    return
                except Exception:  # it failed meanwhile: send it again below
                    pass
            group, size = [op], op.count
            while op.kind is _Kind.METRICS and i + len(group) < len(self._kept):  # one log_batch for many calls
                nxt = self._kept[i + len(group)]
                if nxt.kind is not _Kind.METRICS or nxt.attempt is not None or size + nxt.count > _BATCH_METRICS:
                    break
                group.append(nxt)
                size += nxt.count
            try:
                client = self._get_client()
                attempt = store.Attempt(lambda c=client, g=group: _apply(c, self.run_id, g))
                for o in group:
                    o.attempt = attempt
                attempt.wait(op.timeout)
            except Exception as err:
                if not self._refused(err, f"the MLflow {op.kind} call", stalled=op):
                    return
                for o in group:  # the store refuses it: drop it, say why once
                    self._kept.remove(o)
                why = first_line(err, 200) or type(err).__name__
                self._reject(f"MLflow store {self.shown} refused {_describe(group)[0]}: {why}", key=why)
            i += len(group)
        self._kept = [op for op in self._kept if not op.recorded]
