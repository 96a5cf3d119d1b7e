"""File helpers: atomic writes, and output folders checked before long work starts (real full and
read-only file systems, mounted by the test where the machine allows it)."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipelines.errors import OutputError, Stopped
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


def _stop_after(monkeypatch, module, name: str, nth: int, when=lambda *args: True, before: bool = False):
    """Make ``module.name`` raise :class:`Stopped` right after its ``nth`` call for which ``when(*args)`` holds
    has done its work (``before``: instead of doing it): a stop signal landing between two bytecodes there."""
    real, calls = getattr(module, name), []

    def stopped_after(*args, **kwargs):
        if when(*args):
            calls.append(args)
        stop = len(calls) == nth and calls[-1] is args
        if stop and before:
            raise Stopped("stopped by SIGTERM")
        result = real(*args, **kwargs)
        if stop:
            raise Stopped("stopped by SIGTERM")
        return result

    monkeypatch.setattr(module, name, stopped_after)


@pytest.mark.parametrize("step", ["made the temporary folder", "moved the previous output aside",
                                  "moved the new output in", "removing the previous output"])
def test_a_stop_at_any_step_of_an_atomic_folder_leaves_one_whole_output_and_no_temporary(tmp_path, monkeypatch, step):
    """A stop signal raises where the stage happens to be; in the few bytecodes after the folder is made
    or between the two renames that commit it, it must neither leak ``.out.*`` nor lose the output."""
    from pipelines.fileio import atomic_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "file").write_text("previous")
    if step == "made the temporary folder":
        _stop_after(monkeypatch, os, "mkdir", 1, when=lambda name, *_: os.path.basename(name).startswith(".out."))
    elif step == "removing the previous output":
        _stop_after(monkeypatch, shutil, "rmtree", 1, when=lambda name, *_: ".out.old-" in str(name), before=True)
    else:
        _stop_after(monkeypatch, os, "rename", 1 if step == "moved the previous output aside" else 2)
    with pytest.raises(Stopped), atomic_dir(out) as tmp:
        (tmp / "file").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (out / "file").read_text() == ("previous" if step in ("made the temporary folder",
                                                                  "moved the previous output aside") else "new")


@pytest.mark.parametrize("step", ["linked the unnamed file", "created the named file", "replaced the output"])
def test_a_stop_at_any_step_of_an_atomic_file_leaves_one_whole_file_and_no_temporary(tmp_path, monkeypatch, step):
    """As above, for a file: written unnamed (O_TMPFILE) and linked under a temporary name, or named from the
    start where there is no O_TMPFILE, then renamed over the previous one."""
    from pipelines import fileio

    target = tmp_path / "f.json"
    atomic_write_bytes(target, b"previous")
    if step == "linked the unnamed file":
        _stop_after(monkeypatch, fileio, "_link_unnamed", 1)
    elif step == "created the named file":
        monkeypatch.setattr(fileio, "_unnamed_file", lambda folder: None)
        _stop_after(monkeypatch, os, "open", 1, when=lambda name, *_: os.path.basename(name).startswith(".f.json."))
    else:
        _stop_after(monkeypatch, os, "replace", 1)
    with pytest.raises(Stopped), atomic_file(target) as tmp:
        tmp.write_bytes(b"new")
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
    assert target.read_bytes() == (b"new" if step == "replaced the output" else b"previous")


def test_a_full_disk_during_any_atomic_write_is_one_line_and_keeps_the_previous_file(tmp_path):
    """On a real full file system: torch.save (which loses the errno: "[enforce fail at inline_container.cc:672]
    ..."), numpy's np.save (an OSError without errno: "... requested and ... written"), a plain write, and
    files written inside an atomic folder; each gives one OutputError naming the file, nothing is replaced and
    no temporary file stays."""
    import numpy as np
    import torch

    from pipelines.fileio import atomic_dir

    with _tmpfs(tmp_path / "full", "size=256k") as full:
        target = full / "model.pth"
        atomic_write_bytes(target, b"previous")

        def np_save(tmp):
            with open(tmp, "wb") as f:
                np.save(f, np.zeros(200_000))

        writes = {
            "torch.save": lambda tmp: torch.save({"w": torch.zeros(200_000)}, str(tmp)),
            "np.save": np_save,
            "write_bytes": lambda tmp: tmp.write_bytes(b"\0" * 2**20),
        }
        for name, write in writes.items():
            with pytest.raises(OutputError) as err, atomic_file(target) as tmp:
                write(tmp)
            assert str(err.value).startswith(f"{target}: no space left on device while writing it (more than "), name
            assert str(err.value).endswith(" free); nothing was replaced"), name
            assert target.read_bytes() == b"previous" and sorted(p.name for p in full.iterdir()) == ["model.pth"], name

        folder = full / "cache"
        with pytest.raises(OutputError) as err, atomic_dir(folder) as tmp:
            np.save(tmp / "boxes.npy", np.zeros(200_000))
        assert str(err.value).startswith(f"{folder}: no space left on device while writing it (more than ")
        with pytest.raises(OutputError) as err, atomic_dir(folder) as tmp:
            atomic_write_bytes(tmp / "train.json", b"\0" * 2**20)
        assert str(err.value).startswith(f"{folder}/train.json: no space left on device while writing it (about 1.0 MB "
                                         "needed, ")
        assert sorted(p.name for p in full.iterdir()) == ["model.pth"]


def test_torchvision_write_png_fails_silently_on_a_full_disk_so_the_preview_is_encoded_in_memory(tmp_path):
    """Why pipelines.data.preview does not use torchvision's write_png: on a full disk it leaves a truncated
    file without an error. The preview's own write reports it."""
    import torch
    from torchvision.io import encode_png, write_png

    from pipelines.data.preview import augmentation_preview

    noise = torch.randint(0, 256, (3, 400, 400), dtype=torch.uint8)
    with _tmpfs(tmp_path / "full", "size=64k") as full:
        write_png(noise, str(full / "silent.png"))  # no error, a truncated file
        assert (full / "silent.png").stat().st_size < len(encode_png(noise).numpy().tobytes())
        (full / "silent.png").unlink()

        class Samples:  # two samples of noise, as DetectionDataset gives them
            cache = type("Cache", (), {"categories": [{"id": 1, "name": "x"}]})()

            def __len__(self):
                return 2

            def __getitem__(self, key):
                return noise, {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}, key

        with pytest.raises(OutputError, match=r"preview\.png: no space left on device while writing it \(about "):
            augmentation_preview(Samples(), Samples(), count=2, iteration=0, path=full / "preview.png")
        assert list(full.iterdir()) == []


def test_a_stop_a_finaliser_swallowed_still_stops_the_stage_and_keeps_the_previous_output(tmp_path):
    """Python runs a signal handler between any two bytecodes, also inside a ``__del__``, where the raised
    :class:`Stopped` is dropped and the program runs on (how a stopped prepare once ran to the end and exited
    0). The recorded stop is raised again before the output is put in place, and the stage exits with it, in
    its one line: Python's "Exception ignored in ..." and its traceback are not printed for a stop."""
    program = f"""
import os, signal, sys
from pathlib import Path
from pipelines import cli
from pipelines.fileio import atomic_dir

class Finalised:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGHUP)  # the handler runs here, inside the finaliser
        for _ in range(1000):
            pass

def main(argv):
    with atomic_dir(Path({str(tmp_path / 'out')!r})) as tmp:
        (tmp / "file").write_text("new")
        Finalised()  # dropped at once: its __del__ swallows the stop
        Path({str(tmp_path / 'ran-on')!r}).write_text("written after the stop")

cli.run(main)
"""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file").write_text("previous")
    env = {k: v for k, v in os.environ.items() if k != "PIPELINES_DEBUG"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert (tmp_path / "ran-on").is_file()  # the finaliser did swallow it
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    assert done.stderr.splitlines() == ["error: stopped by SIGHUP"]  # no "Exception ignored", no traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ran-on"]
    assert (tmp_path / "out" / "file").read_text() == "previous"
