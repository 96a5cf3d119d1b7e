"""A shared MLflow tracking server on PostgreSQL, started with one command (docs/team.md).

    python -m pipelines.team.mlflow_server               # or: make tracking-server; Ctrl-C stops it
    python -m pipelines.team.mlflow_server --detach      # in the background; then:
    python -m pipelines.team.mlflow_server stop

Everything it keeps is in ``--folder`` (default :func:`default_folder`, outside the checkout: ``/var/lib/...``
for root, the XDG data folder otherwise; mode 0700/0750, nothing in it readable by other users):

* ``postgres/``: a private PostgreSQL cluster (Debian's ``postgresql``, ``initdb`` on first use)
  listening on a free port of ``--db-host`` (127.0.0.1 unless the database should be reachable from
  elsewhere), never the system's 5432. Run as root it runs as the ``postgres`` user, as PostgreSQL
  requires. Its administrator ``postgres`` has no password (the Unix socket in the private data folder
  only); the server's role, ``mlflow``, is no superuser and owns its two databases only. Its random
  password is kept in ``pgpass`` (mode 600), which the MLflow server reads through libpq's
  ``PGPASSFILE``: it is in no URI, command line or log.
* the ``mlflow`` database; where its schema is older than this MLflow's, ``mlflow db upgrade`` runs
  before the server starts (and says so).
* ``artifacts/``: the runs' artifacts, or the ``--artifacts`` destination (an ``s3://`` bucket, with
  the ``AWS_*`` credentials in the server's environment). The server proxies them
  (``--serve-artifacts``): clients upload and download models and checkpoints through it and need
  neither the disk nor storage credentials.
* ``server.log``: the MLflow server's output; ``server.json``: what runs, for ``stop`` and ``status``.

Started as root, ``mlflow server`` runs as ``--service-user`` (``mlflow``, a system user made on first use), which
owns the folder's log and artifacts; its Python must be outside private folders (:func:`server_python`).
``user NAME --reset`` / ``--remove`` give a user a new password (printed once) or delete it.

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
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import TrackingError
from ..lifetime import free_port
from ..tracking import store
from . import address, service

ROLE = DATABASE = "mlflow"  # the server's database role: NOSUPERUSER, owning its two databases only
SUPERUSER = "postgres"  # the cluster's administrator: no password, reached only on the private Unix socket
SERVICE_USER = "mlflow"  # who runs `mlflow server` when it is started as root (--service-user)
OLD_FOLDER = ".tracking-server"  # the default before the state left the checkout (a `git clean -xdf` deleted it)
READY_TIMEOUT = 120.0  # seconds for `mlflow server` to answer /health: its first start on a busy machine is slow
JOBS_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"  # off unless set: see start()


class ServerError(TrackingError):
    """The tracking server cannot start or stop (one line)."""


TRACKING = service.Service("tracking server", "a", program="mlflow server", module="pipelines.team.mlflow_server",
                           error=ServerError)


def pg_command(name: str, version: str | None = None) -> str:
    """The path of PostgreSQL's ``name`` (``initdb``, ``pg_ctl``, ``pg_dump``): with ``version`` (a cluster's
    ``PG_VERSION``), Debian's binaries of that major version, which a cluster needs (another major version's
    ``pg_ctl`` refuses its data folder); else on ``PATH``, else Debian's newest."""
    debian = Path("/usr/lib/postgresql")
    if version:
        if (debian / version / "bin" / name).is_file():
            return str(debian / version / "bin" / name)
        found = shutil.which(name)
        if found and _major(found) == version:
            return found
        raise ServerError(f"PostgreSQL {version}'s {name} not found (the cluster was made by PostgreSQL {version}): "
                          f"install postgresql-{version}, or pg_dump the databases with it and restore them into a "
                          "new --folder")
    found = shutil.which(name)
    if found:
        return found
    for folder in sorted(debian.glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True):
        if (folder / name).is_file():
            return str(folder / name)
    raise ServerError(f"PostgreSQL's {name} not found: install Debian's postgresql (apt-get install postgresql)")


def _major(program: str) -> str | None:
    """The major version of a PostgreSQL program (``pg_ctl (PostgreSQL) 15.8`` -> ``15``)."""
    done = subprocess.run([program, "--version"], capture_output=True, text=True)
    words = done.stdout.split()
    return words[-1].split(".")[0] if done.returncode == 0 and words else None


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

    @property
    def version(self) -> str | None:
        """The cluster's PostgreSQL major version (``PG_VERSION``); None before ``initdb``."""
        path = self.data / "PG_VERSION"
        return path.read_text().strip() if path.is_file() else None

    def program(self, name: str) -> str:
        """PostgreSQL's ``name`` of this cluster's major version (:func:`pg_command`)."""
        return pg_command(name, self.version)

    def dump(self, port: int, database: str, path: Path) -> None:
        """``pg_dump`` of ``database`` (custom format, for ``pg_restore``) into ``path`` (mode 600), as the
        cluster's administrator over the private socket; its folder is made mode 700."""
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        tmp = path.with_suffix(".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            done = subprocess.run(_as_owner([self.program("pg_dump"), "-h", str(self.data), "-p", str(port), "-U",
                                             SUPERUSER, "-Fc", database]), stdout=out, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise ServerError(f"pg_dump {database} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        tmp.replace(path)

    def init(self) -> bool:
        """Create the cluster if there is none (its administrator :data:`SUPERUSER`, with no password, and the
        password of the role :data:`ROLE` in ``pgpass``, which :meth:`ensure_database` creates); whether it was
        created."""
        if (self.data / "PG_VERSION").is_file():
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.data.exists():
            shutil.rmtree(self.data)  # an initdb that did not finish
        self.data.mkdir(mode=0o700)
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres", "postgres")
            if subprocess.run(["runuser", "-u", "postgres", "--", "test", "-w", str(self.data)]).returncode:
                shutil.rmtree(self.data)
                raise ServerError(f"{self.folder}: the postgres user cannot reach it (a parent folder is private); "
                                  "choose another --folder")
        try:
            _run(_as_owner([pg_command("initdb"), "-D", str(self.data), "-U", SUPERUSER, "--auth-local=trust",
                            "--auth-host=scram-sha-256", "-E", "UTF8"]), "initdb")
        except ServerError:
            shutil.rmtree(self.data, ignore_errors=True)
            raise
        service.write_secret(self.passfile, f"*:*:*:{ROLE}:{secrets.token_urlsafe(24)}\n")
        return True

    def running_port(self) -> int | None:
        """The port of this cluster's server if it runs (``postmaster.pid``'s 4th line), else None."""
        status = subprocess.run(_as_owner([self.program("pg_ctl"), "-D", str(self.data), "status"]), capture_output=True)
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
            _run(_as_owner([self.program("pg_ctl"), "-D", str(self.data), "-l", str(log), "-w", "-t", "60", "-o",
                            options, "start"]), f"starting PostgreSQL (log: {log})")
        except ServerError as err:  # pg_ctl says "Examine the log output.": the cause is in the log
            why = service.cause_since(log, offset)
            raise (ServerError(f"PostgreSQL did not start on port {port}: {why} (log: {log})") if why else err) from None
        return port

    def stop(self) -> None:
        if self.running_port():
            _run(_as_owner([self.program("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]),
                 "stopping PostgreSQL")

    def uri(self, port: int) -> str:
        """The SQLAlchemy URI of the ``mlflow`` database (no password: libpq reads ``PGPASSFILE``)."""
        return f"postgresql+psycopg://{ROLE}@{self.host}:{port}/{DATABASE}"

    def administer(self, port: int):
        """A connection as the cluster's administrator, over the Unix socket in the private data folder (trust:
        only its owner and root reach it); a cluster an earlier version made has :data:`ROLE` as its
        administrator instead."""
        import psycopg

        try:
            return psycopg.connect(host=str(self.data), port=port, user=SUPERUSER, dbname="postgres", autocommit=True)
        except psycopg.OperationalError as err:
            if f'role "{SUPERUSER}" does not exist' not in str(err):
                raise
            return psycopg.connect(host=str(self.data), port=port, user=ROLE, dbname="postgres", autocommit=True)

    def ensure_database(self, port: int, name: str = DATABASE, say=print) -> None:
        """The role :data:`ROLE` (LOGIN, NOSUPERUSER, NOCREATEDB, NOCREATEROLE; its password from ``pgpass``) and
        database ``name`` owned by it, each created if missing. A cluster whose role is a superuser (made by an
        earlier version, where it is PostgreSQL's bootstrap user and cannot be demoted) is said in one line."""
        from psycopg import sql

        with self.administer(port) as conn:
            role = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (ROLE,)).fetchone()
            if role is None:
                password = self.passfile.read_text().strip().rsplit(":", 1)[1]
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
                                     "NOBYPASSRLS PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(password)))
            elif role[0] and name == DATABASE:
                say(f"note: {self.data}: its role {ROLE!r} is the cluster's superuser (made by an earlier version); a "
                    "new cluster's is not: pg_dump the databases, start on a new --folder and restore them as it")
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(ROLE)))


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
AUTH_CACHE = 60  # --auth-cache: seconds a worker remembers a checked password (MLflow's auth_cache_ttl_seconds)
BACKUPS = "backups"  # FOLDER/backups: the dump taken before a schema upgrade


def backup(folder: Path, to: Path) -> list[Path]:
    """``pg_dump`` of the running server's two databases (runs, users) into ``to``; the files written."""
    folder = folder.resolve()
    cluster = Cluster(folder)
    port = cluster.running_port()
    if not port:
        raise ServerError(f"{folder}: its PostgreSQL does not run; start the tracking server first")
    written = []
    for database in (DATABASE, AUTH_DATABASE):
        cluster.dump(port, database, to / f"{database}.dump")
        written.append(to / f"{database}.dump")
    return written


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


WORKSPACES_KEY = "grant_default_workspace_access"


def kept_workspaces(config: Path) -> bool:
    """Whether ``config`` (``basic_auth.ini``) keeps workspaces on: it grants the default workspace (below)."""
    import configparser

    parser = configparser.ConfigParser()
    with contextlib.suppress(configparser.Error, OSError):
        parser.read(config)
    return parser.getboolean("mlflow", WORKSPACES_KEY, fallback=False)


def write_auth_config(folder: Path, *, database_uri: str, default_permission: str | None = None,
                      workspaces: bool = False, auth_cache: int = 0, say=print) -> str:
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
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                      + (f"{WORKSPACES_KEY} = true\n" if workspaces else "")
                      + (f"auth_cache_ttl_seconds = {auth_cache}\n" if auth_cache else ""))
    return permission


def _auth_environment(cluster: Cluster, port: int, *, default_permission: str | None, workspaces: bool | None,
                      auth_cache: int, say) -> tuple[dict[str, str], str, bool]:
    """The basic-auth app's settings (its users in the ``mlflow_auth`` database, :func:`write_auth_config`), the
    admin's password from ``FOLDER/admin-password`` (through the environment, never a file it reads); the
    default permission and whether workspaces are on (``workspaces`` None: as the last start had them)."""
    cluster.ensure_database(port, AUTH_DATABASE)
    kept = kept_workspaces(cluster.folder / "basic_auth.ini")
    if workspaces is None:
        workspaces = kept
    elif workspaces != kept:
        say(f"workspaces: {'off -> on' if workspaces else 'on -> off'} (--{'' if workspaces else 'no-'}workspaces)")
    permission = write_auth_config(cluster.folder, default_permission=default_permission, say=say,
                                   workspaces=workspaces, auth_cache=auth_cache,
                                   database_uri=f"postgresql+psycopg://{ROLE}@{cluster.host}:{port}/{AUTH_DATABASE}")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(cluster.folder / "basic_auth.ini"),
            "MLFLOW_AUTH_ADMIN_PASSWORD": _secret(cluster.folder / "admin-password"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret(cluster.folder / "flask-secret"),  # its CSRF key
            "MLFLOW_ENABLE_WORKSPACES": "true" if workspaces else "false"}, permission, workspaces


def secure(host: str, auth: bool, say=print) -> bool:
    """Whether the server runs with auth: always where ``host`` is not a loopback address (anyone who reaches the
    port could otherwise read, write and delete every experiment and fill the disk), said in one line."""
    if auth or address.is_loopback(host):
        return auth
    say(f"--host {host} is reachable from other machines: auth is on (as with --auth); create users with "
        f"`python -m pipelines.team.mlflow_server user NAME`")
    return True


def default_folder() -> Path:
    """``--folder`` by default, outside any checkout (where ``git clean -xdf`` would delete the team's data):
    ``/var/lib/PROJECT/tracking`` for root, else ``$XDG_DATA_HOME/PROJECT/tracking`` (``~/.local/share``)."""
    return service.state_folder("tracking")


def old_folder_note(folder: Path) -> str | None:
    """One line where this directory holds the in-checkout state folder of an earlier version and ``folder`` is
    another: its data is not moved silently."""
    return service.old_folder_note(Path(OLD_FOLDER), folder, kept="postgres", what="tracking server")


@dataclass(frozen=True)
class Account:
    """The service user that runs ``mlflow server`` when it is started as root."""

    name: str
    uid: int
    gid: int

    def drop(self) -> list[str]:
        """The prefix that runs a command as this user (no supplementary group; umask and environment kept)."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]

    def can(self, *command: str) -> bool:
        return subprocess.run([*self.drop(), *command], capture_output=True).returncode == 0


def service_account(name: str, say=print) -> Account | None:
    """Who runs the MLflow server: None (this process's user) unless we are root; then ``name`` (``--service-user``),
    created as a system user (no login, no home) where missing; ``root`` keeps it root, said in one line."""
    if os.geteuid() != 0:
        return None
    if name == "root":
        say("--service-user root: the network-facing MLflow server runs as root")
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        _run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
              "/usr/sbin/nologin", "--comment", "MLflow tracking server", name], f"--service-user {name}: useradd")
        entry = pwd.getpwnam(name)
        say(f"created the system user {name} (no login), which runs the MLflow server (--service-user)")
    if entry.pw_uid == 0:
        raise ServerError(f"--service-user {name}: its uid is 0 (root); choose an unprivileged user")
    return Account(name, entry.pw_uid, entry.pw_gid)


def _chown(path: Path, account: Account | None, *, group: int | None = None, tree: bool = False) -> None:
    if account is None:
        return
    owner = (account.uid, account.gid if group is None else group)
    if tree and path.is_dir() and (path.stat().st_uid, path.stat().st_gid) != owner:  # once: an earlier root's files
        for root, folders, files in os.walk(path):
            for name in (*folders, *files):
                os.chown(os.path.join(root, name), *owner, follow_symlinks=False)
    os.chown(path, *owner)


def own_folder(folder: Path, account: Account | None) -> None:
    """Make ``folder`` (made if missing) the service's own: mode 0700, or when root runs it 0750, owned by
    ``account`` (root with ``--service-user root``) and group postgres, which traverses it to its data."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(folder, account.uid if account else 0, pwd.getpwnam("postgres").pw_gid)
        folder.chmod(0o750)
    else:
        folder.chmod(0o700)


def secure_folder(folder: Path, account: Account | None, *, local_artifacts: bool) -> None:
    """What ``folder`` holds is readable by the user that runs the server and by nobody else: its log 0600, its
    artifacts 0700 (and what the server writes there, umask 077), ``pgpass`` and ``basic_auth.ini`` 0600, owned
    by that user, which reads them; the other secrets stay root's (the server gets them in its environment)."""
    log = folder / service.LOG
    log.touch(mode=0o600)
    log.chmod(0o600)
    _chown(log, account)
    for name in ("pgpass", "basic_auth.ini"):
        if (folder / name).is_file():
            (folder / name).chmod(0o600)
            _chown(folder / name, account)
    if local_artifacts:
        (folder / "artifacts").mkdir(mode=0o700, exist_ok=True)
        (folder / "artifacts").chmod(0o700)
        _chown(folder / "artifacts", account, tree=True)
    if account and not account.can("test", "-r", str(folder / "pgpass")):
        raise ServerError(f"{folder}: user {account.name} cannot reach it (a parent folder is private); choose "
                          "another --folder")


def service_credentials(env: dict[str, str], folder: Path, account: Account | None, say=print) -> None:
    """Where the server's S3 credentials file (``AWS_SHARED_CREDENTIALS_FILE``, else root's ``~/.aws/credentials``)
    is out of the service user's reach: a copy in ``FOLDER/s3.credentials`` (mode 600, the user's), which ``env``
    then names, said in one line. (The server's ``HOME`` is the folder, so root's own would not be found.)"""
    if account is None:
        return
    given = env.get("AWS_SHARED_CREDENTIALS_FILE")
    source = Path(given) if given else Path.home() / ".aws" / "credentials"
    if not source.is_file() or (given and account.can("test", "-r", given)):
        return
    copy = folder / "s3.credentials"
    service.write_secret(copy, source.read_text())
    _chown(copy, account)
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(copy)
    say(f"the S3 credentials in {source} are out of user {account.name}'s reach: the server reads a copy, {copy}")


def _private_above(path: Path, account: Account) -> Path:
    """The first folder above ``path`` that ``account`` cannot enter (for the message)."""
    for above in reversed(path.parents):
        info = above.stat()
        if not info.st_mode & stat.S_IXOTH and info.st_uid != account.uid:
            return above
    return path


def server_python(account: Account | None, say=print) -> tuple[list[str], dict[str, str]]:
    """How to run this environment's ``mlflow`` as ``account``: the command's start and what it adds to the
    environment. This Python where the user can run it; else (it lies under a private folder such as root's
    home) the system's Python of the same version on this environment's packages, said in one line."""
    if account is None:
        return [_mlflow_command()], {}
    real = Path(sys.executable).resolve()
    # the interpreter's file and its standard library, not a trial run: an interpreter run from a folder it cannot
    # read back may start on another Python's library, and its own child processes (uvicorn's) are refused
    if account.can("test", "-x", str(real)) and account.can("test", "-r", os.__file__):
        return [*account.drop(), sys.executable, "-m", "mlflow"], {}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/local/bin:/usr/bin")
    packages = sysconfig.get_paths()["purelib"]
    if system and account.can(system, "-c", "") and account.can("test", "-r", packages):
        say(f"note: the server's Python {real} is under {_private_above(real, account)}, which user {account.name} "
            f"cannot enter: it runs {system} on this environment's packages ({packages})")
        return [*account.drop(), system, "-s", "-m", "mlflow"], {"PYTHONPATH": packages}
    raise ServerError(f"--service-user {account.name}: it cannot run the server's Python {real} (under "
                      f"{_private_above(real, account)}) and there is no {version} outside it: install the project "
                      "in a virtual environment the user can reach, or pass --service-user root")


def default_workers() -> int:
    """``--workers`` by default: one per core of this process, at most MLflow's own default (4)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def worker_count(text: str) -> int:
    """``--workers``: 1 to 64 (argparse type)."""
    value = int(text) if text.strip().isdigit() else 0
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"expected a number of server processes from 1 to 64, got {text!r}")
    return value


def refused_when(folder: Path) -> str:
    """When a reset or removed password is refused by the running server of ``folder``: at once with one worker
    or no cache, else by every worker within its ``--auth-cache`` seconds."""
    running = service.running(folder.resolve()) or {}
    cache, workers = running.get("auth_cache", 0), running.get("workers", 1)
    return "from now on" if not cache or workers == 1 else f"within {cache} s (--auth-cache) by every worker"


def cache_seconds(text: str) -> int:
    """``--auth-cache``: whole seconds, 0 to 3600 (argparse type)."""
    value = int(text) if text.strip().isdigit() else -1
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected whole seconds from 0 to 3600, got {text!r}")
    return value


def _admin_url(folder: Path) -> str:
    """The URL of the running server of ``folder`` (with auth), this process logged in as its administrator."""
    running = service.running(folder)
    if not running:
        raise ServerError(f"{folder}: no tracking server runs; start it with --auth first")
    if not running.get("auth"):
        raise ServerError(f"{folder}: its server runs without --auth: every client may write already")
    import warnings

    warnings.filterwarnings("ignore", module="mlflow.server.fastapi_app")  # Starlette's, at import: not the user's
    # an administrator's one-off calls: MLflow's patient HTTP defaults, not a stage's 4-s bound (a retried
    # create whose first try went through would answer "already exists")
    os.environ.update({"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": _secret(folder / "admin-password"),
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"})
    return running.get("local_url") or running["url"]  # this machine's way in, whatever the public name


def add_user(folder: Path, name: str, *, experiment: str) -> str:
    """Create user ``name`` on the running server of ``folder`` (with auth) and give it EDIT on ``experiment``
    (created if missing); its new password, or "" for a user that existed (its permission is granted)."""
    url = _admin_url(folder.resolve())
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.server.auth.client import AuthServiceClient

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
    try:
        users.grant_user_permission(name, "experiment", experiment_id, "EDIT")
    except MlflowException as err:
        if "already exists" not in str(err):
            raise ServerError(f"granting user {name!r} EDIT on {experiment!r}: {err.message}") from None
        users.revoke_user_permission(name, "experiment", experiment_id)  # whatever it was: EDIT now
        users.grant_user_permission(name, "experiment", experiment_id, "EDIT")
    return password


def change_user(folder: Path, name: str, *, remove: bool) -> str:
    """Give user ``name`` of the running server of ``folder`` a new password (its old one is refused from now
    on), or with ``remove`` delete it (and its permissions: it is refused from now on); the new password, or ""
    after a removal. The administrator is neither: its password is the folder's ``admin-password``."""
    option = "--remove" if remove else "--reset"
    if name == ADMIN:
        raise ServerError(f"user {option}: {ADMIN!r} is the administrator, whose password the server keeps in "
                          "admin-password; name another user")
    url = _admin_url(folder.resolve())
    from mlflow.exceptions import MlflowException
    from mlflow.server.auth.client import AuthServiceClient

    users = AuthServiceClient(url)
    try:
        users.get_user(name)
    except MlflowException as err:
        if "not found" in str(err).lower() or err.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise ServerError(f"user {option}: there is no user {name!r} on {url}") from None
        raise ServerError(f"user {option} {name!r}: {err.message}") from None
    if remove:
        users.delete_user(name)
        return ""
    password = secrets.token_hex(12)
    users.update_user_password(name, password)
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
    service_user: str = ""  # started as root: the unprivileged user that runs it
    workspaces: bool = False  # with auth: MLflow's workspaces, under which READ is read-only
    auth_cache: int = 0  # with auth: seconds a checked password is remembered per worker

    def describe(self) -> str:
        listens = f"listening on {self.local_url}, " if self.local_url and self.local_url != self.url else ""
        listens += f"as user {self.service_user}, " if self.service_user else ""
        auth = f"auth on, new users {self.default_permission}" if self.auth else "no auth"
        auth += ", workspaces on (creating needs a grant)" if self.workspaces else ""
        auth += f", passwords remembered {self.auth_cache} s" if self.auth and self.auth_cache else ""
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
          default_permission: str | None = None, service_user: str = SERVICE_USER, workspaces: bool | None = None,
          auth_cache: int = AUTH_CACHE, say=print) -> tuple[Server, subprocess.Popen]:
    """Start PostgreSQL and ``mlflow server`` on it; the server and its process (in a session of its own).

    Started as root, the MLflow server runs as ``service_user`` (:func:`service_account`, :func:`server_python`);
    ``folder`` is the service's own, readable by nobody else (:func:`secure_folder`), and so is what the server
    writes (umask 077).

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
    if workspaces and not auth:
        raise ServerError("--workspaces: auth is off (a loopback --host without --auth); add --auth")
    public = public_url or address.default_public_url(host, port)
    local = address.local_url(host, port)
    workers = workers or default_workers()
    account = service_account(service_user, say)
    own_folder(folder, account)
    cluster = Cluster(folder, db_host)
    if cluster.init():
        say(f"created a PostgreSQL cluster in {cluster.data}")
    pg_port = cluster.start()
    try:
        cluster.ensure_database(pg_port, say=say)
        env = {**os.environ, "PGPASSFILE": str(cluster.passfile), "MLFLOW_BACKEND_STORE_URI": cluster.uri(pg_port)}
        # MLflow's job runner (huey consumers, for its GenAI jobs) serves no detection run, and it costs
        # processes and CPU at every start, so it is off unless the user turns it on
        env.setdefault(JOBS_ENV, "false")
        revision, head = schema_revision(cluster, pg_port), head_revision()
        if revision is not None and revision != head:
            kept = folder / BACKUPS / f"{DATABASE}-before-upgrade-{revision}-{time.strftime('%Y%m%d-%H%M%S')}.dump"
            cluster.dump(pg_port, DATABASE, kept)
            say(f"upgrading the MLflow schema from {revision} to {head} (mlflow db upgrade); the database as it was "
                f"is in {kept} (pg_restore)")
            _run([_mlflow_command(), "db", "upgrade", cluster.uri(pg_port)], "mlflow db upgrade", env)
        permission = None
        if auth:
            auth_env, permission, workspaces = _auth_environment(cluster, pg_port, default_permission=default_permission,
                                                                 workspaces=workspaces, auth_cache=auth_cache, say=say)
            env.update(auth_env)
        destination = artifacts or (folder / "artifacts").as_uri()
        secure_folder(folder, account, local_artifacts=not artifacts)
        mlflow_command, python_env = server_python(account, say)
        env.update(python_env)
        if account:
            env.update(HOME=str(folder), USER=account.name, LOGNAME=account.name)
            service_credentials(env, folder, account, say)
        command = [*mlflow_command, "server", "--host", host, "--port", str(port), "--workers", str(workers),
                   "--serve-artifacts", "--artifacts-destination", destination,
                   "--allowed-hosts", address.allowed_hosts(public, host=host, port=port),
                   "--cors-allowed-origins", address.origin(public)]
        if auth:
            command += ["--app-name", "basic-auth", "--enable-workspaces" if workspaces else "--disable-workspaces"]
        umask = os.umask(0o077)  # what the server writes (artifacts, its files) is its own: inherited at fork
        try:
            process = TRACKING.spawn(command, folder=folder, env=env, ready=lambda: _healthy(local),
                                     unready=f"mlflow server did not answer {local}/health", timeout=READY_TIMEOUT)
        finally:
            os.umask(umask)
        _warm_up(local, (ADMIN, env["MLFLOW_AUTH_ADMIN_PASSWORD"]) if auth else None)
        if note := address.unreachable_note(public):
            say(note)
    except BaseException:
        cluster.stop()
        raise
    server = Server(url=public, pid=process.pid, postgres_port=pg_port, artifacts=destination, auth=auth,
                    local_url=local, workers=workers, default_permission=permission, workspaces=bool(workspaces),
                    auth_cache=auth_cache if auth else 0,
                    service_user=account.name if account else "")
    service.write_state(folder, vars(server))
    (folder / service.STATE).chmod(0o600)  # no secret, but nobody else's business either
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
    parser = service.parser(__doc__, actions=("stop", "status", "user"), folder=str(default_folder()), port=5000,
                            helps={
        "action": "user NAME: a user of the --auth server with EDIT on --experiment (--reset: a new password; "
                  "--remove: delete it)",
        "folder": "the server's data, outside the checkout (default %(default)s)",
        "host": "the address the MLflow server listens on (0.0.0.0: all)"})
    parser.add_argument("name", nargs="?", help="the user's name (action user)")
    parser.add_argument("--experiment", default="detection", help="the experiment a new user may edit (%(default)s)")
    change = parser.add_mutually_exclusive_group()
    change.add_argument("--reset", action="store_true", help="user NAME --reset: a new password, printed once")
    change.add_argument("--remove", action="store_true", help="user NAME --remove: delete the user")
    parser.add_argument("--artifacts", help="where artifacts go (default FOLDER/artifacts; s3://bucket/prefix)")
    parser.add_argument("--auth", action="store_true",
                        help="MLflow's basic-auth app (docs/team.md); always on where --host is not loopback")
    parser.add_argument("--default-permission", choices=PERMISSIONS,
                        help="with auth: what users may do where nobody granted them anything (first start: READ; "
                             "then kept across restarts until given again)")
    parser.add_argument("--workers", type=worker_count,
                        help=f"server processes (default: one per core, at most 4; here {default_workers()})")
    parser.add_argument("--workspaces", action=argparse.BooleanOptionalAction,
                        help="with auth: MLflow's workspaces, under which a user without a grant may read but not "
                             "create experiments or models (kept across restarts until given again; first: off)")
    parser.add_argument("--auth-cache", type=cache_seconds, default=AUTH_CACHE, metavar="SECONDS",
                        help="with auth: how long each worker remembers a checked password (default %(default)s; 0: "
                             "every request checks its scrypt hash, ~0.1 s of CPU; a reset or removal is refused at "
                             "once by the worker that made it, by the others within SECONDS)")
    parser.add_argument("--service-user", default=SERVICE_USER, metavar="USER",
                        help="started as root: the unprivileged user that runs the MLflow server, created if missing "
                             "(default %(default)s; root: keep root)")
    args = parser.parse_args(argv)
    if (args.reset or args.remove) and args.action != "user":
        parser.error(f"{'--reset' if args.reset else '--remove'} goes with the action user NAME")
    if args.action == "stop":
        TRACKING.stopped(args.folder, stop(args.folder))
        return
    if args.action == "user":
        if not args.name:
            parser.error("user: give the user's name")
        url = (service.running(args.folder.resolve()) or {}).get("url", "the server's URL")
        if args.reset or args.remove:
            password = change_user(args.folder, args.name, remove=args.remove)
            when = refused_when(args.folder)
            print(f"user {args.name} removed: it is refused {when}" if args.remove else
                  f"user {args.name}: new password {password} (shown once; the old one is refused {when})")
            return
        password = add_user(args.folder, args.name, experiment=args.experiment)
        given = f"password {password}" if password else "its password unchanged"
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
    if note := old_folder_note(args.folder):
        print(note)

    def start_it() -> tuple[str, subprocess.Popen]:
        server, process = start(args.folder, host=args.host, port=args.port, artifacts=args.artifacts, auth=args.auth,
                                public_url=args.public_url, workers=args.workers,
                                default_permission=args.default_permission, service_user=args.service_user,
                                workspaces=args.workspaces, auth_cache=args.auth_cache)
        return server.describe(), process

    TRACKING.serve(args.folder, start_it, detach=args.detach, stop=stop)


if __name__ == "__main__":
    from .. import cli

    cli.run(main)
