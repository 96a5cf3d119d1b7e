"""Bad state where the stages keep their own: special files in place of params or a run file, a full disk
while logging (split from test_bad_input.py)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from .conftest import REPO


# --- processes and state: special files where the stages keep their own state, a full disk mid-log ---


def test_a_fifo_in_place_of_params_or_a_run_file_is_refused_without_blocking(tmp_path):
    params = tmp_path / "params.yaml"
    os.mkfifo(params)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "stages.prepare", "--params", str(params), "--out", str(tmp_path / "p"),
                           "--metrics", str(tmp_path / "m.json")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {params}: not a regular file; expected the parameters (YAML)"

    from pipelines.errors import TrackingError
    from pipelines.tracking.run import read_run_file, read_run_id

    assert read_run_file(params) == {}  # the train stage then starts a new run; it never blocks
    with pytest.raises(TrackingError, match="not a regular file; expected the run file of the train stage"):
        read_run_id(params)


def test_a_full_disk_while_logging_a_training_row_is_one_line_naming_the_log(tmp_path):
    import errno

    from pipelines.engine import MetricLog
    from pipelines.errors import OutputError

    log = MetricLog(tmp_path / "train_log.csv")
    log.write({"iteration": 1, "loss": 1.0})

    class Full:
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

    log._writer = csv.DictWriter(Full(), fieldnames=["iteration", "loss"])
    with pytest.raises(OutputError, match=rf"^{tmp_path / 'train_log.csv'}: cannot write the training log \(No space "
                                          r"left on device\); the last checkpoint is kept"):
        log.write({"iteration": 2, "loss": 0.5})
