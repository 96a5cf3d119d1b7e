"""The one edge from params to objects: each builder passes the params it is given, and only those."""

import dataclasses

import pytest
import torch
import yaml

from pipelines import build
from pipelines.compose import compose_params
from pipelines.config import Params, load_params, params_from_dict
from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.dataset import DetectionDataset
from pipelines.data import transforms
from pipelines.data.transforms import Compose, RandomHorizontalFlip, ResizeShorterSide
from pipelines.policy import decode_policy

from .conftest import REPO


@pytest.fixture(scope="module")
def params() -> Params:
    return load_params(REPO / "params.yaml")


def _with(p: Params, section: str, **values) -> Params:
    return dataclasses.replace(p, **{section: dataclasses.replace(getattr(p, section), **values)})


def test_sa_autoaug_preset_is_the_flip_then_the_policy_with_the_params_settings(params):
    a = params.augment
    assert a.name == "sa_autoaug"
    augmentation = build.augmentation(params)
    flip, autoaug = augmentation.transforms
    assert isinstance(flip, RandomHorizontalFlip) and flip.prob == a.hflip_prob
    assert isinstance(autoaug, ScaleAwareAutoAugment)
    assert autoaug.policy == decode_policy(a.policy, a.n_subpolicies) == build.policy(params)
    assert autoaug.scale_splits == tuple(a.scale_splits) and autoaug.box_prob == a.box_prob
    assert autoaug.max_iter == params.train.max_iter and autoaug.filler_cache_mb == a.filler_cache_mb


@pytest.mark.parametrize("preset", ["none", "flip"])
def test_other_presets(preset):
    p = params_from_dict(yaml.safe_load(compose_params(REPO, [f"augment={preset}"])))
    augmentation = build.augmentation(p)
    assert build.policy(p) is None
    if preset == "none":
        assert augmentation is None
    else:
        assert isinstance(augmentation, RandomHorizontalFlip) and augmentation.prob == p.augment.hflip_prob


def test_transforms_resize_to_the_train_or_test_sizes(params):
    m = params.model
    train = build.train_transforms(params)
    assert isinstance(train, Compose) and len(train.transforms) == 2
    resize = train.transforms[0]
    assert isinstance(resize, ResizeShorterSide) and (resize.min_sizes, resize.max_size) == (m.min_size_train,
                                                                                              m.max_size_train)
    plain = build.train_transforms(params, augment=False)
    assert len(plain.transforms) == 1 and plain.transforms[0].min_sizes == m.min_size_train
    test = build.test_transforms(params).transforms
    assert len(test) == 1 and (test[0].min_sizes, test[0].max_size) == ([m.min_size_test], m.max_size_test)


def test_test_time_augmentation_only_when_asked(params):
    assert build.test_time_augmentation(params) is None
    tta = build.test_time_augmentation(_with(params, "evaluate", tta=True, tta_scales=[200, 300], tta_flip=False))
    assert tta == transforms.TestTimeAugmentation(scales=(200, 300), max_size=params.evaluate.tta_max_size, flip=False)


def test_detector_follows_the_model_section(params):
    p = _with(params, "model", fpn_channels=64, head_convs=1, precision="fp32", channels_last=False, score_thresh=0.2,
              nms_thresh=0.5, detections_per_img=7, topk_candidates=50)
    model = build.detector(p, num_classes=3)
    assert model.backbone.out_channels == 64 and model.autocast_dtype is None and not model.channels_last
    assert len([m for m in model.head.classification_head.conv if isinstance(m, torch.nn.Conv2d)]) == 1
    assert model.head.classification_head.num_classes == 3
    assert (model.score_thresh, model.nms_thresh, model.detections_per_img, model.topk_candidates) == (0.2, 0.5, 7, 50)
    assert build.detector(params, num_classes=3).autocast_dtype == torch.bfloat16


def test_loaders_split_the_global_batch_across_processes(params, tiny_cache):
    p = _with(_with(params, "train", ims_per_batch=4, max_iter=5), "loader", num_workers=0)
    p = _with(p, "evaluate", ims_per_batch=4)
    dataset = DetectionDataset(tiny_cache, transforms=build.train_transforms(p, augment=False), seed=p.seed)
    batches = list(build.train_loader(p, dataset, rank=1, world_size=2, device=torch.device("cpu"), start_iter=2))
    assert len(batches) == 3 and all(len(b.indices) <= 2 for b in batches)
    shards = [list(build.test_loader(p, dataset, rank=r, world_size=2)) for r in range(2)]
    assert all(len(b.indices) <= 2 for shard in shards for b in shard)
    assert sorted(i for shard in shards for b in shard for i in b.indices) == list(range(len(dataset)))


def test_optimizer_and_schedule_follow_the_train_section(params):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    p = _with(params, "train", optimizer="sgd", base_lr=0.5, momentum=0.8, weight_decay=0.01, norm_weight_decay=0.0,
              warmup_iters=10, warmup_factor=0.2)
    optimizer = build.optimizer(p, model)
    assert isinstance(optimizer, torch.optim.SGD)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert optimizer.param_groups[0]["momentum"] == 0.8
    build.scheduler(p, optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 0.2)  # the warm-up factor at iteration 0
    assert isinstance(build.optimizer(params, model), torch.optim.AdamW)
