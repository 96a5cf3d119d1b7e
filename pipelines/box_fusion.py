"""Weighted box fusion (Solovyev, Wang and Gabruseva, "Weighted boxes fusion: ensembling boxes from different
object detection models", arXiv 1910.13302): ``evaluate.merge`` ``wbf``, in numpy, for the PyTorch path
(:func:`pipelines.model.merge`) and the ONNX path (:func:`pipelines.inference.postprocess.merge`) alike, so
that both give the same detections bit for bit.

Within a class, the boxes are taken best score first; each joins the cluster whose fused box it overlaps
most, when that IoU is above ``iou_thresh`` (the reference's strict ``>``), else starts a cluster of its
own. A cluster's fused box is the score-weighted mean of its boxes (recomputed as each joins, the clusters
matched against it). Its score:

- over the candidates of one view (``views`` None: a single forward pass, before any NMS): the cluster's
  best score, the score the view's NMS would keep. The paper fuses each model's final (NMS-ed) detections;
  one view's raw candidates are not independent predictions, and their mean would average in the
  low-scored locations around each object (more of them for a larger object), re-ranking by size rather
  than by agreement;
- over the detections of ``views`` test-time views (the paper's ``avg`` rule, the reference
  implementation's default with equal weights): the mean score of the cluster's boxes times
  ``min(views, size) / views``, so that a box that only some views found loses score in proportion.

The fused detections come out best score first, at most ``detections_per_img``. Arithmetic in float64,
boxes and scores returned in float32; the boxes are taken in an order that does not depend on the input
order (score, then coordinates), so the two paths agree whatever order their candidates come in.

This module imports neither torch nor torchvision (an import-linter contract holds it).
"""

from __future__ import annotations

import numpy as np


def _iou(fused: np.ndarray, box: np.ndarray) -> np.ndarray:
    """IoU of each of the float64 boxes ``fused`` ``[K, 4]`` with the float64 ``box`` ``[4]`` (0 for empty pairs)."""
    wh = np.clip(np.minimum(fused[:, 2:], box[2:]) - np.maximum(fused[:, :2], box[:2]), 0, None)
    inter = wh[:, 0] * wh[:, 1]
    union = (fused[:, 2] - fused[:, 0]) * (fused[:, 3] - fused[:, 1]) + (box[2] - box[0]) * (box[3] - box[1]) - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, inter / union, 0.0)


def _clusters(boxes: np.ndarray, scores: np.ndarray, iou_thresh: float) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                                np.ndarray]:
    """One class's clusters of ``boxes`` (float64, best score first): the fused boxes, the sum and the best of
    each cluster's scores, and its size."""
    count = len(boxes)
    fused, weighted = np.zeros((count, 4)), np.zeros((count, 4))
    total, best, size = np.zeros(count), np.zeros(count), np.zeros(count, np.int64)
    made = 0
    for box, score in zip(boxes, scores):
        if made:
            overlaps = _iou(fused[:made], box)
            j = int(np.argmax(overlaps))
            if overlaps[j] > iou_thresh:
                weighted[j] += score * box
                total[j] += score
                size[j] += 1
                fused[j] = weighted[j] / total[j] if total[j] > 0 else fused[j]
                continue
        fused[made], weighted[made], total[made], best[made], size[made] = box, score * box, score, score, 1
        made += 1
    return fused[:made], total[:made], best[:made], size[:made]


def fuse(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, *, iou_thresh: float, views: int | None,
         detections_per_img: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted box fusion of one image's ``boxes`` (``[N, 4]`` xyxy), ``scores`` ``[N]`` and ``labels`` ``[N]``
    within each class (see the module's docstring): ``views`` None for one view's candidates (a cluster
    scores its best), else the number of test-time views the boxes come from (the mean score times
    ``min(views, size) / views``). Returns float32 boxes ``[K, 4]``, float32 scores ``[K]`` and int64 labels
    ``[K]``, best score first (ties in class order, then cluster order), ``K <= detections_per_img``."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    scores = np.asarray(scores, dtype=np.float32).reshape(-1)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if not len(boxes) or detections_per_img <= 0:
        return np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64)
    order = np.lexsort((boxes[:, 3], boxes[:, 2], boxes[:, 1], boxes[:, 0], -scores))
    all_boxes, all_scores, all_labels = [], [], []
    for label in np.unique(labels):
        chosen = order[labels[order] == label]
        fused, total, best, size = _clusters(boxes[chosen].astype(np.float64), scores[chosen].astype(np.float64),
                                             float(iou_thresh))
        if views is None:
            score = best
        else:
            score = total / size * np.minimum(size, views) / views
        all_boxes.append(fused)
        all_scores.append(score)
        all_labels.append(np.full(len(fused), label, np.int64))
    fused_scores = np.concatenate(all_scores).astype(np.float32)
    keep = np.argsort(-fused_scores, kind="stable")[:detections_per_img]
    return (np.concatenate(all_boxes)[keep].astype(np.float32), fused_scores[keep],
            np.concatenate(all_labels)[keep])
