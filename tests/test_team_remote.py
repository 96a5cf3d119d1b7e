"""A DVC remote on a real S3 server (SeaweedFS, ``python -m pipelines.s3server``): ``dvc push`` from one
clone, ``dvc pull`` into a fresh one, where nothing re-runs and the metrics are the same; the
credentials stay in ``.dvc/config.local``. An experiment handed over with ``dvc exp push`` / ``dvc exp
pull`` through a bare git remote, then evaluated again by the colleague without retraining."""

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipelines import s3server
from pipelines.lifetime import free_port

from .test_pipeline import TINY_ONE_PROCESS as TINY, _copy_repo, _env, _repro

pytestmark = pytest.mark.slow


def _run(cwd, *command, ok=True, timeout=600, env=None):
    done = subprocess.run(list(command), cwd=cwd, env={**_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _commit(repo, message):
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("s3")
    started = subprocess.run([sys.executable, "-m", "pipelines.s3server", "--folder", str(folder), "--port",
                              str(free_port()), "--detach"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    commands = [line.strip() for line in started.stdout.splitlines() if line.strip().startswith("dvc remote")]
    yield folder, commands
    s3server.stop(folder)


@pytest.fixture(scope="module")
def tracking(server):
    """A shared tracking server whose artifacts go to the S3 server's bucket (the server holds the S3
    credentials; its clients have none). Skipped where PostgreSQL is not installed."""
    from pipelines.tracking import server as tracking_server

    try:
        tracking_server.pg_command("initdb")
    except tracking_server.ServerError:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    folder, _ = server
    endpoint = json.loads((folder / "server.json").read_text())["endpoint"]
    access_key, secret_key = s3server.credentials(folder)
    base = Path(tempfile.mkdtemp(prefix="tracking-s3-"))
    base.chmod(0o755)  # PostgreSQL runs as `postgres` when the tests run as root
    env = {**_env(), "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": access_key,
           "AWS_SECRET_ACCESS_KEY": secret_key}
    started = subprocess.run([sys.executable, "-m", "pipelines.tracking.server", "--folder", str(base / "server"),
                              "--port", str(free_port()), "--artifacts", "s3://dvc/mlflow", "--detach"], env=env,
                             capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr
    yield json.loads((base / "server" / "server.json").read_text())["url"]
    tracking_server.stop(base / "server")
    shutil.rmtree(base, ignore_errors=True)


def _use_remote(repo, commands, prefix):
    for command in commands:
        words = command.split()
        if words[2] == "add":
            words[-1] = f"{words[-1]}/{prefix}"
        _run(repo, *words)


def test_push_then_pull_into_a_fresh_clone_runs_nothing_again(server, tmp_path):
    folder, commands = server
    access_key, secret_key = s3server.credentials(folder)
    first = tmp_path / "first"
    first.mkdir()
    _copy_repo(first)
    _run(first, sys.executable, "-m", "pipelines.compose", *TINY)
    assert _repro(first) == {"prepare", "cache", "train", "evaluate"}
    _use_remote(first, commands, "project")
    _commit(first, "tiny pipeline, remote")
    _run(first, "dvc", "push")
    for tracked in (".dvc/config", "dvc.lock", "params.yaml"):
        assert secret_key not in (first / tracked).read_text() and access_key not in (first / tracked).read_text()
    assert secret_key in (first / ".dvc" / "config.local").read_text()
    assert secret_key not in _run(first, "git", "log", "-p").stdout

    # an unreachable remote: one error line naming it, nothing lost locally, the next push goes through
    cache = sorted(p.relative_to(first) for p in (first / ".dvc" / "cache").rglob("*") if p.is_file())
    down = f"http://127.0.0.1:{free_port()}"
    _run(first, "dvc", "remote", "add", "down", "s3://dvc/down")
    _run(first, "dvc", "remote", "modify", "down", "endpointurl", down)
    failed = _run(first, "dvc", "push", "-r", "down", ok=False, env={"AWS_ACCESS_KEY_ID": access_key,
                                                                   "AWS_SECRET_ACCESS_KEY": secret_key})
    errors = [line for line in failed.stderr.splitlines() if line.startswith("ERROR")]
    assert failed.returncode != 0 and len(errors) == 1 and down in errors[0], failed.stderr
    assert sorted(p.relative_to(first) for p in (first / ".dvc" / "cache").rglob("*") if p.is_file()) == cache
    pushed = _run(first, "dvc", "push", "-r", "team")
    assert "up to date" in pushed.stdout + pushed.stderr

    second = tmp_path / "second"
    _run(tmp_path, "git", "clone", "-q", str(first), str(second))
    for command in commands:  # only the credentials: the remote itself came with git
        if "--local" in command:
            _run(second, *command.split())
    _run(second, "dvc", "pull")
    assert "up to date" in _run(second, "dvc", "status").stdout
    assert _repro(second) == set()
    shown = [json.loads(_run(repo, "dvc", "metrics", "show", "--json").stdout) for repo in (first, second)]
    assert shown[0][""]["data"]["metrics/eval.json"] == shown[1][""]["data"]["metrics/eval.json"]
    assert (second / "outputs/train/model_final.pth").read_bytes() == (first / "outputs/train/model_final.pth").read_bytes()
    shutil.rmtree(second / ".dvc" / "cache")


def test_an_experiment_moves_to_a_colleague_who_evaluates_it_again_without_retraining(server, tracking, tmp_path):
    """Alice runs an experiment and pushes it (git refs to a bare repository, outputs to the S3 remote); Bob,
    in a clone of his own, lists it, pulls and applies it, changes an evaluate param on top of it and
    reproduces: only evaluate runs, and its MLflow run on the shared server links to Alice's training run,
    whose model the server stored in the S3 bucket."""
    import boto3
    import mlflow

    folder, commands = server
    store = {"MLFLOW_TRACKING_URI": tracking}
    origin = tmp_path / "origin.git"
    _run(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(origin))
    alice = tmp_path / "alice"
    alice.mkdir()
    _copy_repo(alice)
    _run(alice, sys.executable, "-m", "pipelines.compose", *TINY)
    _use_remote(alice, commands, "handover")
    _commit(alice, "tiny params, remote")
    _run(alice, "git", "remote", "add", "origin", str(origin))
    _run(alice, "git", "push", "-q", "origin", "HEAD:main")
    overrides = [a for o in TINY for a in ("-S", o)]
    _run(alice, "dvc", "exp", "run", "-n", "lr2", *overrides, "-S", "train.base_lr=0.002", env=store, timeout=900)
    _run(alice, "dvc", "exp", "push", "origin", "lr2")
    training = json.loads(_run(alice, "dvc", "exp", "show", "--json", env=store).stdout)
    assert training  # the experiment exists on Alice's side

    bob = tmp_path / "bob"
    _run(tmp_path, "git", "clone", "-q", str(origin), str(bob))
    for command in commands:
        if "--local" in command:
            _run(bob, *command.split())
    assert "lr2" in _run(bob, "dvc", "exp", "list", "origin").stdout
    _run(bob, "dvc", "exp", "pull", "origin", "lr2")
    _run(bob, "dvc", "exp", "apply", "lr2")
    assert "up to date" in _run(bob, "dvc", "status").stdout  # its outputs came from the remote
    trained = json.loads((bob / "outputs/train/run.json").read_text())["run_id"]
    # `dvc exp run -S` would recompose params.yaml from conf/ and lose lr2's own overrides: edit it instead
    _run(bob, sys.executable, "-m", "pipelines.compose", "--edit", "evaluate.backend=pycocotools")
    ran = _run(bob, "dvc", "repro", env=store, timeout=900).stdout
    assert set(re.findall(r"Running stage '(\w+)'", ran)) == {"evaluate"}
    _commit(bob, "lr2, scored with pycocotools")  # `dvc push` would share its outputs
    assert "up to date" in _run(bob, "dvc", "status").stdout
    client = mlflow.MlflowClient(store["MLFLOW_TRACKING_URI"])
    (evaluation,) = client.search_runs([client.get_experiment_by_name("detection").experiment_id],
                                       "tags.`pipeline.stage` = 'evaluate' and params.`evaluate.backend` = 'pycocotools'")
    assert evaluation.data.tags["training_run_id"] == trained
    assert client.get_run(trained).data.params["train.base_lr"] == "0.002"  # Alice's training run
    access_key, secret_key = s3server.credentials(folder)
    bucket = boto3.client("s3", endpoint_url=json.loads((folder / "server.json").read_text())["endpoint"],
                          aws_access_key_id=access_key, aws_secret_access_key=secret_key, region_name="us-east-1")
    stored = [o["Key"] for o in bucket.list_objects_v2(Bucket="dvc", Prefix="mlflow/")["Contents"]]
    assert any(k.endswith(f"{trained}/artifacts/model/model_final.pth") for k in stored), stored
