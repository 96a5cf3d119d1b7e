"""Weighted box fusion (``evaluate.merge=wbf``, :mod:`pipelines.box_fusion`) on boxes small enough to work out by
hand: fused boxes are score-weighted means, clusters form at IoU above the threshold within a class, scores
follow the within-view and across-views rules, and the other merges do not depend on the number of views."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.box_fusion import fuse
from pipelines.inference import postprocess

TWO = np.array([[0, 0, 10, 10], [2, 0, 12, 10]], np.float32)  # IoU 80 / 120 = 0.667


def test_two_overlapping_boxes_fuse_to_their_score_weighted_mean():
    boxes, scores, labels = fuse(TWO, np.array([0.8, 0.2], np.float32), np.array([0, 0]), iou_thresh=0.6, views=None,
                                 detections_per_img=100)
    np.testing.assert_allclose(boxes, [[0.4, 0, 10.4, 10]], rtol=0, atol=1e-6)  # (0.8 * 0 + 0.2 * 2) / 1.0
    assert scores.tolist() == [np.float32(0.8)] and labels.tolist() == [0]  # one view: the cluster's best
    assert boxes.dtype == np.float32 and scores.dtype == np.float32 and labels.dtype == np.int64
    # across 2 views: the mean score (0.5) times min(2, 2) / 2; across 3: times 2 / 3
    for views, expected in ((2, 0.5), (3, 0.5 * 2 / 3)):
        _, scores, _ = fuse(TWO, np.array([0.8, 0.2], np.float32), np.array([0, 0]), iou_thresh=0.6, views=views,
                            detections_per_img=100)
        np.testing.assert_allclose(scores, [expected], rtol=1e-6)


def test_clusters_need_an_iou_above_the_threshold_and_the_same_class():
    scores = np.array([0.8, 0.2], np.float32)
    apart, _, _ = fuse(TWO, scores, np.array([0, 0]), iou_thresh=0.7, views=None, detections_per_img=100)
    np.testing.assert_array_equal(apart, TWO)  # 0.667 is not above 0.7: two detections, as they were
    edge = np.array([[0, 0, 10, 10], [0, 0, 10, 5]], np.float32)  # IoU exactly 0.5
    kept, _, _ = fuse(edge, scores, np.array([0, 0]), iou_thresh=0.5, views=None, detections_per_img=100)
    assert len(kept) == 2  # the reference's strict ">"
    other, _, labels = fuse(TWO, scores, np.array([0, 1]), iou_thresh=0.6, views=None, detections_per_img=100)
    np.testing.assert_array_equal(other, TWO)
    assert labels.tolist() == [0, 1]


def test_a_box_found_by_one_view_of_two_loses_half_its_score_and_the_order_follows():
    boxes = np.array([[0, 0, 10, 10], [0.5, 0, 10.5, 10], [50, 50, 60, 60]], np.float32)
    scores = np.array([0.6, 0.5, 0.9], np.float32)  # the far box scores best, but only one view found it
    fused, fused_scores, _ = fuse(boxes, scores, np.zeros(3, np.int64), iou_thresh=0.6, views=2,
                                  detections_per_img=100)
    np.testing.assert_allclose(fused_scores, [0.55, 0.45], rtol=1e-6)
    np.testing.assert_allclose(fused[0], (0.6 * boxes[0] + 0.5 * boxes[1]) / 1.1, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(fused[1], boxes[2])
    top, _, _ = fuse(boxes, scores, np.zeros(3, np.int64), iou_thresh=0.6, views=2, detections_per_img=1)
    np.testing.assert_array_equal(top, fused[:1])
    empty = fuse(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64), iou_thresh=0.6,
                 views=2, detections_per_img=100)
    assert [a.shape for a in empty] == [(0, 4), (0,), (0,)]


@pytest.mark.parametrize("merge", ["nms", "vote"])
def test_the_other_merges_ignore_the_number_of_views(merge):
    rng = np.random.default_rng(0)
    corners = rng.uniform(0, 80, (40, 2)).astype(np.float32)
    boxes = np.concatenate([corners, corners + rng.uniform(5, 30, (40, 2)).astype(np.float32)], 1)
    scores, labels = rng.uniform(0.05, 1, 40).astype(np.float32), rng.integers(0, 3, 40)
    thresholds = postprocess.Thresholds(0.05, 0.6, 1000, 100, merge=merge)
    alone = postprocess.merge(boxes, scores, labels, thresholds)
    for views in (1, 2, 4):
        again = postprocess.merge(boxes, scores, labels, thresholds, views=views)
        for name in ("boxes", "scores", "labels"):
            np.testing.assert_array_equal(getattr(again, name), getattr(alone, name))
