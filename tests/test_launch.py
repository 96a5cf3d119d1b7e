"""The launcher in front of torchrun's elastic launch: one line per failure, exit code 2, no torchrun block."""

import os
import subprocess
import sys

import pytest
import yaml

from .conftest import REPO


@pytest.fixture(scope="module")
def params(tmp_path_factory):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["nproc"] = 2
    path = tmp_path_factory.mktemp("launch") / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def _launch(params, *args, debug=False, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINES_DEBUG", "PIPELINES_LAUNCHED")}
    env["PYTHONPATH"] = str(REPO)
    if debug:
        env["PIPELINES_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-m", "pipelines.launch", "--params", str(params), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _error_lines(done):
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def test_a_successful_group_exits_0(params):
    done = _launch(params, "tests.launch_probe", "--fail", "none")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not _error_lines(done) and "Traceback" not in done.stderr


def test_a_user_error_on_one_rank_is_one_line_and_exit_code_2(params):
    done = _launch(params, "tests.launch_probe", "--fail", "user-error-on-rank-1")
    assert done.returncode == 2
    assert _error_lines(done) == ["error: images/x.jpg: image id 7: unreadable image (probe)"]
    assert "ChildFailedError" not in done.stderr and "Traceback" not in done.stderr


def test_a_bug_is_one_line_naming_the_exception(params):
    done = _launch(params, "tests.launch_probe", "--fail", "bug-on-rank-1")
    assert done.returncode == 2
    assert _error_lines(done) == ["error: unexpected ZeroDivisionError: division by zero (probe) "
                                  "(set PIPELINES_DEBUG=1 for the traceback)"]
    assert "Traceback" not in done.stderr


def test_a_killed_process_is_named_with_its_signal(params):
    done = _launch(params, "tests.launch_probe", "--fail", "sigkill-rank-1")
    assert done.returncode == 2
    lines = _error_lines(done)
    assert len(lines) == 1 and lines[0].startswith("error: process rank 1 (pid ") and "killed by SIGKILL" in lines[0]


def test_debug_shows_torchruns_report(params):
    done = _launch(params, "tests.launch_probe", "--fail", "user-error-on-rank-1", debug=True)
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
