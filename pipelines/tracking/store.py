"""The MLflow store, within bounds: every call that can wait on it, and where it is.

The store defaults to ``sqlite:///<repository root>/mlflow.db`` with artifacts in
``<repository root>/mlartifacts``; ``MLFLOW_TRACKING_URI`` overrides, and so does, where that is not set,
the team settings file of a clone that joined a team (``make team-join``, :mod:`pipelines.tracking.team_settings`). The repository root is
``DVC_ROOT`` when DVC sets it, and the main repository when DVC runs a queued experiment in
``.dvc/tmp/exps/...`` (which is deleted afterwards). :func:`get_run`, :func:`find_runs` and
:func:`store_status` serve the ``stages.lineage`` command and the machine report.

Tracking never stops or stalls a stage, never raises for store problems and leaves no run RUNNING
that it could end:

* Every store call runs in a worker thread that the stage waits on for at most
  :data:`CALL_TIMEOUT` seconds (10 s), an artifact's upload one second more per :data:`ARTIFACT_RATE`
  bytes (2 MB). The call itself is made to end sooner: for HTTP stores the
  process environment gets ``MLFLOW_HTTP_REQUEST_TIMEOUT=4``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=1``,
  ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1`` and ``MLFLOW_HTTP_REQUEST_BACKOFF_JITTER=0`` unless the
  user set them (a refused connection then fails at once, a server that never answers after 2 x 4 s;
  MLflow's defaults retry for minutes); for SQLite stores MLflow's own per-session ``PRAGMA
  busy_timeout = 20000`` is lowered to :data:`SQLITE_BUSY_TIMEOUT` (8 s) for this store's database, so a
  call on a locked database fails by itself with "database is locked" after 8 s (opening the store
  on a locked database fails after sqlite3's default 5 s). A call still running at its deadline (a
  hung mount, a slow upload) is left to end in the background; if it then succeeds, it counts as
  recorded and the tracker is back online.
* The first failing call puts the tracker offline: it and every later call are kept in memory
  without touching the store, except that at most once per :data:`RECONNECT_INTERVAL` (60 s) a log
  sends what was kept, in order; if that succeeds the tracker is back online (a store restarted, a
  database restarted under a tracking server). :meth:`~pipelines.tracking.tracker.Tracker.finish` retries what was kept once, in order, stopping
  at the first failure, then logs ONE warning naming what was not recorded, e.g.
  ``MLflow store http://127.0.0.1:9 unreachable: 35 metric values, 2 artifacts (model/model_final.pth,
  train_log.csv) and the run status FINISHED were not recorded (run 1f2e...)``. Going offline is
  logged at INFO only.
* :meth:`Tracker.start` on a store that fails: the stage runs on with an offline tracker whose
  ``run_id`` is None (run files then hold ``null``) and one warning says so at once.
  :meth:`Tracker.resume` of a run the store does not have: likewise. Resuming
  on a failing store keeps ``run_id`` and goes offline (the retry at :meth:`finish` may still record).

Bound: on an unreachable or locked store a stage waits for at most two failed calls, one when it goes
offline and one in the retry at :meth:`Tracker.finish`, each at most :data:`CALL_TIMEOUT` (an artifact's
call: its upload bound): 20 s in all without artifacts, whatever the length of the training, plus one
failed call per :data:`RECONNECT_INTERVAL` of outage while the stage runs (plus, once per process, up to :data:`OPEN_TIMEOUT` if
opening the store hangs rather than fails). A refused connection fails at once; a silent server or a
locked SQLite database fails each call after its HTTP or busy timeout, below :data:`CALL_TIMEOUT`.

A store that answers, however slowly, is waited on call by call (each at most ``CALL_TIMEOUT``).
MLflow's own log records and tracebacks from these calls are kept off the terminal (the warning
above is the product). :func:`close_run` ends a run whose owning process was killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable

from ..errors import TrackingError, first_line
from .wording import NO_ANSWER, address, credentials_refused, plural, reason

log = logging.getLogger("pipelines.tracking")

CALL_TIMEOUT = 10.0
"""Seconds a stage waits on one store call."""

ARTIFACT_RATE = 2e6
"""Bytes per second an artifact upload is granted on top of :data:`CALL_TIMEOUT` (a model or checkpoint through
a tracking server on a slow link must not count as a store failure)."""

RECONNECT_INTERVAL = 60.0
"""Seconds between a tracker's attempts, while offline, to send what it kept (each costs one call)."""

SQLITE_BUSY_TIMEOUT = 8.0
"""Seconds a SQLite call waits for a locked database before it fails by itself (MLflow's own: 20 s);
below :data:`CALL_TIMEOUT`, so that the call ends, with the reason, before the stage stops waiting."""

OPEN_TIMEOUT = 30.0
"""Seconds a stage waits for MLflow to open the store, once per process. Making the client of an HTTP
store sends nothing; opening a locked SQLite database fails by itself after 5 s; creating a new one
runs MLflow's schema migrations, which must not be cut short."""

HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
}
"""MLflow's HTTP knobs, set in the process environment unless the user set them (MLflow's defaults
retry 7 times with exponential backoff and wait 120 s per request: minutes on a refused connection)."""

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
_THREAD_NAME = "mlflow-tracking-call"


def repo_root() -> Path:
    """The repository whose ``mlflow.db`` records this run."""
    root = Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()
    parts = root.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return root


def tracking_uri() -> str:
    """The store: ``MLFLOW_TRACKING_URI``, else a joined clone's team settings (:mod:`pipelines.tracking.team_settings`,
    whose user and password then go into the environment where it has none), else the repository's
    ``mlflow.db``. A team settings file that cannot be read raises :class:`~pipelines.errors.TeamError`."""
    return store_source()[0]


def store_source() -> tuple[str, str]:
    """:func:`tracking_uri` and where it comes from, in words (for :func:`announce`)."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri, "MLFLOW_TRACKING_URI"
    from . import team_settings as settings

    root = repo_root()
    if uri := settings.apply(root):
        return uri, f"team settings {settings.path(root)}, user {os.environ.get('MLFLOW_TRACKING_USERNAME')!r}"
    return f"sqlite:///{root / 'mlflow.db'}", "the repository's own; no MLFLOW_TRACKING_URI, no team settings"


def announce() -> None:
    """Log which store this stage records into (its first line; userinfo shown as ``***``)."""
    uri, source = store_source()
    log.info("tracking store %s (%s)", address(uri), source)


def refuse_file_store(uri: str) -> None:
    """Raise :class:`TrackingError` for MLflow's file store (``file:`` or a plain path, which MLflow reads as
    one): MLflow keeps it in maintenance mode and refuses new runs with a message that names no setting, so
    a stage would run untracked. Every other URI is left to MLflow."""
    if uri.lower().startswith("file:") or not re.match(r"[A-Za-z][\w+.-]*://", uri):
        raise TrackingError(f"MLFLOW_TRACKING_URI={address(uri)}: MLflow's file store is not supported here (MLflow "
                            "keeps it in maintenance mode); expected sqlite:///ABSOLUTE/PATH/mlflow.db, "
                            "http(s)://HOST:PORT of a tracking server, or nothing (the repository's mlflow.db)")


def artifact_location(experiment: str, uri: str | None = None) -> str | None:
    """Where a new experiment's artifacts go: ``<repository root>/mlartifacts/<experiment>`` for a store on
    this machine (SQLite), None for a tracking server, which then keeps (and serves) them itself, so that
    clients need neither a shared disk nor storage credentials."""
    if (uri or tracking_uri()).startswith(("http://", "https://", "databricks")):
        return None
    return (repo_root() / "mlartifacts" / experiment).as_uri()


def experiment_id(client, name: str, *, artifact_location: str | None = None) -> str:
    """The id of experiment ``name`` in ``client``'s store, created (with ``artifact_location``) if missing.

    Unbounded: the caller bounds it (a stage through :class:`Attempt`). Raises MlflowException if the store
    refuses; an experiment that another client created meanwhile is found again rather than an error."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as err:  # created meanwhile, by another pipeline or by a retried request
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


class NoAnswer(Exception):
    """A store call still running at its deadline."""


class Attempt:
    """One store call in a daemon thread; ``ok`` and ``error`` are set when it ends, however late."""

    def __init__(self, fn: Callable[[], Any]):
        self.ended = threading.Event()
        self.ok = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._fn = fn
        _quiet_mlflow_logging()  # handlers may have changed since the last call
        threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
            self.ok = True
        except BaseException as err:  # reported to the waiting caller
            self.error = err
        finally:
            self.ended.set()

    def wait(self, timeout: float) -> Any:
        """The call's result; its exception, or :class:`NoAnswer` if it has not ended in ``timeout`` s."""
        if not self.ended.wait(max(timeout, 0.0)):
            raise NoAnswer(f"{NO_ANSWER} {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.result


class _QuietWorkerThreads(logging.Filter):
    """Drops the records that MLflow, SQLAlchemy, urllib3 ... log from the tracking worker threads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.threadName or "").startswith(_THREAD_NAME) or record.name.startswith("pipelines")


_QUIET = _QuietWorkerThreads()
_busy_hook_lock = threading.Lock()
_busy_hook_paths: set[str] = set()
_BUSY_PRAGMA = re.compile(r"\s*PRAGMA\s+busy_timeout\s*=\s*\d+\s*;?\s*$", re.IGNORECASE)


def _quiet_mlflow_logging() -> None:
    """Install :class:`_QuietWorkerThreads` on the handlers that MLflow's and urllib3's records reach."""
    handlers = [logging.lastResort] if logging.lastResort else []
    for name in ("", "mlflow", "sqlalchemy.engine", "alembic", "huey"):
        handlers += logging.getLogger(name).handlers
    for handler in handlers:
        if _QUIET not in handler.filters:
            handler.addFilter(_QUIET)


def _limit_sqlite_busy_wait(uri: str) -> None:
    """Lower MLflow's per-session ``PRAGMA busy_timeout = 20000`` for this store's SQLite database."""
    if not uri.startswith("sqlite:"):
        return
    from sqlalchemy import event
    from sqlalchemy.engine import Engine, make_url

    with _busy_hook_lock:
        if not _busy_hook_paths:

            def rewrite(conn, cursor, statement, parameters, context, executemany):
                url = conn.engine.url
                if url.get_backend_name() == "sqlite" and url.database in _busy_hook_paths \
                        and _BUSY_PRAGMA.match(statement):
                    statement = f"PRAGMA busy_timeout = {max(int(SQLITE_BUSY_TIMEOUT * 1000), 1)};"
                return statement, parameters

            event.listen(Engine, "before_cursor_execute", rewrite, retval=True)
        try:
            _busy_hook_paths.add(make_url(uri).database)
        except Exception:  # an odd URI: MLflow will say what is wrong with it
            pass


def _prepare(uri: str) -> None:
    """Before any client is made for ``uri``: bounded HTTP knobs, bounded SQLite waits, quiet logs, and no URL
    printed by MLflow where ``uri`` carries a user or password."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if address(uri) != uri:  # MLflow prints a run's URL, user and password included, when the run ends
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    import mlflow  # noqa: F401  (configures MLflow's loggers, which _quiet_mlflow_logging then filters)

    _limit_sqlite_busy_wait(uri)
    _quiet_mlflow_logging()


def rejected(err: BaseException) -> bool:
    """The store answered and refused the request (no such run, invalid value): retrying won't help."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    status = err.get_http_status_code()
    return 400 <= status < 500 and status not in (401, 403, 408, 429)  # not credentials, timeouts, rate limits


def refused_credentials(err: BaseException) -> bool:
    """The store answered 401 or 403: no, wrong or insufficient credentials (a tracking server with auth); not
    the 403 of a server that does not admit the name it was reached by (:func:`.wording.host_refused`)."""
    from mlflow.exceptions import MlflowException

    return isinstance(err, MlflowException) and credentials_refused(err)


def open_client(uri: str, timeout: float):
    """An ``MlflowClient`` for ``uri``, made within ``timeout`` (making it opens, maybe creates, the store)."""
    _prepare(uri)
    import mlflow

    def make():
        with _store_creation_lock(uri):
            _open_sqlite_file(uri)
            return mlflow.MlflowClient(tracking_uri=uri)

    return Attempt(make).wait(timeout)


def _open_sqlite_file(uri: str) -> None:
    """Open (and so create, as MLflow would) a SQLite store's file once, to fail at once where it cannot be
    opened at all (a read-only folder without the database, a folder in its place, no permission): MLflow
    retries that 9 times with growing sleeps (100 s), so the stage would wait out ``OPEN_TIMEOUT``, past
    the documented bound. A locked database opens."""
    if uri.startswith("sqlite:///"):
        import sqlite3

        sqlite3.connect(uri[len("sqlite:///"):].split("?", 1)[0]).close()


@contextlib.contextmanager
def _store_creation_lock(uri: str):
    """For a SQLite store: an exclusive ``flock`` on the database's folder while the client opens it.

    Opening a new database runs MLflow's schema migrations; two pipelines doing it at once (the
    experiments of ``dvc queue start -j 2`` on a fresh repository) break one of them ("Online migration
    expected to match one row"). Any other store: nothing to lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    folder = Path(uri[len("sqlite:///"):]).parent
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def close_run(run_id: str, status: str, *, uri: str | None = None) -> bool:
    """Set run ``run_id`` to ``status`` (FAILED or KILLED; FINISHED is accepted too) if it is still RUNNING.

    For a run whose owning process was killed. Returns whether it changed the status. Waits at most
    :data:`CALL_TIMEOUT` on the store (plus :data:`OPEN_TIMEOUT` if opening it hangs) and never raises
    for store problems (one warning line instead); a ``status`` that is not a terminal run status raises
    ValueError.
    """
    status = str(status).upper()
    if status not in RUN_STATUSES:
        raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    if not run_id:
        return False
    uri = uri or tracking_uri()
    try:
        client = open_client(uri, OPEN_TIMEOUT)

        def close() -> bool:
            if client.get_run(run_id).info.status != "RUNNING":
                return False
            client.set_terminated(run_id, status=status)
            return True

        return bool(Attempt(close).wait(CALL_TIMEOUT))
    except Exception as err:  # never raise for the store
        if rejected(err):
            log.warning("MLflow store %s has no run %s to mark %s (%s)", address(uri), run_id, status,
                        first_line(err, 200))
        else:
            log.warning("MLflow store %s %s: run %s was not marked %s", address(uri), reason(err), run_id, status)
        log.debug("close_run(%s) failed", run_id, exc_info=True)
        return False


# --- bounded reads, for the lineage command ----------------------------------------------------------


def _read(uri: str | None, what: Callable[[Any], Any]) -> Any:
    """``what(client)`` within the bounds of the module docstring; a :class:`TrackingError` on store problems."""
    uri = uri or tracking_uri()
    refuse_file_store(uri)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise TrackingError(f"MLflow store {address(uri)}: no such database (no run has been recorded here)")
    try:
        client = open_client(uri, OPEN_TIMEOUT)
        return Attempt(lambda: what(client)).wait(CALL_TIMEOUT)
    except Exception as err:
        if rejected(err):
            return None
        raise TrackingError(f"MLflow store {address(uri)} {reason(err)}") from None


def get_run(run_id: str, *, uri: str | None = None):
    """The ``mlflow.entities.Run`` with this id, None if the store has none."""
    return _read(uri, lambda client: client.get_run(run_id))


def find_runs(filter_string: str, *, uri: str | None = None) -> list:
    """Runs of every experiment that match ``filter_string`` (MLflow's search syntax), newest first."""
    def search(client):
        ids = [e.experiment_id for e in client.search_experiments()]
        return client.search_runs(ids, filter_string, order_by=["attributes.start_time DESC"]) if ids else []

    return _read(uri, search) or []


def store_status(uri: str | None = None) -> str:
    """One line on the tracking store (for the machine report): whether it answers within the bounds."""
    uri = uri or tracking_uri()
    try:
        experiments = _read(uri, lambda client: client.search_experiments(max_results=1000))
    except TrackingError as err:
        return str(err).removeprefix("MLflow store ")
    if experiments is None:
        return f"{address(uri)} refuses this client (see the warning above)"
    return f"{address(uri)} answers ({plural(len(experiments), 'experiment')})"
