"""Issue 38, classes 6 and 7: the servers' own arguments, and hints that point the wrong way. Each bad input stops
with one line naming the argument, key or variable and what was expected (exit code 2), checked where it enters:
the servers' parsers and the reading of their logs, params typing and validation, compose's overrides, the
launcher's fit of ``train.nproc`` and the tracking store's URI. Unit-level: no server runs here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines import cli, compose, launch
from pipelines.config.load import load_params, params_from_dict
from pipelines.errors import STOP_SIGNALS, ConfigError, TrackingError
from pipelines.lifetime import free_port
from pipelines.team import mlflow_server, s3_server, service
from pipelines.tracking import store

from .conftest import REPO, set_dotted

pytestmark = pytest.mark.usefixtures("restore_logging")

# --- class 6: the servers' own arguments -----------------------------------------------------------------------

HOST = "expected an address or name of this machine (127.0.0.1; 0.0.0.0: all)"
PUBLIC = "expected http(s)://NAME[:PORT][/PATH], the address teammates reach the server at"


@pytest.mark.parametrize("server, args, expected", [
    (mlflow_server, ["--port", "70000"], "argument --port: expected a TCP port from 1 to 65535, got '70000'"),
    (s3_server, ["--port", "-5"], "argument --port: expected a TCP port from 1 to 65535, got '-5'"),
    (s3_server, ["--port", "0"], "argument --port: expected a TCP port from 1 to 65535, got '0'"),  # was: 60 s
    (mlflow_server, ["--port", "5e3"], "argument --port: expected a TCP port from 1 to 65535, got '5e3'"),
    (mlflow_server, ["--folder", "{file}"], "argument --folder: {file} is not a folder; expected a folder (made if "
                                            "missing)"),
    (s3_server, ["--folder", "{file}/data"], "argument --folder: {file}/data: {file} is not a folder; expected a "
                                             "folder (made if missing)"),
    (s3_server, ["--host", "no-such-host.invalid"], f"argument --host: 'no-such-host.invalid' does not resolve; {HOST}"),
    (mlflow_server, ["--host", "192.0.2.1"], f"argument --host: '192.0.2.1' is not an address of this machine; {HOST}"),
    (mlflow_server, ["user"], "user: give the user's name"),
    (mlflow_server, ["--public-url", "tracking.example:5000"], f"argument --public-url: 'tracking.example:5000' is "
                                                               f"not an http(s) URL; {PUBLIC}"),
    (s3_server, ["--public-url", "http://s3.example:99999"], f"argument --public-url: 'http://s3.example:99999': its "
                                                             f"port is not one of 1-65535; {PUBLIC}"),
    (mlflow_server, ["--public-url", "http://alice:pw@tracking.example"], "argument --public-url: "
     f"'http://alice:pw@tracking.example' carries a user or password (user:password@): a printed address must not; "
     f"{PUBLIC}"),
    (s3_server, ["--public-url", "http://0.0.0.0:9000"], "argument --public-url: 'http://0.0.0.0:9000': 0.0.0.0 is a "
     f"bind address (all of this machine's), not one clients can reach; {PUBLIC}"),
    (mlflow_server, ["--public-url", "http://under_score:5000"], "argument --public-url: 'http://under_score:5000': "
     f"'under_score' is not a host name or address; {PUBLIC}"),
    (mlflow_server, ["--workers", "0"], "argument --workers: expected a number of server processes from 1 to 64, "
                                        "got '0'"),
    (s3_server, ["user"], "user: give the user's name"),
    (mlflow_server, ["--default-permission", "WRITE"], "argument --default-permission: invalid choice: 'WRITE' "
                                                       "(choose from 'READ', 'EDIT', 'MANAGE', 'NO_PERMISSIONS')"),
], ids=["tracking-port-70000", "s3-port-negative", "s3-port-0", "port-float", "folder-a-file", "folder-under-a-file",
        "host-unresolved", "host-of-another-machine", "user-without-name", "public-url-no-scheme",
        "public-url-port-out-of-range", "public-url-with-password", "public-url-wildcard", "public-url-bad-name",
        "s3-user-without-name", "workers-0", "default-permission-unknown"])
def test_server_arguments_are_checked_where_they_enter(tmp_path, capsys, server, args, expected):
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(SystemExit) as stop:
        server.main([a.format(file=file) for a in args])
    assert (stop.value.code, capsys.readouterr().err.splitlines()) == (
        2, [f"error: {expected.format(file=file)} (--help for usage)"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing made


def test_good_server_arguments_pass():
    cli = service.parser("doc", actions=(), folder=".s3-server", port=9000, helps={"folder": "", "host": ""})
    args = cli.parse_args(["--port", "65535", "--host", "localhost", "--folder", "new/folder"])
    assert (args.port, args.host, args.folder) == (65535, "localhost", Path("new/folder"))
    assert cli.parse_args(["--host", "0.0.0.0"]).port == 9000


def test_the_tracking_servers_port_in_use_is_refused_before_postgres_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(mlflow_server.ServerError) as err:
            mlflow_server.start(tmp_path / "server", port=port)
    assert str(err.value) == (f"--port {port}: something already listens on 127.0.0.1:{port}; choose another port")
    assert not (tmp_path / "server").exists()


SEAWEED_LOG = """\
  Starting SeaweedFS Mini ...
I1205 07:48:49.900000 mini.go:1100 starting master
E1205 07:48:49.943514 mini.go:1244 Port allocation failed: port 9000 for S3 (specified by flag s3.port) is not \
available on 127.0.0.1 and cannot be used
E1205 07:48:50.000001 mini.go:1300 shutting down
"""
POSTGRES_LOG = """\
2026-12-05 07:50:01.000 UTC [123] LOG:  starting PostgreSQL 15.8 on x86_64-pc-linux-gnu
2026-12-05 07:50:01.001 UTC [123] LOG:  could not bind IPv4 address "127.0.0.1": Address already in use
2026-12-05 07:50:01.001 UTC [123] HINT:  Is another postmaster already running on port 5432?
2026-12-05 07:50:01.002 UTC [123] FATAL:  could not create any TCP/IP sockets
"""
PYTHON_LOG = """\
[2026-12-05 07:50:01 +0000] [77] [INFO] Starting gunicorn 23.0.0
Traceback (most recent call last):
  File "/x/sqlalchemy/engine/base.py", line 145, in __init__
sqlalchemy.exc.OperationalError: (psycopg.OperationalError) connection refused
[2026-12-05 07:50:02 +0000] [77] [INFO] Shutting down: Master
"""


@pytest.mark.parametrize("log, cause", [
    (SEAWEED_LOG, "Port allocation failed: port 9000 for S3 (specified by flag s3.port) is not available on "
                  "127.0.0.1 and cannot be used"),
    (POSTGRES_LOG, '2026-12-05 07:50:01.001 UTC [123] LOG:  could not bind IPv4 address "127.0.0.1": Address '
                   'already in use'),
    (POSTGRES_LOG.replace("Address already in use", "Permission denied"),
     "2026-12-05 07:50:01.002 UTC [123] FATAL:  could not create any TCP/IP sockets"),
    (PYTHON_LOG, "sqlalchemy.exc.OperationalError: (psycopg.OperationalError) connection refused"),
    ("\x1b[31m╔═══╗\x1b[0m\n\nsegmentation fault\n", "segmentation fault"),
    ("", ""),
], ids=["seaweedfs-port", "postgres-port", "postgres-fatal", "python-traceback", "last-line", "empty"])
def test_a_childs_log_gives_its_first_meaningful_line(log, cause):
    assert service.log_cause(log) == cause


def test_a_child_that_exits_is_reported_with_the_cause_from_this_start_only(tmp_path):
    (tmp_path / service.LOG).write_text("E1205 07:00:00.000000 mini.go:1 an earlier start's failure\n")
    child = "import sys; print('starting'); print('E1205 07:48:49.943514 mini.go:1244 the cause'); sys.exit(3)"
    weed = service.Service("S3 server", "an", program="weed mini", module="m", error=s3_server.S3ServerError)
    with pytest.raises(s3_server.S3ServerError) as err:
        weed.spawn([sys.executable, "-c", child], folder=tmp_path, env=dict(os.environ), ready=lambda: False,
                   unready="never", timeout=60)
    assert str(err.value) == f"weed mini exited with 3: the cause (log: {tmp_path / service.LOG})"


def test_the_s3_servers_port_in_use_is_refused_before_weed_starts(tmp_path):
    """As the tracking server's (above): one line naming --port, nothing made. (A weed that exits at start for
    another reason is reported with its log's cause: test_a_childs_log_gives_its_first_meaningful_line.)"""
    folder = tmp_path / "s3"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "pipelines.team.s3_server", "--folder", str(folder), "--port",
                               str(port), "--detach"], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"error: --port {port}: something already listens on 127.0.0.1:{port}; choose another port"])
    assert not folder.exists()  # nothing of it runs, is recorded or made


def test_default_permission_without_auth_is_refused_before_postgres_starts(tmp_path):
    with pytest.raises(mlflow_server.ServerError) as err:
        mlflow_server.start(tmp_path / "server", port=free_port(), default_permission="NO_PERMISSIONS")
    assert str(err.value) == ("--default-permission NO_PERMISSIONS: auth is off (a loopback --host without --auth); "
                              "add --auth")
    assert not (tmp_path / "server").exists()


def test_the_s3_server_off_loopback_needs_its_public_url_and_users_must_exist(tmp_path):
    """Off loopback the bind address is not what teammates reach (0.0.0.0, or an address behind a name): the
    URL they use is asked for. Removing a user nobody made names the folder and who exists."""
    with pytest.raises(s3_server.S3ServerError) as err:
        s3_server.start(tmp_path / "s3", host="0.0.0.0", port=9000)
    assert str(err.value) == ("--public-url: required with --host 0.0.0.0: the address teammates reach this "
                              "server by, e.g. --public-url http://s3.example:9000")
    assert not (tmp_path / "s3").exists()
    with pytest.raises(s3_server.S3ServerError) as err:
        s3_server.user(tmp_path / "s3", "bob", remove=True)
    assert str(err.value) == f"user bob: no such S3 user in {(tmp_path / 's3').resolve()} (users: none)"
    with pytest.raises(s3_server.S3ServerError) as err:
        s3_server.user(tmp_path / "s3", "Bob;rm")
    assert str(err.value).startswith("user: 'Bob;rm' is not a user name")


# --- class 7: hints that point the wrong way ---------------------------------------------------------------------

INT64_ABOVE = "an integer at most 2**63-1 (numpy and torch hold it as int64)"


def _compose(tmp_path, capsys, *overrides: str) -> tuple[int, list[str]]:
    """``python -m pipelines.compose OVERRIDES --out tmp`` in-process from the repository root: (exit code, stderr
    lines); the output must stay as it was."""
    out = tmp_path / "params.yaml"
    out.write_text("previous: params\n")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with pytest.raises(SystemExit) as stop:
            cli.run(compose.main, [*overrides, "--out", str(out)])
    finally:
        os.chdir(cwd)
    assert out.read_text() == "previous: params\n"
    return stop.value.code, [line.replace(str(out), "{out}") for line in capsys.readouterr().err.splitlines()]


COMPOSED = "error: {out} (composed from conf/): "


@pytest.mark.parametrize("overrides, expected", [
    (["dataset=coco", "profile=ci"], COMPOSED + "dataset.train_size: unknown key (expected one of: name, train_images, "
     "train_annotations, val_images, val_annotations, max_image_pixels, max_damaged_images); profile=ci sets it "
     "(conf/profile/ci.yaml), a profile for dataset=synthetic"),
    (["modle=fcos_r50"], "error: conf/: override 'modle=fcos_r50': no such key or config group in conf/; did you mean "
     "model=fcos_r50 (config groups: augment, dataset, model, profile, solver)?"),
    (["train.min_size_train=[128]"], "error: conf/: override 'train.min_size_train=[128]': no such key or config "
     "group in conf/; did you mean model.min_size_train?"),
    (["train.max_iters=10"], "error: conf/: override 'train.max_iters=10': no such key or config group in conf/; "
     "did you mean train.max_iter=10?"),
    (["dataset=coco", "dataset.train_size=16"], "error: conf/: override 'dataset.train_size=16': no such key or "
     "config group in conf/; dataset.train_size is a key of dataset=synthetic"),
    (["train.max_iter=1e20"], COMPOSED + f"train.max_iter: expected {INT64_ABOVE}, got 1e+20"),
], ids=["ci-profile-on-coco", "group-typo", "key-of-another-section", "key-typo", "dataset-key-of-another-dataset",
        "max-iter-1e20"])
def test_compose_hints_name_what_was_meant(tmp_path, capsys, overrides, expected):
    assert _compose(tmp_path, capsys, *overrides) == (2, [expected])


@pytest.mark.parametrize("value, expected", [
    (-5, "expected at least 1 iteration, got -5"),
    (-(10**20), "expected at least 1 iteration, got -100000000000000000000"),
    (10**20, f"expected {INT64_ABOVE}, got 100000000000000000000"),
    (1e20, f"expected {INT64_ABOVE}, got 1e+20"),
    (2.5, "expected an integer, got 2.5"),
    (1e3, "expected an integer, got 1000.0 (write 1000: no decimal point or exponent)"),
    (True, "expected an integer, got true"),
    ("ten", "expected an integer, got 'ten'"),
], ids=["minus-5", "minus-1e20-int", "1e20-int", "1e20", "float", "whole-float", "bool", "word"])
def test_an_integer_out_of_range_names_the_bound_that_matters_for_its_field(base_params, value, expected):
    params = yaml.safe_load(yaml.safe_dump(base_params))
    set_dotted(params, "train.max_iter", value)
    with pytest.raises(ConfigError) as err:
        params_from_dict(params, source="params.yaml")
    assert str(err.value) == f"params.yaml: train.max_iter: {expected}"


@pytest.mark.parametrize("key, value, expected", [
    ("loader.num_workers", -(2**63) - 1, "loader.num_workers: expected an integer >= 0, got -9223372036854775809"),
    ("evaluate.bootstrap", 10**20, "evaluate.bootstrap: expected a number of image resamples from 0 (no intervals) "
                                   "to 100000, got 100000000000000000000"),
    ("train.min_size_train", [128], "train.min_size_train: unknown key (expected one of: {train}); did you mean "
                                    "model.min_size_train?"),
    ("model.train_size", 16, "model.train_size: unknown key (expected one of: {model}); did you mean "
                             "dataset.train_size?"),
    ("evaluate.tta", "maybe", "evaluate.tta: expected true or false, got 'maybe'"),
    ("train.base_lr", "fast", "train.base_lr: expected a number, got 'fast'"),
], ids=["workers-below-int64", "bootstrap-above-int64", "train-key-of-model", "model-key-of-dataset", "bool-word",
        "float-word"])
def test_params_hints_name_the_fields_own_bound_or_section(base_params, key, value, expected):
    import dataclasses

    from pipelines.config.schema import Model, Train

    params = yaml.safe_load(yaml.safe_dump(base_params))
    set_dotted(params, key, value)
    with pytest.raises(ConfigError) as err:
        params_from_dict(params, source="params.yaml")
    fields = {name: ", ".join(f.name for f in dataclasses.fields(kind)) for name, kind in (("train", Train),
                                                                                           ("model", Model))}
    assert str(err.value) == "params.yaml: " + expected.format(**fields)


def test_a_profile_key_on_another_dataset_names_the_profile_also_where_dvc_composed_it(base_params):
    """``dvc exp run -S dataset=coco -S profile=ci`` composes params.yaml itself: the stage's validation says it."""
    from pipelines.config.presets import group_presets

    params = yaml.safe_load(yaml.safe_dump(base_params))
    params["dataset"] = {**group_presets("dataset")["coco"], "train_size": 16, "val_size": 8}
    with pytest.raises(ConfigError) as err:
        params_from_dict(params, source="params.yaml")
    assert str(err.value).endswith("; profile=ci sets it (conf/profile/ci.yaml), a profile for dataset=synthetic")
    params["dataset"] = {**group_presets("dataset")["coco"], "num_classes": 5}  # no profile sets it: no hint
    with pytest.raises(ConfigError) as err:
        params_from_dict(params, source="params.yaml")
    assert str(err.value).endswith("max_image_pixels, max_damaged_images)")


def test_a_train_nproc_that_cannot_fit_is_refused_before_any_process_starts(tmp_path, capsys, monkeypatch,
                                                                            base_params):
    params = yaml.safe_load(yaml.safe_dump(base_params))
    set_dotted(params, "train.nproc", 64)
    set_dotted(params, "train.ims_per_batch", 64)
    set_dotted(params, "evaluate.ims_per_batch", 64)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    load_params(path)  # valid params: the machine is what refuses them
    with pytest.raises(launch.ConfigError) as err:
        launch.refuse_unfit(64, str(path), memory=24 * 2**30, cores=2)
    assert str(err.value) == (f"{path}: train.nproc: 64 processes need at least 32.0 GiB of memory (512 MiB each: "
                              "docs/hardware.md), this machine has 24.0 GiB and 2 cores; expected at most 48 processes "
                              "(2: one per core)")
    # GPU nodes and multi-node runs: the rule is per node and counts host memory only
    launch.refuse_unfit(8, str(path), memory=64 * 2**30, cores=32)
    launch.refuse_unfit(2, str(path), memory=2 * 2**30, cores=1)
    if (launch.memory_bytes() or 0) < 64 * launch.PROCESS_MEMORY_MIB * 2**20:  # this machine, through the launcher
        handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}  # the launcher sets its own
        try:
            with pytest.raises(SystemExit) as stop:
                cli.run(launch.main, ["--params", str(path), "stages.train"])
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        assert stop.value.code == 2 and capsys.readouterr().err.startswith(f"error: {path}: train.nproc: 64 processes")
    monkeypatch.setattr(launch, "memory_bytes", lambda: None)
    launch.refuse_unfit(64, str(path))  # memory unknown: nothing refused


def test_memory_is_capped_by_the_cgroup_limit(tmp_path):
    (tmp_path / "memory" / "job").mkdir(parents=True)
    (tmp_path / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    (tmp_path / "cgroup").write_text("4:memory:/job\n0::/\n")
    assert launch.memory_bytes(tmp_path, tmp_path / "cgroup") == 2**30  # v1
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "cgroup").write_text("0::/\n")
    assert launch.memory_bytes(tmp_path, tmp_path / "cgroup") > 2**30  # v2 without a limit: the machine's


@pytest.mark.parametrize("uri", ["file:///tmp/mlruns", "mlruns", "/abs/mlruns"])
def test_mlflows_file_store_is_named_as_the_setting_to_change(monkeypatch, uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    expected = (f"MLFLOW_TRACKING_URI={uri}: MLflow's file store is not supported here (MLflow keeps it in maintenance "
                "mode); expected sqlite:///ABSOLUTE/PATH/mlflow.db, http(s)://HOST:PORT of a tracking server, or "
                "nothing (the repository's mlflow.db)")
    from pipelines.tracking.registry import Registry
    from pipelines.tracking.tracker import Tracker

    for start in (lambda: Tracker.start(experiment="detection", params={}), lambda: Tracker.resume("0" * 32),
                  lambda: store.get_run("0" * 32), lambda: Registry(create=True)):
        with pytest.raises(TrackingError) as err:
            start()
        assert str(err.value) == expected
    assert store.store_status() == expected.removeprefix("MLflow store ")  # the machine report's line
    for fine in ("sqlite:////abs/mlflow.db", "http://127.0.0.1:5000", "https://mlflow.example", "postgresql://u@h/db"):
        store.refuse_file_store(fine)
