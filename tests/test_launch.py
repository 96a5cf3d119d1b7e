"""The launcher in front of torchrun's elastic launch: one line per failure, exit code 2, no torchrun block.
Most tests run twice: with two processes (torchrun's agent) and with one (which the launcher starts itself)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO


def _params(folder: Path, nproc: int) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["nproc"] = nproc
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


@pytest.fixture(scope="module")
def params(tmp_path_factory) -> Path:
    """Two processes."""
    return _params(tmp_path_factory.mktemp("launch"), 2)


@pytest.fixture(scope="module", params=[2, 1], ids=["two-processes", "one-process"])
def group(request, tmp_path_factory) -> tuple[Path, int]:
    """``(params, train.nproc)``: two processes, then one."""
    return _params(tmp_path_factory.mktemp("launch"), request.param), request.param


def _launch(params, *args, debug=False, timeout=120, tmpdir=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINES_DEBUG", "PIPELINES_LAUNCHED")}
    env["PYTHONPATH"] = str(REPO)
    if debug:
        env["PIPELINES_DEBUG"] = "1"
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-m", "pipelines.launch", "--params", str(params), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _start(params, *args, tmpdir=None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINES_DEBUG", "PIPELINES_LAUNCHED")}
    env["PYTHONPATH"] = str(REPO)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.Popen([sys.executable, "-m", "pipelines.launch", "--params", str(params), *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    """``pid``'s children now (threads that end while they are read are passed over)."""
    children = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return children


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _error_lines(done):
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def test_a_successful_group_exits_0_and_leaves_no_temporary_folder(group, tmp_path):
    params, _ = group
    done = _launch(params, "tests.launch_probe", "--fail", "none", tmpdir=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not _error_lines(done) and "Traceback" not in done.stderr
    assert not list(tmp_path.glob("torchelastic_*"))  # torch's agent would leave its error-file folder


def test_a_user_error_on_one_rank_is_one_line_and_exit_code_2(group, tmp_path):
    params, _ = group
    done = _launch(params, "tests.launch_probe", "--fail", "user-error", tmpdir=tmp_path)
    assert done.returncode == 2
    assert _error_lines(done) == ["error: images/x.jpg: image id 7: unreadable image (probe)"]
    assert "ChildFailedError" not in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.glob("torchelastic_*"))  # the error files were read, then removed


def test_a_bug_is_one_line_naming_the_exception(params):
    done = _launch(params, "tests.launch_probe", "--fail", "bug")
    assert done.returncode == 2
    assert _error_lines(done) == ["error: unexpected ZeroDivisionError: division by zero (probe) "
                                  "(set PIPELINES_DEBUG=1 for the traceback)"]
    assert "Traceback" not in done.stderr


def test_a_killed_process_is_named_with_its_signal(group):
    params, nproc = group
    done = _launch(params, "tests.launch_probe", "--fail", "sigkill")
    assert done.returncode == 2
    lines = _error_lines(done)
    assert len(lines) == 1 and lines[0].startswith(f"error: process rank {nproc - 1} (pid ")
    assert "killed by SIGKILL" in lines[0]


@pytest.mark.parametrize("group", [1], indirect=True, ids=["one-process"])
def test_a_run_left_running_by_a_killed_process_is_closed_as_killed(group, tmp_path):
    """The run file names the run a process had open when it was killed: the launcher ends that run KILLED.
    One process, which the launcher starts itself (tests/test_pipeline.py kills one of two, under torchrun's
    agent)."""
    import mlflow

    params, _ = group
    store, run_file = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINES_DEBUG", "PIPELINES_LAUNCHED")}
    done = subprocess.run([sys.executable, "-m", "pipelines.launch", "--params", str(params), "--run-file", str(run_file),
                           "tests.launch_probe", "--fail", "sigkill"], cwd=REPO,
                          env={**env, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": store},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and "killed by SIGKILL" in done.stderr, done.stderr[-2000:]
    run_id = json.loads(run_file.read_text())["run_id"]
    assert mlflow.MlflowClient(store).get_run(run_id).info.status == "KILLED"


def test_debug_shows_torchruns_report(params):
    done = _launch(params, "tests.launch_probe", "--fail", "user-error", debug=True)
    assert done.returncode != 0 and "ChildFailedError" in done.stderr


def test_bad_params_stop_before_any_process_starts(params, tmp_path):
    bad = yaml.safe_load(params.read_text())
    bad["train"]["ims_per_batch"] = 7
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(bad))
    done = _launch(path, "tests.launch_probe", "--fail", "none", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: {path}: train.ims_per_batch: expected a multiple of the number of "
                                   "processes (train.nproc = 2), got 7")


def _workers(launcher: subprocess.Popen, nproc: int, settle_s: float = 2.0) -> list[int]:
    deadline = time.monotonic() + 60
    while len(workers := _children(launcher.pid)) < nproc and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(workers) == nproc
    time.sleep(settle_s)  # both have started
    return workers


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_while_the_group_runs_stops_it_in_one_line(group, signum):
    params, nproc = group
    launcher = _start(params, "tests.launch_probe", "--fail", "sleep")
    workers = _workers(launcher, nproc)
    launcher.send_signal(signum)
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signum
    assert _error_lines(subprocess.CompletedProcess([], 0, stdout, stderr)) == [f"error: stopped by {signum.name}"]
    assert not any(_alive(pid) for pid in workers)  # the launcher stopped the processes it started


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_alive, pids))


def test_a_launcher_killed_with_sigkill_takes_its_processes_with_it(group, tmp_path):
    """What the OOM killer does: the launcher cannot stop anyone, so its processes must die by themselves,
    at once, even while they are still importing torch (seconds of CPU); the agent's log folder that it
    could not remove goes at the next launch."""
    params, nproc = group
    launcher = _start(params, "tests.launch_probe", "--fail", "sleep", tmpdir=tmp_path)
    workers = _workers(launcher, nproc, settle_s=0.5)
    launcher.kill()
    launcher.wait(timeout=10)
    assert _gone_within(workers, 5)
    assert [p.name.split("_")[2] for p in tmp_path.glob("torchelastic_*")] == [str(launcher.pid)]
    done = _launch(params, "tests.launch_probe", "--fail", "none", tmpdir=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not list(tmp_path.glob("torchelastic_*"))


def test_a_launcher_started_by_dvc_dies_with_dvc(group, tmp_path):
    """DVC runs a stage's command through ``$SHELL -c``; once ``dvc`` is gone (and with it the stage's
    lock) the launcher and its processes go too. A stand-in for dvc that sets ``DVC_STAGE`` as dvc does."""
    params, nproc = group
    command = f"{sys.executable} -m pipelines.launch --params {params} tests.launch_probe --fail sleep"
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINES_DEBUG", "PIPELINES_LAUNCHED")}
    dvc = subprocess.Popen([sys.executable, "-c", f"import subprocess; subprocess.run(['sh', '-c', {command!r} + '; true'])"],
                           cwd=REPO, env={**env, "PYTHONPATH": str(REPO), "DVC_STAGE": "train", "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # dvc -> sh (which waits: the '; true') -> launcher -> its processes
        family = [pid for shell in _children(dvc.pid) for pid in _children(shell)]
        family += [pid for launcher in family for pid in _children(launcher)]
        if len(family) == 1 + nproc:
            break
        time.sleep(0.1)
    assert len(family) == 1 + nproc
    time.sleep(2)
    dvc.kill()
    dvc.wait(timeout=10)
    assert _gone_within(family, 5)


def test_a_late_sigterm_is_never_a_silent_death(group, tmp_path):
    """However late a stop signal comes while the launcher ends (the processes done, the agent closing,
    Python shutting down), the exit is 0 (the work is done) or the one stop line: never death by signal."""
    params, _ = group
    for attempt in range(3):
        done_file = tmp_path / f"done{attempt}"
        launcher = _start(params, "tests.launch_probe", "--fail", "none", "--done-file", str(done_file))
        while not done_file.exists() and launcher.poll() is None:
            time.sleep(0.005)
        time.sleep(0.05 * attempt)
        while launcher.poll() is None:  # signal it again and again until it has ended
            launcher.send_signal(signal.SIGTERM)
            time.sleep(0.01)
        stdout, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode in (0, 128 + signal.SIGTERM), stderr[-2000:]
        assert "death signal" not in stderr  # torchrun's agent log stays quiet
        if launcher.returncode:
            assert _error_lines(subprocess.CompletedProcess([], 0, stdout, stderr)) == ["error: stopped by SIGTERM"]
