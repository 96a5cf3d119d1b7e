"""A shared MLflow tracking server on PostgreSQL, started with one command (docs/team.md).

    python -m pipelines.team.mlflow_server               # or: make tracking-server; Ctrl-C stops it
    python -m pipelines.team.mlflow_server --detach      # in the background; then:
    python -m pipelines.team.mlflow_server stop

Everything it keeps is in ``--folder`` (default ``.tracking-server/``):

* ``postgres/``: a private PostgreSQL cluster (Debian's ``postgresql``, ``initdb`` on first use)
  listening on a free port of ``--db-host`` (127.0.0.1 unless the database should be reachable from
  elsewhere), never the system's 5432. Run as root it runs as the ``postgres`` user, as PostgreSQL
  requires. Its one role, ``mlflow``, has a random password kept in ``pgpass`` (mode 600), which the
  MLflow server reads through libpq's ``PGPASSFILE``: it is in no URI, command line or log.
* the ``mlflow`` database; where its schema is older than this MLflow's, ``mlflow db upgrade`` runs
  before the server starts (and says so).
* ``artifacts/``: the runs' artifacts, or the ``--artifacts`` destination (an ``s3://`` bucket, with
  the ``AWS_*`` credentials in the server's environment). The server proxies them
  (``--serve-artifacts``): clients upload and download models and checkpoints through it and need
  neither the disk nor storage credentials.
* ``server.log``: the MLflow server's output; ``server.json``: what runs, for ``stop`` and ``status``.

MLflow's job runner (huey consumers for its GenAI jobs, which no detection run uses) is off unless
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true`` is set: it adds processes and costs CPU at every start, for
nothing a detection run needs.

It prints the URI clients set as ``MLFLOW_TRACKING_URI``: ``--public-url``, the address teammates reach it at
(:mod:`~pipelines.team.address`), apart from ``--host``, where it listens; MLflow admits that name (and this
machine's loopback names and ``--host``) in the ``Host`` header and nothing else. Where ``--host`` is not
loopback, auth is on whether or not ``--auth`` is given. ``--workers`` server processes (default one per
core, at most 4); with auth, ``--default-permission`` (READ at first) is kept across restarts until given
again. Ctrl-C, SIGTERM or SIGHUP (or ``stop``) ends the MLflow server, then PostgreSQL (``pg_ctl stop -m
fast``). Errors are one line, ``error: ...``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import secrets
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import TrackingError
from ..lifetime import free_port
from ..tracking import store
from . import address, service

ROLE = DATABASE = "mlflow"
READY_TIMEOUT = 120.0  # seconds for `mlflow server` to answer /health: its first start on a busy machine is slow
JOBS_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"  # off unless set: see start()


class ServerError(TrackingError):
    """The tracking server cannot start or stop (one line)."""


TRACKING = service.Service("tracking server", "a", program="mlflow server", module="pipelines.team.mlflow_server",
                           error=ServerError)


def pg_command(name: str) -> str:
    """The path of PostgreSQL's ``name`` (``initdb``, ``pg_ctl``): on ``PATH``, else Debian's newest."""
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True):
        if (folder / name).is_file():
            return str(folder / name)
    raise ServerError(f"PostgreSQL's {name} not found: install Debian's postgresql (apt-get install postgresql)")


def _as_owner(command: list[str]) -> list[str]:
    """``command`` run as the cluster's owner: ``postgres`` when we are root (PostgreSQL refuses root)."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def _run(command: list[str], what: str, env: dict | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise ServerError(f"{what} failed: {last[0]}")
    return done.stdout


@dataclass
class Cluster:
    """The private PostgreSQL cluster in ``folder/postgres``, its password in ``folder/pgpass``."""

    folder: Path
    host: str = "127.0.0.1"

    @property
    def data(self) -> Path:
        return self.folder / "postgres"

    @property
    def passfile(self) -> Path:
        return self.folder / "pgpass"

    def init(self) -> bool:
        """Create the cluster and its role if there is none; whether it was created."""
        if (self.data / "PG_VERSION").is_file():
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.data.exists():
            shutil.rmtree(self.data)  # an initdb that did not finish
        password = secrets.token_urlsafe(24)
        self.data.mkdir(mode=0o700)
        pwfile = self.folder / ".initdb-password"  # initdb wants its folder empty
        service.write_secret(pwfile, password + "\n")
        if os.geteuid() == 0:
            for path in (self.data, pwfile):
                shutil.chown(path, "postgres", "postgres")
            if subprocess.run(["runuser", "-u", "postgres", "--", "test", "-w", str(self.data)]).returncode:
                shutil.rmtree(self.data)
                raise ServerError(f"{self.folder}: the postgres user cannot reach it (a parent folder is private); "
                                  "choose another --folder")
        try:
            _run(_as_owner([pg_command("initdb"), "-D", str(self.data), "-U", ROLE, f"--pwfile={pwfile}",
                            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8"]), "initdb")
        except ServerError:
            shutil.rmtree(self.data, ignore_errors=True)
            raise
        finally:
            pwfile.unlink(missing_ok=True)
        service.write_secret(self.passfile, f"*:*:*:{ROLE}:{password}\n")
        return True

    def running_port(self) -> int | None:
        """The port of this cluster's server if it runs (``postmaster.pid``'s 4th line), else None."""
        status = subprocess.run(_as_owner([pg_command("pg_ctl"), "-D", str(self.data), "status"]), capture_output=True)
        if status.returncode:
            return None
        lines = (self.data / "postmaster.pid").read_text().splitlines()
        return int(lines[3])

    def start(self, port: int | None = None) -> int:
        """Start the cluster's server on ``port`` (default: a free one), or find it running; its port."""
        running = self.running_port()
        if running:
            return running
        port = port or free_port(self.host)
        options = f"-p {port} -c listen_addresses={self.host} -c unix_socket_directories='{self.data}'"
        log = self.data / "server.log"
        offset = service.log_size(log)
        try:
            _run(_as_owner([pg_command("pg_ctl"), "-D", str(self.data), "-l", str(log), "-w", "-t", "60", "-o",
                            options, "start"]), f"starting PostgreSQL (log: {log})")
        except ServerError as err:  # pg_ctl says "Examine the log output.": the cause is in the log
            why = service.cause_since(log, offset)
            raise (ServerError(f"PostgreSQL did not start on port {port}: {why} (log: {log})") if why else err) from None
        return port

    def stop(self) -> None:
        if self.running_port():
            _run(_as_owner([pg_command("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]),
                 "stopping PostgreSQL")

    def uri(self, port: int) -> str:
        """The SQLAlchemy URI of the ``mlflow`` database (no password: libpq reads ``PGPASSFILE``)."""
        return f"postgresql+psycopg://{ROLE}@{self.host}:{port}/{DATABASE}"

    def ensure_database(self, port: int, name: str = DATABASE) -> None:
        import psycopg

        with psycopg.connect(host=self.host, port=port, user=ROLE, dbname="postgres", passfile=str(self.passfile),
                             autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(f'CREATE DATABASE "{name}"')


def schema_revision(cluster: Cluster, port: int) -> str | None:
    """The ``mlflow`` database's alembic revision; None for an empty database (the server creates it)."""
    import psycopg

    with psycopg.connect(host=cluster.host, port=port, user=ROLE, dbname=DATABASE, passfile=str(cluster.passfile)) as conn:
        if conn.execute("SELECT to_regclass('alembic_version')").fetchone()[0] is None:
            return None
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        return row[0] if row else None


def head_revision() -> str:
    """The schema revision this MLflow writes (the head of its migrations)."""
    import logging

    logging.getLogger("alembic").setLevel(logging.WARNING)
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    return ScriptDirectory.from_config(_get_alembic_config("sqlite://")).get_current_head()


AUTH_DATABASE = "mlflow_auth"
ADMIN = "admin"


def _secret(path: Path) -> str:
    """The secret kept in ``path`` (mode 600), made on first use."""
    return service.secret(path, lambda: secrets.token_hex(16)).strip()


PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")
"""What ``--default-permission`` may be: what a user may do where nobody granted them anything (MLflow's
basic-auth ``default_permission``)."""
FIRST_PERMISSION = "READ"  # MLflow's own default, the first start's


def kept_permission(config: Path) -> str | None:
    """The ``default_permission`` that ``config`` (``basic_auth.ini``) holds, None without the file or the key."""
    import configparser

    if not config.is_file():
        return None
    parser = configparser.ConfigParser()
    try:
        parser.read(config)
    except configparser.Error:
        return None
    return parser.get("mlflow", "default_permission", fallback=None)


def write_auth_config(folder: Path, *, database_uri: str, default_permission: str | None = None, say=print) -> str:
    """Write ``FOLDER/basic_auth.ini`` (the basic-auth app's settings, no secret in it); its default permission.

    ``default_permission`` None keeps what the file holds (a lead's ``--default-permission`` or hand edit survives
    a restart), else :data:`FIRST_PERMISSION`; a change is said in one line."""
    config = folder / "basic_auth.ini"
    kept = kept_permission(config)
    if default_permission is None and kept is not None and kept not in PERMISSIONS:
        raise ServerError(f"{config}: default_permission = {kept} is not one of {', '.join(PERMISSIONS)}; "
                          "correct it or pass --default-permission")
    permission = default_permission or kept or FIRST_PERMISSION
    if kept is not None and permission != kept:
        say(f"new users' default permission: {kept} -> {permission} (--default-permission)")
    config.write_text(f"[mlflow]\ndefault_permission = {permission}\n"
                      f"database_uri = {database_uri}\n"
                      f"admin_username = {ADMIN}\n"
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    return permission


def _auth_environment(cluster: Cluster, port: int, *, default_permission: str | None,
                      say) -> tuple[dict[str, str], str]:
    """The basic-auth app's settings (its users in the ``mlflow_auth`` database, :func:`write_auth_config`), the
    admin's password from ``FOLDER/admin-password`` (through the environment, never a file it reads); and the
    default permission."""
    cluster.ensure_database(port, AUTH_DATABASE)
    permission = write_auth_config(cluster.folder, default_permission=default_permission, say=say,
                                   database_uri=f"postgresql+psycopg://{ROLE}@{cluster.host}:{port}/{AUTH_DATABASE}")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(cluster.folder / "basic_auth.ini"),
            "MLFLOW_AUTH_ADMIN_PASSWORD": _secret(cluster.folder / "admin-password"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret(cluster.folder / "flask-secret")}, permission  # its CSRF key


def secure(host: str, auth: bool, say=print) -> bool:
    """Whether the server runs with auth: always where ``host`` is not a loopback address (anyone who reaches the
    port could otherwise read, write and delete every experiment and fill the disk), said in one line."""
    if auth or address.is_loopback(host):
        return auth
    say(f"--host {host} is reachable from other machines: auth is on (as with --auth); create users with "
        f"`python -m pipelines.team.mlflow_server user NAME`")
    return True


def default_workers() -> int:
    """``--workers`` by default: one per core of this process, at most MLflow's own default (4)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def worker_count(text: str) -> int:
    """``--workers``: 1 to 64 (argparse type)."""
    value = int(text) if text.strip().isdigit() else 0
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"expected a number of server processes from 1 to 64, got {text!r}")
    return value


def add_user(folder: Path, name: str, *, experiment: str) -> str:
    """Create user ``name`` on the running server of ``folder`` (with auth) and give it EDIT on ``experiment``
    (created if missing); its new password, or "" for a user that existed (its permission is granted)."""
    folder = folder.resolve()
    running = service.running(folder)
    if not running:
        raise ServerError(f"{folder}: no tracking server runs; start it with --auth first")
    url = running.get("local_url") or running["url"]  # this machine's way in, whatever the public name
    if not running.get("auth"):
        raise ServerError(f"{folder}: its server runs without --auth: every client may write already")
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.server.auth.client import AuthServiceClient

    # an administrator's one-off calls: MLflow's patient HTTP defaults, not a stage's 4-s bound (a retried
    # create whose first try went through would answer "already exists")
    os.environ.update({"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": _secret(folder / "admin-password"),
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"})
    try:
        experiment_id = store.experiment_id(mlflow.MlflowClient(url), experiment)
    except MlflowException as err:
        raise ServerError(f"creating experiment {experiment!r}: {err.message}") from None
    users = AuthServiceClient(url)
    password = secrets.token_hex(12)
    try:
        users.create_user(name, password)
    except MlflowException as err:
        if "already exists" not in str(err):
            raise ServerError(f"creating user {name!r}: {err.message}") from None
        password = ""
    users.grant_user_permission(name, "experiment", experiment_id, "EDIT")
    return password


def _mlflow_command() -> str:
    return service.program("mlflow") or "mlflow"


@dataclass
class Server:
    """A running tracking server: what ``server.json`` keeps."""

    url: str  # the public URL, which clients use
    pid: int
    postgres_port: int
    artifacts: str
    auth: bool = False
    local_url: str = ""  # how this machine reaches it (health checks, `user`)
    workers: int = 1
    default_permission: str | None = None  # with auth: new users'

    def describe(self) -> str:
        listens = f"listening on {self.local_url}, " if self.local_url and self.local_url != self.url else ""
        auth = f"auth on, new users {self.default_permission}" if self.auth else "no auth"
        return (f"MLflow tracking server at {self.url} ({listens}{auth}, {self.workers} worker"
                f"{'s' if self.workers != 1 else ''}, PostgreSQL on port {self.postgres_port}, artifacts in "
                f"{self.artifacts}); clients: export MLFLOW_TRACKING_URI={self.url}")


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError, urllib.error.URLError):
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    return False


def _warm_up(url: str, admin: tuple[str, str] | None) -> None:
    """One API call (as the admin, with auth), so that the server's worker sets up its stores now: its first
    call is slow, and the first client, bounded per call, would otherwise pay for it."""
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/search?max_results=1")
    if admin:
        request.add_header("Authorization", "Basic " + base64.b64encode(":".join(admin).encode()).decode())
    with contextlib.suppress(OSError, urllib.error.URLError):
        urllib.request.urlopen(request, timeout=READY_TIMEOUT).close()


def start(folder: Path, *, host: str = "127.0.0.1", port: int = 5000, artifacts: str | None = None,
          auth: bool = False, db_host: str = "127.0.0.1", public_url: str | None = None, workers: int | None = None,
          default_permission: str | None = None, say=print) -> tuple[Server, subprocess.Popen]:
    """Start PostgreSQL and ``mlflow server`` on it; the server and its process (in a session of its own).

    ``public_url`` (default :func:`.address.default_public_url`) is what clients use and what MLflow admits in
    the ``Host`` header and as the UI's origin, beside this machine's loopback names and ``host``; auth is on
    where ``host`` is not loopback (:func:`secure`)."""
    folder = folder.resolve()
    TRACKING.refuse_second(folder, shown="url")
    service.refuse_taken_port(host, port, ServerError)
    auth = secure(host, auth, say)
    if default_permission and not auth:
        raise ServerError(f"--default-permission {default_permission}: auth is off (a loopback --host without --auth); "
                          "add --auth")
    public = public_url or address.default_public_url(host, port)
    local = address.local_url(host, port)
    workers = workers or default_workers()
    cluster = Cluster(folder, db_host)
    if cluster.init():
        say(f"created a PostgreSQL cluster in {cluster.data}")
    pg_port = cluster.start()
    try:
        cluster.ensure_database(pg_port)
        env = {**os.environ, "PGPASSFILE": str(cluster.passfile), "MLFLOW_BACKEND_STORE_URI": cluster.uri(pg_port)}
        # MLflow's job runner (huey consumers, for its GenAI jobs) serves no detection run, and it costs
        # processes and CPU at every start, so it is off unless the user turns it on
        env.setdefault(JOBS_ENV, "false")
        revision, head = schema_revision(cluster, pg_port), head_revision()
        if revision is not None and revision != head:
            say(f"upgrading the MLflow schema from {revision} to {head} (mlflow db upgrade)")
            _run([_mlflow_command(), "db", "upgrade", cluster.uri(pg_port)], "mlflow db upgrade", env)
        permission = None
        if auth:
            auth_env, permission = _auth_environment(cluster, pg_port, default_permission=default_permission, say=say)
            env.update(auth_env)
        destination = artifacts or (folder / "artifacts").as_uri()
        command = [_mlflow_command(), "server", "--host", host, "--port", str(port), "--workers", str(workers),
                   "--serve-artifacts", "--artifacts-destination", destination,
                   "--allowed-hosts", address.allowed_hosts(public, host=host, port=port),
                   "--cors-allowed-origins", address.origin(public)]
        if auth:
            command += ["--app-name", "basic-auth"]
        process = TRACKING.spawn(command, folder=folder, env=env, ready=lambda: _healthy(local),
                                 unready=f"mlflow server did not answer {local}/health", timeout=READY_TIMEOUT)
        _warm_up(local, (ADMIN, env["MLFLOW_AUTH_ADMIN_PASSWORD"]) if auth else None)
    except BaseException:
        cluster.stop()
        raise
    server = Server(url=public, pid=process.pid, postgres_port=pg_port, artifacts=destination, auth=auth,
                    local_url=local, workers=workers, default_permission=permission)
    service.write_state(folder, vars(server))
    return server, process


def stop(folder: Path) -> bool:
    """Stop the MLflow server and PostgreSQL of ``folder``; whether anything ran."""
    folder = folder.resolve()
    ran = service.stop(folder)
    cluster = Cluster(folder)
    if (cluster.data / "PG_VERSION").is_file() and cluster.running_port():
        cluster.stop()
        ran = True
    return ran


def main(argv: list[str] | None = None) -> None:
    parser = service.parser(__doc__, actions=("stop", "status", "user"), folder=".tracking-server", port=5000, helps={
        "action": "user NAME: a user of the --auth server with EDIT on --experiment",
        "folder": "the server's data (default %(default)s)",
        "host": "the address the MLflow server listens on (0.0.0.0: all)"})
    parser.add_argument("name", nargs="?", help="the user's name (action user)")
    parser.add_argument("--experiment", default="detection", help="the experiment a new user may edit (%(default)s)")
    parser.add_argument("--artifacts", help="where artifacts go (default FOLDER/artifacts; s3://bucket/prefix)")
    parser.add_argument("--auth", action="store_true",
                        help="MLflow's basic-auth app (docs/team.md); always on where --host is not loopback")
    parser.add_argument("--default-permission", choices=PERMISSIONS,
                        help="with auth: what users may do where nobody granted them anything (first start: READ; "
                             "then kept across restarts until given again)")
    parser.add_argument("--workers", type=worker_count,
                        help=f"server processes (default: one per core, at most 4; here {default_workers()})")
    args = parser.parse_args(argv)
    if args.action == "stop":
        TRACKING.stopped(args.folder, stop(args.folder))
        return
    if args.action == "user":
        if not args.name:
            parser.error("user: give the user's name")
        password = add_user(args.folder, args.name, experiment=args.experiment)
        given = f"password {password}" if password else "its password unchanged"
        url = (service.running(args.folder.resolve()) or {}).get("url", "the server's URL")
        print(f"user {args.name} ({given}) may edit experiment {args.experiment!r}; they set "
              f"MLFLOW_TRACKING_URI={url}, MLFLOW_TRACKING_USERNAME={args.name} and MLFLOW_TRACKING_PASSWORD in "
              "their environment")
        return
    if args.action == "status":
        running = service.running(args.folder.resolve())
        if not running:
            print(f"{args.folder}: no tracking server runs")
            raise SystemExit(1)
        print(Server(**running).describe())
        return

    def start_it() -> tuple[str, subprocess.Popen]:
        server, process = start(args.folder, host=args.host, port=args.port, artifacts=args.artifacts, auth=args.auth,
                                public_url=args.public_url, workers=args.workers,
                                default_permission=args.default_permission)
        return server.describe(), process

    TRACKING.serve(args.folder, start_it, detach=args.detach, stop=stop)


if __name__ == "__main__":
    from .. import cli

    cli.run(main)
