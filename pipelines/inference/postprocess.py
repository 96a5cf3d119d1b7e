"""FCOS post-processing in numpy, with torchvision's semantics: from the exported network's per-level
head outputs to boxes, scores and labels.

It follows ``torchvision.models.detection.FCOS.postprocess_detections`` step by step, in float32:
per level, scores ``sqrt(sigmoid(cls) * sigmoid(centerness))``, those above ``score_thresh``, the
best ``topk_candidates``, boxes decoded from the level's anchors (``BoxLinearCoder`` with
``normalize_by_size``) and clipped to the image; then over all levels class-wise NMS at
``nms_thresh`` (:func:`batched_nms`, as ``torchvision.ops.batched_nms`` computes it, ties included)
and the best ``detections_per_img``; with ``merge`` ``vote``, their boxes then voted on by all the
candidates (:func:`vote`, as :func:`pipelines.model.vote` computes it); with ``merge`` ``wbf``, weighted box
fusion at ``nms_thresh`` instead of the NMS (:func:`pipelines.box_fusion.fuse`, the code the PyTorch path runs). A model trained with the quality
focal loss (``cls_loss`` ``qfl`` in :class:`Thresholds`, from the model card) is scored ``sigmoid(cls)``,
the centerness unused, as :meth:`pipelines.model.Detector.postprocess_detections` scores it.

It computes less than that order suggests, with the same results: only the class logits that could pass
``score_thresh`` are scored (a cut on the raw logits first: :func:`_logit_floor`), only the chosen
candidates' anchors are computed, and the NMS decides blocks of boxes at once from their IoU matrix
(:func:`_greedy_nms`), one greedy pass over all classes in score order that stops at
``detections_per_img``.

Equal scores are the one place where the order can differ: torchvision's top-k and its per-class NMS
(above 1000 candidates) leave equal scores in the order of a partial or unstable sort, which is not
reproduced here (a stable order is used); its NMS itself sorts stably, and so does :func:`nms`. Real
network outputs rarely tie exactly; where they do, the detections at a cut (``topk_candidates``,
``detections_per_img``) may be other members of the tie.

The anchors are computed from shapes as torchvision's ``AnchorGenerator`` computes them for FCOS: one
per feature-map location, a square of the level's anchor size centred on ``(x, y) * stride``, where a
level's stride is the padded batch's size divided (floor) by the feature map's size (so not always
a power of two: a 320-pixel side has a 3-cell top level, stride 106).

This module imports neither torch nor torchvision (an import-linter contract holds it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..box_fusion import fuse

# torchvision.ops.batched_nms switches from the coordinate trick to per-class NMS above this many
# box coordinates on the CPU: the two differ in tie order, so the same switch is made here.
_VANILLA_ABOVE = 4000
# Boxes the NMS decides together (one IoU matrix of this side at a time), until detections_per_img are kept.
_BLOCK = 128
# How far below logit(score_thresh ** 2) a class logit is still scored (see _logit_floor).
_LOGIT_MARGIN = 1e-3
# evaluate.merge's names (config.MERGES; the torch twin is pipelines.model.merge)
MERGES = ("nms", "vote", "wbf")


@dataclass(frozen=True)
class Thresholds:
    """FCOS's post-processing settings (``model.score_thresh`` etc., ``evaluate.nms_thresh``, ``merge`` and
    ``vote_thresh``, or the model card's): ``merge`` ``nms`` keeps NMS's boxes as they are, ``vote`` votes on
    them, ``wbf`` fuses the boxes instead (:func:`merge`); ``cls_loss``, how the model scores (``focal``: with its centerness; ``qfl``:
    ``sigmoid(cls)``)."""

    score_thresh: float
    nms_thresh: float
    topk_candidates: int
    detections_per_img: int
    cls_loss: str = "focal"
    merge: str = "nms"
    vote_thresh: float = 0.8


@dataclass
class Detections:
    """One image's detections, best first: ``boxes`` float32 ``[K, 4]`` (x1, y1, x2, y2), ``scores``
    float32 ``[K]``, ``labels`` int64 ``[K]`` (contiguous indices into the model's categories)."""

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray

    @classmethod
    def empty(cls) -> Detections:
        return cls(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.scores)

    def scaled(self, sx: float, sy: float) -> Detections:
        """The boxes scaled by ``sx`` horizontally and ``sy`` vertically (from the resized image back to
        the original, as evaluation scales them)."""
        factor = np.array([sx, sy, sx, sy], dtype=np.float32)
        return Detections(self.boxes * factor, self.scores, self.labels)


def level_anchors(grid: tuple[int, int], stride: tuple[int, int], size: int) -> np.ndarray:
    """The anchors of one level, float32 ``[h * w, 4]`` in row-major location order: squares of side
    ``size`` (rounded as torchvision rounds them) centred on ``(x * stride_w, y * stride_h)``."""
    height, width = grid
    half = np.round(np.array([-size, -size, size, size], dtype=np.float32) / 2)
    shift_x = np.arange(width, dtype=np.int64) * stride[1]
    shift_y = np.arange(height, dtype=np.int64) * stride[0]
    ys, xs = np.meshgrid(shift_y, shift_x, indexing="ij")
    xs, ys = xs.reshape(-1), ys.reshape(-1)
    shifts = np.stack([xs, ys, xs, ys], axis=1).astype(np.float32)
    return shifts + half


def level_strides(padded_size: tuple[int, int], grids: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each level's stride, as ``AnchorGenerator`` computes it: the padded batch's size // the grid's."""
    return [(padded_size[0] // h, padded_size[1] // w) for h, w in grids]


def decode_boxes(rel_codes: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """``BoxLinearCoder(normalize_by_size=True).decode``: distances to the four sides, in units of the
    anchor's size, from the anchor's centre."""
    ctr_x = np.float32(0.5) * (anchors[:, 0] + anchors[:, 2])
    ctr_y = np.float32(0.5) * (anchors[:, 1] + anchors[:, 3])
    width = anchors[:, 2] - anchors[:, 0]
    height = anchors[:, 3] - anchors[:, 1]
    codes = rel_codes * np.stack([width, height, width, height], axis=1)
    return np.stack([ctr_x - codes[:, 0], ctr_y - codes[:, 1], ctr_x + codes[:, 2], ctr_y + codes[:, 3]], axis=1)


def clip_boxes(boxes: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
    """Boxes clipped to an image of ``(height, width)``."""
    height, width = image_size
    out = boxes.copy()
    out[:, 0::2] = np.clip(out[:, 0::2], 0, width)
    out[:, 1::2] = np.clip(out[:, 1::2], 0, height)
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp of a large negative logit overflows to inf: the sigmoid is then 0
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def top_order(scores: np.ndarray, k: int | None = None) -> np.ndarray:
    """Indices of the ``k`` best ``scores`` (all if None), best first, equal scores in index order: the
    first ``k`` of a stable descending sort, without sorting all of them."""
    if k is None or k >= len(scores):
        return np.argsort(-scores, kind="stable")
    if k <= 0:
        return np.zeros(0, np.int64)
    kth = np.partition(scores, len(scores) - k)[len(scores) - k]  # the k-th best value
    above = np.flatnonzero(scores > kth)
    chosen = np.concatenate([above, np.flatnonzero(scores == kth)[: k - len(above)]])
    return chosen[np.argsort(-scores[chosen], kind="stable")]


def _overlaps(x1, y1, x2, y2, areas, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """IoU of the boxes ``rows`` (one per row) with the boxes ``cols`` (one per column), float32, in the
    arithmetic of torchvision's CPU NMS kernel (which gives the same value for either order of a pair)."""
    zero = np.float32(0)
    w = np.maximum(zero, np.minimum(x2[rows, None], x2[cols]) - np.maximum(x1[rows, None], x1[cols]))
    h = np.maximum(zero, np.minimum(y2[rows, None], y2[cols]) - np.maximum(y1[rows, None], y1[cols]))
    inter = w * h
    return inter / (areas[rows, None] + areas[cols] - inter)


def _resolve(suppresses: np.ndarray) -> np.ndarray:
    """The greedy decisions within a block of boxes in score order: ``suppresses[i, j]`` (only for ``i``
    before ``j``) says that ``i``, if kept, removes ``j``; a box is kept when none of the boxes kept before
    it removes it. Returns the kept mask. Decided in rounds, all at once: a box is removed once a kept box
    removes it, and kept once no undecided box could (the first undecided box is decided in every round)."""
    kept = np.zeros(len(suppresses), dtype=bool)
    undecided = np.ones(len(suppresses), dtype=bool)
    while undecided.any():
        undecided &= ~suppresses[kept].any(axis=0)
        newly = undecided & ~suppresses[undecided].any(axis=0)
        kept |= newly
        undecided &= ~newly
    return kept


def _greedy_nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, classes: np.ndarray | None,
                max_keep: int | None) -> np.ndarray:
    """Greedy NMS in stable descending score order, a box removed by a kept better one of the same class
    (any class if ``classes`` is None) whose IoU with it is above ``iou_threshold``. The boxes are decided
    in blocks of :data:`_BLOCK`: first against the boxes kept in earlier blocks, then among themselves
    (:func:`_resolve`); the kept indices, best first, at most ``max_keep`` (the blocks stop once reached)."""
    order = np.argsort(-scores, kind="stable")
    x1, y1, x2, y2 = (np.ascontiguousarray(boxes[:, k]) for k in range(4))
    areas = (x2 - x1) * (y2 - y1)
    threshold = np.float64(iou_threshold)  # a float64 scalar: the float32 overlaps are compared in float64
    kept = np.zeros(0, dtype=np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 for empty boxes: NaN, never above the threshold
        for start in range(0, len(order), _BLOCK):
            block = order[start:start + _BLOCK]
            if len(kept):
                removed = _overlaps(x1, y1, x2, y2, areas, kept, block) > threshold
                if classes is not None:
                    removed &= classes[kept, None] == classes[block]
                block = block[~removed.any(axis=0)]
            suppresses = _overlaps(x1, y1, x2, y2, areas, block, block) > threshold
            if classes is not None:
                suppresses &= classes[block, None] == classes[block]
            kept = np.concatenate([kept, block[_resolve(np.triu(suppresses, 1))]])
            if max_keep is not None and len(kept) >= max_keep:
                break
    return kept[:max_keep]


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, *, max_keep: int | None = None) -> np.ndarray:
    """``torchvision.ops.nms`` on the CPU: greedy, best score first (a stable sort: ties in input order),
    dropping every later box whose IoU with a kept one is above ``iou_threshold``; float32 arithmetic in
    the kernel's order, the threshold compared in float64. Returns the kept indices, int64, best first;
    with ``max_keep``, only the first ``max_keep`` of them (the same ones: a greedy NMS decides each box
    from the better ones alone)."""
    if len(boxes) == 0 or max_keep == 0:
        return np.zeros(0, np.int64)
    return _greedy_nms(boxes, scores, iou_threshold, None, max_keep)


def batched_nms(boxes: np.ndarray, scores: np.ndarray, idxs: np.ndarray, iou_threshold: float, *,
                max_keep: int | None = None) -> np.ndarray:
    """``torchvision.ops.batched_nms`` on the CPU: NMS within each class ``idxs``; the kept indices,
    int64, best first. Like torchvision, up to 1000 boxes go through one NMS with the boxes of each class
    shifted apart (the same float32 shifts: the same result, ties included); more go through NMS within
    each class (torchvision's per-class NMS merged by score; here one greedy pass over all the boxes in
    score order, a box removed only by its own class's, which keeps the same boxes; equal scores then in
    index order, torchvision's in its unstable sort's order).
    ``max_keep``: only the first ``max_keep`` kept indices (the same ones, found sooner)."""
    if len(boxes) == 0 or max_keep == 0:
        return np.zeros(0, np.int64)
    if boxes.size > _VANILLA_ABOVE:
        return _greedy_nms(boxes, scores, iou_threshold, np.asarray(idxs), max_keep)
    offsets = idxs.astype(boxes.dtype) * (boxes.max() + boxes.dtype.type(1))
    return _greedy_nms(boxes + offsets[:, None], scores, iou_threshold, None, max_keep)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``torchvision.ops.box_iou`` of float32 boxes ``a`` ``[N, 4]`` and ``b`` ``[M, 4]``: ``[N, M]``, in its
    float32 arithmetic (0 / 0 for empty boxes gives NaN there too)."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    wh = np.clip(np.minimum(a[:, None, 2:], b[None, :, 2:]) - np.maximum(a[:, None, :2], b[None, :, :2]), 0, None)
    inter = wh[..., 0] * wh[..., 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return inter / (area_a[:, None] + area_b[None] - inter)


def vote(kept: np.ndarray, kept_labels: np.ndarray, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, *,
         thresh: float) -> np.ndarray:
    """Box voting (Detectron's ``box_voting``, ``ID`` scoring), as :func:`pipelines.model.vote`: each ``kept``
    box replaced by the ``scores``-weighted mean (in float64, then float32) of the candidate ``boxes`` of its
    label whose IoU with it is at least ``thresh``; one that no candidate reaches stays as it is."""
    if not len(kept) or not len(boxes):
        return kept
    with np.errstate(invalid="ignore"):  # compared in float32, as torch compares a float32 tensor with a number
        reached = (box_iou(kept, boxes) >= np.float32(thresh)) & (kept_labels[:, None] == labels[None])
    weights = reached * scores[None].astype(np.float64)
    total = weights.sum(1, keepdims=True)
    voted = (weights @ boxes.astype(np.float64)) / np.maximum(total, np.finfo(np.float64).tiny)
    return np.where(total > 0, voted, kept).astype(np.float32)


def merge(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, thresholds: Thresholds, *,
          views: int | None = None) -> Detections:
    """One image's detections from its candidates: class-wise NMS at ``nms_thresh``, the best
    ``detections_per_img``, voted on by all the candidates (:func:`vote`) when ``merge`` is ``vote``. With
    ``merge`` ``wbf``, weighted box fusion instead (:func:`pipelines.box_fusion.fuse`, clusters of IoU above
    ``nms_thresh``) of one view's candidates (``views`` None) or of the detections of ``views`` views."""
    if thresholds.merge == "wbf":
        return Detections(*fuse(boxes, scores, labels, iou_thresh=thresholds.nms_thresh, views=views,
                                detections_per_img=thresholds.detections_per_img))
    keep = batched_nms(boxes, scores, labels, thresholds.nms_thresh, max_keep=thresholds.detections_per_img)
    kept = boxes[keep]
    if thresholds.merge == "vote":
        kept = vote(kept, labels[keep], boxes, scores, labels, thresh=thresholds.vote_thresh)
    return Detections(kept, scores[keep], labels[keep])


def _logit_floor(score_thresh: float, centerness: bool = True) -> float | None:
    """A class logit at or below which no score passes ``score_thresh`` (None: no such cut): a score is
    ``sqrt(sigmoid(logit) * sigmoid(centerness))`` and ``sigmoid(centerness) <= 1``, so passing needs
    ``sigmoid(logit) > score_thresh ** 2`` (without ``centerness``, a score ``sigmoid(logit)``: ``> score_thresh``);
    the cut is :data:`_LOGIT_MARGIN` below that logit, far more than float32's rounding of the score can move
    it, so every logit that could pass is scored exactly."""
    square = float(score_thresh) ** 2 if centerness else float(score_thresh)
    if not 0 < square < 1:
        return None
    return math.log(square) - math.log1p(-square) - _LOGIT_MARGIN


def _scored(logits: np.ndarray, ctrness: np.ndarray | None, num_classes: int,
            floor: float | None) -> tuple[np.ndarray | None, np.ndarray]:
    """The scores of one image's level (flat ``logits`` ``[locations * classes]``, ``ctrness``
    ``[locations]``, or None for scores ``sigmoid(logits)``) where the logit is above ``floor``
    (:func:`_logit_floor`; everywhere if None), and where they are in ``logits``; None for everywhere (where
    most logits are above the floor, all are scored: picking them out would cost more than it saves)."""
    above = None if floor is None else logits > floor
    if ctrness is None:
        if above is None or 4 * np.count_nonzero(above) > len(logits):
            return None, _sigmoid(logits)
        candidates = np.flatnonzero(above)
        return candidates, _sigmoid(logits[candidates])
    if above is None or 4 * np.count_nonzero(above) > len(logits):
        return None, np.sqrt(_sigmoid(logits).reshape(-1, num_classes) * _sigmoid(ctrness)[:, None]).reshape(-1)
    candidates = np.flatnonzero(above)
    return candidates, np.sqrt(_sigmoid(logits[candidates]) * _sigmoid(ctrness)[candidates // num_classes])


def _anchors_at(locations: np.ndarray, width: int, stride: tuple[int, int], size: int) -> np.ndarray:
    """:func:`level_anchors` of a level ``width`` locations wide, at ``locations`` only (the same values)."""
    half = np.round(np.array([-size, -size, size, size], dtype=np.float32) / 2)
    xs = (locations % width) * stride[1]
    ys = (locations // width) * stride[0]
    return np.stack([xs, ys, xs, ys], axis=1).astype(np.float32) + half


def detections(cls_logits: Sequence[np.ndarray], bbox_regression: Sequence[np.ndarray],
               bbox_ctrness: Sequence[np.ndarray], *, padded_size: tuple[int, int],
               image_sizes: Sequence[tuple[int, int]], anchor_sizes: Sequence[int],
               thresholds: Thresholds) -> list[Detections]:
    """FCOS's detections for a batch, from the network's outputs.

    Only the class logits above :func:`_logit_floor` are scored (the others cannot pass the threshold),
    and only the chosen candidates' anchors are computed: the same scores, boxes and order as scoring
    every location and class.

    Args:
        cls_logits, bbox_regression, bbox_ctrness: per level (finest first), float32 arrays
            ``[N, h, w, classes]``, ``[N, h, w, 4]`` and ``[N, h, w, 1]``, as the exported graph returns them.
        padded_size: ``(height, width)`` of the padded batch the network saw.
        image_sizes: ``(height, width)`` of each image in it before padding (boxes are clipped to it).
        anchor_sizes: each level's anchor size (the model card's ``anchor_sizes``).
        thresholds: the post-processing settings.

    Returns:
        One :class:`Detections` per image, in the coordinates of the (resized, unpadded) image.
    """
    levels = len(anchor_sizes)
    if not len(cls_logits) == len(bbox_regression) == len(bbox_ctrness) == levels:
        raise ValueError(f"expected {levels} levels of outputs, got {len(cls_logits)}, {len(bbox_regression)}, "
                         f"{len(bbox_ctrness)}")
    grids = [tuple(c.shape[1:3]) for c in cls_logits]
    strides = level_strides(padded_size, grids)
    centerness = thresholds.cls_loss != "qfl"
    floor = _logit_floor(thresholds.score_thresh, centerness)
    results = []
    for index, image_size in enumerate(image_sizes):
        all_codes, all_anchors, all_scores, all_labels = [], [], [], []
        for logits, regression, ctrness, grid, stride, size in zip(cls_logits, bbox_regression, bbox_ctrness,
                                                                   grids, strides, anchor_sizes):
            num_classes = logits.shape[-1]
            logits = np.asarray(logits[index], dtype=np.float32).reshape(-1)
            ctrness = np.asarray(ctrness[index], dtype=np.float32).reshape(-1) if centerness else None
            candidates, scores = _scored(logits, ctrness, num_classes, floor)
            passed = np.flatnonzero(scores > thresholds.score_thresh)
            best = passed[top_order(scores[passed], thresholds.topk_candidates)]
            scores = scores[best]
            locations, labels = np.divmod(best if candidates is None else candidates[best], num_classes)
            regression = np.asarray(regression[index], dtype=np.float32).reshape(-1, 4)
            all_codes.append(regression[locations])
            all_anchors.append(_anchors_at(locations, grid[1], stride, size))
            all_scores.append(scores)
            all_labels.append(labels)
        boxes = clip_boxes(decode_boxes(np.concatenate(all_codes), np.concatenate(all_anchors)), image_size)
        boxes = boxes.astype(np.float32, copy=False)
        scores = np.concatenate(all_scores).astype(np.float32, copy=False)
        labels = np.concatenate(all_labels).astype(np.int64, copy=False)
        results.append(merge(boxes, scores, labels, thresholds))
    return results
