"""The torch-free test-time views (:mod:`pipelines.inference.tta`) are evaluation's
(:func:`pipelines.evaluation.detect`): the same view sizes, mirroring, scaling back and class-wise merge, on
a detector whose detections depend on the view's geometry only (so that PIL's and torchvision's resizes,
which differ in pixels, give the same detections). Pixel-level parity is the export stage's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pipelines.data.collate import Batch, pad_images
from pipelines.data.transforms import TestTimeAugmentation as EvaluationViews
from pipelines.evaluation import detect
from pipelines.inference.postprocess import Detections, Thresholds
from pipelines.inference.tta import Views, detect_views

THRESHOLDS = Thresholds(score_thresh=0.05, nms_thresh=0.6, topk_candidates=1000, detections_per_img=5)


def _geometric(sizes: list[tuple[int, int]]) -> list[Detections]:
    """Per image of (height, width): boxes at fixed fractions of it, scores and labels from its size."""
    found = []
    for height, width in sizes:
        fractions = np.array([[0.1, 0.2, 0.5, 0.6], [0.15, 0.2, 0.55, 0.65], [0.6, 0.1, 0.9, 0.3], [0.0, 0.7, 0.2, 1.0]])
        boxes = (fractions * np.array([width, height, width, height])).astype(np.float32)
        scores = (np.array([0.9, 0.8, 0.7, 0.6]) - (width % 7) / 100 - (height % 5) / 200).astype(np.float32)
        found.append(Detections(boxes, scores, np.array([0, 0, 1, 2], np.int64)))
    return found


class _Model:
    """:func:`_geometric` behind the interface evaluation calls, merging as ``thresholds`` say."""

    def __init__(self, thresholds: Thresholds = THRESHOLDS):
        self.nms_thresh, self.detections_per_img = thresholds.nms_thresh, thresholds.detections_per_img
        self.merge, self.vote_thresh = thresholds.merge, thresholds.vote_thresh

    def __call__(self, images, image_sizes):
        return [{"boxes": torch.from_numpy(d.boxes), "scores": torch.from_numpy(d.scores),
                 "labels": torch.from_numpy(d.labels)} for d in _geometric(image_sizes)]


@pytest.mark.parametrize("scales, flip, merge", [((), True, "nms"), ((384, 256), True, "nms"), ((384,), False, "nms"),
                                                ((384, 256), True, "vote"), ((384, 256), True, "wbf"),
                                                ((384,), False, "wbf")])
def test_torch_free_views_are_evaluations(scales, flip, merge):
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(240, 330), (500, 260), (128, 128)]]
    min_size, max_size, divisor = 320, 416, 32
    # vote: the views' boxes (rounded differently by each view's scale) and the image's two overlapping
    # boxes of class 0 (IoU 0.78: one suppressed at 0.6) vote; wbf: they are fused, scored for the views
    thresholds = dataclasses.replace(THRESHOLDS, merge=merge, vote_thresh=0.65)
    ours = detect_views(lambda images, sizes: _geometric(sizes), pixels, min_size=min_size, max_size=max_size,
                        size_divisibility=divisor, thresholds=thresholds, views=Views(scales, 512, flip))
    if merge != "nms":
        plain = detect_views(lambda images, sizes: _geometric(sizes), pixels, min_size=min_size, max_size=max_size,
                             size_divisibility=divisor, thresholds=THRESHOLDS, views=Views(scales, 512, flip))
        # (wbf: the two boxes fuse, and the views' boxes with them)
        assert all(np.abs(v.boxes[:1] - p.boxes[:1]).max() > 1 for v, p in zip(ours, plain))

    from pipelines.inference.preprocess import resized_size

    resized = [torch.from_numpy(np.ascontiguousarray(im.transpose(2, 0, 1))) for im in pixels]
    resized = [torch.nn.functional.interpolate(im[None].float(), size=resized_size(*im.shape[1:], min_size, max_size))[0]
               .to(torch.uint8) for im in resized]
    batch = Batch(images=pad_images(resized, divisor), image_sizes=[tuple(im.shape[1:]) for im in resized],
                  targets=[{"orig_size": torch.tensor(im.shape[:2])} for im in pixels], indices=[0, 1, 2])
    theirs = detect(_Model(thresholds), batch, device=torch.device("cpu"), tta=EvaluationViews(scales, 512, flip),
                    size_divisibility=divisor)
    for mine, other in zip(ours, theirs, strict=True):
        assert len(mine) == len(other["scores"]) > 0
        np.testing.assert_allclose(mine.boxes, other["boxes"].numpy(), rtol=1e-5, atol=1e-3)
        np.testing.assert_array_equal(mine.scores, other["scores"].numpy())
        np.testing.assert_array_equal(mine.labels, other["labels"].numpy())


def test_without_views_it_is_the_test_size_view_alone():
    pixels = [np.zeros((200, 300, 3), np.uint8)]
    calls = []

    def detect_fn(images, sizes):
        calls.append((images.shape, sizes))
        return _geometric(sizes)

    (found,) = detect_views(detect_fn, pixels, min_size=320, max_size=416, size_divisibility=32, thresholds=THRESHOLDS)
    assert calls == [((1, 3, 288, 416), [(277, 416)])]  # shorter side 320 would make the longer 480 > 416
    np.testing.assert_allclose(found.boxes, _geometric([(200, 300)])[0].boxes, rtol=1e-5)


@pytest.mark.parametrize("source", ["resized", "decoded"])
def test_extra_scales_are_resized_from_the_source_image(source):
    """``evaluate.tta_source``: the extra scale's view is the test-size image resized again (``resized``), or
    the decoded image resized once (``decoded``), in both paths."""
    from torchvision.transforms.v2 import functional as F

    from pipelines.inference.preprocess import resize, resized_size

    original = np.random.default_rng(1).integers(0, 256, (150, 200, 3), dtype=np.uint8)
    test_size, view_size = resized_size(150, 200, 96, 128), resized_size(150, 200, 192, 512)
    seen = []

    def detect_fn(images, sizes):
        seen.append(images[0, :, :sizes[0][0], :sizes[0][1]])
        return _geometric(sizes)

    detect_views(detect_fn, [original], min_size=96, max_size=128, size_divisibility=32, thresholds=THRESHOLDS,
                 views=Views((192,), 512, False, source))
    from_test_size = resize(resize(original, test_size), view_size)
    from_decoded = resize(original, view_size)
    assert np.abs(from_test_size.astype(int) - from_decoded).max() > 10  # the two sources differ
    np.testing.assert_array_equal(seen[1].transpose(1, 2, 0), from_decoded if source == "decoded" else from_test_size)

    decoded = torch.from_numpy(np.ascontiguousarray(original.transpose(2, 0, 1)))
    resized = F.resize(decoded, list(test_size), antialias=True)
    batch = Batch(images=pad_images([resized], 32), image_sizes=[test_size],
                  targets=[{"orig_size": torch.tensor([150, 200])}], indices=[0])
    model = _Recording()
    detect(model, batch, device=torch.device("cpu"), tta=EvaluationViews((192,), 512, False, source),
           size_divisibility=32, originals=[decoded])
    expected = F.resize(decoded if source == "decoded" else resized, list(view_size), antialias=True)
    torch.testing.assert_close(model.views[1], expected, rtol=0, atol=0)


class _Recording(_Model):
    """:class:`_Model` that keeps the first image of each view it is called on."""

    def __init__(self):
        super().__init__()
        self.views = []

    def __call__(self, images, image_sizes):
        self.views.append(images[0, :, :image_sizes[0][0], :image_sizes[0][1]])
        return super().__call__(images, image_sizes)
