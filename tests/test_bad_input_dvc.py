"""Bad input that DVC reads before any stage of ours runs (``python -m pipelines.check``, run by ``make pipeline``),
and outputs that cannot be written where they go (every stage checks them before its work): issue 38,
classes 1 and 5."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .conftest import COCO_REAL, REPO, require

# --- what DVC reads: its lock, params.yaml, dvc.yaml, every path it hashes ---


@pytest.fixture
def project(tmp_path, base_params):
    """A project root with the real dvc.yaml and a params.yaml for a tiny COCO dataset on disk: ``(root, params
    dict, train image folder)``. Nothing of the stages is there (DVC would see the code as missing)."""
    data = tmp_path / "data_in"
    for split in ("train", "val"):
        (data / split).mkdir(parents=True)
        (data / split / "a.jpg").write_bytes(b"\xff\xd8\xff")  # the check never decodes: DVC only hashes
        (data / f"{split}.json").write_text("{}")
    params = json.loads(json.dumps(base_params))
    params["dataset"] = {"name": "coco", "train_images": str(data / "train"), "val_images": str(data / "val"),
                         "train_annotations": str(data / "train.json"),
                         "val_annotations": str(data / "val.json"), "max_image_pixels": 2**28,
                         "max_damaged_images": 0}
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    write_params(root, params)
    return root, params, data / "train"


def write_params(root: Path, params: dict) -> None:
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def check(root: Path) -> int:
    from pipelines.check import check as check_
    return check_(root / "params.yaml", root / "dvc.yaml")


def test_the_good_path_passes_fast_on_the_default_dataset_and_on_real_images(project, base_params, tmp_path):
    from pipelines.check import check as check_

    started = time.perf_counter()
    assert check_(REPO / "params.yaml", REPO / "dvc.yaml") > 10  # the code DVC hashes, at least
    assert time.perf_counter() - started < 2.0

    root, params, _ = project
    assert check(root) == 4  # two images and two annotation files
    real = require(COCO_REAL)
    params["dataset"].update(train_images=str(real / "images"), val_images=str(real / "images"),
                             train_annotations=str(real / "annotations" / "instances.json"),
                             val_annotations=str(real / "annotations" / "instances.json"))
    write_params(root, params)
    started = time.perf_counter()
    assert check(root) == 2 * (len(list((real / "images").iterdir())) + 1)
    assert time.perf_counter() - started < 2.0


def test_a_yaml_alias_bomb_in_params_is_refused_in_one_line_before_dvc_spins_on_it(project):
    from pipelines.errors import ConfigError

    root, _, _ = project
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefg", "bcdefgh")]
    with (root / "params.yaml").open("a") as f:
        f.write("\n".join(lines) + "\n")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^.*params\.yaml:\d+:\d+: YAML aliases expand this to more than 100000 values"):
        check(root)
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("content, expected", [
    (None, r"params\.yaml: file not found"),
    ("", r"params\.yaml: empty; expected the parameters \(python -m pipelines\.compose writes them from conf/\)"),
    ("- 1\n- 2\n", r"params\.yaml: expected a mapping of sections at the top level"),  # unnamed: not a mapping
    ("seed: 0\nseed: 1\n", r"params\.yaml:2:1: not valid YAML: found duplicate key seed"),  # unnamed: a key twice
])
def test_a_missing_empty_listed_or_repeating_params_file_is_one_line(project, content, expected):
    from pipelines.errors import ConfigError

    root, _, _ = project
    if content is None:
        (root / "params.yaml").unlink()
    else:
        (root / "params.yaml").write_text(content)
    with pytest.raises(ConfigError, match=expected):
        check(root)


def test_a_fifo_among_the_images_is_named_with_its_dataset_key_without_blocking(project):
    from pipelines.errors import DatasetError

    root, _, images = project
    os.mkfifo(images / "b.jpg")
    with pytest.raises(DatasetError, match=rf"^{images / 'b.jpg'}: not a regular file \(a FIFO\), in {images} "
                                           r"\(\$\{dataset\.train_images\}\), which DVC hashes for stage prepare; DVC "
                                           r"would wait on it for ever"):
        check(root)


def test_a_socket_a_device_a_symlink_loop_or_a_broken_symlink_among_the_images_is_named(project):
    from pipelines.errors import DatasetError

    root, _, images = project
    sub = images / "nested"
    sub.mkdir()
    listener = socket.socket(socket.AF_UNIX)
    cases = [
        (lambda p: listener.bind(str(p)), r"not a regular file \(a socket\)"),
        (lambda p: p.symlink_to("/dev/zero"), r"not a regular file \(a character device\)"),
        (lambda p: p.symlink_to(p.name), r"a symlink loop"),
        (lambda p: p.symlink_to("gone.jpg"), r"a broken symlink \(to gone\.jpg\)"),
    ]
    for make, expected in cases:
        path = sub / "c.jpg"
        make(path)
        with pytest.raises(DatasetError, match=rf"^{path}: {expected}, in {images} "):
            check(root)
        path.unlink()
    listener.close()
    check(root)


def test_a_missing_dataset_folder_or_a_bad_dvc_yaml_is_one_line(project):
    from pipelines.errors import ConfigError, DatasetError

    root, params, images = project
    shutil.rmtree(images)
    with pytest.raises(DatasetError, match=rf"params\.yaml: dataset\.train_images: {images}: not found; expected the "
                                           "train split's image folder"):
        check(root)
    images.write_text("")
    with pytest.raises(DatasetError, match="dataset.train_images: .*: not a folder"):
        check(root)
    images.unlink()
    images.mkdir()

    dvc_yaml = root / "dvc.yaml"
    dvc_yaml.unlink()
    os.mkfifo(dvc_yaml)
    with pytest.raises(ConfigError, match=r"dvc\.yaml: not a regular file \(a FIFO\); expected the pipeline \(YAML\)"):
        check(root)
    dvc_yaml.unlink()
    dvc_yaml.write_text("stages:\n  prepare:\n    deps:\n      - ${dataset.nothing}\n")
    with pytest.raises(ConfigError, match=r"dvc\.yaml: stages\.prepare\.deps: \$\{dataset\.nothing\}: defined neither"):
        check(root)
    dvc_yaml.write_text("stages: [\n")
    with pytest.raises(ConfigError, match=r"dvc\.yaml:2:1: not valid YAML"):
        check(root)


def write_lock(root: Path, *holders: tuple[str, int, str]) -> Path:
    lock: dict = {"write": {}, "read": {}}
    for mode, pid, cmd in holders:
        info = {"pid": pid, "cmd": cmd}
        if mode == "write":
            lock["write"][str(root / "data" / "prepared")] = info
        else:
            lock["read"].setdefault(str(root / "params.yaml"), []).append(info)
    path = root / ".dvc" / "tmp" / "rwlock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(lock))
    return path


def test_a_lock_held_by_a_zombie_names_it_its_parent_and_the_command_that_clears_it(project):
    from pipelines.check import LockError, process_state

    root, _, _ = project
    child = subprocess.Popen(["true"])  # not waited for: a zombie until it is
    try:
        for _ in range(200):
            if (process_state(child.pid) or ("",))[0] == "Z":
                break
            time.sleep(0.01)
        lock = write_lock(root, ("write", child.pid, "/venv/bin/dvc repro"))
        with pytest.raises(LockError, match=rf"^{lock}: a stale lock: pid {child.pid} \(`/venv/bin/dvc repro`\) is a "
                                            rf"zombie: it has exited, but its parent, pid {os.getpid()} \(`.*`\), has "
                                            rf"not reaped it, so DVC counts it as running; no dvc holds it: clear it "
                                            rf"with `rm {lock}`$"):
            check(root)
    finally:
        child.wait()
    check(root)  # reaped: DVC removes the entry itself


def test_a_lock_whose_pid_is_reused_or_held_by_a_running_dvc_or_corrupt_is_named(project):
    from pipelines.check import LockError

    root, _, _ = project
    lock = write_lock(root, ("read", os.getpid(), "/venv/bin/dvc status"))  # this pid runs pytest, not dvc
    with pytest.raises(LockError, match=rf"a stale lock: pid {os.getpid()} \(`/venv/bin/dvc status`\) has exited and "
                                        rf"its pid is now `.*`, which DVC takes for the holder; .*`rm {lock}`$"):
        check(root)

    running = subprocess.Popen(["sleep", "30"])
    try:
        write_lock(root, ("read", running.pid, "sleep 30"))
        check(root)  # a running reader does not stop a repro's readers
        write_lock(root, ("write", running.pid, "sleep 30"))
        with pytest.raises(LockError, match=rf"a running dvc, pid {running.pid} \(`sleep 30`\), holds a write lock on "
                                            r"this pipeline's outputs; wait for it to end"):
            check(root)
    finally:
        running.kill()
        running.wait()

    lock.write_text('{"write": {')  # unnamed: DVC says "Unable to read RWLock-file" to every command
    with pytest.raises(LockError, match=rf"{lock}: not DVC's lock format \(.*\); DVC refuses every command while it "
                                        rf"is so; if no dvc command is running here, clear it with `rm {lock}`"):
        check(root)


def test_the_command_line_is_one_line_exit_2_without_torch_and_make_pipeline_runs_it_first(project):
    root, _, images = project
    os.mkfifo(images / "b.jpg")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = ("import atexit, runpy, sys; sys.argv = ['check', *sys.argv[1:]]\n"
            "atexit.register(lambda: print('torch' in sys.modules))\n"  # the check ends the process itself
            "runpy.run_module('pipelines.check', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, "--params", str(root / "params.yaml"), "--dvc-file",
                           str(root / "dvc.yaml")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {images / 'b.jpg'}: not a regular file (a FIFO)")
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout.strip() == "False"

    makefile = (REPO / "Makefile").read_text()
    assert "pipeline: install\n\tpython -m pipelines.check && dvc repro\n" in makefile


# --- where we cannot write: every stage checks its outputs before its work ---


def refuse_probe(monkeypatch, code: int, under: Path) -> None:
    """Make the writability probe fail with ``code`` in folders under ``under`` (as a read-only mount, a denied
    folder or a full disk would), elsewhere work as before."""
    import tempfile

    from pipelines import fileio

    real = tempfile.TemporaryFile

    def probe(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve().is_relative_to(under.resolve()):
            raise OSError(code, os.strerror(code))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(fileio.tempfile, "TemporaryFile", probe)


def stage_argv(stage: str, tmp: Path, out: Path) -> list[str]:
    inputs = {"cache": tmp / "cache", "prepared": tmp / "prepared", "model": tmp / "model.pth",
              "train-run": tmp / "run.json"}

    def given(*names):
        return [arg for name in names for arg in (f"--{name}", str(inputs[name]))]

    return {
        "prepare": ["--out", str(out / "prepared"), "--metrics", str(out / "dataset.json")],
        "cache": ["--prepared", str(tmp / "prepared"), "--out", str(out / "cache")],
        "train": given("cache") + ["--checkpoints", str(out / "ck"), "--run-file", str(out / "ck" / "run.json"),
                                   "--model", str(out / "m.pth"), "--run", str(out / "run.json"),
                                   "--train-log", str(out / "log.csv"), "--preview", str(out / "p.png")],
        "evaluate": given("cache", "prepared", "model", "train-run") + [
            "--run-file", str(out / "run.json"), "--metrics", str(out / "eval.json"), "--per-category",
            str(out / "pc.json"), "--run-ids", str(out / "ids.json"), "--plots", str(out / "pr.json"),
            "--detections", str(out / "det.json")],
        "export": given("cache", "prepared", "model", "train-run") + ["--out", str(out / "export"), "--metrics",
                                                                      str(out / "export.json")],
        "predict": ["image.jpg", "--model", str(tmp / "model.onnx"), "--out", str(out / "predictions")],
    }[stage]


@pytest.mark.parametrize("stage", ["prepare", "cache", "train", "evaluate", "export", "predict"])
def test_every_stage_refuses_an_output_folder_it_cannot_write_before_its_work(stage, tmp_path, monkeypatch,
                                                                               capsys, restore_logging):
    import importlib

    from pipelines import cli

    module = importlib.import_module(f"stages.{stage}")
    out = tmp_path / "readonly"
    out.mkdir()
    refuse_probe(monkeypatch, errno.EROFS, out)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        cli.run(module.main, stage_argv(stage, tmp_path, out))  # no input exists: the check comes first
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: {out}: cannot write there (Read-only file system); expected a writable folder "
                           f"for {out}/"), line
    assert "\n" not in line
    assert list(out.iterdir()) == []


def test_a_read_only_mount_stops_prepare_before_validation_in_one_line(tmp_path):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a read-only bind mount")
    (tmp_path / "data").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = (f"mount --bind -o ro {tmp_path} {tmp_path} && cd {tmp_path} && exec {sys.executable} -m stages.prepare "
              f"--params {REPO / 'params.yaml'} --out data/prepared --metrics metrics/dataset.json")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    if "mount" in done.stderr and done.returncode != 2:
        pytest.skip(f"no read-only bind mount here: {done.stderr.strip()}")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: data: cannot write there (Read-only file system); expected a writable "
                                   "folder for data/prepared")
    assert list(tmp_path.iterdir()) == [tmp_path / "data"]


def test_denied_or_full_folders_files_and_links_in_the_way_are_named_before_the_work(tmp_path, monkeypatch):
    from pipelines import fileio
    from pipelines.errors import OutputError

    fileio.check_outputs(folders=[tmp_path / "a" / "b"], files=[tmp_path / "c" / "d.json"])  # writable: fine
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing, makes no folder

    (tmp_path / "outputs").symlink_to(tmp_path / "elsewhere")  # unnamed: outputs/ a dangling symlink
    with pytest.raises(OutputError, match=rf"^{tmp_path / 'outputs'}: a broken symlink \(to {tmp_path / 'elsewhere'}\); "
                                          rf"expected a folder for {tmp_path / 'outputs' / 'train' / 'model.pth'}$"):
        fileio.check_outputs(files=[tmp_path / "outputs" / "train" / "model.pth"])

    (tmp_path / "data").write_text("")  # unnamed: a file where a folder is expected
    with pytest.raises(OutputError, match=rf"^{tmp_path / 'data'}: not a folder; expected a folder for "
                                          rf"{tmp_path / 'data' / 'prepared'}$"):
        fileio.check_outputs(folders=[tmp_path / "data" / "prepared"])

    (tmp_path / "metrics.json").mkdir()  # unnamed: a folder where a file is written (os.replace fails at the end)
    with pytest.raises(OutputError, match=rf"^{tmp_path / 'metrics.json'}: a folder; expected a file"):
        fileio.check_outputs(files=[tmp_path / "metrics.json"])

    refuse_probe(monkeypatch, errno.EACCES, tmp_path / "denied")
    (tmp_path / "denied").mkdir()
    with pytest.raises(OutputError, match=r"denied: cannot write there \(Permission denied\); expected a writable"):
        fileio.check_outputs(folders=[tmp_path / "denied" / "x"])
    refuse_probe(monkeypatch, errno.ENOSPC, tmp_path / "full")
    (tmp_path / "full").mkdir()
    with pytest.raises(OutputError, match=r"full: no space left on device; expected a writable folder for"):
        fileio.check_outputs(folders=[tmp_path / "full" / "x"])

    full = os.statvfs_result((4096, 4096, 10**6, 10**6 - 1, 1, 10**6, 10**6, 10**6, 0, 255))  # one 4 KB block free
    monkeypatch.setattr(fileio.os, "statvfs", lambda _: full)
    with pytest.raises(OutputError, match=r"no space left on device \(4\.0 KB free\); expected a writable folder for "
                                          r".*x with at least 1\.0 MB free$"):
        fileio.check_outputs(folders=[tmp_path / "x"])  # unnamed: a disk full before the work starts
