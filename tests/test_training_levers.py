"""Training levers behind params, off by default: padded-shape batching, the strong-augmentation-off tail
and the quality focal loss (issue 35). The samplers' side of padded-shape batching: tests/test_samplers.py;
the ONNX scoring of a quality-focal-loss model: tests/test_onnx_export.py."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from pipelines.build import data as build_data
from pipelines.build import train as build_train
from pipelines.config.load import params_from_dict
from pipelines.data.collate import pad_images
from pipelines.data.dataset import DetectionDataset
from pipelines.errors import ConfigError
from pipelines.model import build_detector
from pipelines.scale_loss import SEARCH_BOUNDS, paired_iou, quality_focal_loss

from .conftest import set_dotted, spy_on_head_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _params(base: dict, **changes):
    raw = copy.deepcopy(base)
    for key, value in changes.items():
        set_dotted(raw, key.replace("__", "."), value)
    return params_from_dict(raw, source="params.yaml")


def test_the_default_params_turn_every_lever_off_but_the_adopted_one(base_params, tiny_cache):
    p = _params(base_params)
    assert (p.loader.padded_shape_grouping, p.augment.off_tail, p.model.cls_loss) == (True, 0.0, "focal")
    assert build_train.batch_groups(p, DetectionDataset(tiny_cache, transforms=None)) is not None
    off = _params(base_params, loader__padded_shape_grouping=False)
    assert build_train.batch_groups(off, DetectionDataset(tiny_cache, transforms=None)) is None
    assert build_data.tail_start(p) is None
    assert build_data.augmentation(p).transforms[1].off_from is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"loader__padded_shape_grouping": True, "model__min_size_train": [224, 256]},
     "params.yaml: loader.padded_shape_grouping: expected false with several model.min_size_train ([224, 256]: "
     "the size is drawn per image and iteration, after batching), got True"),
    ({"loader__padded_shape_grouping": True, "loader__aspect_grouping": False},
     "params.yaml: loader.padded_shape_grouping: expected false with loader.aspect_grouping false"),
    ({"augment__off_tail": -0.1}, "params.yaml: augment.off_tail: expected a fraction of train.max_iter in [0, 1)"),
    ({"augment__off_tail": KeyError}, "params.yaml: augment.off_tail: missing value (required by augment.name=sa_autoaug)"),
])
def test_bad_lever_settings_stop_with_one_line_naming_the_param(base_params, changes, message):
    with pytest.raises(ConfigError) as err:
        _params(base_params, **changes)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_tail_with_the_flip_alone_is_ignored(base_params):
    """The policy search's baseline trains with ``--set augment.name=flip`` over params that may have a tail."""
    p = _params(base_params, augment__off_tail=0.2, augment__name="flip")
    assert build_data.augmentation(p).__class__.__name__ == "RandomHorizontalFlip"


def test_padded_shape_groups_of_a_cache_give_one_padded_shape_per_training_batch(base_params, tiny_cache):
    p = _params(base_params, loader__padded_shape_grouping=True, train__max_iter=12, train__ims_per_batch=4,
                train__warmup_iters=2)
    dataset = DetectionDataset(tiny_cache, transforms=build_data.train_transforms(p, None), seed=0)
    groups = build_train.batch_groups(p, dataset)
    assert groups.shape == (len(dataset),) and len(np.unique(groups)) > 2
    loader = build_train.train_loader(p, dataset, rank=0, world_size=2, device=torch.device("cpu"))
    for batch in loader:
        assert len({groups[i] for i in batch.indices}) == 1
        assert all(-(-h // 32) * 32 == batch.images.shape[-2] and -(-w // 32) * 32 == batch.images.shape[-1]
                   for h, w in batch.image_sizes)  # no image is padded beyond the next multiple of 32


def test_the_padding_benchmark_replays_the_training_batches(base_params, tiny_cache):
    from benchmarks.padding import padding

    by_orientation = padding(_params(base_params, train__max_iter=30, train__warmup_iters=2,
                                     loader__padded_shape_grouping=False), tiny_cache)
    by_shape = padding(_params(base_params, train__max_iter=30, train__warmup_iters=2,
                               loader__padded_shape_grouping=True), tiny_cache)
    assert by_shape["padding"] < by_orientation["padding"] and by_shape["padded_pixels"] < by_orientation["padded_pixels"]
    assert by_shape["images_per_batch"] <= by_orientation["images_per_batch"] <= 4 and by_shape["exact"]


def test_the_tail_turns_the_policy_off_for_exactly_the_last_iterations_and_resumes(base_params, tiny_cache):
    p = _params(base_params, augment__off_tail=0.25, train__max_iter=8, train__warmup_iters=2, train__ims_per_batch=2, train__nproc=1,
                evaluate__ims_per_batch=2, loader__num_workers=0)
    assert build_data.tail_start(p) == 6
    augmented = DetectionDataset(tiny_cache, transforms=build_data.train_transforms(p, build_data.augmentation(p)))
    flipped = DetectionDataset(tiny_cache, transforms=build_data.train_transforms(p, build_data._flip(p)))
    for iteration in (0, 5, 6, 7):
        same = [torch.equal(augmented[i, iteration][0], flipped[i, iteration][0]) for i in range(6)]
        assert all(same) == (iteration >= 6), iteration  # before the tail the policy changes some image
    full = list(build_train.train_loader(p, augmented, rank=0, world_size=1, device=torch.device("cpu")))
    resumed = list(build_train.train_loader(p, augmented, rank=0, world_size=1, device=torch.device("cpu"), start_iter=5))
    assert len(resumed) == 3
    assert all(torch.equal(a.images, b.images) and a.indices == b.indices for a, b in zip(full[5:], resumed))


def test_quality_focal_loss_is_the_formula():
    logits = torch.tensor([0.0, 0.0, 2.0, -3.0])
    targets = torch.tensor([0.5, 1.0, 0.3, 0.0])
    p = torch.sigmoid(logits)
    expected = -(targets - p).abs() ** 2 * (targets * p.log() + (1 - targets) * (1 - p).log())
    torch.testing.assert_close(quality_focal_loss(logits, targets), expected)
    assert quality_focal_loss(logits, targets)[0] == 0  # a score equal to its target costs nothing
    assert paired_iou(torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10]]),
                      torch.tensor([[0.0, 0, 10, 10], [5, 0, 15, 10]])).tolist() == [1.0, pytest.approx(1 / 3)]


def _batch():
    gen = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 255, (3, 128, 160), dtype=torch.uint8, generator=gen) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[20.0, 30.0, 70.0, 90.0], [90.0, 10.0, 150.0, 50.0]]), "labels": torch.tensor([0, 2])},
               {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}]
    return pad_images(images, 32), [(128, 160)] * 2, targets


def _qfl_model():
    torch.manual_seed(0)
    return build_detector(num_classes=3, backbone="resnet10", fpn_channels=32, head_convs=1, cls_loss="qfl").train()


def test_the_qfl_head_loss_is_qfl_over_positives_with_iou_targets_and_no_centerness():
    model = _qfl_model()
    seen = spy_on_head_loss(model)
    model.head.measure_scales(SEARCH_BOUNDS)
    images, sizes, targets = _batch()
    losses = model(images, sizes, targets)
    # location by location, in float64: the target is the IoU of the decoded box at the matched class
    classification = 0.0
    positives = 0
    binned = 0.0
    for i, target in enumerate(targets):
        logits = seen["outputs"]["cls_logits"][i].double()
        quality = torch.zeros_like(logits)
        matched = seen["matched"][i]
        for location in torch.nonzero(matched >= 0).flatten().tolist():
            box = target["boxes"][matched[location]]
            predicted = model.head.box_coder.decode(seen["outputs"]["bbox_regression"][i][location][None, None],
                                                    seen["anchors"][i][location][None])[0, 0]
            lt, rb = torch.maximum(predicted[:2], box[:2]), torch.minimum(predicted[2:], box[2:])
            inter = (rb - lt).clamp(min=0).prod()
            iou = inter / ((predicted[2:] - predicted[:2]).prod() + (box[2:] - box[:2]).prod() - inter)
            quality[location, target["labels"][matched[location]]] = iou.double()
            positives += 1
        p = torch.sigmoid(logits)
        per = -(quality - p).abs() ** 2 * (quality * torch.log(p) + (1 - quality) * torch.log1p(-p))
        classification += per.sum().item()
        binned += per[matched >= 0].sum().item()
    assert positives > 5
    assert losses["classification"].item() == pytest.approx(classification / positives, rel=1e-5)
    assert losses["bbox_ctrness"].item() == 0
    bins = model.head.take_scale_losses()
    assert bins.sum().item() == pytest.approx(binned + losses["bbox_regression"].item() * positives, rel=1e-4)
    # the target is detached: the classification loss gives the box branch no gradient
    losses["classification"].backward()
    tower = [q.grad for q in model.head.regression_head.parameters()]
    assert all(g is None or not g.any() for g in tower)
    assert any(g is not None and g.any() for g in (q.grad for q in model.head.classification_head.parameters()))


def test_a_qfl_detector_trains_and_scores_without_centerness():
    model = _qfl_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch()
    totals = []
    for _ in range(4):
        losses = model(*batch)
        total = sum(losses.values())
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        totals.append(total.item())
    assert all(math.isfinite(t) for t in totals) and totals[-1] < totals[0]
    model.eval()
    with torch.no_grad():
        found = model(batch[0], batch[1])
        model.head.regression_head.bbox_ctrness.bias.add_(-4.0)  # a centerness that would lower every score
        again = model(batch[0], batch[1])
    assert all(torch.equal(a["scores"], b["scores"]) for a, b in zip(found, again))


def _focal_model(**details):
    torch.manual_seed(0)
    return build_detector(num_classes=3, backbone="resnet10", fpn_channels=32, head_convs=1, **details).train()


def test_the_official_fcos_loss_details(monkeypatch):
    """Without other processes, ``sync_num_pos`` gives torchvision's loss (computed here by the head's own
    path); with another process holding more positives, every term is divided by the processes' mean count;
    ``centerness_weighted_giou`` weighs each positive's GIoU loss by its centerness target over their sum."""
    batch = _batch()
    reference = _focal_model()(*batch)
    synced = _focal_model(sync_num_pos=True)(*batch)
    for key in reference:
        torch.testing.assert_close(synced[key], reference[key], rtol=1e-5, atol=1e-6)

    model = _focal_model(centerness_weighted_giou=True)
    seen = spy_on_head_loss(model)
    weighted = model(*batch)
    torch.testing.assert_close(weighted["classification"], reference["classification"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weighted["bbox_ctrness"], reference["bbox_ctrness"], rtol=1e-5, atol=1e-6)
    matched, target = seen["matched"][0], batch[2][0]
    positive = matched >= 0
    boxes = target["boxes"][matched[positive]]
    anchors = seen["anchors"][0][positive]
    predicted = model.head.box_coder.decode(seen["outputs"]["bbox_regression"][0][positive][None], anchors[None])[0]
    centre = (anchors[:, :2] + anchors[:, 2:]) / 2
    l, t = (centre - boxes[:, :2]).unbind(1)
    r, b = (boxes[:, 2:] - centre).unbind(1)
    centerness = torch.sqrt(torch.minimum(l, r) / torch.maximum(l, r) * torch.minimum(t, b) / torch.maximum(t, b))
    from torchvision.ops import generalized_box_iou_loss

    expected = (generalized_box_iou_loss(predicted, boxes, reduction="none") * centerness).sum() / centerness.sum()
    torch.testing.assert_close(weighted["bbox_regression"], expected, rtol=1e-5, atol=1e-6)

    import torch.distributed as dist

    other = 30.0  # the other process's positives
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: tensor.add_(other))
    shared = _focal_model(sync_num_pos=True)(*batch)
    positives = int(positive.sum())
    for key in reference:
        torch.testing.assert_close(shared[key], reference[key] * positives / ((positives + other) / 2), rtol=1e-5, atol=1e-6)
