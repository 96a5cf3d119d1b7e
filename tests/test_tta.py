"""The torch-free test-time views (:mod:`pipelines.inference.tta`) are evaluation's
(:func:`pipelines.evaluation.detect`): the same view sizes, mirroring, scaling back and class-wise merge, on
a detector whose detections depend on the view's geometry only (so that PIL's and torchvision's resizes,
which differ in pixels, give the same detections). Pixel-level parity is the export stage's."""

from __future__ import annotations

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
    """:func:`_geometric` behind the interface evaluation calls."""

    nms_thresh, detections_per_img = THRESHOLDS.nms_thresh, THRESHOLDS.detections_per_img
    merge, vote_thresh = THRESHOLDS.merge, THRESHOLDS.vote_thresh

    def __call__(self, images, image_sizes):
        return [{"boxes": torch.from_numpy(d.boxes), "scores": torch.from_numpy(d.scores),
                 "labels": torch.from_numpy(d.labels)} for d in _geometric(image_sizes)]


@pytest.mark.parametrize("scales, flip", [((), True), ((384, 256), True), ((384,), False)])
def test_torch_free_views_are_evaluations(scales, flip):
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(240, 330), (500, 260), (128, 128)]]
    min_size, max_size, divisor = 320, 416, 32
    ours = detect_views(lambda images, sizes: _geometric(sizes), pixels, min_size=min_size, max_size=max_size,
                        size_divisibility=divisor, thresholds=THRESHOLDS, views=Views(scales, 512, flip))

    from pipelines.inference.preprocess import resized_size

    resized = [torch.from_numpy(np.ascontiguousarray(im.transpose(2, 0, 1))) for im in pixels]
    resized = [torch.nn.functional.interpolate(im[None].float(), size=resized_size(*im.shape[1:], min_size, max_size))[0]
               .to(torch.uint8) for im in resized]
    batch = Batch(images=pad_images(resized, divisor), image_sizes=[tuple(im.shape[1:]) for im in resized],
                  targets=[{"orig_size": torch.tensor(im.shape[:2])} for im in pixels], indices=[0, 1, 2])
    theirs = detect(_Model(), batch, device=torch.device("cpu"), tta=EvaluationViews(scales, 512, flip),
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
