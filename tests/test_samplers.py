from collections import Counter

import numpy as np
import pytest
from torch.utils.data import BatchSampler

from pipelines.data.samplers import DistributedSampler, GroupedBatchSampler, InferenceSampler, IterationBasedBatchSampler


def _train_batches(size=50, groups=None, batch=4, iters=40, start=0, rank=0, world=1, seed=0):
    groups = np.arange(size) % 3 == 0 if groups is None else groups
    sampler = DistributedSampler(size, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return list(IterationBasedBatchSampler(GroupedBatchSampler(sampler, groups, batch), iters, start))


def test_grouped_batches_hold_one_group_and_cover_the_epoch():
    groups = np.arange(50) % 3 == 0
    sampler = DistributedSampler(50, shuffle=True, seed=1)
    batches = list(GroupedBatchSampler(sampler, groups, 4))
    assert all(len({groups[i] for i in b}) == 1 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(50))
    assert sum(len(b) < 4 for b in batches) <= 2  # at most one partial batch per group


def test_grouped_batches_follow_the_seed_order_of_first_elements():
    order = [5, 0, 1, 7, 2, 3, 4, 6]
    groups = [1, 1, 1, 1, 0, 0, 0, 0]  # by index: 4..7 in group 0
    batches = list(GroupedBatchSampler(order, groups, 2))
    # group 0 in sampled order: 5, 7, 4, 6 -> [5, 7], [4, 6]; group 1: 0, 1, 2, 3 -> [0, 1], [2, 3]
    assert batches == [[5, 7], [0, 1], [2, 3], [4, 6]]
    assert list(GroupedBatchSampler([0, 1, 2], [0, 0, 1], 2, drop_uneven=True)) == [[0, 1]]


def test_exact_iteration_count_across_epochs():
    batches = _train_batches(size=50, batch=4, iters=40)
    assert len(batches) == 40  # 14 batches an epoch: two epochs and a bit
    assert [b[0][1] for b in batches] == list(range(40))
    assert all(len(b) <= 4 for b in batches)


def test_resuming_continues_the_same_sequence():
    full = _train_batches(iters=40)
    for start in (0, 1, 13, 27, 39, 40):
        assert _train_batches(iters=40, start=start) == full[start:]
    assert len(IterationBasedBatchSampler(BatchSampler(range(10), 3, False), 40, 25)) == 15


def test_epochs_reshuffle_and_seed_matters():
    full = _train_batches(iters=40)
    n = len(GroupedBatchSampler(DistributedSampler(50, seed=0), np.arange(50) % 3 == 0, 4))  # batches an epoch
    epoch1 = [i for b in full[:n] for i, _ in b]
    epoch2 = [i for b in full[n : 2 * n] for i, _ in b]
    assert sorted(epoch1) == sorted(epoch2) and epoch1 != epoch2
    assert _train_batches(iters=40, seed=1) != full


def test_distributed_shards_are_disjoint_and_cover():
    size, world = 53, 4
    shards = []
    for rank in range(world):
        s = DistributedSampler(size, num_replicas=world, rank=rank, shuffle=True, seed=5)
        s.set_epoch(2)
        shards.append(list(s))
    assert len({len(s) for s in shards}) == 1
    everything = [i for s in shards for i in s]
    assert set(everything) == set(range(size))
    assert len(everything) - size == 3  # the padding repeats 3 indices once
    assert max(Counter(everything).values()) == 2


def test_training_ranks_see_disjoint_batches():
    size, world = 64, 2
    groups = np.zeros(size)
    per_rank = [_train_batches(size=size, groups=groups, batch=2, iters=16, rank=r, world=world) for r in range(world)]
    first_epoch = [{i for b in batches for i, _ in b} for batches in per_rank]
    assert not first_epoch[0] & first_epoch[1]
    assert first_epoch[0] | first_epoch[1] == set(range(size))


@pytest.mark.parametrize("shuffle", [False, True])
def test_inference_shards_take_every_image_exactly_once(shuffle):
    size, world = 29, 3
    shards = [list(InferenceSampler(size, num_replicas=world, rank=r, shuffle=shuffle, seed=0)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(size))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    if not shuffle:
        assert [i for s in shards for i in s] == list(range(size))


def test_single_process_test_order_is_not_shuffled():
    assert list(InferenceSampler(7)) == list(range(7))
