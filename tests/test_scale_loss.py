"""The FCOS loss by object scale (the search's measurement), on boxes of known areas."""

import pytest
import torch
from torchvision.ops import generalized_box_iou_loss, sigmoid_focal_loss

from pipelines.data.collate import pad_images
from pipelines.model import build_detector
from pipelines.scale_loss import SEARCH_BOUNDS

SIZE = 320
# (width, height) of one box and the bin its area falls in: below 2048, 2048..10240, 10240..51200, above
BOXES = {"small": ((40, 40), 0), "on the first bound": ((32, 64), 1), "medium": ((80, 80), 1),
         "large": ((150, 150), 2), "very large": ((260, 260), 3)}


def _model():
    torch.manual_seed(0)
    return build_detector(num_classes=3, backbone="resnet10", fpn_channels=32, head_convs=1).train()


def _batch(boxes: list[list[tuple[int, int]]]):
    """One image per entry, each with boxes of the given (width, height), centred."""
    gen = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 255, (3, SIZE, SIZE), dtype=torch.uint8, generator=gen) for _ in boxes]
    targets = []
    for sizes in boxes:
        xyxy = [[(SIZE - w) / 2, (SIZE - h) / 2, (SIZE + w) / 2, (SIZE + h) / 2] for w, h in sizes]
        targets.append({"boxes": torch.tensor(xyxy, dtype=torch.float32).reshape(-1, 4),
                        "labels": torch.arange(len(sizes)) % 3})
    return pad_images(images, 32), [(SIZE, SIZE)] * len(boxes), targets


@pytest.mark.parametrize("name", BOXES)
def test_a_box_adds_its_loss_to_the_bin_of_its_area_only(name):
    (size, expected) = BOXES[name]
    model = _model()
    model.head.measure_scales(SEARCH_BOUNDS)
    model(*_batch([[size]]))
    bins = model.head.take_scale_losses()
    assert bins.shape == (4,) and bins[expected] > 0
    assert torch.count_nonzero(bins) == 1


def test_the_bins_hold_the_positive_locations_classification_and_regression_loss():
    """Against a location-by-location sum over the head's own matches; the loss the model trains on is
    the same bit for bit with the measurement on or off, gradients included."""
    batch = _batch([[(40, 40), (150, 150)], [(80, 80)], []])
    plain = _model()
    losses = plain(*batch)
    sum(losses.values()).backward()

    model = _model()
    seen = {}
    compute_loss = model.head.compute_loss

    def spy(targets, head_outputs, anchors, matched_idxs):
        seen.update(head_outputs=head_outputs, anchors=anchors, matched=matched_idxs, targets=targets)
        return compute_loss(targets, head_outputs, anchors, matched_idxs)

    model.head.compute_loss = spy
    model.head.measure_scales(SEARCH_BOUNDS)
    measured = model(*batch)
    sum(measured.values()).backward()
    assert all(torch.equal(losses[k], measured[k]) for k in losses)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()) if a.grad is not None)

    expected = torch.zeros(4, dtype=torch.float64)
    positives = 0
    for i, target in enumerate(seen["targets"]):
        for location, box_index in enumerate(seen["matched"][i].tolist()):
            if box_index < 0:
                continue
            positives += 1
            box, label = target["boxes"][box_index], target["labels"][box_index]
            logits = seen["head_outputs"]["cls_logits"][i, location]
            classification = sigmoid_focal_loss(logits, torch.nn.functional.one_hot(label, 3).float()).sum()
            decoded = model.head.box_coder.decode(seen["head_outputs"]["bbox_regression"][i, location][None, None],
                                                  seen["anchors"][i][location][None, None])[0, 0]
            regression = generalized_box_iou_loss(decoded, box)
            area = float((box[2] - box[0]) * (box[3] - box[1]))
            expected[sum(area >= b for b in SEARCH_BOUNDS)] += float((classification + regression).detach())
    bins = model.head.take_scale_losses()
    assert positives > 0 and (bins[[0, 1, 2]] > 0).all() and bins[3] == 0
    assert torch.allclose(bins, expected, rtol=1e-5)
    # the regression part is FCOS's own regression loss before its division by the positive count
    assert float(measured["bbox_regression"].detach()) * positives < float(bins.sum())


def test_the_bins_add_up_over_steps_until_taken_and_stop_when_switched_off():
    model = _model()
    model.head.measure_scales(SEARCH_BOUNDS)
    batch = _batch([[(40, 40)]])
    model(*batch)
    once = model.head.scale_losses.clone()
    model(*batch)
    assert torch.allclose(model.head.take_scale_losses(), 2 * once)
    assert torch.equal(model.head.take_scale_losses(), torch.zeros(4, dtype=torch.float64))
    model(*_batch([[]]))  # an image without boxes adds nothing
    assert torch.equal(model.head.take_scale_losses(), torch.zeros(4, dtype=torch.float64))
    model.head.measure_scales(None)
    model(*batch)
    assert model.head.scale_losses is None
    with pytest.raises(RuntimeError, match="measure_scales"):
        model.head.take_scale_losses()
    with pytest.raises(ValueError, match="increase"):
        model.head.measure_scales([10240, 2048])
