"""Box helpers shared by the ops that move or crop boxes."""

from __future__ import annotations

import torch

# A box is kept after a crop or a move only if at least this share of its area stays visible.
MIN_VISIBLE = 0.5


def areas(boxes: torch.Tensor) -> torch.Tensor:
    """Areas ``[K]`` of xyxy boxes ``[K, 4]`` (inverted boxes count as 0)."""
    return (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)


def clip_visible(boxes: torch.Tensor, *, height: float, width: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip boxes to ``[0, width] x [0, height]``; also a bool mask of those keeping ``MIN_VISIBLE`` of their area."""
    clipped = torch.stack([boxes[:, 0].clamp(0, width), boxes[:, 1].clamp(0, height),
                           boxes[:, 2].clamp(0, width), boxes[:, 3].clamp(0, height)], dim=1)
    before = areas(boxes)
    keep = (before > 0) & (areas(clipped) >= MIN_VISIBLE * before)
    return clipped, keep
