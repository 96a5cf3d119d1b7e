"""Image-level zoom ops: zoom_in (enlarge and crop) and zoom_out (shrink into a mosaic).

``level`` indexes a ratio table, it is not a strength: zoom_in enlarges by
``linspace(1, 1.5, 11)[1:][level]`` (level 3: 1.2), zoom_out shrinks by
``linspace(1, 0.5, 11)[1:][level]`` (level 9: 0.5). Both keep the image size. A box is kept only if
at least half of its (scaled) area stays inside the crop or mosaic region, clipped to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ._boxes import clip_visible
from ._pixels import MEAN_PIXEL

ZOOM_IN_RATIOS = tuple(float(r) for r in np.linspace(1.0, 1.5, 11)[1:])
ZOOM_OUT_RATIOS = tuple(float(r) for r in np.linspace(1.0, 0.5, 11)[1:])

Sample = tuple[torch.Tensor, dict]


def zoom_in_ratio(level: int) -> float:
    """Enlargement of zoom_in at ``level`` (0..9): 1.05 .. 1.5."""
    return ZOOM_IN_RATIOS[level]


def zoom_out_ratio(level: int) -> float:
    """Shrink factor of zoom_out at ``level`` (0..9): 0.95 .. 0.5."""
    return ZOOM_OUT_RATIOS[level]


def resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of uint8 ``[3, H, W]`` to ``size`` (antialiased when shrinking; uint8 kernel, no float copy)."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return F.interpolate(image[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]


def _scale_boxes(boxes: torch.Tensor, *, sx: float, sy: float) -> torch.Tensor:
    return boxes * torch.tensor([sx, sy, sx, sy], dtype=boxes.dtype)


def zoom_in(image: torch.Tensor, target: dict, *, ratio: float, rng: np.random.Generator) -> Sample:
    """Enlarge by ``ratio`` and crop the original size back at an offset drawn from ``rng``.

    Boxes are scaled, shifted and clipped; those keeping less than half of their area are dropped.
    If none survives, the input is returned unchanged (the offset is drawn all the same).
    """
    height, width = image.shape[-2:]
    new_h, new_w = int(height * ratio), int(width * ratio)
    # As the original: offsets in [0, new - old), exclusive.
    top = int(rng.integers(0, new_h - height)) if new_h > height else 0
    left = int(rng.integers(0, new_w - width)) if new_w > width else 0
    boxes = _scale_boxes(target["boxes"], sx=new_w / width, sy=new_h / height)
    boxes = boxes - torch.tensor([left, top, left, top], dtype=boxes.dtype)
    clipped, keep = clip_visible(boxes, height=height, width=width)
    if not bool(keep.any()):
        return image, target
    enlarged = resize(image, (new_h, new_w))
    out = enlarged[:, top:top + height, left:left + width].contiguous()
    return out, {**target, "boxes": clipped[keep], "labels": target["labels"][keep]}


def zoom_out(image: torch.Tensor, target: dict, *, ratio: float, fillers: Sequence[Sample]) -> Sample:
    """Shrink by ``ratio`` into the top-left corner of a mosaic of the original size.

    The right, bottom and bottom-right regions are filled with the top-left crops of ``fillers[0..2]``
    (stored images with their targets), each first rescaled to the shrunken size; their boxes that
    keep at least half of their area inside their region are added, offset into place. With fewer
    than three fillers only the shrunken image is placed; whatever no image covers (also a row or
    column left over by an odd size) is the mean pixel.
    """
    height, width = image.shape[-2:]
    new_h, new_w = max(int(ratio * height), 1), max(int(ratio * width), 1)
    canvas = torch.empty((3, height, width), dtype=torch.uint8)
    canvas[:] = torch.tensor([round(m) for m in MEAN_PIXEL], dtype=torch.uint8).view(3, 1, 1)
    canvas[:, :new_h, :new_w] = resize(image, (new_h, new_w))
    boxes = [_scale_boxes(target["boxes"], sx=new_w / width, sy=new_h / height)]
    labels = [target["labels"]]
    if len(fillers) >= 3:
        # (top, left) of the right, bottom and bottom-right regions.
        regions = [(0, new_w), (new_h, 0), (new_h, new_w)]
        for (filler_image, filler_target), (top, left) in zip(fillers, regions):
            rh, rw = min(height - top, new_h), min(width - left, new_w)
            fh, fw = filler_image.shape[-2:]
            canvas[:, top:top + rh, left:left + rw] = resize(filler_image, (new_h, new_w))[:, :rh, :rw]
            scaled = _scale_boxes(filler_target["boxes"], sx=new_w / fw, sy=new_h / fh)
            clipped, keep = clip_visible(scaled, height=rh, width=rw)
            boxes.append(clipped[keep] + torch.tensor([left, top, left, top], dtype=clipped.dtype))
            labels.append(filler_target["labels"][keep])
    return canvas, {**target, "boxes": torch.cat(boxes), "labels": torch.cat(labels)}
