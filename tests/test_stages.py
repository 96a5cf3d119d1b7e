"""Stages as a user runs them: clean one-line errors, nothing damaged, caches rebuilt when broken."""

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from pipelines.data.annotation_cache import AnnotationCache

from .conftest import REPO, train_outputs


def _write_params(path, params) -> str:
    path.write_text(yaml.safe_dump(params))
    return str(path)


def _run(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PIPELINES_DEBUG"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _coco_params(base, tmp_path, annotations, images) -> dict:
    params = copy.deepcopy(base)
    params["dataset"] = {"name": "coco", "train_images": str(images),
                         "train_annotations": str(annotations), "val_images": str(images),
                         "val_annotations": str(annotations), "max_image_pixels": 2**28,
                         "max_damaged_images": 0}
    return params


def test_prepare_imports_coco_and_reports_broken_input_in_one_line(base_params, coco_real, tmp_path):
    annotations, images = coco_real
    params = _write_params(tmp_path / "params.yaml", _coco_params(base_params, tmp_path, annotations, images))
    out, metrics = tmp_path / "prepared", tmp_path / "dataset.json"
    done = _run("stages.prepare", "--params", params, "--out", str(out), "--metrics", str(metrics), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    counts = {row["item"]: row["count"] for row in json.loads(metrics.read_text())}
    assert counts["train: images"] == 33 and counts["val: crowd"] >= 1
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["splits"]["val"]["images"] == str(images)
    before = sorted(p.name for p in out.iterdir())

    broken = json.loads(annotations.read_text())
    broken["annotations"][5]["image_id"] = 123456789
    bad_json = tmp_path / "broken.json"
    bad_json.write_text(json.dumps(broken))
    params = _write_params(tmp_path / "params.yaml", _coco_params(base_params, tmp_path, bad_json, images))
    failed = _run("stages.prepare", "--params", params, "--out", str(out), "--metrics", str(metrics), cwd=tmp_path)
    assert failed.returncode == 2
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in failed.stderr
    assert "broken.json" in errors[0] and f"annotation id {broken['annotations'][5]['id']}" in errors[0]
    assert "missing image id 123456789" in errors[0]
    assert sorted(p.name for p in out.iterdir()) == before  # the earlier output is intact
    assert {row["item"]: row["count"] for row in json.loads(metrics.read_text())} == counts
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prepared")]  # no half-written folder


def test_bad_params_stop_the_train_stage_in_one_line(base_params, tmp_path):
    params = copy.deepcopy(base_params)
    params["train"]["base_lr"] = -1.0
    path = _write_params(tmp_path / "params.yaml", params)
    done = _run("stages.train", "--params", path, "--cache", "x", *train_outputs("y"), "--train-log", "z", "--preview", "p",
                cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {path}: train.base_lr: expected a learning rate > 0, got -1.0"
    )
    assert "Traceback" not in done.stderr
    checked = _run("pipelines.config", "--params", path, cwd=tmp_path)  # dvc.yaml's check before torchrun
    assert checked.returncode == 2 and checked.stderr.strip() == done.stderr.strip().splitlines()[-1]


def test_cache_stage_rebuilds_a_corrupt_cache(base_params, tmp_path):
    params = copy.deepcopy(base_params)
    params["dataset"].update(train_size=6, val_size=3)
    path = _write_params(tmp_path / "params.yaml", params)
    prepared, cache = tmp_path / "prepared", tmp_path / "cache"
    assert _run("stages.prepare", "--params", path, "--out", "prepared", "--metrics", "m.json", cwd=tmp_path).returncode == 0
    first = _run("stages.cache", "--prepared", str(prepared), "--out", str(cache), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert len(AnnotationCache(cache / "val")) == 3

    again = _run("stages.cache", "--prepared", str(prepared), "--out", str(cache), cwd=tmp_path)
    assert again.stderr.count("cache up to date") == 2

    data = (cache / "train" / "boxes.npy").read_bytes()
    (cache / "train" / "boxes.npy").write_bytes(data[:100])
    rebuilt = _run("stages.cache", "--prepared", str(prepared), "--out", str(cache), cwd=tmp_path)
    assert rebuilt.returncode == 0
    assert "train: cached" in rebuilt.stderr and "val: cache up to date" in rebuilt.stderr
    assert len(AnnotationCache(cache / "train")) >= 1
    assert "train: building the cache" in rebuilt.stderr and "boxes.npy: corrupt or truncated" in rebuilt.stderr

    # Corruption that keeps every size fails the checksums; an older format version is rebuilt too.
    labels = bytearray((cache / "val" / "labels.npy").read_bytes())
    labels[-1] ^= 0xFF
    (cache / "val" / "labels.npy").write_bytes(bytes(labels))
    # Train and evaluate verify the cache whenever they open it, however they are started.
    train_labels = bytearray((cache / "train" / "labels.npy").read_bytes())
    train_labels[-1] ^= 0xFF
    (cache / "train" / "labels.npy").write_bytes(bytes(train_labels))
    (tmp_path / "r.json").write_text('{"run_id": null}')  # a train stage that ran without tracking
    for stage, args in (("stages.train", [*train_outputs("t"), "--train-log", "t.csv", "--preview", "t.png"]),
                        ("stages.evaluate", ["--prepared", "prepared", "--model", "m.pth", "--train-run", "r.json",
                                             "--run-file", "e.json", "--metrics", "e1.json", "--per-category",
                                             "e2.json", "--run-ids", "e3.json", "--plots", "e4.json",
                                             "--detections", "e5.json"])):
        done = _run(stage, "--params", path, "--cache", str(cache), *args, cwd=tmp_path)
        split = "train" if stage == "stages.train" else "val"
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"error: {cache / split / 'labels.npy'}: content does")
    meta = json.loads((cache / "train" / "meta.json").read_text())
    meta["format_version"] = 1
    (cache / "train" / "meta.json").write_text(json.dumps(meta))
    fixed = _run("stages.cache", "--prepared", str(prepared), "--out", str(cache), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert "labels.npy: content does not match its checksum" in fixed.stderr
    assert "cache format version 1, expected" in fixed.stderr
    assert fixed.stderr.count("cached") == 2
    assert AnnotationCache(cache / "val", verify=True).meta["num_images"] == 3
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no half-written or old folders left


def test_a_full_output_folder_stops_training_before_it_starts(base_params, tmp_path):
    params = copy.deepcopy(base_params)
    params["dataset"].update(train_size=6, val_size=3, min_side=128, max_side=160)
    params["train"].update(nproc=1, ims_per_batch=2, max_iter=2, warmup_iters=1)
    params["evaluate"].update(ims_per_batch=2)
    path = _write_params(tmp_path / "params.yaml", params)
    assert _run("stages.prepare", "--params", path, "--out", "prepared", "--metrics", "m.json", cwd=tmp_path).returncode == 0
    assert _run("stages.cache", "--prepared", "prepared", "--out", "cache", cwd=tmp_path).returncode == 0
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        done = _run("stages.train", "--params", path, "--cache", "cache", *train_outputs(full / "train"),
                    "--train-log", "log.csv", "--preview", "p.png", cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(full)], check=True)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "checkpoints: No space left on device for the outputs" in errors[0]
    assert "train:" not in done.stderr and "Traceback" not in done.stderr  # reported before training starts


def test_a_second_trainer_on_the_same_outputs_is_refused_in_one_line(base_params, tmp_path):
    """Rank 0 holds a lock on the training folder; here the test holds it, as a trainer still running would."""
    from pipelines.lifetime import FolderLock

    params = copy.deepcopy(base_params)
    params["dataset"].update(train_size=6, val_size=3, min_side=128, max_side=160)
    params["train"].update(nproc=1, ims_per_batch=2, max_iter=2, warmup_iters=1)
    path = _write_params(tmp_path / "params.yaml", params)
    assert _run("stages.prepare", "--params", path, "--out", "prepared", "--metrics", "m.json", cwd=tmp_path).returncode == 0
    assert _run("stages.cache", "--prepared", "prepared", "--out", "cache", cwd=tmp_path).returncode == 0
    with FolderLock(tmp_path / "train" / "checkpoints", job="another"):
        done = _run("stages.train", "--params", path, "--cache", "cache", *train_outputs("train"), "--train-log", "log.csv",
                    "--preview", "p.png", cwd=tmp_path)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: train/checkpoints: another training run is using this folder (pid {os.getpid()} on "
                      f"{os.uname().nodename}, started {errors[0].split('started ')[1].split(')')[0]}); wait for it "
                      "to end or stop it, then run the stage again"], done.stderr[-2000:]
    assert not (tmp_path / "train" / "model_final.pth").exists() and not list((tmp_path / "train" / "checkpoints").glob("model_*"))


def test_a_stop_signal_stops_a_stage_even_inside_a_library_that_catches_every_exception():
    """PIL and MLflow wrap calls in ``except Exception``; a stop that arrives there must still stop the stage
    (it once returned 0: prepare swallowed the SIGINT while reading an image header and ran to the end)."""
    from pipelines import cli

    def main(_argv):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        except Exception:
            pass
        raise AssertionError("the stage ran on after the stop")

    before = signal.getsignal(signal.SIGINT)  # pytest's (SIG_IGN where pytest was started in the background)
    with pytest.raises(SystemExit) as stopped:
        cli.run(main)
    assert stopped.value.code == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # the handler in place before is back


def test_a_log_record_while_a_progress_bar_is_shown_goes_on_a_line_of_its_own(capsys):
    """Training logs its checkpoints while its bar is shown: the record is written above the bar (the bar
    cleared, then drawn again below it), not after the bar's text on its line."""
    import logging

    from tqdm import tqdm

    from pipelines import cli

    def main(_argv):
        with tqdm(total=8, desc="train") as bar:
            bar.update(2)
            logging.getLogger("pipelines.engine").info("iteration 2: checkpoint model_0000002.pth")
            bar.update(2)

    cli.run(main)
    lines = capsys.readouterr().err.splitlines()
    (record,) = [line for line in lines if "checkpoint" in line]
    assert record.endswith(" pipelines.engine INFO: iteration 2: checkpoint model_0000002.pth")
    assert record.split()[0].count(":") == 2  # the line starts with the record's own time, not the bar's text
    assert any(line.startswith("train:  50%") for line in lines[lines.index(record):])  # the bar goes on below


@pytest.mark.parametrize("when", ["while the bar is made", "while the bar is open"])
def test_an_error_while_a_progress_bar_is_shown_is_printed_on_a_line_of_its_own(monkeypatch, capsys, when):
    """A stop in the bar's constructor, after its first display (where a stop signal sent as prepare starts
    once landed in CI), or an error while a bar made in full is open: the bar's line is ended before the
    error is printed, once (no empty line), not left for the error to follow its text."""
    from tqdm import tqdm

    from pipelines import cli
    from pipelines.errors import Stopped

    shown = tqdm.refresh

    def refresh_then_stop(self, *args, **kwargs):
        shown(self, *args, **kwargs)
        raise Stopped("stopped by SIGHUP", signum=signal.SIGHUP)

    def main(_argv):
        if when == "while the bar is made":
            monkeypatch.setattr(tqdm, "refresh", refresh_then_stop)
            for _ in tqdm(range(4000), desc="synthetic train"):
                raise AssertionError("the loop started")
        bar = tqdm(total=4000, desc="synthetic train")
        bar.update(7)
        raise Stopped("stopped by SIGHUP", signum=signal.SIGHUP)

    with pytest.raises(SystemExit) as stopped:
        cli.run(main)
    assert stopped.value.code == 128 + signal.SIGHUP
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "error:" in line] == ["error: stopped by SIGHUP"] == lines[-1:]
    assert "synthetic train" in lines[-2]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_a_stop_signal_during_prepare_is_one_line_and_leaves_the_previous_output(base_params, tmp_path, signum):
    """Every stage reads the three stop signals alike: ``error: stopped by <SIGNAL>``, exit 128 + its number,
    and its outputs as they were (prepare writes its folder in one rename at the end)."""
    params = copy.deepcopy(base_params)
    params["dataset"].update(train_size=4000, val_size=8, min_side=320, max_side=480)
    path = _write_params(tmp_path / "params.yaml", params)
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "earlier").write_text("kept")
    env = {k: v for k, v in os.environ.items() if k != "PIPELINES_DEBUG"}
    env["PYTHONPATH"] = str(REPO)
    stage = subprocess.Popen([sys.executable, "-m", "stages.prepare", "--params", path, "--out", "prepared",
                              "--metrics", "m.json"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".prepared.") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)  # until it writes into its temporary folder
    stage.send_signal(signum)
    _, stderr = stage.communicate(timeout=120)
    assert stage.returncode == 128 + signum
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [f"error: stopped by {signum.name}"]
    assert "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "prepared"]  # no temporary folder left
    assert [p.name for p in (tmp_path / "prepared").iterdir()] == ["earlier"]


EXIT_PROGRAM = """
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from pipelines import cli
from pipelines.errors import DatasetError

out = Path(sys.argv[1])

class Torn:
    def __del__(self):  # runs only if the interpreter tears its modules down
        out.joinpath("torn-down").touch()

KEEP = Torn()

def main(argv):
    atexit.register(lambda: out.joinpath("atexit").write_text("ran"))
    pool = concurrent.futures.ThreadPoolExecutor(1)  # idle and never shut down: the exit must not hang on it
    pool.submit(int).result()
    threading.Thread(target=lambda: (time.sleep(0.5), out.joinpath("thread").touch())).start()  # not a daemon
    print("no newline", end="")  # buffered: a pipe
    if sys.argv[2] == "user-error":
        raise DatasetError("images/x.jpg: unreadable image")
    if sys.argv[2] == "message":
        sys.exit("a message")

cli.run(main)
"""


@pytest.mark.parametrize(("mode", "code", "stderr"), [("ok", 0, ""), ("user-error", 2, "error: images/x.jpg"),
                                                        ("message", 1, "a message")])
def test_a_stage_process_ends_without_the_interpreters_teardown_but_with_all_an_exit_does(tmp_path, mode, code, stderr):
    """``cli.run`` as a program's entry ends with ``os._exit`` (about 2 s of CPU less per stage process), after
    what a normal exit does: non-daemon threads joined, idle thread pools stopped, atexit handlers run,
    buffered output flushed; the exit status as ``sys.exit`` gives it."""
    done = subprocess.run([sys.executable, "-c", EXIT_PROGRAM, str(tmp_path), mode], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == code, done.stderr
    assert done.stdout == "no newline" and done.stderr.startswith(stderr)
    assert (tmp_path / "thread").is_file() and (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "torn-down").exists()  # the modules were not torn down
