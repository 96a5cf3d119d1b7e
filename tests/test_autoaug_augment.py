"""The Scale-aware AutoAugment transform: op probabilities, the ramp, fillers, determinism."""

import math
import pickle

import numpy as np
import pytest
import torch

from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.autoaug._cache import SampleCache
from pipelines.data.autoaug._pixels import MEAN_PIXEL
from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.dataset import DetectionDataset
from pipelines.data.loader import make_train_loader
from pipelines.data.transforms import Compose, ResizeShorterSide, SampleContext
from pipelines.policy import COLOR_OPS, GEO_OPS, PUBLISHED_POLICY, BoxOp, Policy, SubPolicy, ZoomOp, decode_policy

MAX_ITER = 100


pytestmark = pytest.mark.usefixtures("one_thread")


def _policy(color=("Brightness", 0.0, 10), geometric=("hflip", 0.0, 1), zoom_out=(0.0, 9), zoom_in=(0.0, 3),
            area=(1, 0, 0), prob=(1, 0, 0)):
    """One sub-policy; by default every op off and all selection weight on small boxes."""
    return Policy(zoom_out=ZoomOp(*zoom_out), zoom_in=ZoomOp(*zoom_in),
                  subpolicies=(SubPolicy(BoxOp(*color), BoxOp(*geometric)),), area_ratios=area, prob_ratios=prob)


def _image(height, width, seed=0, low=0, high=256):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (3, height, width), dtype=torch.uint8, generator=generator)


def _sample():
    # Two small boxes (selected with probability box_prob under the default ratios) and a large one.
    image = _image(120, 160, seed=1, low=20, high=221)
    boxes = [[30.0, 30.0, 60.0, 60.0], [100.0, 70.0, 130.0, 100.0], [10.0, 5.0, 150.0, 115.0]]
    target = {"boxes": torch.tensor(boxes), "labels": torch.tensor([1, 2, 3])}
    return image, target


FILLERS = [(_image(90 + 10 * k, 110, seed=50 + k), {"boxes": torch.tensor([[5.0, 5.0, 100.0, 80.0]]),
                                                    "labels": torch.tensor([40 + k])}) for k in range(5)]


def _ctx(seed, iteration=MAX_ITER, fetch=FILLERS.__getitem__, num_samples=len(FILLERS)):
    return SampleContext(rng=np.random.default_rng((7, iteration, seed)), iteration=iteration, fetch=fetch,
                         num_samples=num_samples)


def _same(a, b):
    return (torch.equal(a[0], b[0]) and torch.equal(a[1]["boxes"], b[1]["boxes"])
            and torch.equal(a[1]["labels"], b[1]["labels"]))


OPS = ([("color", name) for name in COLOR_OPS] + [("geometric", name) for name in GEO_OPS]
       + [("zoom", "zoom_out"), ("zoom", "zoom_in")])


def _one_op_policy(kind, name, prob):
    if kind == "color":
        return _policy(color=(name, prob, 9))
    if kind == "geometric":
        return _policy(geometric=(name, prob, 4))  # translate by 48 px: some copies stay inside
    return _policy(**{name: (prob, 9 if name == "zoom_out" else 3)})


@pytest.mark.parametrize("kind, name", OPS)
def test_each_op_at_probability_0_changes_nothing_and_at_1_changes_the_image(kind, name):
    image, target = _sample()
    original = image.clone()
    off = ScaleAwareAutoAugment(_one_op_policy(kind, name, 0.0), box_prob=1.0, max_iter=MAX_ITER)
    on = ScaleAwareAutoAugment(_one_op_policy(kind, name, 1.0), box_prob=1.0, max_iter=MAX_ITER)
    for seed in range(6):
        out, t = off(image, target, _ctx(seed))
        assert torch.equal(out, image) and torch.equal(t["boxes"], target["boxes"])
        out, t = on(image, target, _ctx(seed))
        assert out.shape == image.shape and out.dtype == torch.uint8
        assert not torch.equal(out, image)
        if kind != "zoom":
            # Only the selected (small) boxes: the pixels far from both are untouched.
            assert torch.equal(out[:, :, :5], image[:, :, :5]) or kind == "color"
            assert torch.equal(t["boxes"][:3], target["boxes"])
        assert len(t["labels"]) == len(t["boxes"])
    assert torch.equal(image, original)  # never modified in place


def test_zoom_probabilities_are_exactly_the_configured_ones():
    # The published 0.30 / 0.25; the original's second draw would make zoom_out fire 41% of the time.
    policy = decode_policy(PUBLISHED_POLICY)
    augment = ScaleAwareAutoAugment(policy, max_iter=MAX_ITER)
    image = _image(24, 32)
    target = {"boxes": torch.tensor([[6.0, 5.0, 26.0, 19.0]]), "labels": torch.tensor([1])}
    n, outs, ins = 4000, 0, 0
    for seed in range(n):
        # Iteration 0: the box-level ops are off, the zoom ops are not (they do not ramp).
        out, t = augment(image, target, _ctx(seed, iteration=0))
        if len(t["boxes"]) > 1:  # the fillers' boxes
            outs += 1
        elif not torch.equal(out, image):
            ins += 1
    for freq, p in ((outs / n, 0.30), (ins / n, 0.25)):
        assert abs(freq - p) < 4.5 * math.sqrt(p * (1 - p) / n), (freq, p)


def test_zoom_out_draws_fillers_through_fetch_or_fills_with_the_mean_pixel():
    augment = ScaleAwareAutoAugment(_policy(zoom_out=(1.0, 9)), max_iter=MAX_ITER)
    image, target = _sample()
    fetched = []

    def fetch(index):
        fetched.append(index)
        return FILLERS[index]

    out, t = augment(image, target, _ctx(0, fetch=fetch))
    assert len(fetched) == 3 and len(set(fetched)) == 3 and all(0 <= i < len(FILLERS) for i in fetched)
    assert t["labels"].tolist() == [1, 2, 3] + [40 + i for i in fetched]
    out, t = augment(image, target, _ctx(0, fetch=None, num_samples=0))
    mean = torch.tensor([round(m) for m in MEAN_PIXEL], dtype=torch.uint8).view(3, 1)
    assert out.shape == image.shape and (out[:, 60:, 80:].reshape(3, -1) == mean).all()
    assert t["labels"].tolist() == [1, 2, 3]


def test_ramp_is_a_function_of_the_iteration():
    augment = ScaleAwareAutoAugment(_policy(), max_iter=200)
    assert [augment.ramp(k) for k in (0, 50, 100, 200, 10_000, -5)] == [0.0, 0.25, 0.5, 1.0, 1.0, 0.0]


def test_box_ops_fire_with_probability_p_times_the_ramp():
    augment = ScaleAwareAutoAugment(_policy(color=("Brightness", 1.0, 10)), box_prob=1.0, max_iter=MAX_ITER)
    image, target = _sample()

    def fired(iteration, n):
        return sum(not torch.equal(augment(image, target, _ctx(s, iteration))[0], image) for s in range(n))

    assert fired(0, 100) == 0
    assert fired(MAX_ITER, 100) == 100
    n = 1000
    freq = fired(MAX_ITER // 4, n) / n
    assert abs(freq - 0.25) < 4.5 * math.sqrt(0.25 * 0.75 / n)
    augment = ScaleAwareAutoAugment(_policy(color=("Brightness", 0.5, 10)), box_prob=1.0, max_iter=MAX_ITER)
    assert 60 < fired(MAX_ITER, 200) < 140  # p = 0.5 at full ramp
    freq = fired(MAX_ITER // 2, n) / n
    assert abs(freq - 0.25) < 4.5 * math.sqrt(0.25 * 0.75 / n)


def test_the_ramp_does_not_depend_on_what_the_transform_did_before():
    policy = decode_policy(PUBLISHED_POLICY)
    image, target = _sample()
    fresh = ScaleAwareAutoAugment(policy, max_iter=MAX_ITER)
    busy = ScaleAwareAutoAugment(policy, max_iter=MAX_ITER)
    for seed in range(40):  # e.g. another worker's history, or the epochs before a resume
        busy(image, target, _ctx(1000 + seed, iteration=seed * 3))
    for k in (0, 10, 60, MAX_ITER):
        for seed in range(10):
            assert _same(fresh(image, target, _ctx(seed, k)), busy(image, target, _ctx(seed, k)))


def test_same_seed_and_iteration_give_the_same_output_and_others_differ():
    augment = ScaleAwareAutoAugment(decode_policy(PUBLISHED_POLICY), max_iter=MAX_ITER)
    image, target = _sample()
    outputs = []
    for seed in range(30):
        first = augment(image, target, _ctx(seed))
        assert _same(first, augment(image, target, _ctx(seed)))
        outputs.append(first[0])
    assert len({o.numpy().tobytes() for o in outputs}) > 10


def test_cached_and_fresh_fillers_give_the_same_output():
    policy = decode_policy(PUBLISHED_POLICY)
    cached = ScaleAwareAutoAugment(policy, max_iter=MAX_ITER, filler_cache_mb=1.0)
    uncached = ScaleAwareAutoAugment(policy, max_iter=MAX_ITER, filler_cache_mb=0)
    image, target = _sample()
    for seed in range(60):
        assert _same(cached(image, target, _ctx(seed)), uncached(image, target, _ctx(seed)))
    assert cached._fillers.hits > 10 and uncached._fillers.hits == 0


def test_outputs_stay_valid_under_the_published_policy():
    augment = ScaleAwareAutoAugment(decode_policy(PUBLISHED_POLICY), max_iter=MAX_ITER)
    image, target = _sample()
    original = image.clone()
    counts = set()
    for seed in range(150):
        out, t = augment(image, target, _ctx(seed))
        boxes, labels = t["boxes"], t["labels"]
        assert out.shape == image.shape and out.dtype == torch.uint8
        assert boxes.dtype == torch.float32 and labels.dtype == torch.int64 and len(boxes) == len(labels)
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 160).all() and (boxes[:, 3] <= 120).all()
        counts.add(len(boxes))
    assert torch.equal(image, original)
    assert len(counts) > 2  # zoom in drops, zoom out and translate add


@pytest.mark.parametrize("kind, name", OPS)
def test_an_image_without_boxes_goes_through_every_op(kind, name):
    augment = ScaleAwareAutoAugment(_one_op_policy(kind, name, 1.0), box_prob=1.0, max_iter=MAX_ITER)
    image = _image(60, 80, seed=3)
    empty = {"boxes": torch.zeros((0, 4)), "labels": torch.zeros(0, dtype=torch.int64)}
    out, t = augment(image, empty, _ctx(0, fetch=None, num_samples=0))
    assert out.shape == image.shape and t["boxes"].shape == (0, 4) and len(t["labels"]) == 0
    if kind != "zoom" or name == "zoom_in":
        assert torch.equal(out, image)  # nothing to select, nothing survives a crop


STRONG = [8, 9, 8, 3,  3, 9, 5, 4, 9, 4,  6, 9, 5, 1, 9, 5,  1, 9, 0, 2, 9, 6,  2, 9, 5, 0, 9, 1,  5, 9, 8, 5, 9, 8,
          1, 1, 1, 1, 1, 1]


def _collect(loader):
    return [(b.images.clone(), [t["boxes"].clone() for t in b.targets], [t["labels"].clone() for t in b.targets],
             b.indices) for b in loader]


def test_data_loader_output_does_not_depend_on_the_number_of_workers(tiny_cache):
    augment = ScaleAwareAutoAugment(decode_policy(STRONG), box_prob=1.0, max_iter=6, filler_cache_mb=2.0)
    resize = ResizeShorterSide([160, 192], 256)
    dataset = DetectionDataset(tiny_cache, transforms=Compose([resize, augment]), seed=5)
    kwargs = dict(batch_size=2, max_iter=6, seed=0, aspect_grouping=False)
    in_process = _collect(make_train_loader(dataset, num_workers=0, **kwargs))
    two_workers = _collect(make_train_loader(dataset, num_workers=2, **kwargs))
    plain = _collect(make_train_loader(DetectionDataset(tiny_cache, transforms=Compose([resize]), seed=5),
                                       num_workers=0, **kwargs))
    assert len(in_process) == len(two_workers) == 6
    for (ia, ba, la, xa), (ib, bb, lb, xb) in zip(in_process, two_workers):
        assert xa == xb and torch.equal(ia, ib)
        assert all(torch.equal(p, q) for p, q in zip(ba, bb)) and all(torch.equal(p, q) for p, q in zip(la, lb))
    changed = sum(not (ia.shape == ip.shape and torch.equal(ia, ip)) for (ia, *_), (ip, *_) in zip(in_process, plain))
    assert changed >= 3  # the augmentation really ran


def test_repr():
    policy = decode_policy(PUBLISHED_POLICY)
    augment = ScaleAwareAutoAugment(policy, max_iter=90)
    text = repr(augment)
    assert text.startswith("ScaleAwareAutoAugment(scale_splits=[2048, 10240, 51200], box_prob=0.3, max_iter=90")
    assert str(policy) in text.replace("\n    ", "\n")


def test_sample_cache_is_an_lru_bounded_by_pixel_bytes():
    calls = []

    def fetch(index):
        calls.append(index)
        side = 10 if index < 10 else 1  # 300 bytes; from index 10 on, 30 bytes
        return torch.zeros((3, side, 10), dtype=torch.uint8), {"index": index}

    cache = SampleCache(max_bytes=700)
    assert cache.get(1, fetch) is cache.get(1, fetch)
    cache.get(2, fetch)
    cache.get(1, fetch)  # 1 is now the most recent
    cache.get(3, fetch)  # evicts 2
    assert len(cache) == 2
    cache.get(2, fetch)  # evicts 1
    assert calls == [1, 2, 3, 2]
    # 600 bytes held (3 and 2): three 30-byte samples fit beside them, a fourth evicts the oldest, 3.
    for index in (10, 11, 12, 13):
        cache.get(index, fetch)
    cache.get(2, fetch)
    assert len(cache) == 5 and calls == [1, 2, 3, 2, 10, 11, 12, 13]
    cache.get(3, fetch)
    assert calls[-1] == 3
    off = SampleCache(max_bytes=0)
    off.get(1, fetch), off.get(1, fetch)
    assert calls[-2:] == [1, 1] and len(off) == 0
    # Each worker process starts with an empty cache of the same bound.
    copy = pickle.loads(pickle.dumps(cache))
    assert len(copy) == 0 and copy.max_bytes == 700


def _always_zoom_out(policy: Policy) -> Policy:
    return Policy(zoom_out=ZoomOp(1.0, 9), zoom_in=ZoomOp(0.0, 3), subpolicies=policy.subpolicies,
                  area_ratios=policy.area_ratios, prob_ratios=policy.prob_ratios)


def _zooming_out_dataset(cache, *, filler_cache_mb, seed=5, filler_pool=0):
    """Training's path (stored image, resize, augmentation with fillers fetched by the dataset) with
    zoom_out on every sample and strong box-level ops, so fillers are loaded for every sample."""
    augment = ScaleAwareAutoAugment(_always_zoom_out(decode_policy(STRONG)), box_prob=1.0, max_iter=4,
                                    filler_cache_mb=filler_cache_mb, filler_pool=filler_pool, filler_pool_iters=2)
    transforms = Compose([ResizeShorterSide([160, 192], 256), augment])
    return DetectionDataset(cache, transforms=transforms, seed=seed), augment


def _same_sample(a, b):
    return (torch.equal(a[0], b[0]) and torch.equal(a[1]["boxes"], b[1]["boxes"])
            and torch.equal(a[1]["labels"], b[1]["labels"]) and a[2] == b[2])


def _check_fillers_cached_or_decoded_give_the_same_samples(cache, filler_pool=0):
    cached, cached_augment = _zooming_out_dataset(cache, filler_cache_mb=64.0, filler_pool=filler_pool)
    decoded, decoded_augment = _zooming_out_dataset(cache, filler_cache_mb=0, filler_pool=filler_pool)
    keys = [(index, iteration) for iteration in (0, 2, 4) for index in range(len(cache))]
    first = [cached[key] for key in keys]
    assert cached_augment._fillers.hits > 0  # already during the first pass, with 3 fillers per sample
    hits = cached_augment._fillers.hits
    for key, sample in zip(keys, first):
        assert _same_sample(sample, decoded[key])  # fillers decoded from their files every time
        assert _same_sample(sample, cached[key])  # the same key again, now mostly from the cache
    assert cached_augment._fillers.hits > hits and decoded_augment._fillers.hits == 0
    # The fillers really are in the output: their boxes are added to the sample's own.
    assert any(len(s[1]["boxes"]) > len(cache.annotations(s[2])[0]) for s in first)
    assert len({s[0].numpy().tobytes() for s in first}) == len(first)  # every (index, iteration) differs


@pytest.mark.parametrize("filler_pool", [0, 4])
def test_a_sample_is_the_same_whether_its_fillers_were_cached_or_decoded_from_files(tiny_cache, filler_pool):
    _check_fillers_cached_or_decoded_give_the_same_samples(tiny_cache, filler_pool)


def test_fillers_come_from_a_pool_shared_by_every_worker_that_changes_every_block():
    """200 samples over 4 blocks of 5 iterations, in two augmenters (two workers, each with its own
    cache, off here to see every draw): every filler of a block is one of its pool's 8 indices; both draw the same; each block's
    pool differs; without a pool the same samples draw from all 1000 indices."""
    from pipelines.data.autoaug.augment import filler_pool

    policy = _always_zoom_out(decode_policy(PUBLISHED_POLICY))
    image, target = _sample()

    def fillers_drawn(pool: int, seed: int = 3) -> dict[int, list[int]]:
        augment = ScaleAwareAutoAugment(policy, max_iter=20, filler_cache_mb=0, filler_pool=pool, filler_pool_iters=5)
        drawn = {}
        for iteration in range(20):
            for index in range(10):
                fetch = lambda i: (drawn.setdefault(iteration // 5, []).append(i), FILLERS[i % 5])[1]  # noqa: B023
                augment(image, target, SampleContext(rng=np.random.default_rng((seed, iteration, index)),
                                                     iteration=iteration, fetch=fetch, num_samples=1000, seed=seed))
        return drawn

    drawn = fillers_drawn(8)
    assert drawn == fillers_drawn(8)  # another worker: the same fillers
    for block, indices in drawn.items():
        pool = filler_pool(3, block, 1000, 8)
        assert len(pool) == 8 and set(indices) <= set(pool.tolist()) and len(indices) == 150  # 3 per sample
    assert len({filler_pool(3, block, 1000, 8).tobytes() for block in range(4)}) == 4
    assert filler_pool(4, 0, 1000, 8).tolist() != filler_pool(3, 0, 1000, 8).tolist()  # and with the seed
    assert len({i for indices in fillers_drawn(0).values() for i in indices}) > 400
    assert filler_pool(3, 0, 5, 8).tolist() == [0, 1, 2, 3, 4]  # a split smaller than the pool: all of it


def test_the_same_holds_for_real_coco_photos(coco_real, tmp_path):
    # Real JPEGs, among them a greyscale one, decoded as training decodes them.
    annotations, images = coco_real
    build_cache(annotations, tmp_path / "cache", image_root=str(images), drop_empty=True)
    _check_fillers_cached_or_decoded_give_the_same_samples(AnnotationCache(tmp_path / "cache"))


def test_the_same_seed_gives_the_same_sample_twice(tiny_cache):
    # Two datasets (as two workers or two runs would hold), each asked twice.
    first, _ = _zooming_out_dataset(tiny_cache, filler_cache_mb=64.0)
    second, _ = _zooming_out_dataset(tiny_cache, filler_cache_mb=64.0)
    for key in [(0, 4), (3, 4), (5, 1), (0, 4)]:
        sample = first[key]
        assert _same_sample(sample, first[key]) and _same_sample(sample, second[key])
    other_seed, _ = _zooming_out_dataset(tiny_cache, filler_cache_mb=64.0, seed=6)
    assert not torch.equal(first[(0, 4)][0], other_seed[(0, 4)][0])


def test_the_output_does_not_depend_on_the_input_memory_layout():
    # Decoded images are stored interleaved ([H, W, 3] in memory), synthetic ones plane by plane.
    augment = ScaleAwareAutoAugment(decode_policy(STRONG), box_prob=1.0, max_iter=MAX_ITER)
    image, target = _sample()
    interleaved = image.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    fillers = [(f.permute(1, 2, 0).contiguous().permute(2, 0, 1), t) for f, t in FILLERS]
    for seed in range(40):
        planar_out = augment(image, target, _ctx(seed))
        assert _same(planar_out, augment(interleaved, target, _ctx(seed)))
        assert _same(planar_out, augment(image, target, _ctx(seed, fetch=fillers.__getitem__)))
