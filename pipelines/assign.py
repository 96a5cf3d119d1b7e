"""Which locations train on which object: ATSS's adaptive training sample selection (``model.assigner=atss``).

Zhang et al., "Bridging the Gap Between Anchor-based and Anchor-free Detection via Adaptive Training Sample
Selection" (CVPR 2020; sfzhang15/ATSS, mmdetection's ``ATSSAssigner``), for the detector's one location per
feature-map cell. For each ground-truth box:

1. per pyramid level, the ``topk`` (9) locations whose centres are nearest the box's centre (L2 distance)
   are its candidates (all of a level's locations when it has fewer);
2. each candidate's IoU with the box is taken with the candidate's ATSS anchor: a square of ``anchor_scale``
   (8) times the location's torchvision anchor size (the level's stride), centred on the location, as ATSS's
   anchor-free variant and mmdetection's configs (``octave_base_scale=8``) do. With torchvision's own
   stride-sized anchors the IoU would peak three levels higher than FCOS's scale ranges put the box;
3. the box's threshold is the mean plus the standard deviation (unbiased, as ``torch.std``) of its
   candidates' IoUs;
4. its positives are the candidates with IoU at or above the threshold whose centre lies strictly inside
   the box (as FCOS requires, so that every positive has positive regression targets; the original's margin
   is 0.01 px).

A location that is a positive of several boxes takes the one it overlaps most (ATSS anchor IoU), as
mmdetection does; equal IoUs go to the box listed first (``torch.max`` returns the first maximum). Ties in
distance among candidates go to the lower location index (row-major within a level: a stable sort).
The result is torchvision's ``matched_idxs``: per location the index of its box, or -1 for background; what
the head computes from it (classification, GIoU and centerness targets, the normalisation) is unchanged.
It is used in training only; the exported model and the post-processing do not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchvision.ops import box_iou

ATSS_TOPK = 9  # candidates per level and box (ATSS's)
ATSS_ANCHOR_SCALE = 8.0  # the ATSS anchor's side over the level's stride (ATSS's anchor-free variant)


def atss_matched_idxs(anchors: Tensor, boxes: Tensor, num_anchors_per_level: Sequence[int], *,
                      topk: int = ATSS_TOPK, anchor_scale: float = ATSS_ANCHOR_SCALE) -> Tensor:
    """One image's assignment (see the module's docstring).

    Args:
        anchors: ``[N, 4]`` xyxy, torchvision's FCOS anchors of all levels in order (a square of the level's
            anchor size centred on each location).
        boxes: ``[M, 4]`` xyxy ground-truth boxes (``M`` may be 0).
        num_anchors_per_level: how many of ``anchors`` each level holds, in order.

    Returns:
        ``[N]`` int64: the index into ``boxes`` of each location's box, -1 for background.
    """
    matched = torch.full((len(anchors),), -1, dtype=torch.int64, device=anchors.device)
    if boxes.numel() == 0:
        return matched
    centres = (anchors[:, :2] + anchors[:, 2:]) / 2
    half = (anchors[:, 2:] - anchors[:, :2]) * (anchor_scale / 2)
    atss_anchors = torch.cat([centres - half, centres + half], dim=1)
    box_centres = (boxes[:, :2] + boxes[:, 2:]) / 2
    distances = (centres[:, None, :] - box_centres[None, :, :]).pow(2).sum(dim=2).sqrt()  # [N, M]

    candidates, start = [], 0
    for count in num_anchors_per_level:
        nearest = distances[start:start + count].sort(dim=0, stable=True).indices[:min(topk, count)]
        candidates.append(nearest + start)
        start += count
    candidates = torch.cat(candidates)  # [C, M]: per box (column), its candidate locations

    ious = box_iou(atss_anchors, boxes).gather(0, candidates)  # [C, M]
    threshold = ious.mean(dim=0) + ious.std(dim=0)
    points = centres[candidates]  # [C, M, 2]
    inside = torch.minimum(points - boxes[None, :, :2], boxes[None, :, 2:] - points).amin(dim=2) > 0
    positive = (ious >= threshold[None]) & inside

    # a box's candidates are distinct locations (one level's nearest each), so the scatter writes each cell once
    overlaps = torch.full_like(distances, float("-inf"))
    overlaps.scatter_(0, candidates, torch.where(positive, ious, float("-inf")))
    best, index = overlaps.max(dim=1)
    return torch.where(best > float("-inf"), index, matched)
