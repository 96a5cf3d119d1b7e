"""A DVC remote on a real S3 server (SeaweedFS, ``python -m pipelines.s3server``): ``dvc push`` from one
clone, ``dvc pull`` into a fresh one, where nothing re-runs and the metrics are the same; the
credentials stay in ``.dvc/config.local``."""

import json
import shutil
import subprocess
import sys

import pytest

from pipelines import s3server
from pipelines.lifetime import free_port

from .test_pipeline import TINY, _copy_repo, _env, _repro

pytestmark = pytest.mark.slow


def _run(cwd, *command, ok=True, timeout=600):
    done = subprocess.run(list(command), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
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

    second = tmp_path / "second"
    _run(tmp_path, "git", "clone", "-q", str(first), str(second))
    for command in commands:  # only the credentials: the remote itself came with git
        if "--local" in command:
            _run(second, *command.split())
    # the default pipeline's outputs; a plain `dvc pull` also asks for the search's (search/dvc.yaml), which
    # never ran here, and fails on them
    _run(second, "dvc", "pull", "dvc.yaml")
    assert "up to date" in _run(second, "dvc", "status", "dvc.yaml").stdout
    assert _repro(second) == set()
    shown = [json.loads(_run(repo, "dvc", "metrics", "show", "--json").stdout) for repo in (first, second)]
    assert shown[0][""]["data"]["metrics/eval.json"] == shown[1][""]["data"]["metrics/eval.json"]
    assert (second / "outputs/train/model_final.pth").read_bytes() == (first / "outputs/train/model_final.pth").read_bytes()
    shutil.rmtree(second / ".dvc" / "cache")
