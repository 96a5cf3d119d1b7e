"""MLflow tracking: the default store and run files, and a tracker that never stops or stalls a stage
when the store is unreachable (connection refused), silent (accepts, never answers) or locked
(SQLite under ``BEGIN EXCLUSIVE``). Every store is on 127.0.0.1 or a SQLite file under a temporary
folder; time bounds are generous (the machine is shared and noisy)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import yaml

from pipelines.tracking import lineage
from pipelines.tracking import store as tracking_store
from pipelines.tracking import tracker as tracker_module
from pipelines.tracking.run import (CONTINUES_TAG, StageRun, close_run_file, open_run, read_run_id,
                                    write_run_file)
from pipelines.tracking.tracker import Tracker
from pipelines.errors import Stopped, TrackingError

from .conftest import REPO

BOUND = 60.0  # seconds for a whole start/log/finish sequence on a failing store


# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory):
    """A SQLite store (uri, folder), opened once: creating MLflow's tables takes seconds."""
    import mlflow

    folder = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()
    return uri, folder


@pytest.fixture
def store(sqlite_store, monkeypatch):
    """The SQLite store as this test's tracking store, with artifacts beside it."""
    uri, folder = sqlite_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DVC_ROOT", str(folder))
    return uri, folder


@pytest.fixture(autouse=True)
def _restore_http_knobs(monkeypatch):
    """The tracker sets MLflow's HTTP knobs in the environment: undo that after each test."""
    for key in tracking_store.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def fast(monkeypatch):
    """Shorter waits than the defaults, to keep the outage tests quick."""
    monkeypatch.setattr(tracking_store, "CALL_TIMEOUT", 5.0)
    monkeypatch.setattr(tracking_store, "SQLITE_BUSY_TIMEOUT", 1.5)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")  # 2 attempts: 2 s


@pytest.fixture
def refused_uri():
    """An HTTP address on 127.0.0.1 where nothing listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_uri():
    """An HTTP address on 127.0.0.1 whose server accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    server.close()


@pytest.fixture
def lock_store(store):
    """``lock()`` holds an exclusive lock on the store's database (``BEGIN EXCLUSIVE``) until ``unlock()``."""
    db = store[0].removeprefix("sqlite:///")
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)

    class Lock:
        @staticmethod
        def lock():
            conn.execute("BEGIN EXCLUSIVE")

        @staticmethod
        def unlock():
            if conn.in_transaction:
                conn.execute("ROLLBACK")

    yield Lock
    Lock.unlock()
    conn.close()


def _files(tmp_path):
    for name in ("model_final.pth", "train_log.csv"):
        (tmp_path / name).write_text(name)
    return tmp_path / "model_final.pth", tmp_path / "train_log.csv"


def _log_a_training(tracker, tmp_path, *, iterations=5):
    """What the train stage logs: 7 metric values per logging step, then two artifacts, then finish."""
    model, train_log = _files(tmp_path)
    for it in range(1, iterations + 1):
        tracker.log_metrics({"train/loss": 1.0 / it, "train/cls": 0.5, "train/box": 0.3, "train/ctr": 0.2,
                             "train/lr": 0.01, "train/images_per_sec": 10.0, "train/x": 1.0}, step=it)
    tracker.log_artifact(model, "model")
    tracker.log_artifact(train_log)
    tracker.finish()


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _no_worker_left(seconds=15.0):
    """Store calls end by themselves (bounded by MLflow's knobs): no worker thread outlives them long."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(t.name.startswith("mlflow-tracking-call") and t.is_alive() for t in threading.enumerate()):
            return True
        time.sleep(0.1)
    return False


def _run(uri, run_id):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)


# --- paths, run files, the main process ---------------------------------------------------------------


def test_repo_root_escapes_dvc_temporary_workspaces(monkeypatch, tmp_path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "tmpab12"))
    assert tracking_store.repo_root() == tmp_path / "repo"
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo"))
    assert tracking_store.repo_root() == tmp_path / "repo"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_store.tracking_uri() == f"sqlite:///{tmp_path / 'repo' / 'mlflow.db'}"
    assert tracking_store.artifact_location("detection") == (tmp_path / "repo" / "mlartifacts" / "detection").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_store.tracking_uri() == "http://127.0.0.1:5000"
    assert tracking_store.artifact_location("detection") is None  # a server keeps and serves them itself


def test_importing_tracking_stays_cheap():
    code = "import sys, pipelines.tracking.tracker, pipelines.tracking.run; print(sorted({'mlflow', 'sqlalchemy', 'torch'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_tracker_of_other_processes_is_silent(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = Tracker()  # what the stages give every process but the main one
    assert not tracker.active
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.log_artifact(tmp_path / "absent")
    tracker.set_tag("a", "b")
    assert tracker.last_step("loss") == 0
    tracker.finish()
    assert not (tmp_path / "mlflow.db").exists()


def test_run_file_round_trip_and_errors(tmp_path):
    write_run_file(tmp_path / "run.json", run_id="abc123", experiment="detection")
    assert read_run_id(tmp_path / "run.json") == "abc123"
    write_run_file(tmp_path / "offline.json", run_id=None, experiment="detection")  # train ran untracked
    assert '"run_id": null' in (tmp_path / "offline.json").read_text()
    assert read_run_id(tmp_path / "offline.json") is None
    for content in ("", "{}", '{"run_id": 5}', '{"run_id": ""}', "[1]", "null"):
        (tmp_path / "bad.json").write_text(content)
        with pytest.raises(TrackingError, match="bad.json"):
            read_run_id(tmp_path / "bad.json")
    with pytest.raises(TrackingError, match="not a run file"):
        read_run_id(tmp_path / "absent.json")


def test_a_run_on_a_working_store(store, tmp_path, caplog, monkeypatch):
    uri, _ = store
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    params = {f"p.{i}": i for i in range(150)}  # more than one batch of 100
    tracker = Tracker.start(experiment="working", params=params)
    assert tracker.run_id and not tracker._offline
    tracker.log_text("policy", "augment_policy.txt")
    tracker.set_tag("k", "v")
    _log_a_training(tracker, tmp_path)
    run = _run(uri, tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp-1"
    assert run.data.params["p.149"] == "149" and len(run.data.params) == 150
    assert run.data.tags["dvc.exp_name"] == "exp-1" and run.data.tags["k"] == "v"
    assert run.data.metrics["train/loss"] == pytest.approx(0.2)
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    assert {a.path for a in client.list_artifacts(tracker.run_id)} >= {"model", "train_log.csv", "augment_policy.txt"}
    assert not _warnings(caplog)


def test_last_step_lets_a_resumed_training_skip_logged_steps(store, tmp_path, caplog):
    uri, _ = store
    tracker = Tracker.start(experiment="resume", params={})
    assert tracker.last_step("train/loss") == 0
    for it in (20, 40):
        tracker.log_metrics({"train/loss": 1.0}, step=it)
    assert tracker.last_step("train/loss") == 40
    tracker.finish("KILLED")

    resumed = Tracker.resume(tracker.run_id)  # a new process would do this
    assert _run(uri, tracker.run_id).info.status == "RUNNING"
    assert resumed.last_step("train/loss") == 40 and resumed.last_step("eval/AP") == 0
    for it in range(20, 81, 20):
        if it > resumed.last_step("train/loss"):
            resumed.log_metrics({"train/loss": 0.5}, step=it)
    resumed.finish()
    import mlflow

    steps = sorted(m.step for m in mlflow.MlflowClient(tracking_uri=uri).get_metric_history(tracker.run_id, "train/loss"))
    assert steps == [20, 40, 60, 80]
    assert _run(uri, tracker.run_id).info.status == "FINISHED"
    assert not _warnings(caplog)


def test_a_resume_on_a_locked_store_records_no_step_twice(store, lock_store, fast, caplog):
    """last_step cannot ask the store: the training re-logs from step 0 (kept), and the retry at
    finish drops the steps that the store already has."""
    uri, _ = store
    tracker = Tracker.start(experiment="resume", params={})
    for it in (20, 40):
        tracker.log_metrics({"train/loss": 1.0, "train/lr": 0.1}, step=it)
    tracker.finish("KILLED")

    lock_store.lock()
    resumed = Tracker.resume(tracker.run_id)
    assert resumed._offline and resumed.run_id == tracker.run_id
    assert resumed.last_step("train/loss") == 0
    for it in range(20, 81, 20):
        resumed.log_metrics({"train/loss": 0.5, "train/lr": 0.1}, step=it)
    lock_store.unlock()
    resumed.finish()
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    for key in ("train/loss", "train/lr"):
        assert sorted(m.step for m in client.get_metric_history(tracker.run_id, key)) == [20, 40, 60, 80]
    assert _run(uri, tracker.run_id).info.status == "FINISHED"
    assert not _warnings(caplog)


def test_close_run_ends_a_running_run_and_leaves_others(store, refused_uri, fast, caplog):
    uri, _ = store
    running = Tracker.start(experiment="close", params={})  # its process "was killed"
    done = Tracker.start(experiment="close", params={})
    done.finish()
    assert tracking_store.close_run(running.run_id, "KILLED") is True
    assert _run(uri, running.run_id).info.status == "KILLED"
    assert _run(uri, running.run_id).info.end_time is not None
    assert tracking_store.close_run(running.run_id, "FAILED") is False  # no longer RUNNING
    assert tracking_store.close_run(done.run_id, "KILLED") is False
    assert _run(uri, done.run_id).info.status == "FINISHED"
    assert not _warnings(caplog)
    with pytest.raises(ValueError, match="status"):
        tracking_store.close_run(done.run_id, "RUNNING")

    start = time.monotonic()
    assert tracking_store.close_run("0" * 32, "KILLED") is False  # no such run: one warning, no exception
    assert tracking_store.close_run(running.run_id, "KILLED", uri=refused_uri) is False
    assert time.monotonic() - start < BOUND
    assert len(_warnings(caplog)) == 2 and "unreachable" in _warnings(caplog)[1]


def test_a_missing_artifact_is_one_warning_not_an_error(store, tmp_path, caplog):
    uri, _ = store
    tracker = Tracker.start(experiment="working", params={})
    tracker.log_artifact(tmp_path / "absent.pth", "model")
    tracker.log_artifact(tmp_path / "absent.pth", "model")
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    tracker.finish()
    assert len(_warnings(caplog)) == 1 and "absent.pth" in _warnings(caplog)[0]
    assert _run(uri, tracker.run_id).info.status == "FINISHED"


# --- outages -------------------------------------------------------------------------------------------


def _check_one_warning(caplog, capfd, *needles):
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    for needle in needles:
        assert needle in warnings[0], warnings[0]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "mlflow.store" not in err and "urllib3" not in err, err[-2000:]
    return warnings[0]


@pytest.mark.parametrize("outage", ["refused", "silent"])
def test_start_on_an_unreachable_http_store_runs_untracked(outage, refused_uri, silent_uri, tmp_path, monkeypatch,
                                                          caplog, capfd):
    """With MLflow's default knobs replaced by the tracker's: refused at once, silent within about 8 s."""
    uri = refused_uri if outage == "refused" else silent_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    start = time.monotonic()
    tracker = Tracker.start(experiment="detection", params={"a": 1})
    assert tracker.run_id is None and tracker._offline
    _log_a_training(tracker, tmp_path)
    assert tracker.last_step("train/loss") == 0
    elapsed = time.monotonic() - start
    assert elapsed < BOUND
    _check_one_warning(caplog, capfd, uri, "unreachable" if outage == "refused" else "not answering", "not tracked")
    write_run_file(tmp_path / "run.json", run_id=tracker.run_id, experiment="detection")
    assert read_run_id(tmp_path / "run.json") is None


@pytest.mark.parametrize("outage", ["refused", "silent"])
def test_resume_on_an_unreachable_http_store_keeps_and_reports(outage, refused_uri, silent_uri, fast, tmp_path,
                                                              monkeypatch, caplog, capfd):
    uri = refused_uri if outage == "refused" else silent_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    start = time.monotonic()
    tracker = Tracker.resume("f" * 32)
    assert tracker.run_id == "f" * 32 and tracker._offline
    _log_a_training(tracker, tmp_path)
    assert time.monotonic() - start < BOUND
    warning = _check_one_warning(caplog, capfd, uri, "35 metric values", "2 artifacts (model/model_final.pth, "
                                 "train_log.csv)", "the run status FINISHED were not recorded", "f" * 32)
    assert ("unreachable" if outage == "refused" else "not answering") in warning
    assert _no_worker_left()


def test_locked_sqlite_store(store, lock_store, fast, tmp_path, caplog, capfd):
    uri, _ = store
    # the store locks up during the run: the first call waits, later ones are kept, finish retries once
    tracker = Tracker.start(experiment="locked", params={"a": 1})
    assert tracker.run_id
    lock_store.lock()
    start = time.monotonic()
    _log_a_training(tracker, tmp_path)
    assert time.monotonic() - start < BOUND
    _check_one_warning(caplog, capfd, uri, "locked", "35 metric values", "2 artifacts", "the run status FINISHED")
    assert _no_worker_left()  # the locked calls ended by themselves (busy timeout below the deadline)

    # started while locked: no run, one warning
    caplog.clear()
    start = time.monotonic()
    untracked = Tracker.start(experiment="locked", params={"a": 1})
    assert untracked.run_id is None
    _log_a_training(untracked, tmp_path)
    assert time.monotonic() - start < BOUND
    _check_one_warning(caplog, capfd, uri, "locked", "not tracked")

    # released: the first run is still there, RUNNING (close_run's job), and a new tracker works
    lock_store.unlock()
    caplog.clear()
    assert _run(uri, tracker.run_id).info.status == "RUNNING"
    assert tracking_store.close_run(tracker.run_id, "FAILED") is True
    again = Tracker.start(experiment="locked", params={"a": 1})
    _log_a_training(again, tmp_path)
    run = _run(uri, again.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["train/loss"] == pytest.approx(0.2)
    assert not _warnings(caplog)


def test_a_lock_released_before_finish_loses_nothing(store, lock_store, fast, tmp_path, caplog):
    uri, _ = store
    tracker = Tracker.start(experiment="locked", params={"a": 1})
    lock_store.lock()
    tracker.log_metrics({"train/loss": 1.0}, step=1)  # waits, fails, goes offline
    assert tracker._offline
    tracker.log_metrics({"train/loss": 0.5}, step=2)  # kept at once
    for it in (3, 4, 5):  # 1800 values: more than one log_batch (1000 at most) in the retry
        tracker.log_metrics({f"many/{k}": k for k in range(600)}, step=it)
    lock_store.unlock()
    model, _ = _files(tmp_path)
    tracker.log_artifact(model, "model")
    tracker.finish()
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "train/loss")) == [1, 2]
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "many/599")) == [3, 4, 5]
    assert _run(uri, tracker.run_id).info.status == "FINISHED"
    assert not _warnings(caplog)


def test_an_offline_tracker_comes_back_at_a_log_once_the_store_answers_again(store, lock_store, fast, monkeypatch,
                                                                            caplog):
    """A store back during the run (a database restarted under a tracking server) gets what was kept at the
    next log after RECONNECT_INTERVAL, not only when the stage ends; while it still fails, a log costs
    nothing between those attempts."""
    import mlflow

    uri, _ = store
    monkeypatch.setattr(tracking_store, "RECONNECT_INTERVAL", 2.0)
    tracker = Tracker.start(experiment="restarted", params={"a": 1})
    lock_store.lock()
    tracker.log_metrics({"train/loss": 1.0}, step=1)  # waits, fails, goes offline
    assert tracker._offline
    start = time.monotonic()
    tracker.log_metrics({"train/loss": 0.9}, step=2)  # before the interval: kept at once, no call
    assert time.monotonic() - start < 0.5
    time.sleep(2.0)
    tracker.log_metrics({"train/loss": 0.8}, step=3)  # an attempt: fails again (one call), stays offline
    assert tracker._offline
    lock_store.unlock()
    tracker.log_metrics({"train/loss": 0.7}, step=4)  # within the interval of the last attempt: kept
    assert tracker._offline
    time.sleep(2.0)
    with caplog.at_level(logging.INFO, logger="pipelines.tracking"):
        tracker.log_metrics({"train/loss": 0.6}, step=5)
    assert not tracker._offline and "tracking is back online" in caplog.text
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "train/loss")) == [1, 2, 3, 4, 5]
    tracker.finish()
    assert _run(uri, tracker.run_id).info.status == "FINISHED" and not _warnings(caplog)


def test_a_call_past_its_deadline_that_succeeds_counts_as_recorded(store, tmp_path, monkeypatch, caplog):
    """A slow call (a big upload) is not waited on past CALL_TIMEOUT; when it then succeeds the tracker
    goes back online and nothing is reported lost."""
    uri, _ = store
    monkeypatch.setattr(tracking_store, "CALL_TIMEOUT", 1.0)
    tracker = Tracker.start(experiment="slow", params={})
    apply, release = tracker_module._apply, threading.Event()

    def slow_apply(client, run_id, ops):
        if ops[0].kind == "artifact":
            release.wait(20)
        return apply(client, run_id, ops)

    monkeypatch.setattr(tracker_module, "_apply", slow_apply)
    model, _ = _files(tmp_path)
    start = time.monotonic()
    tracker.log_artifact(model, "model")
    assert tracker._offline and time.monotonic() - start < BOUND
    release.set()
    assert _no_worker_left()
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    assert not tracker._offline  # the slow call went through: back online
    tracker.finish()
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    assert [a.path for a in client.list_artifacts(tracker.run_id, "model")] == ["model/model_final.pth"]
    assert client.get_run(tracker.run_id).data.metrics["train/loss"] == 1.0
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not _warnings(caplog)


def test_an_artifact_upload_is_granted_time_by_its_size(store, tmp_path, monkeypatch, caplog):
    """A model upload slower than CALL_TIMEOUT but within its size's bound (ARTIFACT_RATE) is waited on: the
    tracker stays online; a metric call as slow is not (it goes offline, as above)."""
    monkeypatch.setattr(tracking_store, "CALL_TIMEOUT", 1.0)
    tracker = Tracker.start(experiment="upload", params={})
    model, _ = _files(tmp_path)
    monkeypatch.setattr(tracking_store, "ARTIFACT_RATE", model.stat().st_size / 4.0)  # this file: 1 + 4 s
    apply = tracker_module._apply

    def slow_apply(client, run_id, ops):
        if ops[0].kind in ("artifact", "metrics"):
            time.sleep(2.0)
        return apply(client, run_id, ops)

    monkeypatch.setattr(tracker_module, "_apply", slow_apply)
    tracker.log_artifact(model, "model")
    assert not tracker._offline
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    assert tracker._offline
    tracker.finish()
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store[0])
    assert [a.path for a in client.list_artifacts(tracker.run_id, "model")] == ["model/model_final.pth"]


# --- lineage: names and tags -------------------------------------------------------------------------


def test_run_names_read_well(monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    defaults = {"evaluate.tta": False, "train.base_lr": 0.001, "train.steps": [], "model.name": "fcos_small"}
    tta = {**defaults, "evaluate.tta": True}
    assert lineage.run_name("evaluate", tta, defaults) == "evaluate.tta=true"
    many = {**tta, "train.base_lr": 0.002, "train.steps": [60, 80], "model.name": "fcos_r50"}
    assert lineage.describe_changes(many, defaults, first=("train.",), limit=50) == \
        "train.base_lr=0.002, train.steps=[60,80] (+2 more)"
    assert lineage.run_name("train", many, defaults) == \
        "evaluate.tta=true, model.name=fcos_r50 (+2 more) (train)"
    assert re.fullmatch(r"evaluate [0-9a-f]{8}", lineage.run_name("evaluate", defaults, defaults))
    assert re.fullmatch(r"train [0-9a-f]{8}", lineage.run_name("train", tta, None))  # defaults unknown
    monkeypatch.setenv("DVC_EXP_NAME", "lanky-tuna")
    assert lineage.run_name("evaluate", tta, defaults) == "lanky-tuna"
    assert lineage.run_name("train", tta, defaults) == "lanky-tuna (train)"


def test_stage_tags_hash_the_params_cache_and_earlier_stages_data(tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    for split in ("train", "val"):
        (tmp_path / "cache" / split).mkdir(parents=True)
        (tmp_path / "cache" / split / "meta.json").write_text(json.dumps({"arrays": {"boxes": {"sha256": split}}}))
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {
        "prepare": {"deps": [{"path": "pipelines/cli.py", "md5": "c0de"}, {"path": "data/coco", "md5": "d1.dir"}],
                    "outs": [{"path": "data/prepared", "md5": "a1.dir"}]},
        "train": {"deps": [{"path": "data/prepared", "md5": "a1.dir"}],
                  "outs": [{"path": "outputs/train/model_final.pth", "md5": "m0"}]},
        "evaluate": {"outs": [{"path": "metrics/eval.json", "md5": "stale"}]}}}, sort_keys=False))
    (tmp_path / "dvc.yaml").write_text("stages:\n  prepare: {}\n  cache: {}\n  train: {}\n  evaluate: {}\n")
    tags = lineage.stage_tags("evaluate", params_file=tmp_path / "params.yaml", cache=tmp_path / "cache",
                               lock_file=tmp_path / "dvc.lock")
    assert tags == {
        "pipeline.stage": "evaluate", "params.sha256": hashlib.sha256(b"seed: 0\n").hexdigest(),
        "data.cache.train": hashlib.sha256(b'{"boxes": {"sha256": "train"}}').hexdigest(),
        "data.cache.val": hashlib.sha256(b'{"boxes": {"sha256": "val"}}').hexdigest(),
        "dvc.lock/prepare/data/coco": "d1.dir", "dvc.lock/prepare/data/prepared": "a1.dir",
        "dvc.lock/train/data/prepared": "a1.dir", "dvc.lock/train/outputs/train/model_final.pth": "m0"}
    assert lineage.stage_tags("train", params_file=tmp_path / "missing.yaml") == {"pipeline.stage": "train"}


_CREATE_STORE = """
import sys, time
from pathlib import Path
import mlflow
from pipelines.tracking import store as tracking_store
uri, go, direct = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "direct"
print("ready", flush=True)
while not go.exists():
    time.sleep(0.01)
client = mlflow.MlflowClient(tracking_uri=uri) if direct else tracking_store.open_client(uri, tracking_store.OPEN_TIMEOUT)
print(len(client.search_experiments()))
"""


def _create_store_twice_at_once(tmp_path, how: str) -> list[subprocess.CompletedProcess]:
    uri, go = f"sqlite:///{tmp_path / how / 'mlflow.db'}", tmp_path / f"go-{how}"
    (tmp_path / how).mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _CREATE_STORE, uri, str(go), how], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    assert all(p.stdout.readline().strip() == "ready" for p in procs)  # both have imported mlflow
    go.touch()
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]


def test_two_pipelines_creating_a_new_sqlite_store_at_once_both_get_it(tmp_path):
    """The experiments of ``dvc queue start -j 2`` on a fresh repository open a new store at the same moment."""
    for done in _create_store_twice_at_once(tmp_path, "locked"):
        assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]  # the Default experiment


@pytest.mark.parametrize(("raised", "status"), [(None, "FINISHED"), (ValueError("bug"), "FAILED"),
                                                 (Stopped("stopped by SIGINT", signum=2), "KILLED")])
def test_a_stage_run_ends_as_its_block_ends_and_its_run_file_follows(store, tmp_path, raised, status):
    """A :class:`StageRun` ends the run as MLflow's ``ActiveRun.__exit__`` would (KILLED on a stop signal is
    ours); the run file says ``running`` inside the block, then ``finished`` (and so does the output copy)
    only if the block ended, and the declared artifacts are logged only then."""
    tracker = Tracker.start(experiment="stage-run", params={"a": 1})
    run_file, output, model = tmp_path / "run.json", tmp_path / "out.json", tmp_path / "model.pth"
    model.write_bytes(b"weights")
    try:
        with StageRun(tracker, run_file, experiment="stage-run", fields={"fingerprint": "f" * 64}, output=output,
                      artifacts=[(model, "model")]) as inside:
            assert inside is tracker
            assert json.loads(run_file.read_text()) == {
                "run_id": tracker.run_id, "tracking_uri": store[0], "experiment": "stage-run",
                "fingerprint": "f" * 64, "status": "running"}
            if raised is not None:
                raise raised
    except (ValueError, Stopped) as err:
        assert err is raised  # re-raised as it came
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store[0])
    assert client.get_run(tracker.run_id).info.status == status
    assert json.loads(run_file.read_text())["status"] == ("finished" if raised is None else "running")
    assert output.is_file() == (raised is None)
    logged = [a.path for a in client.list_artifacts(tracker.run_id, "model")]
    assert logged == (["model/model.pth"] if raised is None else [])


def test_other_processes_get_a_run_that_does_nothing(tmp_path, monkeypatch):
    from pipelines import distributed

    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = open_run("train", tmp_path / "run.json", experiment="e", params={}, params_file=tmp_path / "params.yaml",
                   fingerprint="f" * 64, resumed_from=None, output=tmp_path / "out.json",
                   artifacts=[(tmp_path / "absent", None)])
    with run as tracker:
        assert not tracker.active and run.tracked_until == 0
    assert list(tmp_path.iterdir()) == []  # no run file, no store


def test_a_run_left_running_is_continued_where_the_run_file_agrees_else_closed(store, tmp_path):
    """The run file of a killed start names its run, left RUNNING: the next start continues it with the
    same fingerprint (a training only when it resumes a checkpoint of that run, or one that does not say);
    otherwise that run, and the run a resumed checkpoint names, are closed as KILLED and a new run starts."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=store[0])
    params_file, run_file = tmp_path / "params.yaml", tmp_path / "run.json"
    params_file.write_text("seed: 1\n")
    status = lambda run: client.get_run(run.tracker.run_id).info.status  # noqa: E731

    def killed(stage: str, **kwargs) -> StageRun:
        """A start of ``stage`` killed inside its run: the run file says running, the run is RUNNING."""
        run = open_run(stage, run_file, experiment="stale", params={"seed": 1}, params_file=params_file, **kwargs)
        run.__enter__()
        return run

    first = killed("search", fingerprint="a", resumed_from="")
    again = killed("search", fingerprint="a", resumed_from="")
    assert again.tracker.run_id == first.tracker.run_id and status(first) == "RUNNING"
    other = killed("search", fingerprint="b", resumed_from="")  # another search
    assert other.tracker.run_id != first.tracker.run_id and status(first) == "KILLED"

    train = killed("train", fingerprint="b", resumed_from=None)  # from iteration 0: never continues
    assert status(other) == "KILLED" and CONTINUES_TAG not in client.get_run(train.tracker.run_id).data.tags
    train.tracker.log_metrics({"train/loss": 1.0}, step=5)
    resumed = killed("train", fingerprint="b", resumed_from=train.tracker.run_id)
    assert resumed.tracker.run_id == train.tracker.run_id and resumed.tracked_until == 5
    elsewhere = killed("train", fingerprint="b", resumed_from=first.tracker.run_id)  # its run file was lost
    assert status(train) == "KILLED"
    assert client.get_run(elsewhere.tracker.run_id).data.tags[CONTINUES_TAG] == first.tracker.run_id

    with open_run("evaluate", run_file, experiment="stale", params={"seed": 1}, params_file=params_file,
                  training_run_id=elsewhere.tracker.run_id) as tracker:
        assert status(elsewhere) == "KILLED"  # an evaluation never continues a run
        assert client.get_run(tracker.run_id).data.tags["training_run_id"] == elsewhere.tracker.run_id
    assert json.loads(run_file.read_text()) == {
        "run_id": tracker.run_id, "tracking_uri": store[0], "experiment": "stale",
        "training_run_id": elsewhere.tracker.run_id, "status": "finished"}
    close_run_file(run_file, "FAILED")  # the launcher's call: no longer RUNNING, nothing changes
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_run_names_compare_against_the_committed_params_not_a_composition(tmp_path, monkeypatch):
    """The baseline of a run's name is a record that exists: params.yaml as the commit the run starts from
    holds it (a DVC experiment's baseline, else HEAD); without one, names fall back to a hash."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DVC_EXP_BASELINE_REV", raising=False)
    params = tmp_path / "params.yaml"
    assert lineage.baseline_params(params) is None  # not a git repository
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    commits = []
    for lr in (0.001, 0.002):
        params.write_text(f"train:\n  base_lr: {lr}\n  max_iter: 800\n")
        subprocess.run(["git", "add", "params.yaml"], cwd=tmp_path, check=True)
        subprocess.run(["git", "commit", "-qm", f"base_lr {lr}"], cwd=tmp_path, check=True)
        commits.append(subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                                      check=True).stdout.strip())
    params.write_text("train:\n  base_lr: 0.005\n  max_iter: 800\n")  # edited, not committed
    assert lineage.baseline_params(params) == {"train.base_lr": 0.002, "train.max_iter": 800}
    now = {"train.base_lr": 0.005, "train.max_iter": 800}
    assert lineage.run_name("evaluate", now, lineage.baseline_params(params)) == "train.base_lr=0.005"
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", commits[0])
    assert lineage.baseline_params(params) == {"train.base_lr": 0.001, "train.max_iter": 800}
