"""What the model sees, from params: train and test transforms, the training augmentation (the presets,
or a given Scale-aware AutoAugment policy as the search applies it), the test loader, the test-time
augmentation and the augmentation preview. The train loaders run to the schedule's end: :mod:`.train`.
"""

from __future__ import annotations

from pathlib import Path

from ..config.schema import Params, registry
from ..data.autoaug.augment import ScaleAwareAutoAugment
from ..data.dataset import DetectionDataset
from ..data.loader import make_test_loader
from ..data.preview import augmentation_preview
from ..data.transforms import Compose, RandomHorizontalFlip, TestTimeAugmentation, build_transforms
from ..policy import Policy, decode_policy, trivial_policy, trivial_zoom_policy


def policy(p: Params) -> Policy | None:
    """The decoded Scale-aware AutoAugment policy of ``p.augment``, or ``None`` for other presets.
    Decode it once per process and pass it on (:func:`augmentation`)."""
    augment = p.augment
    return decode_policy(augment.policy, augment.n_subpolicies) if augment.name == "sa_autoaug" else None


def augmentation(p: Params, policy: Policy | None = None, *, ramp: bool = True):
    """The training augmentation as one transform, or ``None``.

    With ``policy`` (decoded: :func:`policy`, or a search candidate's): the flip, then Scale-aware
    AutoAugment with it, ramped up over ``train.max_iter`` iterations and off in the tail of ``augment.off_tail``
    (:func:`tail_start`) or, without ``ramp``, at full strength from the first to the last (the search's fine-tunes). Without, the preset ``p.augment.name``: ``none``: nothing;
    ``flip``: horizontal flip with ``hflip_prob``; ``sa_autoaug``: as with its policy (decoded here: a caller
    that also logs the policy passes the one it decoded); ``trivial``: the flip, then one box-level op of the
    same set at a uniform level, always but in the tail (:func:`pipelines.policy.trivial_policy`);
    ``trivial_zoom``: the same after a zoom_out, zoom_in or no zoom, one third each, at a uniform level, its
    fillers drawn as ``sa_autoaug``'s are (:func:`pipelines.policy.trivial_zoom_policy`).
    """
    if policy is not None:
        return _scale_aware(p, policy, ramp=ramp)
    return AUGMENTATIONS[p.augment.name](p)


def tail_start(p: Params) -> int | None:
    """The iteration from which the strong augmentation is off (``augment.off_tail``: the last
    ``round(off_tail * train.max_iter)`` iterations of the schedule run the resize and flip only), or ``None``
    without a tail. A function of the params alone, so a resumed run turns it off at the same iteration."""
    length = round(p.augment.off_tail * p.train.max_iter)
    return p.train.max_iter - length if length > 0 else None


def _flip(p: Params) -> RandomHorizontalFlip:
    return RandomHorizontalFlip(p.augment.hflip_prob)


def _scale_aware(p: Params, policy: Policy, *, ramp: bool) -> Compose:
    augment = p.augment
    autoaug = ScaleAwareAutoAugment(policy, scale_splits=augment.scale_splits, box_prob=augment.box_prob,
                                    max_iter=p.train.max_iter if ramp else 0, filler_cache_mb=augment.filler_cache_mb,
                                    filler_pool=augment.filler_pool, filler_pool_iters=augment.filler_pool_iters,
                                    off_from=tail_start(p) if ramp else None,
                                    translate_relative=bool(augment.translate_relative))
    return Compose([_flip(p), autoaug])


def _trivial(p: Params) -> Compose:
    augment = p.augment  # no ramp (max_iter 0): TrivialAugment applies its op at once, at full strength
    return Compose([_flip(p), ScaleAwareAutoAugment(trivial_policy(), scale_splits=augment.scale_splits,
                                                    box_prob=augment.box_prob, max_iter=0, filler_cache_mb=0,
                                                    off_from=tail_start(p),
                                                    translate_relative=bool(augment.translate_relative))])


def _trivial_zoom(p: Params) -> Compose:
    augment = p.augment  # as _trivial, no ramp; zoom_out's fillers as sa_autoaug's (pool, cache)
    autoaug = ScaleAwareAutoAugment(trivial_zoom_policy(), scale_splits=augment.scale_splits, box_prob=augment.box_prob,
                                    max_iter=0, filler_cache_mb=augment.filler_cache_mb,
                                    filler_pool=augment.filler_pool, filler_pool_iters=augment.filler_pool_iters,
                                    off_from=tail_start(p), translate_relative=bool(augment.translate_relative))
    return Compose([_flip(p), autoaug])


# augment.name: the names config validation accepts are these keys (config.registry).
AUGMENTATIONS = registry("augment.name", {"none": lambda p: None, "flip": _flip,
                                          "sa_autoaug": lambda p: _scale_aware(p, policy(p), ramp=True),
                                          "trivial": _trivial, "trivial_zoom": _trivial_zoom})


def train_transforms(p: Params, augmentation) -> Compose:
    """Resize to the training sizes, then ``augmentation`` (:func:`augmentation`; ``None``: resize only)."""
    return build_transforms(min_sizes=p.model.min_size_train, max_size=p.model.max_size_train, augment=augmentation)


def test_transforms(p: Params) -> Compose:
    """Resize to the test size."""
    return build_transforms(min_sizes=[p.model.min_size_test], max_size=p.model.max_size_test)


def test_time_augmentation(p: Params, *, always: bool = False) -> TestTimeAugmentation | None:
    """The extra test-time views of ``p.evaluate``, or ``None`` when ``evaluate.tta`` is off (``always``:
    the views ``evaluate.tta_*`` describe, even then)."""
    evaluate = p.evaluate
    return (TestTimeAugmentation(tuple(evaluate.tta_scales), evaluate.tta_max_size, evaluate.tta_flip,
                                 evaluate.tta_source)
            if evaluate.tta or always else None)


def test_loader(p: Params, dataset, *, rank: int, world_size: int):
    """This rank's shard of the test set in batches of ``evaluate.ims_per_batch / world_size``."""
    return make_test_loader(dataset, batch_size=p.evaluate.ims_per_batch // world_size,
                            aspect_grouping=p.loader.aspect_grouping, num_workers=p.loader.num_workers,
                            size_divisibility=p.loader.size_divisibility, seed=p.seed, rank=rank,
                            world_size=world_size)


def preview(p: Params, augmented: DetectionDataset, *, count: int, iteration: int, path: Path) -> Path:
    """Write the PNG of the first ``count`` samples of ``augmented``'s images resized only (row 1) and as
    ``augmented`` gives them at ``iteration`` (row 2; :func:`pipelines.data.preview.augmentation_preview`)."""
    resized = DetectionDataset(augmented.cache, transforms=train_transforms(p, None), seed=p.seed)
    return augmentation_preview(resized, augmented, count=count, iteration=iteration, path=path)
