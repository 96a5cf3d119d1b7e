"""File helpers: atomic writes, and output folders checked before long work starts (real full and
read-only file systems, mounted by the test where the machine allows it)."""

import contextlib
import os
import subprocess
import uuid

import pytest

from pipelines.errors import OutputError
from pipelines.fileio import atomic_file, atomic_write_bytes, check_writable


@contextlib.contextmanager
def _tmpfs(path, options: str):
    """A small tmpfs at ``path`` (root only); skips the test where mounting is not allowed."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_file_system_is_reported_in_words_before_writing(tmp_path):
    with _tmpfs(tmp_path / "full", "size=1m") as full:
        check_writable(full / "out", needed_bytes=100_000)
        with pytest.raises(OutputError, match=r"out: No space left on device for the outputs \(about 10 MB needed, "
                                              r"1 MB free\)$"):
            check_writable(full / "out", needed_bytes=10 * 2**20)


def test_a_read_only_file_system_is_reported_in_words(tmp_path):
    with _tmpfs(tmp_path / "ro", "size=1m,ro") as read_only:
        with pytest.raises(OutputError, match=r"ro/out: cannot write there \(Read-only file system\)$"):
            check_writable(read_only / "out")


def test_a_folder_under_a_file_is_reported(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match=r"file/out: cannot write there \(Not a directory\)$"):
        check_writable(tmp_path / "file" / "out")


def test_atomic_writes_leave_the_old_file_on_failure_and_use_normal_permissions(tmp_path):
    target = tmp_path / "f.json"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("crash while writing")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    umask = os.umask(0)
    os.umask(umask)
    name = tmp_path / f"{uuid.uuid4().hex}.bin"
    atomic_write_bytes(name, b"new")
    assert name.stat().st_mode & 0o777 == 0o666 & ~umask
