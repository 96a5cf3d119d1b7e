"""Distributed helpers with two gloo processes (``torch.multiprocessing.spawn``, file init)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelines import distributed


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        losses = {
            "loss_b": torch.tensor(float(rank + 1), requires_grad=True) * 1,
            "loss_a": torch.tensor(10.0 * (rank + 1)),
            "loss_c": torch.tensor(-3.0 * rank),
        }
        before = {k: v.detach().clone() for k, v in losses.items()}
        reduced, raised = distributed.reduce_loss_dict(losses, flag=rank == 1)
        _, none_raised = distributed.reduce_loss_dict(losses)
        unchanged = all(torch.equal(losses[k].detach(), before[k]) for k in losses)
        result = {
            "keys": list(reduced),
            "reduced": {k: float(v) for k, v in reduced.items()},
            "unchanged": unchanged,
            "gathered": distributed.gather_objects({"rank": rank, "items": list(range(rank + 1))}),
            "broadcast": distributed.broadcast_object(f"from {rank}"),
            "raised": (raised, none_raised),
            "rank": distributed.get_rank(),
            "world": distributed.get_world_size(),
        }
        torch.save(result, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_helpers_with_two_gloo_processes(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))

    # The seed's reduce_loss_dict: sorted keys, summed and divided by the world size, here on every rank.
    assert r0["keys"] == r1["keys"] == ["loss_a", "loss_b", "loss_c"]
    assert r0["reduced"] == r1["reduced"] == {"loss_a": 15.0, "loss_b": 1.5, "loss_c": -1.5}
    assert r0["unchanged"] and r1["unchanged"]  # the tensors used for backward are untouched

    assert r0["gathered"] == [{"rank": 0, "items": [0]}, {"rank": 1, "items": [0, 1]}]
    assert r1["gathered"] is None
    assert r0["broadcast"] == r1["broadcast"] == "from 0"
    assert r0["raised"] == r1["raised"] == (True, False)  # a flag raised on rank 1 only is seen by both
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)


def test_single_process_fallbacks():
    assert not distributed.is_initialized()
    assert distributed.get_world_size() == 1 and distributed.get_rank() == 0 and distributed.is_main_process()
    losses = {"b": torch.tensor(2.0), "a": torch.tensor(1.0)}
    reduced, raised = distributed.reduce_loss_dict(losses, flag=True)
    assert list(reduced) == ["a", "b"] and {k: float(v) for k, v in reduced.items()} == {"a": 1.0, "b": 2.0}
    assert raised and not distributed.reduce_loss_dict(losses)[1]
    assert distributed.gather_objects(3) == [3]
    assert distributed.broadcast_object("x") == "x"
