"""Box helpers shared by the ops that move or crop boxes."""

from __future__ import annotations

import torch

# A box is kept after a crop or a move only if at least this share of its area stays visible.
MIN_VISIBLE = 0.5


def areas(boxes: torch.Tensor) -> torch.Tensor:
    """Areas ``[K]`` of xyxy boxes ``[K, 4]`` (inverted boxes count as 0)."""
    wh = (boxes[:, 2:] - boxes[:, :2]).clamp_(min=0)
    return wh[:, 0] * wh[:, 1]


def clip_visible(boxes: torch.Tensor, *, height: float | None = None, width: float | None = None,
                 limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip boxes to ``[0, width] x [0, height]``; also a bool mask of those keeping ``MIN_VISIBLE`` of their area.

    ``limits`` (``[4]`` or ``[K, 4]``: ``width, height, width, height`` per box) replaces ``height``
    and ``width`` to clip each box to its own region. The clipped boxes are a new tensor.
    """
    if limits is None:
        limits = torch.tensor([width, height, width, height], dtype=boxes.dtype)
    clipped = boxes.clamp(min=0).minimum(limits)
    before = areas(boxes)
    keep = (before > 0) & (areas(clipped) >= MIN_VISIBLE * before)
    return clipped, keep
