"""MLflow tracking, on the main process only.

Runs (see :func:`stage_tags`, :func:`run_name`): the train stage makes a *training run* (the params
it depends on, the loss curves, the model, checkpoints) and writes its id to ``outputs/train/run.json``;
every execution of the evaluate stage makes an *evaluation run* of its own (all the params it ran with,
the ``eval/*`` metrics) tagged ``training_run_id`` with the training run whose model it scored. So a
run's params and metrics always belong together, and re-running only evaluate with other params (e.g.
``dvc exp run -S evaluate.tta=true``) gives a new run rather than adding to an earlier one. Both kinds
carry the lineage tags of :func:`stage_tags`; :func:`get_run`, :func:`find_runs` and :func:`run_url`
serve the ``stages.lineage`` command. The tracking store defaults to
``sqlite:///<repository root>/mlflow.db`` with artifacts in ``<repository root>/mlartifacts``;
``MLFLOW_TRACKING_URI`` overrides. The repository root is ``DVC_ROOT`` when DVC sets it, and the
main repository when DVC runs a queued experiment in ``.dvc/tmp/exps/...`` (which is deleted
afterwards).

Tracking never stops or stalls a stage, never raises for store problems and leaves no run RUNNING
that it could end:

* Every store call runs in a worker thread that the stage waits on for at most
  :data:`CALL_TIMEOUT` seconds (10 s). The call itself is made to end sooner: for HTTP stores the
  process environment gets ``MLFLOW_HTTP_REQUEST_TIMEOUT=4``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=1``,
  ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1`` and ``MLFLOW_HTTP_REQUEST_BACKOFF_JITTER=0`` unless the
  user set them (a refused connection then fails at once, a server that never answers after 2 x 4 s;
  MLflow's defaults retry for 263 s); for SQLite stores MLflow's own per-session ``PRAGMA
  busy_timeout = 20000`` is lowered to :data:`SQLITE_BUSY_TIMEOUT` (8 s) for this store's database, so a
  call on a locked database fails by itself with "database is locked" after 8 s (opening the store
  on a locked database fails after sqlite3's default 5 s). A call still running at its deadline (a
  hung mount, a slow upload) is left to end in the background; if it then succeeds, it counts as
  recorded and the tracker is back online.
* The first failing call puts the tracker offline: it and every later call are kept in memory
  without touching the store. :meth:`Tracker.finish` retries what was kept once, in order, stopping
  at the first failure, then logs ONE warning naming what was not recorded, e.g.
  ``MLflow store http://127.0.0.1:9 unreachable: 35 metric values, 2 artifacts (model/model_final.pth,
  train_log.csv) and the run status FINISHED were not recorded (run 1f2e...)``. Going offline is
  logged at INFO only.
* :meth:`Tracker.start` on a store that fails: the stage runs on with an offline tracker whose
  ``run_id`` is None (run files then hold ``null``) and one warning says so at once.
  :meth:`Tracker.resume` with ``run_id=None`` or a run the store does not have: likewise. Resuming
  on a failing store keeps ``run_id`` and goes offline (the retry at :meth:`finish` may still record).

Bound: on an unreachable or locked store a stage waits for at most two failed calls, one when it goes
offline and one in the retry at :meth:`Tracker.finish`, each at most :data:`CALL_TIMEOUT`: 20 s in
all, whatever the length of the training (plus, once per process, up to :data:`OPEN_TIMEOUT` if
opening the store hangs rather than fails). Measured on the 2-core development machine with the
defaults, for start, 5 x log_metrics (35 values), 2 x log_artifact, finish:

* connection refused: 0.05 s per failed call; 0.05 s for the whole sequence;
* a server that accepts and never answers: 8.0 s per failed call; 8.0 s for the sequence when
  ``start`` fails, 16.0 s when the run was created (resume) and finish retries;
* SQLite under ``BEGIN EXCLUSIVE``: 8.0 s per failed call; 16.1 s when the lock comes during the
  run, 8.0 s when it is there at start (6.6 s if the process first opens the store under the lock).

A store that answers, however slowly, is waited on call by call (each at most ``CALL_TIMEOUT``).
MLflow's own log records and tracebacks from these calls are kept off the terminal (the warning
above is the product). :func:`close_run` ends a run whose owning process was killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import TrackingError
from .fileio import write_json

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0
"""Seconds a stage waits on one store call."""

SQLITE_BUSY_TIMEOUT = 8.0
"""Seconds a SQLite call waits for a locked database before it fails by itself (MLflow's own: 20 s);
below :data:`CALL_TIMEOUT`, so that the call ends, with the reason, before the stage stops waiting."""

OPEN_TIMEOUT = 30.0
"""Seconds a stage waits for MLflow to open the store, once per process. Making the client of an HTTP
store sends nothing; opening a locked SQLite database fails by itself after 5 s; creating a new one
runs MLflow's schema migrations (about 6 s here), which must not be cut short."""

HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
}
"""MLflow's HTTP knobs, set in the process environment unless the user set them (MLflow's defaults
retry 7 times with exponential backoff and wait 120 s per request: 263 s on a refused connection)."""

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
UI_URL = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` (and ``mlflow server``) serve by default; run URLs are given under it."""
STAGE_TAG = "pipeline.stage"  # train | evaluate
TRAINING_RUN_TAG = "training_run_id"  # on an evaluation run: the training run whose model it scored
EXP_NAME_TAG, BASELINE_TAG, COMMIT_TAG = "dvc.exp_name", "dvc.baseline_rev", "mlflow.source.git.commit"
PARAMS_HASH_TAG = "params.sha256"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI (Markdown)
_TAG_KEY = re.compile(r"[^\w./ :-]")  # characters MLflow does not take in a tag key
_THREAD_NAME = "mlflow-tracking-call"
_BATCH_METRICS = 1000  # MLflow's limits per log_batch
_BATCH_PARAMS = 100


def repo_root() -> Path:
    """The repository whose ``mlflow.db`` records this run."""
    root = Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()
    parts = root.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return root


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


_default_tracking_uri = tracking_uri  # close_run's keyword argument shadows the name


def artifact_location(experiment: str) -> str:
    return (repo_root() / "mlartifacts" / experiment).as_uri()


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


def git_commit(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or os.getcwd(), capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# --- lineage: run names and tags ---------------------------------------------------------------------


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys (``{"train": {"base_lr": 1}}`` -> ``{"train.base_lr": 1}``)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def describe_changes(params: dict[str, Any], defaults: dict[str, Any], *, first: tuple[str, ...] = (),
                     limit: int = 60) -> str:
    """The params (dotted keys) that differ from ``defaults``, as ``key=value`` pairs: those starting
    with ``first`` come first, then in key order; at most ``limit`` characters, the rest counted, e.g.
    ``evaluate.tta=true, train.max_iter=4 (+12 more)``. Empty if nothing differs."""
    changed = sorted((k for k in params if params[k] != defaults.get(k, object())),
                     key=lambda k: (not k.startswith(first) if first else False, k))
    shown: list[str] = []
    for i, key in enumerate(changed):
        pair = f"{key}={_shown(params[key])}"
        rest = len(changed) - i - 1
        if shown and len(", ".join([*shown, pair])) + (len(f" (+{rest} more)") if rest else 0) > limit:
            return ", ".join(shown) + f" (+{len(changed) - i} more)"
        shown.append(pair)
    return ", ".join(shown)


def run_name(stage: str, params: dict[str, Any], defaults: dict[str, Any] | None, *,
              first: tuple[str, ...] = ()) -> str:
    """A readable MLflow run name: the DVC experiment name (``DVC_EXP_NAME``) when DVC sets it, else the
    params changed against ``defaults`` (see :func:`describe_changes`; None when they are unknown), else
    ``<stage> <8 hex digits of the params' hash>``. Training runs end in `` (train)``."""
    label = os.environ.get("DVC_EXP_NAME") or (describe_changes(params, defaults, first=first) if defaults else "")
    if not label:
        digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
        return f"{stage} {digest}"
    return label if stage == "evaluate" else f"{label} ({stage})"


def default_params(root: str | Path = ".") -> dict[str, Any] | None:
    """The params (dotted keys) that ``conf/`` under ``root`` composes to without overrides, for
    :func:`run_name`; None if it cannot be composed (logged at INFO)."""
    import yaml

    from .compose import compose_params

    try:
        return flatten(yaml.safe_load(compose_params(root)))
    except Exception as err:  # a name is not worth stopping a stage for
        log.info("the default params are unknown (%s: %s): run names use a hash", type(err).__name__, err)
        return None


def training_note(run_id: str) -> str:
    """The UI description of a training run."""
    return (f"Training run: loss curves, model and checkpoints. Each evaluation of its model is a run of its own, "
            f"tagged `{TRAINING_RUN_TAG}` = `{run_id}` (search `tags.{TRAINING_RUN_TAG} = '{run_id}'`).")


def evaluation_note(training_run_id: str | None, experiment_id: str | None) -> str:
    """The UI description of an evaluation run, linking to its training run."""
    if not training_run_id:
        return "Evaluation run; the model's training was not tracked."
    link = f"[{training_run_id}](#/experiments/{experiment_id}/runs/{training_run_id})" if experiment_id \
        else f"`{training_run_id}`"
    return f"Evaluation run: params and `eval/*` metrics of this configuration. Model from training run {link}."


CODE_FOLDERS = ("pipelines/", "stages/")  # code deps: the git commit (or DVC experiment) pins them


def _lock_tags(lock_file: Path, stage: str) -> dict[str, str]:
    """``dvc.lock/<stage>/<path>: <md5>`` for every dep and out that is not code (:data:`CODE_FOLDERS`)
    of the stages before ``stage`` (in the order of ``dvc.yaml`` beside ``lock_file``, else of the
    lock file): the data and model that ``stage`` reads, and the data they were made from. These
    entries are final when ``stage`` runs (DVC writes a stage's own entry only after it ends)."""
    stages = _bounded_yaml(lock_file).get("stages") or {}
    pipeline = lock_file.with_name("dvc.yaml")
    order = list(_bounded_yaml(pipeline).get("stages") or {}) if pipeline.is_file() else []
    order += [name for name in stages if name not in order]
    tags = {}
    for name in order[: order.index(stage)] if stage in order else []:
        entry = stages.get(name) or {}
        for item in [*(entry.get("deps") or []), *(entry.get("outs") or [])]:
            digest = item.get("md5") or item.get("etag") or item.get("checksum")
            if item.get("path") and digest and not str(item["path"]).startswith(CODE_FOLDERS):
                tags[_TAG_KEY.sub("_", f"dvc.lock/{name}/{item['path']}")[:250]] = str(digest)
    return tags


def _bounded_yaml(path: Path) -> dict:
    """A YAML mapping read with the size and alias-expansion bounds of ``params.yaml``; ``{}`` where it
    is unusable (lineage tags are worth no stop)."""
    from omegaconf import OmegaConf

    from .config import parse_yaml, read_yaml_text
    from .errors import ConfigError

    try:
        tree = OmegaConf.to_container(parse_yaml(read_yaml_text(path), str(path)))
    except ConfigError as err:
        log.info("%s: not used for lineage tags (%s)", path, err)
        return {}
    return tree if isinstance(tree, dict) else {}


def stage_tags(stage: str, *, params_file: str | Path, cache: str | Path | None = None,
               lock_file: str | Path = "dvc.lock") -> dict[str, str]:
    """The lineage tags of a stage's run, from files in the stage's working folder:

    * ``pipeline.stage``: ``stage``; ``params.sha256``: SHA-256 of ``params_file``'s bytes;
    * ``data.cache.<split>``: SHA-256 of the array hashes in ``<cache>/<split>/meta.json`` (the
      annotation cache's content), for every split there;
    * ``dvc.lock/<stage>/<path>``: the md5 that ``lock_file`` records for each dep and out, code
      aside, of the stages that run before ``stage`` (the data and model it reads), if there is one.

    The git commit and DVC experiment name and baseline are added by :meth:`Tracker.start`. A file
    that cannot be read leaves its tags out (logged at INFO): tracking never stops a stage."""
    tags = {STAGE_TAG: stage}
    try:
        tags[PARAMS_HASH_TAG] = hashlib.sha256(Path(params_file).read_bytes()).hexdigest()
        for meta in sorted(Path(cache).glob("*/meta.json")) if cache else []:
            arrays = json.loads(meta.read_text())["arrays"]
            digest = hashlib.sha256(json.dumps(arrays, sort_keys=True).encode())
            tags[f"data.cache.{meta.parent.name}"] = digest.hexdigest()
        if Path(lock_file).is_file():
            tags.update(_lock_tags(Path(lock_file), stage))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.info("lineage tags left incomplete: %s: %s", type(err).__name__, err)
    return tags


def run_url(experiment_id: str, run_id: str, base: str = UI_URL) -> str:
    """The run's page in the MLflow UI served at ``base``."""
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


# --- bounded reads, for the lineage command ----------------------------------------------------------


def _read(uri: str | None, what: Callable[[Any], Any]) -> Any:
    """``what(client)`` within the bounds of the module docstring; a :class:`TrackingError` on store problems."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise TrackingError(f"MLflow store {uri}: no such database (no run has been recorded here)")
    try:
        client = _client(uri, OPEN_TIMEOUT)
        return _Attempt(lambda: what(client)).wait(CALL_TIMEOUT)
    except Exception as err:
        if _store_rejected(err):
            return None
        raise TrackingError(f"MLflow store {uri} {_reason(err)}") from None


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
        return f"{uri} refuses this client (see the warning above)"
    return f"{uri} answers ({_plural(len(experiments), 'experiment')})"


# --- bounded store calls -----------------------------------------------------------------------------


class _NoAnswer(Exception):
    """A store call still running at its deadline."""


class _Attempt:
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
        """The call's result; its exception, or :class:`_NoAnswer` if it has not ended in ``timeout`` s."""
        if not self.ended.wait(max(timeout, 0.0)):
            raise _NoAnswer(f"no answer within {timeout:g} s")
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
    """Before any client is made for ``uri``: bounded HTTP knobs, bounded SQLite waits, quiet logs."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import mlflow  # noqa: F401  (configures MLflow's loggers, which _quiet_mlflow_logging then filters)

    _limit_sqlite_busy_wait(uri)
    _quiet_mlflow_logging()


def _store_rejected(err: BaseException) -> bool:
    """The store answered and refused the request (no such run, invalid value): retrying won't help."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    status = err.get_http_status_code()
    return 400 <= status < 500 and status not in (401, 403, 408, 429)  # not credentials, timeouts, rate limits


def _reason(err: BaseException) -> str:
    """What is wrong with the store, in a few words, for the warning."""
    text = str(err)
    if isinstance(err, _NoAnswer):
        return f"not answering ({err})"
    if "database is locked" in text or "database table is locked" in text:
        return "locked"
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return "not answering (timed out)"
    if re.search(r"refused|Max retries exceeded|Failed to establish|Name or service not known|NameResolution"
                 r"|unable to open database|Connection (aborted|reset)", text, re.IGNORECASE):
        return "unreachable"
    first = text.strip().splitlines()[0][:200] if text.strip() else ""
    return f"failing ({type(err).__name__}: {first})" if first else f"failing ({type(err).__name__})"


def _client(uri: str, timeout: float):
    """An ``MlflowClient`` for ``uri``, made within ``timeout`` (making it opens, maybe creates, the store)."""
    _prepare(uri)
    import mlflow

    def make():
        with _store_creation_lock(uri):
            _open_sqlite_file(uri)
            return mlflow.MlflowClient(tracking_uri=uri)

    return _Attempt(make).wait(timeout)


def _open_sqlite_file(uri: str) -> None:
    """Open (and so create, as MLflow would) a SQLite store's file once, to fail at once where it cannot be
    opened at all (a read-only folder without the database, a folder in its place, no permission): MLflow
    retries that 9 times with growing sleeps (100 s), so the stage would wait out ``OPEN_TIMEOUT``
    (measured: 31 s for a read-only folder), past the documented bound. A locked database opens."""
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


def close_run(run_id: str, status: str, *, tracking_uri: str | None = None) -> bool:
    """Set run ``run_id`` to ``status`` (FAILED or KILLED; FINISHED is accepted too) if it is still RUNNING.

    For a run whose owning process was killed. Returns whether it changed the status. Waits at most
    :data:`CALL_TIMEOUT` on the store (plus :data:`OPEN_TIMEOUT` if opening it hangs; measured: 0.01 s
    when refused, 8 s when silent or locked) and never raises for store problems (one warning line
    instead); a ``status`` that is not a terminal run status raises ValueError.
    """
    status = str(status).upper()
    if status not in RUN_STATUSES:
        raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
    if not run_id:
        return False
    uri = tracking_uri or _default_tracking_uri()
    try:
        client = _client(uri, OPEN_TIMEOUT)

        def close() -> bool:
            if client.get_run(run_id).info.status != "RUNNING":
                return False
            client.set_terminated(run_id, status=status)
            return True

        return bool(_Attempt(close).wait(CALL_TIMEOUT))
    except Exception as err:  # never raise for the store
        if _store_rejected(err):
            log.warning("MLflow store %s has no run %s to mark %s (%s)", uri, run_id, status, str(err).splitlines()[0][:200])
        else:
            log.warning("MLflow store %s %s: run %s was not marked %s", uri, _reason(err), run_id, status)
        log.debug("close_run(%s) failed", run_id, exc_info=True)
        return False


# --- the tracker -------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Op:
    """One logging request: kept until the store has it."""

    kind: str  # params | metrics | tag | artifact | artifacts | text | reopen | status
    args: tuple
    count: int = 1
    name: str = ""
    attempt: _Attempt | None = field(default=None, repr=False)

    @property
    def recorded(self) -> bool:
        return self.attempt is not None and self.attempt.ended.is_set() and self.attempt.ok

    @property
    def in_flight(self) -> bool:
        return self.attempt is not None and not self.attempt.ended.is_set()


def _apply(client, run_id: str, ops: list[_Op]) -> None:
    """Send ``ops`` (consecutive metric values merged into batches) to the store."""
    import mlflow

    if ops[0].kind == "metrics":
        metrics = [m for op in ops for m in op.args[0]]
        for i in range(0, len(metrics), _BATCH_METRICS):
            client.log_batch(run_id, metrics=metrics[i : i + _BATCH_METRICS])
        return
    (op,) = ops
    if op.kind == "params":
        items = [mlflow.entities.Param(k, v) for k, v in op.args[0]]
        for i in range(0, len(items), _BATCH_PARAMS):
            client.log_batch(run_id, params=items[i : i + _BATCH_PARAMS])
    elif op.kind == "tag":
        client.set_tag(run_id, *op.args)
    elif op.kind == "artifact":
        client.log_artifact(run_id, *op.args)
    elif op.kind == "artifacts":
        client.log_artifacts(run_id, *op.args)
    elif op.kind == "text":
        client.log_text(run_id, *op.args)
    elif op.kind == "reopen":
        client.update_run(run_id, status="RUNNING")
    elif op.kind == "status":
        client.set_terminated(run_id, status=op.args[0], end_time=op.args[1])
    else:
        raise AssertionError(op.kind)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _describe(ops: list[_Op]) -> tuple[str, bool]:
    """``"35 metric values, 2 artifacts (a, b) and the run status"`` and whether it is plural."""
    count = lambda *kinds: sum(op.count for op in ops if op.kind in kinds)  # noqa: E731
    names = [op.name for op in ops if op.kind in ("artifact", "artifacts", "text")]
    parts = []
    if n := count("params"):
        parts.append(_plural(n, "param"))
    if n := count("metrics"):
        parts.append(_plural(n, "metric value"))
    if n := count("tag"):
        parts.append(_plural(n, "tag"))
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{_plural(len(names), 'artifact')} ({shown})")
    if statuses := [op.args[0] for op in ops if op.kind == "status"]:
        parts.append(f"the run status {statuses[-1]}")
    if not parts:
        return "the run's reopening", False
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    plural = len(parts) > 1 or (bool(parts) and not parts[0].startswith(("1 ", "the ")))
    return text, plural


class Tracker:
    """An MLflow run on the main process; on other processes every method is a no-op.

    Use :meth:`start` (a new run) or :meth:`resume` (a run to continue, e.g. an interrupted training),
    then ``log_*`` and :meth:`finish`. No
    method raises for store problems or waits more than :data:`CALL_TIMEOUT` on one (see the module
    docstring); ``run_id`` is None when there is no run to log to (not the main process, or the
    store could not create or find it).
    """

    def __init__(self, run_id: str | None = None, *, uri: str | None = None):
        self.run_id = run_id
        self.experiment_id: str | None = None  # known after start()
        self.uri = uri or tracking_uri()
        self._client_obj = None
        self._kept: list[_Op] = []  # not (yet) recorded, in order
        self._offline = False  # after a store failure: keep everything for finish()
        self._error: BaseException | None = None  # the last store failure
        self._stalled: _Op | None = None  # the op whose call was still running at its deadline
        self._steps: dict[str, int] = {}  # the largest step this tracker logged, per metric
        self._rejected: set[str] = set()
        self._unknown_steps: set[str] = set()  # metrics whose last_step the store could not tell
        self._finished = False

    @property
    def active(self) -> bool:
        return self.run_id is not None

    @property
    def offline(self) -> bool:
        """True after a store failure: calls are kept for :meth:`finish` instead of being sent."""
        return self._offline

    # construction

    @classmethod
    def start(cls, *, experiment: str, params: dict[str, Any], run_name: str | None = None,
              tags: dict[str, str] | None = None, main_process: bool = True) -> "Tracker":
        """Create the run with params (dotted keys) and tags: git commit, DVC experiment name and
        baseline (when DVC sets ``DVC_EXP_NAME``, ``DVC_EXP_BASELINE_REV``), then ``tags``.

        If the store fails, the returned tracker is offline with ``run_id`` None and a warning says so."""
        if not main_process:
            return cls()
        tracker = cls()
        all_tags = {"pipeline": "detection"}
        if commit := git_commit(repo_root()):
            all_tags[COMMIT_TAG] = commit
        if exp_name := os.environ.get("DVC_EXP_NAME"):
            all_tags[EXP_NAME_TAG] = exp_name
        if baseline := os.environ.get("DVC_EXP_BASELINE_REV"):
            all_tags[BASELINE_TAG] = baseline
        all_tags.update(tags or {})
        name = run_name or os.environ.get("DVC_EXP_NAME")
        try:
            client = tracker._get_client()
            tracker.run_id, tracker.experiment_id = cls._create_run(client, experiment, name, all_tags)
        except Exception as err:
            tracker._offline, tracker._error = True, err
            log.debug("creating the MLflow run failed", exc_info=True)
            log.warning("MLflow store %s %s: this run is not tracked (no MLflow run was created; its params, "
                        "metrics, artifacts and status are not recorded)", tracker.uri, _reason(err))
            return tracker
        tracker._submit(_Op("params", ([(k, str(v)) for k, v in params.items()],), count=len(params)))
        log.info("MLflow run %s in experiment %r at %s", tracker.run_id, experiment, tracker.uri)
        return tracker

    @staticmethod
    def _create_run(client, experiment: str, run_name: str | None, tags: dict[str, str]) -> tuple[str, str]:
        """The new run's id and its experiment's id, within ``CALL_TIMEOUT``; a run created after the caller
        gave up is ended at once (KILLED) rather than left RUNNING."""
        import mlflow

        lock, state = threading.Lock(), {"gave_up": False, "claimed": False}

        def create() -> str:
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                try:
                    exp_id = client.create_experiment(experiment, artifact_location=artifact_location(experiment))
                except mlflow.exceptions.MlflowException:  # created meanwhile by another pipeline
                    exp_id = client.get_experiment_by_name(experiment).experiment_id
            else:
                exp_id = exp.experiment_id
            run_id = client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
            with lock:
                state["claimed"] = not state["gave_up"]
            if not state["claimed"]:
                client.set_terminated(run_id, status="KILLED")
            return run_id, exp_id

        attempt = _Attempt(create)
        try:
            return attempt.wait(CALL_TIMEOUT)
        except _NoAnswer:
            with lock:
                state["gave_up"] = not state["claimed"]
            if state["gave_up"]:
                raise
            return attempt.wait(CALL_TIMEOUT)  # created just now: returns at once

    @classmethod
    def resume(cls, run_id: str | None, *, main_process: bool = True) -> "Tracker":
        """Reopen an existing run (e.g. the train stage's) to add to it.

        ``run_id`` None (the train stage ran without tracking) or a run the store does not have: an
        offline tracker with ``run_id`` None and one warning. A store that fails: the tracker keeps
        ``run_id``, goes offline and :meth:`finish` retries what was logged."""
        if not main_process:
            return cls()
        if run_id is None:
            tracker = cls()
            tracker._offline = True
            log.warning("No MLflow run to add to (the train stage ran without tracking): these results are not "
                        "recorded in MLflow")
            return tracker
        tracker = cls(run_id)
        reopen = _Op("reopen", (), count=0)
        tracker._kept.append(reopen)  # kept in order, so that a late RUNNING never follows the final status
        try:
            client = tracker._get_client()
            reopen.attempt = _Attempt(lambda: client.update_run(run_id, status="RUNNING"))
            reopen.attempt.wait(CALL_TIMEOUT)
            tracker._kept.remove(reopen)
        except Exception as err:
            log.debug("resuming MLflow run %s failed", run_id, exc_info=True)
            if _store_rejected(err):
                tracker.run_id, tracker._offline, tracker._kept = None, True, []
                log.warning("MLflow store %s has no run %s to add to (%s): these results are not recorded in MLflow",
                            tracker.uri, run_id, str(err).strip().splitlines()[0][:200])
            else:
                if isinstance(err, _NoAnswer):
                    tracker._stalled = reopen
                tracker._go_offline(err)
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
            self._submit(_Op("metrics", (values,), count=len(values)))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.active and self._exists(path):
            name = "/".join(filter(None, [artifact_path, Path(path).name]))
            self._submit(_Op("artifact", (str(path), artifact_path), name=name))

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        if self.active and self._exists(folder):
            self._submit(_Op("artifacts", (str(folder), artifact_path), name=(artifact_path or ".") + "/"))

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.active:
            self._submit(_Op("text", (text, artifact_file), name=artifact_file))

    def set_tag(self, key: str, value: str) -> None:
        if self.active:
            self._submit(_Op("tag", (key, value)))

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
            if _store_rejected(err):
                return local
            self._unknown_steps.add(key)
            self._go_offline(err)
            return local
        return max([local, *(m.step for m in history)])

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (FINISHED, FAILED or KILLED) after one retry of what was kept;
        logs one warning naming what could still not be recorded."""
        status = str(status).upper()
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
        if not self.active or self._finished:
            return
        self._finished = True
        self._kept.append(_Op("status", (status, int(time.time() * 1000))))
        if self._offline:
            log.debug("retrying %d kept MLflow calls", len(self._kept))
        if not self._unknown_steps or self._drop_logged_steps():
            self._flush(retry=True)
        self._kept = [op for op in self._kept if not op.recorded]
        if self._kept:
            what, plural = _describe(self._kept)
            log.warning("MLflow store %s %s: %s %s not recorded (run %s)", self.uri,
                        _reason(self._error) if self._error else "failing", what, "were" if plural else "was",
                        self.run_id)

    # internals

    def _drop_logged_steps(self) -> bool:
        """After :meth:`last_step` could not ask the store: drop the kept metric values (of every key,
        as a resumed training re-logs them all) at steps the store already has. False if the store
        failed (one call, at most ``CALL_TIMEOUT``)."""
        run_id = self.run_id
        keys = sorted({m.key for op in self._kept if op.kind == "metrics" for m in op.args[0]})

        def logged(client) -> dict[str, int]:
            steps = {k: [m.step for m in client.get_metric_history(run_id, k)] for k in keys}
            return {k: max(v) for k, v in steps.items() if v}

        try:
            client = self._get_client()
            last = _Attempt(lambda: logged(client)).wait(CALL_TIMEOUT)
        except Exception as err:
            log.debug("asking the MLflow store for logged steps failed", exc_info=True)
            if _store_rejected(err):
                return True
            self._go_offline(err)
            return False
        self._unknown_steps.clear()
        for op in list(self._kept):
            if op.kind == "metrics" and not op.in_flight and not op.recorded:
                values = [m for m in op.args[0] if m.step > last.get(m.key, -1 << 62)]
                if len(values) < op.count:
                    log.debug("dropping %d kept metric values at steps the store has", op.count - len(values))
                    op.args, op.count = (values,), len(values)
                    if not values:
                        self._kept.remove(op)
        return True

    def _get_client(self):
        if self._client_obj is None:
            self._client_obj = _client(self.uri, OPEN_TIMEOUT)
        return self._client_obj

    def _call(self, fn: Callable[[], Any]) -> Any:
        return _Attempt(fn).wait(CALL_TIMEOUT)

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

    def _go_offline(self, err: BaseException) -> None:
        self._error = err
        if not self._offline:
            self._offline = True
            log.info("MLflow store %s %s: tracking goes on offline, and what it keeps is retried when the stage "
                     "ends", self.uri, _reason(err))

    def _submit(self, op: _Op) -> None:
        self._kept.append(op)
        if self._offline and self._stalled is not None and self._stalled.recorded and \
                not any(o.in_flight for o in self._kept):
            # the call that missed its deadline went through after all: the store is back
            self._offline, self._stalled = False, None
            log.info("MLflow store %s answers again: tracking is back online", self.uri)
        if not self._offline:
            self._flush(retry=False)

    def _flush(self, *, retry: bool) -> None:
        """Send the kept ops in order, stopping at the first store failure (which puts the tracker offline).

        In the retry at :meth:`finish`, a call still running from earlier is waited on first (at most
        ``CALL_TIMEOUT``) rather than sent twice at once."""
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
                    op.attempt.wait(CALL_TIMEOUT)
                    i += 1
                    continue
                except _NoAnswer as err:
                    self._error = err
                    return
                except Exception:  # it failed meanwhile: send it again below
                    pass
            group, size = [op], op.count
            while op.kind == "metrics" and i + len(group) < len(self._kept):  # one log_batch for many calls
                nxt = self._kept[i + len(group)]
                if nxt.kind != "metrics" or nxt.attempt is not None or size + nxt.count > _BATCH_METRICS:
                    break
                group.append(nxt)
                size += nxt.count
            try:
                client = self._get_client()
                attempt = _Attempt(lambda c=client, g=group: _apply(c, self.run_id, g))
                for o in group:
                    o.attempt = attempt
                attempt.wait(CALL_TIMEOUT)
            except Exception as err:
                log.debug("MLflow %s call failed", op.kind, exc_info=True)
                if _store_rejected(err):  # the store refuses it: drop it, say why once
                    for o in group:
                        self._kept.remove(o)
                    why = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
                    self._reject(f"MLflow store {self.uri} refused {_describe(group)[0]}: {why}", key=why)
                    continue
                if isinstance(err, _NoAnswer):
                    self._stalled = op
                self._go_offline(err)
                return
            i += len(group)
        self._kept = [op for op in self._kept if not op.recorded]
