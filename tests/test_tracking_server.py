"""The shared tracking server (``python -m pipelines.tracking.server``): a private PostgreSQL cluster and
``mlflow server`` with proxied artifacts, started and stopped by one command, as a team would run it.
Skipped where PostgreSQL is not installed."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipelines.lifetime import free_port
from pipelines.tracking import server as tracking_server
from pipelines.tracking.tracker import Tracker

from .conftest import REPO
from .test_pipeline import TINY_ONE_PROCESS

pytestmark = pytest.mark.slow

try:
    tracking_server.pg_command("initdb")
except tracking_server.ServerError:
    pytest.skip("PostgreSQL is not installed (apt-get install postgresql)", allow_module_level=True)


def _server(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "pipelines.tracking.server", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def folder():
    # not under pytest's tmp_path: run as root, PostgreSQL runs as `postgres`, which must reach the folder
    base = Path(tempfile.mkdtemp(prefix="tracking-server-"))
    base.chmod(0o755)
    yield base / "server"
    tracking_server.stop(base / "server")
    shutil.rmtree(base, ignore_errors=True)


def _older_schema(folder: Path) -> str:
    """A cluster whose database an older MLflow left: its schema one migration behind; that revision."""
    import sqlalchemy
    from alembic import command
    from alembic.script import ScriptDirectory
    from mlflow.store.db import utils

    cluster = tracking_server.Cluster(folder)
    cluster.init()
    port = cluster.start()
    cluster.ensure_database(port)
    engine = sqlalchemy.create_engine(cluster.uri(port), connect_args={"passfile": str(cluster.passfile)})
    config = utils._get_alembic_config(str(engine.url))
    older = ScriptDirectory.from_config(config).get_revision(tracking_server.head_revision()).down_revision
    utils.InitialBase.metadata.create_all(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, older)
    engine.dispose()
    assert tracking_server.schema_revision(cluster, port) == older
    cluster.stop()
    return older


@pytest.fixture(scope="module")
def running(folder):
    """The server, started on a database one migration behind (as an older MLflow left it)."""
    older = _older_schema(folder)
    port = free_port()
    started = _server("--folder", str(folder), "--port", str(port), "--detach")
    assert started.returncode == 0, started.stderr
    assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{port}" in started.stdout
    head = tracking_server.head_revision()
    assert f"upgrading the MLflow schema from {older} to {head} (mlflow db upgrade)" in started.stdout
    running = json.loads((folder / "server.json").read_text())
    assert tracking_server.schema_revision(tracking_server.Cluster(folder), running["postgres_port"]) == head
    return running


def test_runs_go_to_postgresql_and_artifacts_through_the_server(running, folder, tmp_path, monkeypatch):
    import mlflow
    import psycopg

    monkeypatch.setenv("MLFLOW_TRACKING_URI", running["url"])
    tracker = Tracker.start(experiment="team", params={"train.base_lr": 0.001})
    model = tmp_path / "model_final.pth"
    model.write_bytes(os.urandom(1 << 20))
    tracker.log_metrics({"train/loss": 0.5}, step=3)
    tracker.log_artifact(model, "model")
    tracker.finish()
    assert not tracker.offline
    client = mlflow.MlflowClient(running["url"])
    assert client.get_experiment_by_name("team").artifact_location.startswith("mlflow-artifacts:")  # the server's
    assert client.get_run(tracker.run_id).data.metrics["train/loss"] == 0.5
    stored = list((folder / "artifacts").rglob("model_final.pth"))
    assert len(stored) == 1 and stored[0].read_bytes() == model.read_bytes()  # uploaded through the server
    with psycopg.connect(host="127.0.0.1", port=running["postgres_port"], user="mlflow", dbname="mlflow",
                         passfile=str(folder / "pgpass")) as conn:
        assert conn.execute("SELECT status FROM runs WHERE run_uuid = %s", (tracker.run_id,)).fetchone() == ("FINISHED",)


def test_the_team_benchmark_times_both_stores_and_the_upload_through_the_server(running):
    """benchmarks/team.py against this server: the stages on the tiny params against SQLite and the server,
    and a checkpoint-sized file logged both ways, in one table."""
    from benchmarks import team

    command = [sys.executable, "-m", "benchmarks.team", "--server", running["url"], "--repeats", "1", "--megabytes",
               "4", "--overrides", " ".join(TINY_ONE_PROCESS), "--json"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(figures["stages"]) == set(figures["upload"]) == {"sqlite", "server"}
    for name in ("sqlite", "server"):
        assert len(figures["stages"][name]["train_s"]) == len(figures["stages"][name]["evaluate_s"]) == 1
        assert all(s > 0 for s in figures["stages"][name]["train_s"] + figures["upload"][name])
    table = team.table(figures)
    assert "| SQLite store (baseline) |" in table and "| 4 MB checkpoint logged as an artifact |" in table
    import mlflow

    uploads = [e for e in mlflow.MlflowClient(running["url"]).search_experiments()
               if e.name.startswith("benchmark-upload-")]
    assert uploads and all(e.artifact_location.startswith("mlflow-artifacts:") for e in uploads)  # the server's


def test_the_database_password_is_in_no_command_line_state_or_log(running, folder):
    password = (folder / "pgpass").read_text().strip().rsplit(":", 1)[1]
    assert oct((folder / "pgpass").stat().st_mode & 0o777) == "0o600"
    assert password not in Path(f"/proc/{running['pid']}/cmdline").read_text()
    for path in (folder / "server.json", folder / "server.log", folder / "postgres" / "server.log"):
        assert password not in path.read_text(errors="replace")


def test_a_second_server_on_the_folder_or_port_is_a_one_line_error(running, folder):
    again = _server("--folder", str(folder), "--port", str(free_port()), "--detach")
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "runs already" in again.stderr
    taken = _server("--folder", str(folder) + "-other", "--port", running["url"].rsplit(":", 1)[1], "--detach")
    assert taken.returncode == 2 and "something already listens" in taken.stderr and len(taken.stderr.splitlines()) == 1


def test_a_database_restart_under_the_server_loses_nothing_and_a_stopped_server_is_one_warning(
        running, folder, monkeypatch, caplog):
    """PostgreSQL stopped and started again under the running server: the tracker goes offline, then sends
    what it kept at its next log after RECONNECT_INTERVAL. Then the MLflow server itself stops for good:
    training goes on, and finish names what was not recorded in one warning, within the bound."""
    import mlflow

    from pipelines.tracking import store

    monkeypatch.setenv("MLFLOW_TRACKING_URI", running["url"])
    monkeypatch.setattr(store, "RECONNECT_INTERVAL", 1.0)
    tracker = Tracker.start(experiment="team", params={})
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    cluster = tracking_server.Cluster(folder)
    cluster.stop()
    tracker.log_metrics({"train/loss": 0.9}, step=2)  # the server answers 500 or not at all: offline
    assert tracker.offline
    cluster.start(running["postgres_port"])
    deadline = time.monotonic() + 60
    step = 3
    while tracker.offline and time.monotonic() < deadline:
        time.sleep(1.1)
        tracker.log_metrics({"train/loss": 1.0 - step / 10}, step=step)
        step += 1
    assert not tracker.offline  # back during the run, not only at its end
    client = mlflow.MlflowClient(running["url"])
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "train/loss")) == list(range(1, step))

    from pipelines.lifetime import end_group

    end_group(running["pid"])  # the MLflow server, by the pid this test's fixture started
    start = time.monotonic()
    for more in range(step, step + 5):
        tracker.log_metrics({"train/loss": 0.1}, step=more)
    tracker.finish()
    assert time.monotonic() - start < 2 * store.CALL_TIMEOUT + 5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "5 metric values and the run status FINISHED were not recorded" in warnings[0]


def test_stop_then_a_foreground_server_on_the_same_data_ends_cleanly_on_sigterm(running, folder):
    stopped = _server("stop", "--folder", str(folder))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not _listening(int(running["url"].rsplit(":", 1)[1])) and not _listening(running["postgres_port"])
    assert _server("status", "--folder", str(folder)).returncode == 1

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pipelines.tracking.server", "--folder", str(folder),
                                "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
