"""Distributed helpers. Each falls back to world size 1 / rank 0 when no process group is running.

Which process receives a result is stated in each docstring.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from . import hardware


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def init_from_env(timeout_s: float = 1800) -> torch.device:
    """Join the process group that ``torchrun`` describes in the environment, if any.

    NCCL with one GPU per local rank when CUDA is available, gloo on CPU. Without ``WORLD_SIZE`` > 1
    (plain ``python -m ...``) nothing is initialised. On CPU the cores this process may use
    (:func:`pipelines.hardware.cpu_budget`) are split evenly between the node's processes, unless
    ``PIPELINES_THREADS`` says how many threads each takes. Returns
    the device this process should use.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Share the cores this process may use (affinity mask and cgroup quota) between the
        # processes of this node instead of oversubscribing them.
        torch.set_num_threads(hardware.threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if world_size > 1 and not is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def shutdown() -> None:
    if is_initialized():
        dist.destroy_process_group()


def reduce_loss_dict(loss_dict: dict[str, torch.Tensor], *,
                     flag: bool = False) -> tuple[dict[str, torch.Tensor], bool]:
    """Average scalar losses across processes and learn whether any process raised ``flag``, in one
    all-reduce: ``(losses, any flag)``, the same on every process.

    As maskrcnn-benchmark's ``reduce_loss_dict`` (keys sorted, also in one process; values stacked, summed,
    divided by the world size), but all-reduced instead of reduced to rank 0, so that every process
    sees the same values and they stop together on a non-finite loss or a stop request. The flag
    rides in the losses' tensor, on the training device: an NCCL group has no CPU backend.
    """
    world_size = get_world_size()
    names = sorted(loss_dict)
    if world_size < 2:
        return {k: loss_dict[k].detach() for k in names}, flag
    with torch.no_grad():
        values = [loss_dict[k].detach().float() for k in names]
        stacked = torch.stack([*values, values[0].new_tensor(float(flag))])
        dist.all_reduce(stacked)
        stacked /= world_size
    return dict(zip(names, stacked[:-1])), bool(stacked[-1] > 0)


def gather_objects(obj) -> list | None:
    """Collect one picklable object from every process: the list on rank 0, ``None`` elsewhere."""
    if get_world_size() < 2:
        return [obj]
    out = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj):
    """Rank 0's ``obj`` on every process."""
    if get_world_size() < 2:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
