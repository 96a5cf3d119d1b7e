"""The training step and loop on a tiny model: what one step does, checkpoints, an early end, the log."""

import csv
import shutil
import math

import pytest
import torch
from torch import nn

from pipelines import checkpoint
from pipelines.checkpoint import Checkpointer
from pipelines.data.collate import Batch
from pipelines.engine import MetricLog, Reporter, StopRequest, train, train_step
from pipelines.errors import Stopped, TrainingError
from pipelines.solver import build_lr_scheduler


class TinyDetector(nn.Module):
    """Takes batches as the detector does and returns two loss components."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)

    def forward(self, images, image_sizes, targets):
        out = self.linear(images.float().mean(dim=(2, 3)) / 255).mean()
        return {"classification": out**2, "bbox_regression": (out - 1).abs()}


def _batches(count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(0)
    return [Batch(torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8, generator=generator), [(8, 8)] * 2,
                  [{}, {}], [2 * i, 2 * i + 1]) for i in range(count)]


def _setup(lr: float = 0.1, model_type: type = TinyDetector):
    torch.manual_seed(0)
    model = model_type()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine", max_iter=10, steps=[], gamma=0.1, warmup_iters=2,
                                   warmup_factor=0.1)
    return model, optimizer, scheduler


def test_train_step_updates_the_model_and_returns_detached_local_losses():
    model, optimizer, scheduler = _setup()
    batch = _batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        expected = {k: float(v) for k, v in model(batch.images, batch.image_sizes, batch.targets).items()}
    losses = train_step(model, batch, optimizer, scheduler)
    assert {k: float(v) for k, v in losses.items()} == pytest.approx(expected)
    assert not any(v.requires_grad for v in losses.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scheduler.last_epoch == 1  # stepped once: warm-up half done (factor 0.55), cosine at 1/10
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.55 * 0.5 * (1 + math.cos(math.pi / 10)))


def test_train_step_clips_the_gradient_norm():
    steps = {}
    for clip in (0.0, 1e-3):
        model, optimizer, scheduler = _setup(lr=100.0)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        train_step(model, _batches(1)[0], optimizer, scheduler, clip_grad_norm=clip)
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        steps[clip] = float((after - before).norm())
    lr = 100.0 * 0.1  # warm-up factor at iteration 0
    assert steps[1e-3] == pytest.approx(lr * 1e-3, rel=1e-3)
    assert steps[0.0] > 10 * steps[1e-3]


def _checkpointer(folder, keep=5, fingerprint="f"):
    return Checkpointer(folder, keep=keep, fingerprint=fingerprint, extra={"categories": []})


def test_loop_checkpoints_every_period_but_not_at_the_end_and_keeps_the_newest(tmp_path):
    model, optimizer, scheduler = _setup()
    train(model, _batches(7), optimizer, scheduler, device=torch.device("cpu"), max_iter=7, checkpoint_period=2, checkpointer=_checkpointer(tmp_path, keep=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_0000004.pth", "model_0000006.pth"]
    state = checkpoint.load(tmp_path / "model_0000006.pth")
    assert state["iteration"] == 6 and state["scheduler"]["last_epoch"] == 6 and state["fingerprint"] == "f"
    assert set(state) == {"model", "optimizer", "scheduler", "iteration", "fingerprint", "rng", "categories"}


def test_loop_resumed_at_start_iter_counts_from_there(tmp_path):
    model, optimizer, scheduler = _setup()
    train(model, _batches(3), optimizer, scheduler, device=torch.device("cpu"), start_iter=4, max_iter=7,
          checkpoint_period=5, checkpointer=_checkpointer(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["model_0000005.pth"]


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path):
    batches = _batches(8)
    model, optimizer, scheduler = _setup()
    train(model, batches, optimizer, scheduler, device=torch.device("cpu"), max_iter=8)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, optimizer, scheduler = _setup()
    with pytest.raises(RuntimeError, match="ended at iteration 5"):  # as if killed after iteration 5
        train(model, batches[:5], optimizer, scheduler, device=torch.device("cpu"), max_iter=8, checkpoint_period=3, checkpointer=_checkpointer(tmp_path))
    model, optimizer, scheduler = _setup()
    torch.nn.init.zeros_(model.linear.weight)  # whatever the fresh state, the checkpoint replaces it
    start, extras = _checkpointer(tmp_path).resume(model=model, optimizer=optimizer, scheduler=scheduler)
    assert start == 3 and extras["iteration"] == 3
    train(model, batches[3:], optimizer, scheduler, device=torch.device("cpu"), start_iter=3, max_iter=8)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, model.parameters()))


def test_checkpoints_of_another_fingerprint_are_set_aside(tmp_path):
    model, optimizer, scheduler = _setup()
    train(model, _batches(4), optimizer, scheduler, device=torch.device("cpu"), max_iter=4, checkpoint_period=2, checkpointer=_checkpointer(tmp_path, fingerprint="old"))
    (tmp_path / ".model_0000003.pth.abc123").write_bytes(b"half")  # a write that was interrupted
    start, _ = _checkpointer(tmp_path, fingerprint="new").resume(model=model, optimizer=optimizer, scheduler=scheduler)
    assert start == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"]
    assert [p.name for p in (tmp_path / "previous").iterdir()] == ["model_0000002.pth"]


def test_an_unreadable_checkpoint_is_skipped_for_the_one_before(tmp_path):
    model, optimizer, scheduler = _setup()
    train(model, _batches(5), optimizer, scheduler, device=torch.device("cpu"), max_iter=5, checkpoint_period=2, checkpointer=_checkpointer(tmp_path))
    (tmp_path / "model_0000004.pth").write_bytes(b"not a checkpoint")
    start, _ = _checkpointer(tmp_path).resume(model=model, optimizer=optimizer, scheduler=scheduler)
    assert start == 2


def test_pruning_counts_only_this_runs_loadable_checkpoints(tmp_path):
    """A planted unreadable file, named as the newest, is set aside, never kept as one of the newest two;
    neither is a copy whose name gives another iteration, nor a file that appears during the run."""
    model, optimizer, scheduler = _setup()
    with pytest.raises(RuntimeError, match="ended at iteration 5"):  # killed after iteration 5
        train(model, _batches(5), optimizer, scheduler, device=torch.device("cpu"), max_iter=12, checkpoint_period=2, checkpointer=_checkpointer(tmp_path))
    (tmp_path / "model_0000007.pth").write_bytes(b"not a checkpoint")
    shutil.copyfile(tmp_path / "model_0000002.pth", tmp_path / "model_0000003.pth")
    model, optimizer, scheduler = _setup()
    checkpointer = _checkpointer(tmp_path, keep=2)
    start, _ = checkpointer.resume(model=model, optimizer=optimizer, scheduler=scheduler)
    assert start == 4
    assert sorted(p.name for p in (tmp_path / "previous").iterdir()) == ["model_0000003.pth", "model_0000007.pth"]

    class Planting(list):  # plants a stranger once the run has gone on
        def __iter__(self):
            for i, batch in enumerate(list.__iter__(self)):
                if i == 1:
                    (tmp_path / "model_0000099.pth").write_bytes((tmp_path / "model_0000004.pth").read_bytes())
                yield batch

    train(model, Planting(_batches(12)[4:11]), optimizer, scheduler, device=torch.device("cpu"), start_iter=4,
          max_iter=11, checkpoint_period=2, checkpointer=checkpointer)
    assert sorted(p.name for p in tmp_path.glob("model_*.pth")) == ["model_0000008.pth", "model_0000010.pth"]
    assert (tmp_path / "previous" / "model_0000099.pth").is_file()
    checkpointer.finish()  # the run is over: nothing left to resume, nothing set aside
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_non_finite_loss_stops_training_naming_iteration_and_component(tmp_path):
    model, optimizer, scheduler = _setup(lr=1e30)
    with pytest.raises(TrainingError, match=r"^iteration \d+: loss (bbox_regression|classification) is (nan|inf)"):
        train(model, _batches(10), optimizer, scheduler, device=torch.device("cpu"), max_iter=10, checkpoint_period=100, checkpointer=_checkpointer(tmp_path))
    assert not list(tmp_path.iterdir())  # no checkpoint of a diverged model


def test_a_non_finite_loss_after_a_resume_names_the_checkpoint_it_resumed_from(tmp_path):
    model, optimizer, scheduler = _setup(lr=1e30)
    with pytest.raises(TrainingError, match=r"training stopped, the checkpoint of iteration 4 it resumed from is kept"):
        train(model, _batches(6), optimizer, scheduler, device=torch.device("cpu"), start_iter=4, max_iter=10,
              checkpoint_period=100, checkpointer=_checkpointer(tmp_path))


def test_a_stop_request_checkpoints_the_next_iteration_and_stops(tmp_path):
    model, optimizer, scheduler = _setup()
    stop = StopRequest()
    stop.set()
    with pytest.raises(Stopped, match=r"stopped by a stop request at iteration 1; checkpoint .*model_0000001.pth"):
        train(model, _batches(5), optimizer, scheduler, device=torch.device("cpu"), max_iter=5, checkpointer=_checkpointer(tmp_path), stop=stop)
    assert checkpoint.load(tmp_path / "model_0000001.pth")["iteration"] == 1


def test_a_loader_that_ends_early_is_an_error(tmp_path):
    model, optimizer, scheduler = _setup()
    with pytest.raises(RuntimeError, match="the loader ended at iteration 3, expected 5"):
        train(model, _batches(3), optimizer, scheduler, device=torch.device("cpu"), max_iter=5)


def test_metric_log_has_a_row_every_period_and_at_the_end(tmp_path):
    model, optimizer, scheduler = _setup()
    log = tmp_path / "log.csv"
    train(model, _batches(5), optimizer, scheduler, device=torch.device("cpu"), max_iter=5,
          checkpointer=_checkpointer(tmp_path / "ckpt"),
          report=Reporter(max_iter=5, log_period=2, metric_log=MetricLog(log)))
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == [2, 4, 5]
    assert list(rows[0]) == ["iteration", "loss", "bbox_regression", "classification", "lr"]  # sorted, as with DDP
    for row in rows:
        assert float(row["loss"]) == pytest.approx(float(row["classification"]) + float(row["bbox_regression"]), rel=1e-4)
    assert float(rows[-1]["lr"]) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-5)
    assert not (tmp_path / "ckpt").exists()  # checkpoint_period (1000) never reached

    MetricLog(log, start_iter=3).close()  # a run resumed from iteration 3 drops what came after it
    with open(log, newline="") as f:
        assert [int(r["iteration"]) for r in csv.DictReader(f)] == [2]


class Fp16TinyDetector(TinyDetector):
    """Runs its forward pass under fp16 autocast, as the detector does (never the backward or the step)."""

    def forward(self, images, image_sizes, targets):
        with torch.autocast("cpu", dtype=torch.float16):
            return super().forward(images, image_sizes, targets)


def _fp16_run(batches, folder=None, *, start: int = 0, max_iter: int = 8, resume: bool = False):
    """fp16 autocast with a gradient scaler (on CPU, as on a GPU), from iteration ``start``."""
    model, optimizer, scheduler = _setup(model_type=Fp16TinyDetector)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)
    if resume:
        assert _checkpointer(folder).resume(model=model, optimizer=optimizer, scheduler=scheduler,
                                            scaler=scaler)[0] == start
    try:
        train(model, batches[start:], optimizer, scheduler, device=torch.device("cpu"), start_iter=start,
              max_iter=max_iter, checkpoint_period=3, clip_grad_norm=1.0, scaler=scaler,
              checkpointer=_checkpointer(folder) if folder and not resume else None)
    except RuntimeError:  # the loader ended early: as if killed
        pass
    return model, scaler


def test_fp16_steps_scale_the_loss_and_resume_with_the_scalers_state(tmp_path):
    batches = _batches(8)
    model, scaler = _fp16_run(batches)
    assert scaler.get_scale() == 2.0**4 * 2**4  # grown every 2 finite steps: the scaler took part in each
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    _fp16_run(batches[:5], tmp_path)  # killed after iteration 5; the newest checkpoint is at 3
    state = checkpoint.load(tmp_path / "model_0000003.pth")
    assert state["grad_scaler"]["scale"] == 2.0**4 * 2  # grown once, after iterations 1-2
    model, scaler = _fp16_run(batches, tmp_path, start=3, resume=True)
    assert scaler.get_scale() == 2.0**4 * 2**4
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, model.parameters()))


def test_a_disabled_scaler_is_neither_used_nor_saved(tmp_path):
    model, optimizer, scheduler = _setup()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train(model, _batches(4), optimizer, scheduler, device=torch.device("cpu"), max_iter=4, checkpoint_period=2, scaler=scaler, checkpointer=_checkpointer(tmp_path))
    assert "grad_scaler" not in checkpoint.load(tmp_path / "model_0000002.pth")


GPU = torch.device("cuda", 0)


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it lives on ``cuda:0``, as do the tensors derived from it (this machine
    has no GPU: it stands for the losses of a training process on a GPU)."""

    @property
    def device(self):
        return GPU


class _GpuBatch:
    """A batch already on the training device: ``to`` leaves it as it is."""

    def to(self, device, non_blocking=False):
        return self


def test_every_collective_of_the_loop_runs_on_the_training_device(monkeypatch):
    """An NCCL process group has no CPU backend: a collective given a CPU tensor stops multi-GPU training
    at its first iteration. Posing as one of two processes training on cuda:0, with the collectives
    recorded (they leave the tensors as they are), every tensor the loop hands to a collective must be
    on the training device: the loss reduction's and the stop request's."""
    from pipelines import distributed, engine

    seen = []

    def record(tensor, *args, **kwargs):
        seen.append(tensor.device)

    monkeypatch.setattr(distributed, "get_world_size", lambda: 2)
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce"):
        monkeypatch.setattr(torch.distributed, name, record)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(engine, "train_step", lambda *args, **kwargs: {
        "classification": torch.tensor(0.5).as_subclass(_OnGpu),
        "bbox_regression": torch.tensor(0.25).as_subclass(_OnGpu)})
    model, optimizer, scheduler = _setup()
    stop = StopRequest()
    train(model, [_GpuBatch()] * 3, optimizer, scheduler, device=GPU, max_iter=3, stop=stop,
          report=Reporter(max_iter=3, log_period=1, device=GPU))
    assert len(seen) >= 3 and set(seen) == {GPU}  # at least one collective per iteration, every one on cuda:0

    seen.clear()
    stop.set()  # a stop request reaches the other process through the same collective
    with pytest.raises(Stopped, match="at iteration 1"):
        train(model, [_GpuBatch()] * 3, optimizer, scheduler, device=GPU, max_iter=3, stop=stop)
    assert seen and set(seen) == {GPU}
