"""Gradient all-reduce through shared memory, for DDP processes on one machine: a DDP communication hook.

On CPU, gloo all-reduces DDP's gradient buckets through TCP loopback: every byte is copied into and out
of the kernel, and that CPU time is taken from training, whose processes already use every core.
Processes on one machine can sum through a shared buffer instead, in about half the time:

1. each process copies its bucket into its own slot of the buffer;
2. barrier; process ``r`` sums chunk ``r`` of every slot, in rank order, into its own slot;
3. barrier; each process copies every summed chunk back into its bucket.

Slots come in two sets used in turn, so that a process can fill its slot for the next bucket while the
others still read the last one (the barrier after that orders the set's next use). The sum is in rank
order, so it is deterministic; with two processes it is gloo's bit for bit (``a + b == b + a``).

The buffer is a file in ``/dev/shm`` that rank 0 creates and reserves (``posix_fallocate``: a full
``/dev/shm`` fails there, with an error, and not later with SIGBUS) and every process maps; rank 0 unlinks
it once all have mapped it, so nothing is left behind however the processes end. A process that cannot
open the file is on another machine: every process then raises :class:`SharedMemoryUnavailable`.
"""

import os
import uuid

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"


class SharedMemoryUnavailable(RuntimeError):
    """The processes cannot share a buffer (not all on one machine, or no room in ``/dev/shm``). Raised on
    every process alike."""


class SharedMemoryAllReduce:
    """Sums float32 tensors across the processes of ``group`` through shared memory. Collective: every
    process constructs it (which checks that they share ``/dev/shm``), then calls :meth:`all_reduce` in
    the same order with tensors of the same size. The buffer grows, collectively, to the largest tensor.

    Raises:
        SharedMemoryUnavailable: on every process, when one cannot map the others' buffer.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, shm_dir: str | None = None):
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.world < 2:
            raise ValueError("a shared-memory all-reduce needs at least 2 processes")
        self.root, self.shm_dir = dist.get_global_rank(self.group, 0), shm_dir or SHM_DIR
        self.capacity, self.calls = 0, 0
        self._allocate(1)

    def _allocate(self, capacity: int) -> None:
        size = 2 * self.world * capacity
        box = [f"pipelines-allreduce-{uuid.uuid4().hex}" if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        path, problem = os.path.join(self.shm_dir, box[0]), None  # the same name in each machine's folder
        try:
            if self.rank == 0:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.posix_fallocate(fd, 0, size * 4)
                    finally:
                        os.close(fd)
                except OSError as e:
                    problem = f"cannot reserve {size * 4 / 2**20:.1f} MiB in {self.shm_dir} ({e.strerror})"
            dist.barrier(group=self.group)  # rank 0 has made the file
            if self.rank != 0 and not os.path.isfile(path):
                problem = f"{path}, made by process 0, is not there: the processes are not on one machine"
            problems = [None] * self.world
            dist.all_gather_object(problems, problem, group=self.group)
            failed = [(r, m) for r, m in enumerate(problems) if m]
            if failed:
                raise SharedMemoryUnavailable(f"process {failed[0][0]}: {failed[0][1]}")
            buffer = torch.from_file(path, shared=True, size=size, dtype=torch.float32)
            dist.barrier(group=self.group)  # every process has mapped it
        finally:
            if self.rank == 0 and os.path.exists(path):
                os.unlink(path)
        self.buffer, self.capacity, self.calls = buffer.view(2, self.world, capacity), capacity, 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous float32) over the processes, in place; returns it."""
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"all_reduce takes contiguous float32 tensors; got {tensor.dtype}")
        n = tensor.numel()
        if n > self.capacity:
            self._allocate(n)
        slots = self.buffer[self.calls % 2, :, :n]
        self.calls += 1
        slots[self.rank].copy_(tensor.view(-1))
        dist.barrier(group=self.group)
        bounds = [n * q // self.world for q in range(self.world + 1)]
        mine = slice(bounds[self.rank], bounds[self.rank + 1])
        # The sum in rank order, into this process's slot (process r alone reads chunk r of the slots).
        total = slots[self.rank, mine] if self.rank < 2 else torch.empty_like(slots[0, mine])
        torch.add(slots[0, mine], slots[1, mine], out=total)
        for q in range(2, self.world):
            total.add_(slots[q, mine])
        if self.rank >= 2:
            slots[self.rank, mine].copy_(total)
        dist.barrier(group=self.group)
        flat = tensor.view(-1)
        for q in range(self.world):
            flat[bounds[q]:bounds[q + 1]].copy_(slots[q, bounds[q]:bounds[q + 1]])
        return tensor


def ddp_hook(state: SharedMemoryAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (``ddp.register_comm_hook(state, ddp_hook)``): the bucket's mean over the
    processes, as DDP's built-in all-reduce computes it (each gradient times ``1 / world``, then summed)."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / state.world)
    future = torch.futures.Future()
    future.set_result(state.all_reduce(buffer))
    return future
