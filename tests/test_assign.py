"""ATSS's assignment (``model.assigner=atss``, pipelines/assign.py) against a plain loop over locations, the
default ``fcos`` left as torchvision computes it, and a detector that trains with ATSS."""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
from torchvision.models.detection.fcos import FCOS

from pipelines.assign import atss_matched_idxs
from pipelines.build import model as build_model
from pipelines.config.load import params_from_dict
from pipelines.data.collate import pad_images
from pipelines.errors import ConfigError
from pipelines.scale_loss import SEARCH_BOUNDS

from .conftest import set_dotted, spy_on_head_loss

pytestmark = pytest.mark.usefixtures("one_thread")

STRIDES, SIDE = (8, 16, 32, 64), 128  # the last level holds 4 locations, fewer than ATSS's 9 candidates


def _anchors() -> tuple[torch.Tensor, list[int]]:
    """torchvision's FCOS anchors of a ``SIDE`` x ``SIDE`` image: per level, row by row, a square of the stride
    centred on each location (the locations at multiples of the stride)."""
    anchors, counts = [], []
    for s in STRIDES:
        cells = SIDE // s
        anchors += [[x * s - s / 2, y * s - s / 2, x * s + s / 2, y * s + s / 2] for y in range(cells) for x in range(cells)]
        counts.append(cells * cells)
    return torch.tensor(anchors), counts


def _iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _reference(anchors, boxes, counts, topk=9, scale=8.0):
    """ATSS location by location, in Python floats; also how close the case comes to a tie it could flip."""
    anchors, boxes = anchors.tolist(), boxes.tolist()
    best: dict[int, tuple[float, int]] = {}
    margins, rejected = [], {"outside": 0, "below": 0, "contested": 0, "taken_over": 0}
    for j, box in enumerate(boxes):
        bx, by = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        candidates, start = [], 0
        for count in counts:
            near = []
            for i in range(start, start + count):
                cx, cy = (anchors[i][0] + anchors[i][2]) / 2, (anchors[i][1] + anchors[i][3]) / 2
                near.append((math.hypot(cx - bx, cy - by), i))
            near.sort()
            if len(near) > topk:
                margins.append(near[topk][0] - near[topk - 1][0])
            candidates += [i for _, i in near[:topk]]
            start += count
        ious = {}
        for i in candidates:
            cx, cy = (anchors[i][0] + anchors[i][2]) / 2, (anchors[i][1] + anchors[i][3]) / 2
            side = (anchors[i][2] - anchors[i][0]) * scale
            ious[i] = _iou([cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2], box)
        threshold = statistics.mean(ious.values()) + statistics.stdev(ious.values())
        margins += [abs(v - threshold) for v in ious.values()]
        for i in candidates:
            cx, cy = (anchors[i][0] + anchors[i][2]) / 2, (anchors[i][1] + anchors[i][3]) / 2
            if ious[i] < threshold:
                rejected["below"] += 1
            elif not (box[0] < cx < box[2] and box[1] < cy < box[3]):
                rejected["outside"] += 1
            elif i in best:
                rejected["contested"] += 1
                if ious[i] > best[i][0]:
                    rejected["taken_over"] += 1
                    best[i] = (ious[i], j)
            else:
                best[i] = (ious[i], j)
    return [best[i][1] if i in best else -1 for i in range(len(anchors))], min(margins), rejected


def test_atss_positives_are_those_of_the_rule_location_by_location():
    anchors, counts = _anchors()
    boxes = torch.tensor([[10.3, 14.6, 61.1, 70.9], [40.7, 30.2, 120.4, 117.8], [25.8, 19.6, 73.6, 64.4],
                          [2.2, 90.4, 13.9, 101.7]])
    contests = []
    for order in (boxes, boxes.flip(0)):  # a contested location goes to the higher IoU, first or last listed
        expected, margin, rejected = _reference(anchors, order, counts)
        assert margin > 1e-4  # the case is not on the edge of a tie that float32 could flip
        assert all(j in expected for j in range(len(order)))
        assert atss_matched_idxs(anchors, order, counts).tolist() == expected
        contests.append(rejected)
    # the case exercises every rule: IoU below the threshold, centre outside the box, either contest outcome
    assert all(r["below"] and r["outside"] and r["contested"] for r in contests)
    assert sorted(bool(r["taken_over"]) for r in contests) == [False, True]
    # no boxes: all background
    assert atss_matched_idxs(anchors, torch.zeros(0, 4), counts).tolist() == [-1] * len(anchors)


def _batch():
    gen = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 255, (3, 128, 160), dtype=torch.uint8, generator=gen) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[20.0, 30.0, 70.0, 90.0], [90.0, 10.0, 150.0, 50.0]]), "labels": torch.tensor([0, 2])},
               {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}]
    return pad_images(images, 32), [(128, 160)] * 2, targets


LEVELS = [16 * 20, 8 * 10, 4 * 5, 2 * 3, 1 * 2]  # locations per level of a 128 x 160 batch, strides 8..128


def _detector(base_params: dict, **changes):
    raw = copy.deepcopy(base_params)
    for key, value in {"model.backbone": "resnet10", "model.fpn_channels": 32, "model.head_convs": 1,
                       "model.precision": "fp32", "model.channels_last": False, **changes}.items():
        set_dotted(raw, key, value)
    p = params_from_dict(raw, source="params.yaml")
    torch.manual_seed(0)
    return build_model.detector(p, num_classes=3, compute=build_model.compute(p, torch.device("cpu"))).train()




def test_fcos_is_torchvisions_assignment_and_atss_another(base_params):
    batch = _batch()
    model = _detector(base_params)
    assert model.assigner == "fcos"
    seen = spy_on_head_loss(model)
    losses = model(*batch)
    matched, outputs, anchors = seen["matched"], seen["outputs"], seen["anchors"]
    assert sum(LEVELS) == len(anchors[0])
    reference = FCOS.compute_loss(model, batch[2], outputs, anchors, LEVELS)  # torchvision's, through the spy
    assert all(torch.equal(a, b) for a, b in zip(matched, seen["matched"]))
    assert all(torch.equal(losses[k], reference[k]) for k in losses)

    atss = atss_matched_idxs(anchors[0], batch[2][0]["boxes"], LEVELS)
    assert not torch.equal(atss, matched[0])
    # with ATSS's 8-stride anchors these boxes (50-60 px) train on the finest levels, as FCOS's scale ranges put them
    level = torch.repeat_interleave(torch.arange(len(LEVELS)), torch.tensor(LEVELS))
    assert set(level[atss >= 0].tolist()) <= {0, 1} and set(level[matched[0] >= 0].tolist()) <= {0, 1}
    assert (atss == 0).any() and (atss == 1).any()


def test_an_atss_detector_trains_with_finite_losses_and_scale_bins(base_params):
    model = _detector(base_params, **{"model.assigner": "atss"})
    seen = spy_on_head_loss(model)
    model.head.measure_scales(SEARCH_BOUNDS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch()
    for _ in range(2):
        losses = model(*batch)
        assert all(math.isfinite(v.item()) for v in losses.values()) and losses["bbox_regression"].item() > 0
        optimizer.zero_grad()
        sum(losses.values()).backward()
        optimizer.step()
    assert torch.equal(seen["matched"][0], atss_matched_idxs(seen["anchors"][0], batch[2][0]["boxes"], LEVELS))
    assert (seen["matched"][1] == -1).all()
    bins = model.head.take_scale_losses()
    assert bins[1] > 0 and math.isfinite(bins[1]) and bins.count_nonzero() == 1  # both boxes: 2048-10240 px


def test_a_bad_assigner_stops_in_one_line_naming_the_param(base_params):
    raw = copy.deepcopy(base_params)
    set_dotted(raw, "model.assigner", "paa")
    with pytest.raises(ConfigError, match=r"^params\.yaml: model\.assigner: expected one of fcos, atss, got 'paa'$"):
        params_from_dict(raw, source="params.yaml")
