from collections import Counter

import numpy as np
import pytest
from torch.utils.data import BatchSampler

from pipelines.data.samplers import (DistributedSampler, GroupedBatchSampler, InferenceSampler, IterationBasedBatchSampler,
                                     padded_shape_groups)
from pipelines.data.sizes import resized_size


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


# --- padded-shape grouping (loader.padded_shape_grouping) ------------------------------------------------------


def _sizes(count=120, seed=3):
    """Stored (width, height) pairs as the annotation cache holds them: sides 256..416, both orientations."""
    return np.random.default_rng(seed).integers(256, 417, size=(count, 2))


def _padding(batches, resized, divisor=32):
    """The fraction of padded pixels in ``batches`` of (index, iteration) pairs, and each batch's padded shape."""
    image = padded = 0
    shapes = []
    for batch in batches:
        idx = [i for i, _ in batch]
        shape = tuple(-(-int(resized[idx, k].max()) // divisor) * divisor for k in (0, 1))
        image += int((resized[idx, 0] * resized[idx, 1]).sum())
        padded += shape[0] * shape[1] * len(idx)
        shapes.append(shape)
    return 1 - image / padded, shapes


def test_padded_shape_groups_give_one_shape_per_batch_less_padding_and_resume_on_every_rank():
    sizes = _sizes()
    orientation = (sizes[:, 1] >= sizes[:, 0]).astype(np.uint8)
    groups = padded_shape_groups(sizes, orientation, min_size=256, max_size=320, size_divisibility=32)
    resized = np.array([resized_size(int(h), int(w), 256, 320) for w, h in sizes])
    up = -(-resized // 32) * 32
    assert len(np.unique(groups)) > 2
    for g in np.unique(groups):  # a group is one padded shape within one orientation
        assert len({tuple(s) for s in up[groups == g]}) == 1 and len(set(orientation[groups == g])) == 1
    for rank in range(2):
        by_shape = _train_batches(size=len(sizes), groups=groups, batch=4, iters=60, rank=rank, world=2)
        by_orientation = _train_batches(size=len(sizes), groups=orientation, batch=4, iters=60, rank=rank, world=2)
        shape_padding, shapes = _padding(by_shape, resized)
        orientation_padding, _ = _padding(by_orientation, resized)
        assert shape_padding < 0.7 * orientation_padding
        assert all(len({tuple(up[i]) for i, _ in b}) == 1 for b in by_shape)  # every batch: one padded shape
        for start in (1, 29, 59):
            assert _train_batches(size=len(sizes), groups=groups, batch=4, iters=60, start=start, rank=rank,
                                  world=2) == by_shape[start:]
    first = [{i for b in _train_batches(size=len(sizes), groups=groups, batch=4, iters=10, rank=r, world=2)
              for i, _ in b} for r in range(2)]
    assert not first[0] & first[1]  # the ranks' shards stay disjoint
