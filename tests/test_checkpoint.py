"""Checkpoint files under faults: a process killed while writing never leaves one that resume would load."""

import multiprocessing
import os
import random
import signal
import time

import torch

from pipelines import checkpoint
from pipelines.checkpoint import Checkpointer


def _write_forever(folder: str, state: dict) -> None:
    """Write checkpoints as training does, one after another, until killed (no torch computation
    here: OpenMP's thread pool does not survive a fork)."""
    iteration = 0
    while True:
        iteration += 1
        with open(f"{folder}/writing", "w") as f:  # which write a kill interrupted (not a checkpoint name)
            f.write(str(iteration))
        checkpoint.save(f"{folder}/model_{iteration:07d}.pth", model=state, optimizer={}, scheduler={},
                        iteration=iteration, fingerprint="f")
        for old in sorted(os.listdir(folder))[:-3]:
            if old.startswith("model_"):
                os.unlink(f"{folder}/{old}")


def test_twenty_kills_during_checkpoint_writes_never_leave_a_loadable_partial_file(tmp_path):
    context = multiprocessing.get_context("fork")  # the writer starts in milliseconds, torch already loaded
    rng = random.Random(0)
    weights = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(6)}  # 24 MB: about 0.1 s a write
    interrupted_writes = named_temporaries = 0
    for _ in range(20):
        writer = context.Process(target=_write_forever, args=(str(tmp_path), weights), daemon=True)
        writer.start()
        time.sleep(rng.uniform(0.1, 0.4))
        os.kill(writer.pid, signal.SIGKILL)  # only the process this test started, by pid
        writer.join()
        writing = int((tmp_path / "writing").read_text() or 0)
        interrupted_writes += not (tmp_path / f"model_{writing:07d}.pth").exists()
        # the file is unnamed until complete (O_TMPFILE): a killed write leaves a named temporary file only
        # if the kill lands in the instant between its link and its rename; the next start removes it
        named_temporaries += any(p.name.startswith(".model_") for p in tmp_path.iterdir())
        found = Checkpointer(tmp_path, keep=3, fingerprint="f").latest()
        assert not any(p.name.startswith(".model_") for p in tmp_path.iterdir())
        if found is not None:
            path, loaded = found
            assert loaded["iteration"] == int(path.stem.split("_")[1])
            assert torch.equal(loaded["model"]["w5"], weights["w5"])  # complete, not truncated
    assert interrupted_writes >= 3  # the kills did land during writes
    assert named_temporaries <= 1  # and almost never left even a named temporary file


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    import numpy as np

    torch.manual_seed(3)
    np.random.seed(4)
    random.seed(5)
    checkpoint.save(tmp_path / "c.pth", model={}, rng=[checkpoint.rng_state()])
    expected = (torch.rand(3), np.random.rand(3), random.random())
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "c.pth")["rng"][0])
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_rng_state_carries_the_cuda_generator_where_cuda_is_in_use(tmp_path, monkeypatch):
    """On a GPU machine the CUDA generator's state is saved and restored with the others (faked here:
    this machine has no CUDA; the real round trip is in tests/test_gpu.py)."""
    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: cuda_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: restored.append(state))
    checkpoint.save(tmp_path / "c.pth", model={}, rng=[checkpoint.rng_state()])
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "c.pth")["rng"][0])
    assert len(restored) == 1 and torch.equal(restored[0], cuda_state)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run: no CUDA entry, nothing restored
    assert "cuda" not in checkpoint.rng_state()


def test_the_same_state_gives_the_same_bytes_whatever_the_temporary_file(tmp_path):
    """The temporary file is ``/proc/self/fd/N`` until complete: its descriptor's number, which depends on
    what else the process has open, must not reach the bytes (``torch.save`` given a path names its
    archive after the file)."""
    state = {"model": {"w": torch.arange(6.0)}, "iteration": 3}
    checkpoint.save(tmp_path / "a.pth", **state)
    held = [open(tmp_path / f"held{i}", "w") for i in range(5)]  # other descriptors in between
    try:
        checkpoint.save(tmp_path / "b.pth", **state)
    finally:
        for f in held:
            f.close()
    assert (tmp_path / "a.pth").read_bytes() == (tmp_path / "b.pth").read_bytes()
