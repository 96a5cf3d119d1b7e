"""Samplers: distributed sharding, aspect-ratio (or padded-shape) grouping and iteration-based, resumable batching.

They reproduce maskrcnn-benchmark's ``make_data_loader`` (the original SA-AutoAug's) behaviour with two fixes:
every shuffle takes an explicit seed, and :class:`IterationBasedBatchSampler` resumed at
``start_iter`` continues the very same batch sequence instead of restarting an epoch.

Training batches carry their global iteration: the iteration-based sampler yields
``[(index, iteration), ...]`` so that the dataset (and the augmentation's probability ramp) sees the
true iteration whatever the number of workers or ranks, and after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from .sizes import resized_size


class DistributedSampler(Sampler[int]):
    """One rank's share of the dataset, reshuffled every epoch from ``(seed, epoch)``.

    As in the seed: the index list is padded by repetition to a multiple of ``num_replicas``, and
    rank ``r`` takes the ``r``-th contiguous chunk. With ``num_replicas=1`` it is a plain
    (optionally shuffled) sampler, the single-process fallback.
    """

    def __init__(self, size: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside [0, {num_replicas})")
        self.size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.num_samples = math.ceil(size / num_replicas)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            indices = np.random.default_rng((self.seed, self.epoch)).permutation(self.size)
        else:
            indices = np.arange(self.size)
        total = self.num_samples * self.num_replicas
        indices = np.resize(indices, total)  # pads by repeating from the start
        start = self.num_samples * self.rank
        return iter(indices[start : start + self.num_samples].tolist())

    def __len__(self) -> int:
        return self.num_samples


class InferenceSampler(Sampler[int]):
    """Every index exactly once across ranks: rank ``r`` takes the ``r``-th contiguous shard.

    Shard sizes differ by at most one. With ``shuffle`` the order is a permutation from ``seed``
    (maskrcnn-benchmark shuffles the test set when distributed, which balances aspect ratios across ranks).
    """

    def __init__(self, size: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = False, seed: int = 0):
        order = np.random.default_rng(seed).permutation(size) if shuffle else np.arange(size)
        bounds = np.linspace(0, size, num_replicas + 1).round().astype(int)
        self.indices = order[bounds[rank] : bounds[rank + 1]].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def padded_shape_groups(sizes: np.ndarray, orientation: np.ndarray, *, min_size: int, max_size: int,
                        size_divisibility: int) -> np.ndarray:
    """Group ids (int64, ``N``) of images by the padded shape they get at one training resize: images
    of stored ``sizes`` (``N x 2``, width and height, as the annotation cache holds them) resized by
    :func:`~.sizes.resized_size` to ``min_size`` / ``max_size``, their sides rounded up to multiples of
    ``size_divisibility`` (as :func:`~.collate.pad_images` pads a batch). The groups refine ``orientation``
    (the cache's aspect groups): two images share a group when they share both. Ids are numbered in
    increasing (orientation, height, width) order. Only the sizes are read: no image is decoded."""
    def up(side: int) -> int:
        return -(-side // size_divisibility) * size_divisibility

    keys = np.array([(int(o), *(up(s) for s in resized_size(int(h), int(w), min_size, max_size)))
                     for (w, h), o in zip(np.asarray(sizes).reshape(-1, 2), orientation)], dtype=np.int64).reshape(-1, 3)
    return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)


class GroupedBatchSampler(Sampler[list[int]]):
    """Batches whose images all come from one group (e.g. landscape or portrait).

    Follows the seed: the sampled order is split by group, each group is cut into batches of
    ``batch_size`` (the last one may be smaller unless ``drop_uneven``), and batches are emitted in
    the order of their first element in the sampled order.
    """

    def __init__(self, sampler: Sampler[int], group_ids: Sequence[int], batch_size: int, drop_uneven: bool = False):
        self.sampler = sampler
        self.group_ids = np.asarray(group_ids)
        self.batch_size = batch_size
        self.drop_uneven = drop_uneven

    def _batches(self) -> list[list[int]]:
        sampled = np.fromiter(iter(self.sampler), dtype=np.int64)
        groups = self.group_ids[sampled]
        batches = []
        for group in np.unique(groups):
            positions = np.flatnonzero(groups == group)
            for start in range(0, len(positions), self.batch_size):
                chunk = positions[start : start + self.batch_size]
                if self.drop_uneven and len(chunk) < self.batch_size:
                    continue
                batches.append((chunk[0], sampled[chunk].tolist()))
        batches.sort(key=lambda item: item[0])
        return [batch for _, batch in batches]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class IterationBasedBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields exactly ``num_iterations - start_iter`` batches, epoch after epoch.

    Epoch ``e`` calls ``sampler.set_epoch(e)`` before drawing its batches, so the sequence depends
    only on the seed: starting at ``start_iter`` skips the first ``start_iter`` batches of that very
    sequence (index work only, no data is loaded). Each element is ``(index, iteration)`` where
    ``iteration`` counts batches from 0.
    """

    def __init__(self, batch_sampler: Sampler[list[int]], num_iterations: int, start_iter: int = 0):
        if not 0 <= start_iter <= num_iterations:
            raise ValueError(f"start_iter {start_iter} outside [0, {num_iterations}]")
        self.batch_sampler = batch_sampler
        self.num_iterations = num_iterations
        self.start_iter = start_iter

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        iteration, epoch = 0, 0
        sampler = getattr(self.batch_sampler, "sampler", None)
        while iteration < self.num_iterations:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            produced = False
            for batch in self.batch_sampler:
                produced = True
                if iteration >= self.start_iter:
                    yield [(index, iteration) for index in batch]
                iteration += 1
                if iteration >= self.num_iterations:
                    return
            if not produced:
                raise ValueError("the batch sampler yields no batches: is the dataset empty?")
            epoch += 1

    def __len__(self) -> int:
        return self.num_iterations - self.start_iter
