"""Team mode across hosts, on one machine: the servers in one network namespace, the teammates' clones in another.

:mod:`benchmarks.netns` makes the two "hosts", linked by a veth pair on 198.18.0.0/15 with no route out. In the
server's namespace, the lead's commands (``pipelines.team.lead server`` and ``user alice``): the S3 server
(SeaweedFS) and the tracking server (PostgreSQL, ``mlflow server`` with auth and workspaces, its artifacts in
the S3 bucket), each bound to the server's 198.18 address and advertised by the name ``team-<pid>.example``,
which both namespaces' ``/etc/hosts`` map to that address; a teammate, alice, with her ``team.env``. In the
client's namespace, reaching the servers only by that name: a clone joins (``pipelines.team.join``), trains and
evaluates (one short ``dvc repro``) and pushes; a second clone joins with a pull and reproduces nothing; lineage
links are under the public name. Refused, each from the client's namespace: a wrong ``Host`` header, no
password, a wrong one, a user granted nothing on the experiment (bob: he reads, creates and writes nothing), and
every port but S3's, its certificate-only gRPC port and the tracking server's (SeaweedFS's master, volume
server, filer, PostgreSQL); S3 answers an unsigned request with 403. Skipped where PostgreSQL is missing or
namespaces cannot be made (not root)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from benchmarks import netns
from pipelines.team import lead, mlflow_server

from .conftest import REPO
from .test_pipeline import TINY_ONE_PROCESS, _copy_repo, _env

pytestmark = pytest.mark.slow

try:
    mlflow_server.pg_command("initdb")
except mlflow_server.ServerError:
    pytest.skip("PostgreSQL is not installed (apt-get install postgresql)", allow_module_level=True)
if reason := netns.available():
    pytest.skip(reason, allow_module_level=True)

from .test_team import NICE, SERVICE_USER, SLOW_SERVER  # noqa: E402 (after the skips: its own skip is PostgreSQL's)

S3_PORT, TRACKING_PORT = 9000, 5000  # the documented defaults: nothing else listens in a fresh namespace
EXPERIMENT = "detection"


def _client_env() -> dict[str, str]:
    """A teammate's shell: no tracking, DVC or AWS settings but what ``join`` writes into the clone."""
    return {**{k: v for k, v in _env().items() if not k.startswith("AWS_")}, **SLOW_SERVER}


def _in(namespace: str, *command, cwd=REPO, ok=True, timeout=600, env=None) -> subprocess.CompletedProcess:
    done = subprocess.run(netns.exec_in(namespace, [str(c) for c in command]), cwd=cwd, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _python(namespace: str, code: str, *args, **kwargs) -> subprocess.CompletedProcess:
    return _in(namespace, sys.executable, "-c", textwrap.dedent(code), *args, **kwargs)


def _start_team(net: netns.Network, base: Path) -> dict:
    """The lead's one command, in the server's namespace: the S3 server and the tracking server (auth, workspaces,
    artifacts in the S3 bucket, one worker), both bound to the server's address and advertised by name."""
    public = f"http://{net.name}:{TRACKING_PORT}"
    started = _in(net.server, sys.executable, "-m", "pipelines.team.lead", "server", "--folder", base, "--host",
                  net.server_address, "--port", TRACKING_PORT, "--s3-port", S3_PORT, "--public-url", public,
                  "--workers", "1", *SERVICE_USER, timeout=300)
    assert f"export MLFLOW_TRACKING_URI={public}" in started.stdout, started.stdout
    s3, tracking = base / "s3", base / "tracking"
    return {"s3_folder": s3, "tracking_folder": tracking, "tracking": public, "s3": f"http://{net.name}:{S3_PORT}",
            "s3_bind": json.loads((s3 / "server.json").read_text())["bind"]}


def _make_user(net: netns.Network, team: dict, name: str, out: Path) -> Path:
    """The lead's one command for a teammate, in the server's namespace: an MLflow user with EDIT on the
    experiment and an S3 key for the DVC bucket, in ``out`` (a mode-600 ``team.env``); ``out``."""
    _in(net.server, sys.executable, "-m", "pipelines.team.lead", "user", name, "--folder", team["s3_folder"].parent,
        "--out", out, timeout=180)
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    return out


@pytest.fixture(scope="module")
def net():
    with netns.network() as made:
        yield made


@pytest.fixture(scope="module")
def team(net):
    """The servers and two users: alice (her ``team.env``, EDIT on the experiment) and bob (EDIT on another
    experiment only: nothing on this one, where workspaces leave him READ)."""
    # not under pytest's tmp_path: run as root, PostgreSQL runs as `postgres`, which must reach the folder
    base = Path(tempfile.mkdtemp(prefix="team-netns-"))
    base.chmod(0o755)
    try:
        servers = _start_team(net, base)
        alice = _make_user(net, servers, "alice", base / "alice" / "team.env")
        bob = _in(net.server, sys.executable, "-m", "pipelines.team.mlflow_server", "user", "bob", "--folder",
                  servers["tracking_folder"], "--experiment", "elsewhere", timeout=180)
        yield {**servers, "alice": alice, "bob": re.search(r"\(password (\w+)\)", bob.stdout)[1]}
    finally:  # stopped however the set-up ends; what is left in the namespaces ends with them
        lead.stop(base)
        shutil.rmtree(base, ignore_errors=True)


def _team_env(team: dict) -> dict[str, str]:
    return dict(line.split("=", 1) for line in team["alice"].read_text().splitlines() if "=" in line)


def _commit(repo: Path, message: str) -> None:
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, capture_output=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def first(net, team, tmp_path_factory):
    """Alice's clone, in the client's namespace: joined (no pull: nothing pushed yet), the tiny pipeline
    reproduced once (recording into the team's server) and committed, its outputs pushed:
    ``{"repo", "repro" (the output of dvc repro), "push"}``."""
    repo = tmp_path_factory.mktemp("netns") / "one"
    repo.mkdir()
    _copy_repo(repo)
    subprocess.run([sys.executable, "-m", "pipelines.compose", *TINY_ONE_PROCESS], cwd=repo, env=_env(), check=True,
                   capture_output=True)
    env = _client_env()
    _in(net.client, sys.executable, "-m", "pipelines.team.join", "--team-env", team["alice"], "--no-pull", cwd=repo,
        env=env)
    repro = _in(net.client, *NICE, "dvc", "repro", cwd=repo, env=env, timeout=900)
    _commit(repo, "alice's results")
    push = _in(net.client, "dvc", "push", cwd=repo, env=env)
    return {"repo": repo, "repro": repro.stdout + repro.stderr, "push": push.stdout + push.stderr}


def test_a_clone_joins_trains_evaluates_and_pushes_through_the_public_name(net, team, first):
    """Every stage says it records into the server by its public name as alice; the runs' lineage links are
    under that name; the model went through the tracking server into its bucket, and the outputs into the
    DVC bucket, all over the 198.18 link."""
    repo, log = first["repo"], first["repro"]
    assert {"prepare", "train", "evaluate"} <= set(re.findall(r"Running stage '(\w+)'", log)), log[-3000:]
    announced = re.findall(r"tracking store (\S+) \((.*?)\)$", log, re.M)
    assert announced and {uri for uri, _ in announced} == {team["tracking"]}, announced
    assert all(source.endswith("user 'alice'") for _, source in announced), announced
    assert "not recorded" not in log and "offline" not in log  # nothing lost on the way
    local = (repo / ".dvc" / "config.local").read_text()
    assert f"endpointurl = {team['s3']}" in local and "credentialpath" in local
    secrets = [_team_env(team)[k] for k in ("MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY")]
    history = subprocess.run(["git", "log", "-p"], cwd=repo, capture_output=True, text=True, check=True).stdout
    kept = [log, local, history, *((repo / name).read_text() for name in (".dvc/config", "dvc.lock", "params.yaml"))]
    assert not [secret for secret in secrets for text in kept if secret in text]  # only in .team/, mode 600

    shown = _in(net.client, sys.executable, "-m", "stages.lineage", "workspace", cwd=repo, env=_client_env()).stdout
    links = re.findall(r"http://\S+/#/experiments/\d+/runs/([0-9a-f]{32})", shown)
    assert len(links) >= 2, shown  # training and evaluation
    assert set(re.findall(r"(http://[^/\s]+)/#/experiments/", shown)) == {team["tracking"]}, shown
    trained = json.loads((repo / "outputs/train/run.json").read_text())["run_id"]
    assert trained in links

    # the server's side: the model in the MLflow bucket, the pushed outputs in the DVC bucket (the admin's key)
    listed = _python(net.server, """
        import json, sys
        from pathlib import Path
        import boto3
        from pipelines.team import s3_server
        key = s3_server.credentials(Path(sys.argv[1]))
        s3 = boto3.client("s3", endpoint_url=sys.argv[2], aws_access_key_id=key[0], aws_secret_access_key=key[1],
                          region_name="us-east-1")
        print(json.dumps({b: [o["Key"] for o in s3.list_objects_v2(Bucket=b).get("Contents", [])]
                          for b in ("mlflow", "dvc")}))
    """, team["s3_folder"], team["s3_bind"]).stdout
    keys = json.loads(listed)
    assert any(k.endswith(f"{trained}/artifacts/model/model_final.pth") for k in keys["mlflow"]), keys["mlflow"]
    assert any(k.startswith("files/md5/") for k in keys["dvc"]), keys["dvc"]
    assert "in sync" in _in(net.client, "dvc", "status", "--cloud", cwd=repo, env=_client_env()).stdout


def test_a_second_clone_joins_with_a_pull_and_reproduces_nothing(net, team, first, tmp_path):
    """A fresh ``git clone`` of alice's repository (no DVC cache, no settings) joins with the pull: its
    outputs come from the S3 server, ``dvc status`` is clean and ``dvc repro`` runs nothing; the same model."""
    second = tmp_path / "two"
    subprocess.run(["git", "clone", "-q", str(first["repo"]), str(second)], check=True, capture_output=True)
    env = _client_env()
    _in(net.client, sys.executable, "-m", "pipelines.team.join", "--team-env", team["alice"], cwd=second, env=env)
    assert "up to date" in _in(net.client, "dvc", "status", cwd=second, env=env).stdout
    ran = _in(net.client, "dvc", "repro", cwd=second, env=env, timeout=900)
    assert "Running stage" not in ran.stdout, ran.stdout[-3000:]
    assert (second / "outputs/train/model_final.pth").read_bytes() == (
        first["repo"] / "outputs/train/model_final.pth").read_bytes()


# From the client's namespace, in one process: the stage's start (Tracker.start) as each user, or its one-line
# error, for each tracking URI given.
STARTS = """
    import json, os, sys
    from pipelines.errors import TrackingError
    from pipelines.tracking.tracker import Tracker
    for uri, user, password in json.loads(sys.argv[1]):
        os.environ["MLFLOW_TRACKING_URI"] = uri
        for name, value in (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        try:
            tracker = Tracker.start(experiment="detection", params={})
            tracker.finish()
            print("started", tracker.run_id)
        except TrackingError as err:
            print("error", err)
"""


def test_a_wrong_name_no_password_a_wrong_one_and_a_user_granted_nothing_are_refused(net, team):
    """Through the other name (the server's address, a name it was not started for), the stage stops in one line
    naming --public-url, not the credentials; without a user, with a wrong password, and as bob (nothing granted
    on the experiment) in one line naming the credentials; the same requests in HTTP: 403 Invalid Host header,
    401, 401, and bob reads but creates no experiment, run or model (workspaces), nor does alice create an
    experiment."""
    url, password = team["tracking"], _team_env(team)["MLFLOW_TRACKING_PASSWORD"]
    other = url.replace(net.name, net.other_name)
    cases = [(other, "alice", password), (url, None, None), (url, "alice", "wrong"), (url, "bob", team["bob"])]
    lines = _python(net.client, STARTS, json.dumps(cases), env=_client_env()).stdout.splitlines()
    lines = [line for line in lines if line.startswith(("started ", "error "))]
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"error MLflow store {other} refused the name '{net.other_name}' (403 Invalid Host "
                               "header, not a credentials problem): ") and "--public-url" in lines[0], lines[0]
    for line, who in zip(lines[1:], ("no user (MLFLOW_TRACKING_USERNAME is not set)", "user 'alice'", "user 'bob'")):
        assert line == (f"error MLflow store {url} refused {who}: set MLFLOW_TRACKING_USERNAME and "
                        f"MLFLOW_TRACKING_PASSWORD to a user with EDIT on experiment '{EXPERIMENT}' (docs/team.md)")
    assert password not in "\n".join(lines)

    statuses = json.loads(_python(net.client, """
        import json, sys
        import requests
        url, name, password, bob = sys.argv[1:]
        api = f"{url}/api/2.0/mlflow"
        def get(auth=None, **headers):
            answer = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": "detection"},
                                  auth=auth, headers=headers, timeout=60)
            return answer.status_code, answer.text[:200]
        def post(path, auth, body):
            return requests.post(f"{api}/{path}", json=body, auth=auth, timeout=60).status_code
        alice = ("alice", password)
        experiment = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": "detection"},
                                  auth=alice, timeout=60).json()["experiment"]["experiment_id"]
        print(json.dumps({
            "wrong host": get(alice, Host="evil.example:5000"), "no password": get(), "wrong password":
            get(("alice", "wrong")), "alice reads": get(alice), "bob reads": get(("bob", bob)),
            "bob creates an experiment": post("experiments/create", ("bob", bob), {"name": "bobs"}),
            "bob creates a run": post("runs/create", ("bob", bob), {"experiment_id": experiment}),
            "bob creates a model": post("registered-models/create", ("bob", bob), {"name": "bobs"}),
            "alice creates an experiment": post("experiments/create", alice, {"name": "alices"}),
        }))
    """, url, net.name, password, team["bob"], env=_client_env()).stdout.splitlines()[-1])
    assert statuses["wrong host"][0] == 403 and "Invalid Host header" in statuses["wrong host"][1], statuses
    assert [statuses[k][0] for k in ("no password", "wrong password", "alice reads", "bob reads")] == [
        401, 401, 200, 200], statuses
    assert [statuses[k] for k in ("bob creates an experiment", "bob creates a run", "bob creates a model",
                                  "alice creates an experiment")] == [403, 403, 403, 403], statuses


# Every TCP port listening in the namespace this runs in (/proc/net: the namespace's own), as (address, port).
LISTENING = """
    import json, socket
    from pathlib import Path
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((socket.inet_ntop(family, words), int(port, 16)))
    print(json.dumps(found))
"""

# What an anonymous client in this namespace gets from each port of the address: "closed" (refused or no
# answer), "TLS: ..." where the port wants TLS, else the HTTP status of GET /.
ANSWERS = """
    import json, socket, ssl, sys, urllib.error, urllib.request
    address, ports = sys.argv[1], json.loads(sys.argv[2])
    def answer(port):
        try:
            socket.create_connection((address, port), timeout=3).close()
        except OSError:
            return "closed"
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        context.set_alpn_protocols(["h2"])
        try:
            with socket.create_connection((address, port), timeout=5) as raw, context.wrap_socket(raw) as tls:
                tls.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
                return f"TLS answered {tls.recv(64)!r}"
        except ssl.SSLError as err:
            if "ALERT" in (err.reason or ""):
                return "TLS refused: " + err.reason
        except OSError:
            pass
        try:
            with urllib.request.urlopen(f"http://{address}:{port}/", timeout=5) as response:
                return str(response.status)
        except urllib.error.HTTPError as err:
            return str(err.code)
        except OSError as err:
            return f"no HTTP answer: {err}"
    print(json.dumps({port: answer(port) for port in ports}))
"""


def test_from_the_client_only_s3_and_the_tracking_server_answer_and_only_with_credentials(net, team):
    """Every port that listens in the server's namespace (SeaweedFS's master, volume server, filer and admin
    server, the S3 gateway and its gRPC port, PostgreSQL, MLflow): from the client's namespace, all are closed
    but S3 (403 to an unsigned request), its gRPC port (a client without the server's certificate refused in
    the handshake) and the tracking server (401 without a password). WebDAV is not open at all."""
    listening = json.loads(_python(net.server, LISTENING).stdout)
    ports = sorted({port for _, port in listening})
    tracking = json.loads((team["tracking_folder"] / "server.json").read_text())
    s3 = json.loads((team["s3_folder"] / "server.json").read_text())
    store = Path(f"/proc/{s3['pid']}/cmdline").read_text().split("\0")
    inner = {int(a.split("=", 1)[1]) for a in store
             if re.fullmatch(r"-(master|volume|filer|admin)\.port(\.grpc)?=\d+", a)}
    gateway = Path(f"/proc/{s3['s3_pid']}/cmdline").read_text().split("\0")
    s3_grpc = int(next(a for a in gateway if a.startswith("-port.grpc=")).split("=", 1)[1])
    assert len(inner) == 8 and {*inner, tracking["postgres_port"], S3_PORT, s3_grpc, TRACKING_PORT} <= set(ports), (
        listening, inner)
    assert "-webdav=false" in store  # WebDAV not started at all
    answers = {int(k): v for k, v in json.loads(_python(net.client, ANSWERS, net.server_address, json.dumps(ports),
                                                        env=_client_env()).stdout).items()}
    expected = {port: "closed" for port in ports}
    expected.update({S3_PORT: "403", s3_grpc: "TLS refused: TLSV13_ALERT_CERTIFICATE_REQUIRED", TRACKING_PORT: "401"})
    assert answers == expected, (answers, listening)


def test_a_push_that_failed_with_the_s3_server_down_is_sent_whole_by_the_next(net, team, first):
    """The S3 server stopped under a teammate's ``dvc push``: one DVC error line naming the endpoint, a non-zero
    exit, nothing lost; the server started again on the same folder, the next push sends everything and the
    remote is in sync."""
    repo, env = first["repo"], _client_env()
    (repo / "notes").mkdir(exist_ok=True)
    (repo / "notes" / "extra.bin").write_bytes(bytes(range(256)) * 64)
    _in(net.client, "dvc", "add", "notes/extra.bin", cwd=repo, env=env)
    s3 = json.loads((team["s3_folder"] / "server.json").read_text())
    _in(net.server, sys.executable, "-m", "pipelines.team.s3_server", "stop", "--folder", team["s3_folder"])
    cache = sorted(p.relative_to(repo) for p in (repo / ".dvc" / "cache").rglob("*") if p.is_file())
    failed = _in(net.client, "dvc", "push", cwd=repo, env={**env, "AWS_MAX_ATTEMPTS": "1"}, ok=False, timeout=300)
    errors = [line for line in failed.stderr.splitlines() if line.startswith("ERROR")]
    assert failed.returncode != 0 and len(errors) == 1 and team["s3"] in errors[0], failed.stderr[-2000:]
    assert sorted(p.relative_to(repo) for p in (repo / ".dvc" / "cache").rglob("*") if p.is_file()) == cache
    _in(net.server, sys.executable, "-m", "pipelines.team.s3_server", "--folder", team["s3_folder"], "--host",
        net.server_address, "--port", S3_PORT, "--public-url", s3["endpoint"], "--detach", timeout=180)
    pushed = _in(net.client, "dvc", "push", cwd=repo, env=env)
    assert "1 file pushed" in pushed.stdout + pushed.stderr, pushed.stdout + pushed.stderr
    assert "in sync" in _in(net.client, "dvc", "status", "--cloud", cwd=repo, env=env).stdout


def test_a_backup_holds_both_databases_and_every_object_of_both_buckets(net, team, first):
    """``lead backup`` while the servers run: restorable dumps of the runs' and the users' databases, a copy of
    every object of the DVC and MLflow buckets, the S3 identities; a second backup into the same folder is one
    line and writes nothing."""
    to = team["s3_folder"].parent / "backup"
    said = _in(net.server, sys.executable, "-m", "pipelines.team.lead", "backup", "--folder", team["s3_folder"].parent,
               "--to", to, timeout=300).stdout
    assert said.startswith(f"backup in {to}: mlflow.dump, mlflow_auth.dump (pg_restore), "), said
    objects = int(re.search(r"(\d+) objects of the buckets", said)[1])
    copied = [p for p in (to / "s3").rglob("*") if p.is_file() and p.name != "s3.json"]
    assert objects == len(copied) and any(p.name == "model_final.pth" for p in copied)
    assert {p.relative_to(to / "s3").parts[0] for p in copied} == {"dvc", "mlflow"}
    version = mlflow_server.Cluster(team["tracking_folder"]).version
    for dump, table in (("mlflow.dump", "runs"), ("mlflow_auth.dump", "users")):
        listed = subprocess.run([mlflow_server.pg_command("pg_restore", version), "--list", to / "tracking" / dump],
                                capture_output=True, text=True, check=True).stdout
        assert f"TABLE DATA public {table} " in listed, listed[-2000:]
    assert (to / "s3" / "s3.json").stat().st_mode & 0o077 == 0 and to.stat().st_mode & 0o077 == 0
    again = _in(net.server, sys.executable, "-m", "pipelines.team.lead", "backup", "--folder", team["s3_folder"].parent,
                "--to", to, ok=False)
    assert again.returncode == 2 and again.stderr == f"error: --to {to}: not empty; expected a new folder for the backup\n"


# A stage's tracker as carol in the client's namespace: started, one metric logged, then (after the test removed
# carol on the server) more metrics and the finish: what the tracker says, in its log.
REMOVED_MID_RUN = """
    import logging, sys
    from pipelines.tracking import store
    from pipelines.tracking.tracker import Tracker
    store.RECONNECT_INTERVAL = 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    tracker = Tracker.start(experiment="detection", params={})
    tracker.log_metrics({"loss": 1.0}, step=0)
    print("started", flush=True)
    sys.stdin.readline()  # carol is removed meanwhile
    for step in range(1, 4):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    tracker.finish()
    print("finished", flush=True)
"""


def test_a_teammate_removed_mid_run_is_told_so_and_the_stage_finishes(net, team, tmp_path):
    """``lead user carol --remove`` while carol's stage runs: the stage goes on (training is never stopped by the
    store), its tracker says the server refuses carol's user and password, not that it is unreachable, and its
    closing warning names what was not recorded."""
    carol = _make_user(net, team, "carol", tmp_path / "carol.team.env")
    values = dict(line.split("=", 1) for line in carol.read_text().splitlines() if "=" in line)
    env = {**_client_env(), **{k: values[k] for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME",
                                                      "MLFLOW_TRACKING_PASSWORD")}}
    stage = subprocess.Popen(netns.exec_in(net.client, [sys.executable, "-c", textwrap.dedent(REMOVED_MID_RUN)]),
                             cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert stage.stdout.readline().strip() == "started"
        _in(net.server, sys.executable, "-m", "pipelines.team.lead", "user", "carol", "--remove", "--folder",
            team["s3_folder"].parent)
        out, err = stage.communicate("go\n", timeout=300)
    finally:
        if stage.poll() is None:
            stage.kill()
    assert stage.returncode == 0 and "finished" in out, err[-3000:]
    assert "refusing this client's user and password (HTTP 401/403: the user was removed or its password reset" in err
    assert re.search(r"WARNING MLflow store \S+ refusing this client's user and password .*: .* not recorded", err), err


def test_the_team_benchmarks_writers_log_at_once_through_the_link_and_every_value_is_read_back(net, team):
    """``benchmarks.team``'s concurrent writers, as alice from the client's namespace against the team's server
    (auth on): every value they logged is read back, and the table says so."""
    from benchmarks import team as bench

    values = _team_env(team)
    env = {k: values[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    found = bench.writers(team["tracking"], count=2, runs=1, batches=3, env={**env, **SLOW_SERVER},
                          prefix=tuple(netns.exec_in(net.client, [])))
    assert found["values"] == found["present"] == 2 * 1 * 3 * 20 and found["values_per_s"] > 0
    figures = {"config": {"writers": 2, "runs": 1, "batches": 3, "workers": 1, "link": "netns", "overrides": "tiny",
                          "repeats": 1, "megabytes": 4},
               "writers": {"sqlite": found, "server": found}, "stages": {"sqlite": {"train_s": [1.0], "evaluate_s": [1.0]}},
               "upload": {"sqlite": [0.1]}}
    table = bench.table(figures)
    assert "2 writers at once" in table and "Every value was read back." in table
    assert "| tracking server on PostgreSQL, auth on | 120 |" in table
