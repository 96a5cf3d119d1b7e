import pytest
import torch

from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.dataset import DetectionDataset
from pipelines.data.loader import make_test_loader, make_train_loader
from pipelines.data.transforms import Compose, RandomHorizontalFlip, build_transforms
from pipelines.policy import PUBLISHED_POLICY, decode_policy


@pytest.fixture
def train_set(tiny_cache):
    transforms = build_transforms(min_sizes=[160, 192], max_size=256, augment=RandomHorizontalFlip(0.5))
    return DetectionDataset(tiny_cache, transforms=transforms, seed=11)


def _collect(loader):
    return [(b.images.clone(), [t["boxes"].clone() for t in b.targets], b.indices) for b in loader]


def test_train_loader_yields_exactly_max_iter_padded_batches(train_set):
    batches = list(make_train_loader(train_set, batch_size=2, max_iter=7, world_size=2, rank=1, seed=0,
                                     size_divisibility=32))
    assert len(batches) == 7
    for batch in batches:
        assert batch.images.shape[0] <= 2
        assert batch.images.shape[-1] % 32 == 0 and batch.images.shape[-2] % 32 == 0
        groups = {int(train_set.aspect_groups[i]) for i in batch.indices}
        assert len(groups) == 1
        for target, (h, w) in zip(batch.targets, batch.image_sizes):
            boxes = target["boxes"]
            assert len(boxes) == len(target["labels"]) > 0
            assert (boxes[:, 2:] > boxes[:, :2]).all()
            assert (boxes[:, 2] <= w + 1e-3).all() and (boxes[:, 3] <= h + 1e-3).all()


def test_samples_do_not_depend_on_the_number_of_workers(train_set):
    kwargs = dict(batch_size=2, max_iter=5, seed=0)
    in_process = _collect(make_train_loader(train_set, num_workers=0, **kwargs))
    two_workers = _collect(make_train_loader(train_set, num_workers=2, **kwargs))
    assert len(in_process) == len(two_workers) == 5
    for (ia, ba, xa), (ib, bb, xb) in zip(in_process, two_workers):
        assert xa == xb and torch.equal(ia, ib)
        assert all(torch.equal(p, q) for p, q in zip(ba, bb))


@pytest.mark.parametrize("augment", ["flip", "sa_autoaug"])
def test_resumed_loader_continues_with_identical_samples(tiny_cache, augment):
    """Resuming at iteration 5 gives the very batches (and augmentation ramp) of an uninterrupted run."""
    flip = RandomHorizontalFlip(0.5)
    autoaug = ScaleAwareAutoAugment(decode_policy(PUBLISHED_POLICY), max_iter=8)
    transforms = build_transforms(min_sizes=[160], max_size=256,
                                  augment=Compose([flip, autoaug]) if augment == "sa_autoaug" else flip)
    train_set = DetectionDataset(tiny_cache, transforms=transforms, seed=11)
    full = _collect(make_train_loader(train_set, batch_size=2, max_iter=8, seed=0))
    resumed = _collect(make_train_loader(train_set, batch_size=2, max_iter=8, start_iter=5, seed=0))
    assert len(resumed) == 3
    for (ia, ba, xa), (ib, bb, xb) in zip(full[5:], resumed):
        assert xa == xb and torch.equal(ia, ib)
        assert all(torch.equal(p, q) for p, q in zip(ba, bb))


def test_test_loader_covers_every_image_once_across_ranks(tiny_cache):
    dataset = DetectionDataset(tiny_cache, transforms=build_transforms(min_sizes=[160], max_size=256),
                               skip_crowd=False)
    seen = []
    for rank in range(2):
        for batch in make_test_loader(dataset, batch_size=2, world_size=2, rank=rank):
            assert len(batch.indices) <= 2
            seen += batch.indices
    assert sorted(seen) == list(range(len(dataset)))
