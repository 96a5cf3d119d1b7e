"""Team mode on localhost, as a team would run it, with each server started once for the whole module:
a real S3 server (SeaweedFS, ``python -m pipelines.team.s3_server``) holding the DVC remote and the tracking
server's artifacts, and the shared tracking server (``python -m pipelines.team.mlflow_server``: a private
PostgreSQL cluster on a schema an older MLflow left, ``mlflow server --auth`` with proxied artifacts).

In order: the server itself (upgrade, artifacts through the server into the bucket, secrets, an unprivileged
server on a private folder, a database role that is no superuser, refusals, password reset and removal); two
clones and a ``dvc queue start -j 2`` sweep writing at once; one clone's experiment handed to a colleague who
evaluates it again without retraining; then outages (the database restarted under the server, the server
stopped), a foreground server on the same data and one with workspaces, under which READ is read-only.
Skipped where PostgreSQL is not installed. The lead's and teammates' commands across two hosts (a clone that
joins, pushes and is pulled into another where nothing re-runs, the public name, every refusal from another
host, a push resent after an outage, backups, the team benchmark's writers) are in test_team_netns.py."""

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipelines.lifetime import end_group, free_port
from pipelines.team import mlflow_server, s3_server
from pipelines.tracking.tracker import Tracker

from .conftest import REPO
from .test_pipeline import _copy_repo, _env
from .test_sweep import wait_for_queue

pytestmark = pytest.mark.slow

try:
    mlflow_server.pg_command("initdb")
except mlflow_server.ServerError:
    pytest.skip("PostgreSQL is not installed (apt-get install postgresql)", allow_module_level=True)

CI = ["-S", "profile=ci", "-S", "train.nproc=1"]
# The clients run at a lower CPU priority: a team's server has a machine of its own, and here it shares 2 cores
# with four stages (on a 2-core AVX2 machine, calls then outlasted the clients' 4-s bound and were lost).
NICE = ["nice", "-n", "10"]
# and they give each call up to 9 s in one try instead of 4 s twice (the user's setting, which the stages keep;
# each call is bounded at 10 s): on 2 cores beside another test file, 4 s was not enough.
SLOW_SERVER = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "9", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
# The server's public name: not this machine's, so MLflow admits it only because --public-url says so.
PUBLIC_NAME = "tracking.example"


def _run(cwd, *command, ok=True, timeout=600, env=None):
    done = subprocess.run(list(command), cwd=cwd, env={**_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _reachable_by_others(path: Path) -> bool:
    """Whether users other than the owner can enter every folder down to ``path`` (a service user must reach the
    checkout's virtual environment)."""
    return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


# As root the server runs as the unprivileged user ``mlflow``, which must reach the tests' Python environment (this
# checkout's .venv, or the one a copy of it runs with); under a folder other users cannot enter (a mktemp -d folder,
# root's home) the server stays root.
UNPRIVILEGED = os.geteuid() != 0 or _reachable_by_others(Path(sys.prefix))
SERVICE_USER = () if UNPRIVILEGED else ("--service-user", "root")


def _server(*args, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "pipelines.team.mlflow_server", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _commit(repo, message):
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _password(line: str) -> str:
    return line.split("(password ", 1)[1].split(")", 1)[0]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The S3 server, its S3 port on every interface (``--host 0.0.0.0``; its other ports on 127.0.0.1), reached
    at 127.0.0.1, and a teammate's key: its folder, the ``dvc remote`` commands it and ``user team`` printed (the
    teammate's credentials file through ``credentialpath``), its endpoint, the teammate's and the admin's keys."""
    folder = tmp_path_factory.mktemp("s3")
    port = free_port()
    started = _s3_server("--folder", str(folder), "--host", "0.0.0.0", "--port", str(port), "--public-url",
                         f"http://127.0.0.1:{port}", "--detach")
    assert started.returncode == 0, started.stderr
    try:
        user = _s3_server("user", "team", "--folder", str(folder))
        assert user.returncode == 0, user.stderr
        credentials = folder / "users" / "team.credentials"
        commands = [line.strip().replace("/path/to/team.credentials", str(credentials))
                    for line in (started.stdout + user.stdout).splitlines() if line.strip().startswith("dvc remote")]
        keys = re.findall(r"aws_access_key_id = (\w+)\s+aws_secret_access_key = (\w+)", user.stdout)
        assert keys == re.findall(r"aws_access_key_id = (\w+)\s+aws_secret_access_key = (\w+)", credentials.read_text())
        yield {"folder": folder, "commands": commands, "keys": keys[0], "admin": s3_server.credentials(folder),
               "endpoint": json.loads((folder / "server.json").read_text())["endpoint"], "started": started.stdout}
    finally:
        s3_server.stop(folder)


def _s3_server(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pipelines.team.s3_server", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _bucket(s3, keys=None):
    import boto3

    access_key, secret_key = keys or s3["admin"]
    return boto3.client("s3", endpoint_url=s3["endpoint"], aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, region_name="us-east-1")


def _listening_ports(leader: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in the session that ``leader`` leads (/proc: the process
    this module started and whatever it started)."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3]) == leader:
                inodes |= {os.readlink(fd)[8:-1] for fd in (proc / "fd").iterdir()
                           if os.readlink(fd).startswith("socket:[")}
        except OSError:  # gone meanwhile
            pass
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host order per 32-bit word
                found.add((socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words),
                           int(port, 16)))
    return found


def _outside_address() -> str | None:
    """An address of this machine other than loopback (the one its default route leaves by), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _answer(address: str, port: int) -> str:
    """What an anonymous client gets from ``address:port``: how a TLS handshake without a client certificate
    ended where the port speaks TLS (gRPC), else the HTTP status of ``GET /``."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((address, port), timeout=5) as raw, context.wrap_socket(raw) as tls:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            return f"TLS answered {tls.recv(64)!r}"
    except ssl.SSLError as err:
        if "ALERT" in (err.reason or ""):
            return "TLS refused: " + err.reason
    except OSError as err:
        return f"no answer: {err}"
    try:  # not TLS
        with urllib.request.urlopen(f"http://{address}:{port}/", timeout=5) as response:
            return str(response.status)
    except urllib.error.HTTPError as err:
        return str(err.code)
    except (urllib.error.URLError, OSError) as err:
        return f"no answer: {err}"


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def test_only_the_s3_port_answers_other_hosts_and_only_with_a_key(s3):
    """Every port the S3 server's two processes listen on: all but S3's HTTP and gRPC ports on 127.0.0.1; from
    a non-loopback address of this machine, S3 refuses an unsigned request (403) and its gRPC port a client without
    the server's certificate (it accepts identity updates otherwise); on loopback, the volume server and filer
    refuse an unsigned request (401). WebDAV, Iceberg, Lance, metrics and debug ports are not open at all."""
    state = json.loads((s3["folder"] / "server.json").read_text())
    port = int(state["endpoint"].rsplit(":", 1)[1])
    ports = _listening_ports(state["pid"]) | _listening_ports(state["s3_pid"])  # the store's, the S3 gateway's
    outside = {(a, p) for a, p in ports if not _loopback(a)}
    assert {p for _, p in outside} == {port, int(re.search(r"-port\.grpc=(\d+)", Path(
        f"/proc/{state['s3_pid']}/cmdline").read_text().replace("\0", " "))[1])}, ports
    assert {a for a, _ in outside} <= {"0.0.0.0", "::"}, outside  # --host 0.0.0.0
    assert len(ports - outside) == 8, ports  # master, volume server, filer, admin server: HTTP and gRPC each
    address = _outside_address() or "127.0.0.1"
    for _, p in outside:
        expected = "403" if p == port else "TLS refused: TLSV13_ALERT_CERTIFICATE_REQUIRED"
        assert _answer(address, p) == expected, (address, p)
    loopback = {p: _answer("127.0.0.1", p) for _, p in ports - outside}
    refused = "TLS refused: TLSV13_ALERT_CERTIFICATE_REQUIRED"
    # on 127.0.0.1 only: the master's status page, the admin server's /health and /metrics (its UI off: 404 at
    # /); the volume server and filer want a JWT; every gRPC port a certificate
    assert sorted(loopback.values()) == ["200", "401", "401", "404", refused, refused, refused, refused], loopback
    assert oct(s3["folder"].stat().st_mode & 0o777) == "0o700"


def test_a_teammates_key_writes_the_dvc_bucket_and_nothing_else(s3):
    """The teammate's key puts, reads, lists and deletes objects of the DVC bucket; it cannot delete the bucket,
    make one, or touch the MLflow bucket, and not even the admin deletes a bucket that is not empty. Its secret is
    in its credentials file (mode 600), not in the server's log or command line; a removed user's key is
    refused at once, and a second removal is one line."""
    from botocore.exceptions import ClientError

    def refused(call, **kwargs) -> str:
        with pytest.raises(ClientError) as err:
            call(**kwargs)
        return err.value.response["Error"]["Code"]

    team = _bucket(s3, s3["keys"])
    team.put_object(Bucket="dvc", Key="files/md5/00/probe", Body=b"probe")
    assert team.get_object(Bucket="dvc", Key="files/md5/00/probe")["Body"].read() == b"probe"
    assert refused(team.delete_bucket, Bucket="dvc") == "AccessDenied"
    assert refused(team.create_bucket, Bucket="other") == "AccessDenied"
    assert refused(team.put_object, Bucket="mlflow", Key="artifacts/x", Body=b"x") == "AccessDenied"
    assert refused(team.list_objects_v2, Bucket="mlflow") == "AccessDenied"
    assert refused(_bucket(s3).delete_bucket, Bucket="dvc") == "BucketNotEmpty"
    team.delete_object(Bucket="dvc", Key="files/md5/00/probe")
    folder, secret = s3["folder"], s3["keys"][1]
    assert oct((folder / "users" / "team.credentials").stat().st_mode & 0o777) == "0o600"
    state = json.loads((folder / "server.json").read_text())
    for text in ((folder / "server.log").read_text(errors="replace"), s3["started"],
                 Path(f"/proc/{state['pid']}/cmdline").read_text(), Path(f"/proc/{state['s3_pid']}/cmdline").read_text()):
        assert secret not in text and s3["admin"][1] not in text

    made = _s3_server("user", "carol", "--folder", str(folder))
    assert made.returncode == 0, made.stderr
    carol = re.findall(r"aws_access_key_id = (\w+)\s+aws_secret_access_key = (\w+)", made.stdout)[0]
    assert _bucket(s3, carol).list_objects_v2(Bucket="dvc")["ResponseMetadata"]["HTTPStatusCode"] == 200
    removed = _s3_server("user", "carol", "--remove", "--folder", str(folder))
    assert removed.returncode == 0 and "their key is refused" in removed.stdout, removed.stderr
    assert refused(_bucket(s3, carol).list_objects_v2, Bucket="dvc") == "InvalidAccessKeyId"
    again = _s3_server("user", "carol", "--remove", "--folder", str(folder))
    assert (again.returncode, again.stderr.splitlines()) == (
        2, [f"error: user carol: no such S3 user in {folder.resolve()} (users: team)"])
    second = _s3_server("--folder", str(folder), "--port", str(free_port()), "--detach")
    assert (second.returncode, len(second.stderr.splitlines())) == (2, 1) and "runs already" in second.stderr
    assert _bucket(s3, s3["keys"]).head_bucket(Bucket="dvc")  # the teammate's key still works


def _older_schema(folder: Path) -> str:
    """A cluster whose database an older MLflow left: its schema one migration behind; that revision."""
    import sqlalchemy
    from alembic import command
    from alembic.script import ScriptDirectory
    from mlflow.store.db import utils

    cluster = mlflow_server.Cluster(folder)
    cluster.init()
    port = cluster.start()
    cluster.ensure_database(port)
    engine = sqlalchemy.create_engine(cluster.uri(port), connect_args={"passfile": str(cluster.passfile)})
    config = utils._get_alembic_config(str(engine.url))
    older = ScriptDirectory.from_config(config).get_revision(mlflow_server.head_revision()).down_revision
    utils.InitialBase.metadata.create_all(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, older)
    engine.dispose()
    assert mlflow_server.schema_revision(cluster, port) == older
    cluster.stop()
    return older


@pytest.fixture(scope="module")
def server(s3):
    """The tracking server, started with ``--auth`` on a database one migration behind, its artifacts in the
    S3 bucket (the server holds the S3 credentials; its clients have none), a public URL of a name that is not
    this machine's (:data:`PUBLIC_NAME`) and one worker, and a user with EDIT on experiment detection:
    ``{"url" (127.0.0.1), "public_url", "pid", "postgres_port", "folder", "credentials"}``."""
    # not under pytest's tmp_path: run as root, PostgreSQL runs as `postgres`, which must reach the folder
    base = Path(tempfile.mkdtemp(prefix="tracking-team-"))
    base.chmod(0o755)
    folder = base / "server"
    # the MLflow server's own key, limited to its bucket, from the file the S3 server wrote
    env = {**_env(), "MLFLOW_S3_ENDPOINT_URL": s3["endpoint"],
           "AWS_SHARED_CREDENTIALS_FILE": str(s3["folder"] / "mlflow.credentials")}
    try:  # stopped however the set-up ends: a failed assertion must not leave the servers running
        older = _older_schema(folder)
        port = free_port()
        public = f"http://{PUBLIC_NAME}:{port}"  # the name teammates use; this machine reaches it on 127.0.0.1
        started = _server("--folder", str(folder), "--port", str(port), "--public-url", public, "--workers", "1",
                          "--auth", "--artifacts", "s3://mlflow/artifacts", "--detach", *SERVICE_USER, env=env)
        assert started.returncode == 0, started.stderr
        assert started.stdout.rstrip().endswith(f"export MLFLOW_TRACKING_URI={public}")  # the public URL, not 127.0.0.1
        head = mlflow_server.head_revision()
        assert f"upgrading the MLflow schema from {older} to {head} (mlflow db upgrade); the database as it was is in " \
            in started.stdout
        kept = re.search(r"the database as it was is in (\S+\.dump) \(pg_restore\)", started.stdout)[1]
        listed = subprocess.run([mlflow_server.pg_command("pg_restore", mlflow_server.Cluster(folder).version), "--list",
                                 kept], capture_output=True, text=True)
        assert "alembic_version" in listed.stdout and Path(kept).stat().st_mode & 0o077 == 0  # restorable, private
        state = json.loads((folder / "server.json").read_text())
        assert mlflow_server.schema_revision(mlflow_server.Cluster(folder), state["postgres_port"]) == head
        user = _server("--folder", str(folder), "user", "team", timeout=120)
        assert user.returncode == 0 and "may edit experiment 'detection'" in user.stdout, user.stderr
        assert f"they set MLFLOW_TRACKING_URI={public}," in user.stdout
        credentials = {"MLFLOW_TRACKING_USERNAME": "team", "MLFLOW_TRACKING_PASSWORD": _password(user.stdout)}
        # the tests below reach it as this machine does (no resolver here knows the public name)
        yield {**state, "url": state["local_url"], "public_url": public, "folder": folder, "credentials": credentials}
    finally:
        mlflow_server.stop(folder)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def as_team(server, monkeypatch):
    """This process as the team's user of the server, patient with it as the stages of the concurrency test are."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server["url"])
    for name, value in {**server["credentials"], **SLOW_SERVER}.items():
        monkeypatch.setenv(name, value)
    return server


def test_runs_go_to_postgresql_and_artifacts_through_the_server_into_the_bucket(as_team, s3, tmp_path, monkeypatch):
    import mlflow
    import psycopg

    from pipelines.tracking import store

    # Not a test of the bounds: with --auth every call checks the password (scrypt), which is slow when other
    # processes hold the cores, and the run's creation (three calls) must not go offline.
    monkeypatch.setattr(store, "CALL_TIMEOUT", 60.0)
    tracker = Tracker.start(experiment="team", params={"train.base_lr": 0.001})
    model = tmp_path / "model_final.pth"
    model.write_bytes(os.urandom(1 << 20))
    tracker.log_metrics({"train/loss": 0.5}, step=3)
    tracker.log_artifact(model, "model")
    tracker.finish()
    assert not tracker._offline
    client = mlflow.MlflowClient(as_team["url"])
    assert client.get_experiment_by_name("team").artifact_location.startswith("mlflow-artifacts:")  # the server's
    assert client.get_run(tracker.run_id).data.metrics["train/loss"] == 0.5
    bucket = _bucket(s3)
    (key,) = [o["Key"] for o in bucket.list_objects_v2(Bucket="mlflow", Prefix="artifacts/")["Contents"]
              if o["Key"].endswith(f"{tracker.run_id}/artifacts/model/model_final.pth")]
    assert bucket.get_object(Bucket="mlflow", Key=key)["Body"].read() == model.read_bytes()  # uploaded through it
    with psycopg.connect(host="127.0.0.1", port=as_team["postgres_port"], user="mlflow", dbname="mlflow",
                         passfile=str(as_team["folder"] / "pgpass")) as conn:
        assert conn.execute("SELECT status FROM runs WHERE run_uuid = %s", (tracker.run_id,)).fetchone() == ("FINISHED",)


def test_the_database_password_is_in_no_command_line_state_or_log(server):
    folder = server["folder"]
    password = (folder / "pgpass").read_text().strip().rsplit(":", 1)[1]
    assert oct((folder / "pgpass").stat().st_mode & 0o777) == "0o600"
    assert password not in Path(f"/proc/{server['pid']}/cmdline").read_text()
    for path in (folder / "server.json", folder / "server.log", folder / "postgres" / "server.log"):
        assert password not in path.read_text(errors="replace")


def _session(pid: int) -> list[Path]:
    """The /proc folders of the processes of the session ``pid`` leads (the server's: ``start_new_session``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3]) == pid:
                found.append(proc)
        except OSError:  # gone meanwhile
            pass
    return found


def test_the_server_runs_unprivileged_and_its_state_is_readable_by_nobody_else(server):
    """Started as root, the MLflow server and its workers run as the service user, which owns the folder (mode
    0750, group postgres, which only traverses it) and what the server reads and writes; nothing in the folder
    is readable by other users (the log and the artifacts included). As another user: the folder is 0700."""
    if not UNPRIVILEGED:
        pytest.skip(f"{REPO} is under a folder other users cannot enter, so the server ran as root")
    folder, root = server["folder"], os.geteuid() == 0
    uids = {int((proc / "status").read_text().split("\nUid:")[1].split()[0]) for proc in _session(server["pid"])}
    assert uids == ({pwd.getpwnam("mlflow").pw_uid} if root else {os.geteuid()})
    assert oct(folder.stat().st_mode & 0o777) == ("0o750" if root else "0o700")
    owner = pwd.getpwnam("mlflow").pw_uid if root else os.geteuid()
    assert {p.name for p in folder.iterdir() if p.stat().st_uid == owner} >= {"pgpass", "server.log"}
    readable = [str(path) for path in folder.rglob("*") if not path.is_socket() and path.stat().st_mode & 0o004]
    assert readable == []


def test_the_database_role_is_no_superuser_and_owns_only_its_databases(server):
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=server["postgres_port"], user="mlflow", dbname="mlflow",
                         passfile=str(server["folder"] / "pgpass"), autocommit=True) as conn:
        assert conn.execute("SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls FROM pg_roles "
                            "WHERE rolname = current_user").fetchone() == (False, False, False, False, False)
        owned = conn.execute("SELECT datname FROM pg_database WHERE datdba = "
                             "(SELECT oid FROM pg_roles WHERE rolname = 'mlflow')").fetchall()
        assert sorted(owned) == [("mlflow",), ("mlflow_auth",)]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE ROLE intruder SUPERUSER")


def test_the_server_runs_without_mlflows_job_runner(server):
    """Its session (``start_new_session``: the server's pid leads it) holds the server and its one worker, no
    huey consumer or job runner."""
    commands = []
    for proc in _session(server["pid"]):
        with contextlib.suppress(OSError):  # gone meanwhile
            commands.append((proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " "))
    assert commands and any("mlflow server" in c or "uvicorn" in c for c in commands), commands
    assert not [c for c in commands if "huey" in c or "job_runner" in c], commands


def test_a_second_server_on_the_folder_or_port_is_a_one_line_error(server):
    folder = server["folder"]
    again = _server("--folder", str(folder), "--port", str(free_port()), "--detach")
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "runs already" in again.stderr
    taken = _server("--folder", str(folder) + "-other", "--port", server["url"].rsplit(":", 1)[1], "--detach")
    assert taken.returncode == 2 and "something already listens" in taken.stderr and len(taken.stderr.splitlines()) == 1


START = ("import sys; from pipelines import cli; from pipelines.tracking.tracker import Tracker\n"
         "def main(argv):\n    t = Tracker.start(experiment='detection', params={'train.base_lr': 0.001}); t.finish()\n"
         "    print(t.run_id)\ncli.run(main)")


def _start_run(url, user=None, password=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = url
    if user:
        env.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
    return subprocess.run([sys.executable, "-c", START], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_user_without_edit_or_with_a_wrong_password_stops_a_stage_at_once_in_one_line(server):
    """The one tracking failure that stops a stage: the server refuses the identity (401 or 403)."""
    url = server["url"]
    bob = _server("--folder", str(server["folder"]), "user", "bob", "--experiment", "elsewhere", timeout=120)  # READ
    assert bob.returncode == 0, bob.stderr
    for user, secret, who in (("team", "wrong", "user 'team'"), ("bob", _password(bob.stdout), "user 'bob'"),
                              (None, None, "no user (MLFLOW_TRACKING_USERNAME is not set)")):
        refused = _start_run(url, user, secret)
        assert refused.returncode == 2 and refused.stdout == ""  # stopped before any work
        assert refused.stderr.splitlines() == [
            f"error: MLflow store {url} refused {who}: set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD to a user with EDIT on experiment 'detection' (docs/team.md)"]
    allowed = _start_run(url, "team", server["credentials"]["MLFLOW_TRACKING_PASSWORD"])
    assert allowed.returncode == 0, allowed.stderr


def _status_as(url, user, password) -> int:
    """The HTTP status of one API call as ``user``."""
    import requests

    return requests.get(f"{url}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": "detection"},
                        auth=(user, password), timeout=60).status_code


def test_a_reset_password_replaces_the_old_one_and_a_removed_user_is_refused(server, monkeypatch):
    """``user NAME --reset`` prints a new password once, and the old one gets 401 from then on; after ``user NAME
    --remove`` the user gets 401. (The creation and removal in this process: the command's own MLflow login.)"""
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(name, "")  # the administrator's login below is this test's only
    url, folder = server["url"], server["folder"]
    old = mlflow_server.add_user(folder, "dave", experiment="detection")
    assert _status_as(url, "dave", old) == 200
    reset = _server("--folder", str(folder), "user", "dave", "--reset", timeout=120)
    assert reset.returncode == 0, reset.stderr
    new = re.fullmatch(r"user dave: new password (\w+) \(shown once; the old one is refused from now on\)\n",
                       reset.stdout)[1]
    assert (_status_as(url, "dave", old), _status_as(url, "dave", new)) == (401, 200)
    assert mlflow_server.change_user(folder, "dave", remove=True) == ""
    assert _status_as(url, "dave", new) == 401
    with pytest.raises(mlflow_server.ServerError, match=f"^user --reset: there is no user 'dave' on {url}$"):
        mlflow_server.change_user(folder, "dave", remove=False)


def _use_remote(repo, commands, prefix):
    for command in commands:
        words = command.split()
        if words[2] == "add":
            words[-1] = f"{words[-1]}/{prefix}"
        _run(repo, *words)


@pytest.fixture(scope="module")
def writers(server, s3, tmp_path_factory):
    """Two clones running ``dvc exp run`` while a third runs a queued sweep of two experiments, all at once,
    against the server (as its user, at a lower CPU priority). Each clone has the S3 remote committed (the
    credentials only in ``.dvc/config.local``), as a team's repository would: ``{"repos", "names", "logs"}``."""
    root = tmp_path_factory.mktemp("writers")
    env = {**_env(), "MLFLOW_TRACKING_URI": server["url"], **server["credentials"], **SLOW_SERVER}
    # the data is prepared and cached once, committed (dvc.lock) and copied with DVC's cache: every run below
    # starts at train, which is what writes to the server (each `dvc exp run` skips prepare and cache)
    template = root / "template"
    template.mkdir()
    _copy_repo(template)
    _run(template, sys.executable, "-m", "pipelines.compose", *CI[1::2])
    _run(template, "dvc", "repro", "cache")
    _commit(template, "the data, prepared")
    repos = {name: root / name for name in ("one", "two", "sweep")}
    for name, repo in repos.items():
        shutil.copytree(template, repo, symlinks=True)
        _use_remote(repo, s3["commands"], name)
        _commit(repo, "the team's remote")
    # (up to evaluate, the stages that write to the server, and the export, most of a tiny pipeline's time, only in
    # clone two, whose experiment the test below applies elsewhere: `dvc exp apply` needs every output in its lock)
    queued = subprocess.run([*NICE, "dvc", "exp", "run", "--queue", *CI, "-S", "augment=none,flip", "evaluate"],
                            cwd=repos["sweep"],
                            env=env, capture_output=True, text=True, timeout=120)
    names = re.findall(r"Queued experiment '([\w-]+)'", queued.stdout)
    assert len(names) == 2, queued.stderr
    logs = {name: root / f"{name}.log" for name in repos}
    files = {name: open(logs[name], "w") for name in repos}
    clones = [subprocess.Popen([*NICE, "dvc", "exp", "run", "-n", f"clone-{name}", *CI, *target], cwd=repos[name],
                               env=env, stdout=files[name], stderr=subprocess.STDOUT)
              for name, target in (("one", ["evaluate"]), ("two", []))]
    started = subprocess.run([*NICE, "dvc", "queue", "start", "-j", "2"], cwd=repos["sweep"], env=env,
                             stdout=files["sweep"], stderr=subprocess.STDOUT, timeout=120)
    assert started.returncode == 0
    for clone in clones:
        assert clone.wait(timeout=1200) == 0, [logs[n].read_text()[-3000:] for n in ("one", "two")]
    status = wait_for_queue(repos["sweep"], env, len(names), timeout_s=1200)
    assert all(re.search(rf"{name}\s.*\bSuccess\b", status) for name in names), status
    for file in files.values():
        file.close()
    return {"repos": repos, "names": names, "logs": logs}


def test_two_clones_and_a_queued_sweep_write_to_one_server_at_once(writers, as_team):
    import mlflow

    repos, names = writers["repos"], writers["names"]
    text = "".join(log.read_text() for log in writers["logs"].values())
    assert "MLflow store" not in text and "database is locked" not in text  # no store failure, no warning
    assert "Running stage 'train'" in text and "Running stage 'prepare'" not in text  # the data came prepared

    password = as_team["credentials"]["MLFLOW_TRACKING_PASSWORD"]
    assert password not in text  # in no log
    for repo in repos.values():  # nor in any file DVC or git keeps
        for name in ("dvc.lock", "params.yaml", ".dvc/config", ".dvc/config.local"):
            assert not (repo / name).is_file() or password not in (repo / name).read_text()
    client = mlflow.MlflowClient(as_team["url"])
    runs = client.search_runs([client.get_experiment_by_name("detection").experiment_id])
    experiments = [r for r in runs if "dvc.exp_name" in r.data.tags]  # not the team benchmark's runs
    trainings = {r.data.tags["dvc.exp_name"]: r for r in experiments if r.data.tags.get("pipeline.stage") == "train"}
    evaluations = {r.data.tags["dvc.exp_name"]: r for r in experiments if r.data.tags.get("pipeline.stage") == "evaluate"}
    expected = {"clone-one", "clone-two", *names}
    assert set(trainings) == set(evaluations) == expected
    for name in expected:
        training, evaluation = trainings[name], evaluations[name]
        assert training.info.status == evaluation.info.status == "FINISHED"
        assert evaluation.data.tags["training_run_id"] == training.info.run_id  # each linked to its own
        steps = [m.step for m in client.get_metric_history(training.info.run_id, "train/loss")]
        assert sorted(steps) == [2, 4, 6, 8]  # the ci profile logs every 2 of 8 iterations: none lost
        assert "eval/AP" in evaluation.data.metrics
    assert {trainings[n].data.params["augment.name"] for n in names} == {"none", "flip"}
    assert all(password not in json.dumps([r.data.params, r.data.tags]) for r in runs)  # nor in any run


def test_an_experiment_moves_to_a_colleague_who_evaluates_it_again_without_retraining(writers, as_team, s3, tmp_path):
    """Alice (clone two) pushes her experiment (git refs to a bare repository, outputs to the S3 remote); Bob,
    in a clone of his own, lists it, pulls and applies it, changes an evaluate param on top of it and
    reproduces: only evaluate runs, and its MLflow run on the shared server links to Alice's training run,
    whose model the server stored in the S3 bucket."""
    import mlflow

    store = {"MLFLOW_TRACKING_URI": as_team["url"], **as_team["credentials"]}
    alice = writers["repos"]["two"]
    origin = tmp_path / "origin.git"
    _run(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(origin))
    _run(alice, "git", "remote", "add", "origin", str(origin))
    _run(alice, "git", "push", "-q", "origin", "HEAD:main")
    _run(alice, "dvc", "exp", "push", "origin", "clone-two")

    bob = tmp_path / "bob"
    _run(tmp_path, "git", "clone", "-q", str(origin), str(bob))
    for command in s3["commands"]:
        if "--local" in command:
            _run(bob, *command.split())
    assert "clone-two" in _run(bob, "dvc", "exp", "list", "origin").stdout
    _run(bob, "dvc", "exp", "pull", "origin", "clone-two")
    _run(bob, "dvc", "exp", "apply", "clone-two")
    assert "up to date" in _run(bob, "dvc", "status").stdout  # its outputs came from the remote
    trained = json.loads((bob / "outputs/train/run.json").read_text())["run_id"]
    # `dvc exp run -S` would recompose params.yaml from conf/ and lose the experiment's own overrides: edit it instead
    _run(bob, sys.executable, "-m", "pipelines.compose", "--edit", "evaluate.backend=pycocotools")
    ran = _run(bob, "dvc", "repro", env=store, timeout=900).stdout
    assert set(re.findall(r"Running stage '(\w+)'", ran)) == {"evaluate"}
    _commit(bob, "clone-two, scored with pycocotools")  # `dvc push` would share its outputs
    assert "up to date" in _run(bob, "dvc", "status").stdout
    client = mlflow.MlflowClient(as_team["url"])
    (evaluation,) = client.search_runs([client.get_experiment_by_name("detection").experiment_id],
                                       "tags.`pipeline.stage` = 'evaluate' and params.`evaluate.backend` = 'pycocotools'")
    assert evaluation.data.tags["training_run_id"] == trained
    assert client.get_run(trained).data.tags["dvc.exp_name"] == "clone-two"  # Alice's training run
    stored = [o["Key"] for o in _bucket(s3).list_objects_v2(Bucket="mlflow", Prefix="artifacts/")["Contents"]]
    assert any(k.endswith(f"{trained}/artifacts/model/model_final.pth") for k in stored), stored


def test_a_database_restart_under_the_server_loses_nothing_and_a_stopped_server_is_one_warning(
        as_team, monkeypatch, caplog):
    """PostgreSQL stopped and started again under the running server: the tracker goes offline, then sends
    what it kept at its next log after RECONNECT_INTERVAL. Then the MLflow server itself stops for good:
    training goes on, and finish names what was not recorded in one warning, within the bound."""
    import mlflow

    from pipelines.tracking import store

    monkeypatch.setattr(store, "RECONNECT_INTERVAL", 1.0)
    tracker = Tracker.start(experiment="team", params={})
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    cluster = mlflow_server.Cluster(as_team["folder"])
    cluster.stop()
    tracker.log_metrics({"train/loss": 0.9}, step=2)  # the server answers 500 or not at all: offline
    assert tracker._offline
    cluster.start(as_team["postgres_port"])
    deadline = time.monotonic() + 60
    step = 3
    while tracker._offline and time.monotonic() < deadline:
        time.sleep(1.1)
        tracker.log_metrics({"train/loss": 1.0 - step / 10}, step=step)
        step += 1
    assert not tracker._offline  # back during the run, not only at its end
    client = mlflow.MlflowClient(as_team["url"])
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "train/loss")) == list(range(1, step))

    end_group(as_team["pid"])  # the MLflow server, by the pid this module's fixture started
    start = time.monotonic()
    for more in range(step, step + 5):
        tracker.log_metrics({"train/loss": 0.1}, step=more)
    tracker.finish()
    assert time.monotonic() - start < 2 * store.CALL_TIMEOUT + 5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "5 metric values and the run status FINISHED were not recorded" in warnings[0]


def test_stop_then_a_foreground_server_on_the_same_data_ends_cleanly_on_sigterm(server):
    """After the tests above stopped its MLflow server: ``stop`` ends what is left (PostgreSQL); a server
    started again in the foreground (without --auth) serves the same database and ends on SIGTERM."""
    folder = server["folder"]
    stopped = _server("stop", "--folder", str(folder))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not _listening(int(server["url"].rsplit(":", 1)[1])) and not _listening(server["postgres_port"])
    assert _server("status", "--folder", str(folder)).returncode == 1

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pipelines.team.mlflow_server", "--folder", str(folder),
                                "--port", str(port), "--workers", "1", *SERVICE_USER], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (folder / "server.json").is_file() or not _listening(port):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.poll() else ""
        time.sleep(0.5)
    state = json.loads((folder / "server.json").read_text())
    import mlflow

    client = mlflow.MlflowClient(state["url"])
    assert client.get_experiment_by_name("team") is not None  # the same database, kept across restarts
    process.send_signal(signal.SIGTERM)  # the process this test started, by its pid
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "created a PostgreSQL cluster" not in out and out.rstrip().endswith("stopped")
    assert not _listening(port) and not _listening(state["postgres_port"])
    assert not (folder / "server.json").exists()


def test_with_workspaces_read_means_read_and_edit_writes_its_experiment(server, monkeypatch):
    """The server again on the same data, with ``--workspaces`` (MLflow's, with the default workspace granted at
    the default permission): bob, READ (EDIT on another experiment only), reads the team's experiment but
    creates no experiment, model or run in it; the team's user, EDIT on it, writes its runs there but creates
    no experiment either. The setting is kept across a restart."""
    import requests

    folder = server["folder"]
    mlflow_server.stop(folder)  # whatever the tests above left running
    port = free_port()
    started = _server("--folder", str(folder), "--port", str(port), "--auth", "--workspaces", "--workers", "1",
                      "--detach", *SERVICE_USER)
    assert started.returncode == 0, started.stderr
    assert "workspaces: off -> on (--workspaces)" in started.stdout and "workspaces on" in started.stdout
    assert mlflow_server.kept_workspaces(folder / "basic_auth.ini")
    url = f"http://127.0.0.1:{port}"
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(name, "")  # the administrator's login below is this test's only
    mlflow_server.add_user(folder, "bob", experiment="elsewhere")  # (made above where the module runs whole)
    bob, team = (mlflow_server.change_user(folder, name, remove=False) for name in ("bob", "team"))
    experiment = requests.get(f"{url}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": "detection"},
                              auth=("team", team), timeout=60).json()["experiment"]["experiment_id"]

    def status(who, password, path, body):
        return requests.post(f"{url}/api/2.0/mlflow/{path}", json=body, auth=(who, password), timeout=60).status_code

    for who, password in (("bob", bob), ("team", team)):
        assert _status_as(url, who, password) == 200  # reads
        assert status(who, password, "runs/search", {"experiment_ids": [experiment]}) == 200
        assert status(who, password, "experiments/create", {"name": f"new-{who}"}) == 403
        assert status(who, password, "registered-models/create", {"name": f"model-{who}"}) == 403
    assert status("bob", bob, "runs/create", {"experiment_id": experiment}) == 403
    assert status("team", team, "runs/create", {"experiment_id": experiment}) == 200
