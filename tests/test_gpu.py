"""The GPU path: autocast precisions with the gradient scaler, pinned batches copied without blocking,
and SyncBatchNorm over two NCCL processes. Skipped without CUDA (this project's CI machine has none;
``benchmarks/gpu_smoke.sh`` runs the whole pipeline on a GPU)."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from pipelines import distributed
from pipelines.build import model as build_model
from pipelines.build import train as build_train
from pipelines.config.load import load_params
from pipelines.data.collate import Batch
from pipelines.engine import train_step

from .conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batch(device: torch.device, images: int = 2) -> Batch:
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 255, (images, 3, 256, 320), dtype=torch.uint8, generator=generator).pin_memory()
    targets = [{"boxes": torch.tensor([[20.0, 30.0, 120.0, 160.0], [150.0, 40.0, 300.0, 220.0]]),
                "labels": torch.tensor([0, 2])} for _ in range(images)]
    return Batch(pixels, [(256, 320)] * images, targets, list(range(images))).to(device, non_blocking=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_training_steps_on_the_gpu_in_each_precision(precision):
    device = torch.device("cuda", 0)
    p = load_params(REPO / "params.yaml")
    p.model.precision = precision
    torch.manual_seed(0)
    compute = build_model.compute(p, device)
    assert compute.precision == precision
    model = build_model.detector(p, num_classes=5, compute=compute).to(device)
    optimizer = build_train.optimizer(p, model)
    scheduler = build_train.scheduler(p, optimizer)
    scaler = build_train.grad_scaler(compute, device)
    assert scaler.is_enabled() == (precision == "fp16")
    before = [x.detach().clone() for x in model.parameters()]
    for _ in range(3):
        losses = train_step(model, _batch(device), optimizer, scheduler, p.train.clip_grad_norm, scaler)
        assert all(torch.isfinite(v) for v in losses.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _sync_batchnorm_worker(rank: int, init_file: str, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    p = load_params(REPO / "params.yaml")
    p.model.sync_batchnorm = True
    device = torch.device("cuda", rank)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).to(device)
    model = build_train.data_parallel(p, model, device=device, world_size=2)
    x = torch.full((2, 3, 8, 8), float(rank + 1), device=device)  # each process sees other data
    model(x)
    results[rank] = model.module[1].running_mean.cpu()
    distributed.shutdown()


def test_sync_batchnorm_shares_the_statistics_of_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_sync_batchnorm_worker, args=(os.path.join(folder, "init"), results), nprocs=2)
        assert torch.equal(results[0], results[1])  # one set of statistics over both processes' batches


def test_the_cuda_generator_state_round_trips_through_a_checkpoint(tmp_path):
    from pipelines import checkpoint

    torch.cuda.manual_seed(3)
    torch.rand(1, device="cuda")
    checkpoint.save(tmp_path / "c.pth", model={}, rng=[checkpoint.rng_state()])
    expected = torch.rand(4, device="cuda")
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "c.pth")["rng"][0])
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def _loop_worker(rank: int, init_file: str, results) -> None:
    """Two NCCL processes run the training loop; rank 1 alone asks to stop at iteration 2."""
    from pipelines.engine import Reporter, StopRequest, train
    from pipelines.errors import Stopped

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    device = torch.device("cuda", rank)
    p = load_params(REPO / "params.yaml")
    compute = build_model.compute(p, device)
    torch.manual_seed(0)
    model = build_train.data_parallel(p, build_model.detector(p, num_classes=5, compute=compute).to(device),
                                      device=device, world_size=2)
    optimizer = build_train.optimizer(p, model)
    scheduler = build_train.scheduler(p, optimizer)
    stop = StopRequest()

    class Loader:
        def __iter__(self):
            for i in range(5):
                if rank == 1 and i == 1:
                    stop.set()
                yield _batch(device)

    try:
        train(model, Loader(), optimizer, scheduler, device=device, max_iter=5,
              scaler=build_train.grad_scaler(compute, device), stop=stop,
              report=Reporter(max_iter=5, ims_per_batch=4, log_period=1, device=device))
        results[rank] = "finished"
    except Stopped as err:
        results[rank] = str(err)
    distributed.shutdown()


def test_the_training_loop_on_two_gpus_stops_together(tmp_path):
    """Every collective of the loop (loss reduction, stop request) on the GPUs of an NCCL group."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_loop_worker, args=(str(tmp_path / "init"), results), nprocs=2)
        assert results[0] == results[1] and "at iteration 2" in results[0]
