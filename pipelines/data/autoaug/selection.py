"""Scale-aware box selection: which boxes a box-level op acts on.

A box falls in bucket small / medium / large by its area on the (resized) training image:
``area < scale_splits[0]`` is small, ``area < scale_splits[1]`` medium, otherwise large. Each box is
then selected independently with probability ``box_prob * r[k] / sum(r)`` where ``k`` is its
bucket and ``r`` the policy's ``area`` ratios (color ops) or ``prob`` ratios (geometric ops).
Boxes of zero area are never selected, as in the original.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

SMALL, MEDIUM, LARGE = 0, 1, 2


def box_areas(boxes: torch.Tensor) -> np.ndarray:
    """Areas (float64 ``[K]``) of xyxy boxes ``[K, 4]``; inverted boxes count as area 0."""
    b = boxes.detach().to(torch.float64).numpy().reshape(-1, 4)
    return np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)


def scale_buckets(areas: np.ndarray, scale_splits: Sequence[int]) -> np.ndarray:
    """Bucket (``SMALL``, ``MEDIUM`` or ``LARGE``, int64 ``[K]``) of each box area."""
    return np.where(areas < scale_splits[0], SMALL, np.where(areas < scale_splits[1], MEDIUM, LARGE))


def selection_probabilities(boxes: torch.Tensor, *, ratios: Sequence[int], box_prob: float,
                            scale_splits: Sequence[int]) -> np.ndarray:
    """Per-box selection probability (float64 ``[K]``): ``box_prob * ratios[bucket] / sum(ratios)``.

    All-zero ratios select nothing (the original divides by zero there).
    """
    areas = box_areas(boxes)
    total = float(sum(ratios))
    if total <= 0:
        return np.zeros(len(areas))
    per_bucket = box_prob * np.asarray(ratios, dtype=np.float64) / total
    return np.where(areas > 0, per_bucket[scale_buckets(areas, scale_splits)], 0.0)


def select_boxes(boxes: torch.Tensor, *, ratios: Sequence[int], box_prob: float, scale_splits: Sequence[int],
                 rng: np.random.Generator) -> np.ndarray:
    """Draw the selection: a bool ``[K]`` mask, one uniform draw per box from ``rng``."""
    probs = selection_probabilities(boxes, ratios=ratios, box_prob=box_prob, scale_splits=scale_splits)
    return rng.random(len(probs)) < probs
