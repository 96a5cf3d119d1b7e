"""The shared-memory gradient all-reduce (DDP communication hook) with two and three gloo processes."""

import dataclasses
import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelines import build, shm_allreduce
from pipelines.config import Params, load_params
from pipelines.errors import ConfigError

from .conftest import REPO


@pytest.fixture(scope="module")
def params() -> Params:
    return load_params(REPO / "params.yaml")


def _with(p: Params, **train) -> Params:
    return dataclasses.replace(p, train=dataclasses.replace(p.train, **train))


def _init(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)


def _inputs(world: int, numel: int) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(r)) * 10 ** r for r in range(world)]


def _sums(rank: int, world: int, tmp: str) -> None:
    _init(rank, world, tmp)
    try:
        reducer = shm_allreduce.SharedMemoryAllReduce(shm_dir=tmp)
        out = []
        for numel in (5, 1000, 3, 20_001):  # grows twice; the odd sizes split unevenly between processes
            tensor = _inputs(world, numel)[rank].clone()
            out.append(reducer.all_reduce(tensor).clone())
            out.append(reducer.all_reduce(torch.ones(numel)).clone())  # the other set of slots
        torch.save(out, f"{tmp}/sums{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_every_process_gets_the_sum_in_rank_order_and_no_file_is_left(tmp_path, world):
    mp.spawn(_sums, args=(world, str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"sums{r}.pt") for r in range(world)]
    for i, numel in enumerate((5, 1000, 3, 20_001)):
        inputs = _inputs(world, numel)
        expected = inputs[0] + inputs[1]
        for t in inputs[2:]:
            expected = expected + t
        for r in range(world):
            assert torch.equal(results[r][2 * i], expected), (world, numel, r)  # bit for bit
            assert torch.equal(results[r][2 * i + 1], torch.full((numel,), float(world)))
    assert not [name for name in os.listdir(tmp_path) if name.startswith("pipelines-allreduce-")]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(16 * 14 * 14, 5))


def _train(rank: int, world: int, tmp: str, params, allreduce: str) -> list:
    model = build.data_parallel(_with(params, allreduce=allreduce), _model(),
                                device=torch.device("cpu"), world_size=world)
    assert [hook.__name__ for hook, _ in model._comm_hooks] == (["ddp_hook"] if allreduce != "backend" else [])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(4):
        loss = model(torch.randn(4, 3, 16, 16, generator=generator)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [t.detach().clone() for t in model.module.state_dict().values()]


def _ddp(rank: int, world: int, tmp: str, params) -> None:
    _init(rank, world, tmp)
    try:
        hooked = _train(rank, world, tmp, params, "shared_memory")
        gloo = _train(rank, world, tmp, params, "backend")
        torch.save({"hooked": hooked, "gloo": gloo}, f"{tmp}/ddp{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_through_shared_memory_trains_gloos_weights_bit_for_bit_with_two_processes(tmp_path, params):
    mp.spawn(_ddp, args=(2, str(tmp_path), params), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"ddp{r}.pt") for r in range(2))
    assert len(r0["hooked"]) == 2 + 5 + 2  # conv, BatchNorm (with its statistics), linear
    for r in (r0, r1):
        assert all(torch.equal(a, b) for a, b in zip(r["hooked"], r["gloo"]))
    # The weights are the same in both processes (BatchNorm's statistics are each process's own).
    assert all(torch.equal(r0["hooked"][i], r1["hooked"][i]) for i in (0, 1, 2, 3, 7, 8))
    assert not torch.equal(r0["hooked"][0], _model().state_dict()["0.weight"])  # it did train


def _elsewhere(rank: int, world: int, tmp: str, params) -> None:
    """Rank 1 looks for rank 0's buffer in another folder, as a process on another machine would."""
    _init(rank, world, tmp)
    shm_allreduce.SHM_DIR = os.path.join(tmp, f"shm{rank}")
    os.makedirs(shm_allreduce.SHM_DIR)
    outcome = {}
    try:
        try:
            shm_allreduce.SharedMemoryAllReduce()
        except shm_allreduce.SharedMemoryUnavailable as e:
            outcome["unavailable"] = str(e)
        try:
            build.data_parallel(_with(params, allreduce="shared_memory"), _model(),
                                device=torch.device("cpu"), world_size=world)
        except ConfigError as e:
            outcome["config_error"] = str(e)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("pipelines.build").addHandler(handler)
        auto = build.data_parallel(_with(params, allreduce="auto"), _model(),
                                   device=torch.device("cpu"), world_size=world)
        outcome["auto_warnings"] = [r.getMessage() for r in records]
        auto(torch.randn(2, 3, 16, 16)).sum().backward()  # gloo's all-reduce: no hook was registered
        outcome["auto_hooks"] = len(auto._comm_hooks)
        outcome["left"] = sorted(os.listdir(shm_allreduce.SHM_DIR))
        torch.save(outcome, f"{tmp}/elsewhere{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_processes_on_two_machines_fall_back_under_auto_and_fail_in_one_line_under_shared_memory(tmp_path, params):
    mp.spawn(_elsewhere, args=(2, str(tmp_path), params), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"elsewhere{r}.pt") for r in range(2))
    for r in (r0, r1):
        assert r["unavailable"].startswith("process 1: ") and r["unavailable"].endswith(
            "is not there: the processes are not on one machine")
        assert r["config_error"].startswith("train.allreduce: shared_memory: process 1: ")
        assert r["config_error"].endswith("(set auto or backend)") and "\n" not in r["config_error"]
        assert r["left"] == [] and r["auto_hooks"] == 0
    assert len(r0["auto_warnings"]) == 1 and r0["auto_warnings"][0].startswith("train.allreduce: auto: process 1:")
    assert r1["auto_warnings"] == []


def test_shared_memory_on_gpus_is_a_config_error(params):
    with pytest.raises(ConfigError, match="train.allreduce: shared_memory sums on the CPU; this run is on GPUs"):
        build.data_parallel(_with(params, allreduce="shared_memory"), _model(),
                            device=torch.device("cuda", 0), world_size=2)
