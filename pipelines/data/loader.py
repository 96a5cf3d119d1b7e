"""Data loaders for training and testing (maskrcnn-benchmark's ``make_data_loader``, as the original
SA-AutoAug uses it, with explicit arguments)."""

from __future__ import annotations

import random
import signal

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader

from .collate import BatchCollator
from .samplers import DistributedSampler, GroupedBatchSampler, InferenceSampler, IterationBasedBatchSampler


def _batch_sampler(sampler, dataset, batch_size: int, aspect_grouping: bool, group_ids=None):
    if group_ids is not None:
        return GroupedBatchSampler(sampler, group_ids, batch_size, drop_uneven=False)
    if aspect_grouping:
        return GroupedBatchSampler(sampler, dataset.aspect_groups, batch_size, drop_uneven=False)
    return BatchSampler(sampler, batch_size, drop_last=False)


def _worker_init(seed: int, rank: int):
    def init(worker_id: int) -> None:
        # Samples draw from their own per-sample generators; this only pins library-level randomness.
        worker_seed = (seed * 1000 + rank * 100 + worker_id) % 2**32
        random.seed(worker_seed)
        np.random.seed(worker_seed)
        torch.manual_seed(worker_seed)
        torch.set_num_threads(1)
        # A stop signal sent to the whole process group (Ctrl-C in a terminal, a scheduler's SIGTERM)
        # is for the training process, which stops at an iteration boundary and checkpoints: a worker
        # dying of it first would break that step. Workers end with their loader (or their parent).
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)

    return init


def make_train_loader(dataset, *, batch_size: int, max_iter: int, start_iter: int = 0, aspect_grouping: bool = True,
                      num_workers: int = 0, size_divisibility: int = 32, seed: int = 0, rank: int = 0,
                      world_size: int = 1, pin_memory: bool = False, group_ids: np.ndarray | None = None) -> DataLoader:
    """A loader that yields exactly ``max_iter - start_iter`` batches of this rank's share.

    Batches hold images of one group: ``group_ids`` (one per image, e.g.
    :func:`~.samplers.padded_shape_groups`) where given, else the orientation with ``aspect_grouping``.

    ``batch_size`` is this process's part of the global batch (each of the ``world_size`` processes
    loads as many). The sequence of batches is a function of ``seed`` only, and resuming at
    ``start_iter`` continues it.
    """
    sampler = DistributedSampler(len(dataset), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    batches = IterationBasedBatchSampler(_batch_sampler(sampler, dataset, batch_size, aspect_grouping, group_ids),
                                         max_iter, start_iter)
    return DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=num_workers,
        collate_fn=BatchCollator(size_divisibility),
        worker_init_fn=_worker_init(seed, rank),
        pin_memory=pin_memory,
        persistent_workers=False,
    )


def make_test_loader(dataset, *, batch_size: int, aspect_grouping: bool = True, num_workers: int = 0,
                     size_divisibility: int = 32, seed: int = 0, rank: int = 0, world_size: int = 1,
                     pin_memory: bool = False) -> DataLoader:
    """A loader over this rank's shard of the test set: every image exactly once across ranks.

    ``batch_size`` is per process. As in the seed, the order is shuffled only when distributed.
    """
    sampler = InferenceSampler(len(dataset), num_replicas=world_size, rank=rank, shuffle=world_size > 1, seed=seed)
    return DataLoader(
        dataset,
        batch_sampler=_batch_sampler(sampler, dataset, batch_size, aspect_grouping),
        num_workers=num_workers,
        collate_fn=BatchCollator(size_divisibility),
        worker_init_fn=_worker_init(seed, rank),
        pin_memory=pin_memory,
    )
