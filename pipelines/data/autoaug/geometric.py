"""The six box-level geometric ops: each transforms the pixels inside selected boxes.

``hflip``, ``rotate`` (``level / 10 * 30`` degrees), ``shearX`` and ``shearY`` (``level / 10 * 15``
degrees) transform the crop under each selected box about its centre, with bilinear sampling
that fills from outside the crop with the mean pixel, and paste it back onto the box with a
Gaussian blend (see :func:`pipelines.data.autoaug.blend.paste_weights`); boxes do not move.

``translateX`` and ``translateY`` (``level / 10 * 120`` pixels) leave each selected object in
place and paste a shifted copy of its box content (with the same Gaussian blend), appending a box
with the same label: deliberate in the original, it leaves no hole. A copy that would keep less
than half of its area inside the image is neither pasted nor added; one that keeps more is
clipped to the image. (The original pastes the crop's top-left corner where the copy was clipped
on the left or top, and clamps its box differently from its pixels.)

One call negates the angle, shear or offset for all its boxes with probability 0.5. Crops are read
from the input image and pasted in box order onto the output, as in the original.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ._boxes import clip_visible
from ._pixels import MEAN_PIXEL
from .blend import Rect, blend_patch, paste_weights
from ...policy import GEO_OPS, op_table

MAX_LEVEL = 10.0
ROTATE_MAX_DEGREES = 30.0
SHEAR_MAX_DEGREES = 15.0
TRANSLATE_MAX_PIXELS = 120.0
REFERENCE_SIDE = 800  # the shorter side the original's images are resized to: its translate pixels are for it

_FILL = torch.tensor(MEAN_PIXEL, dtype=torch.float32).view(3, 1, 1)


# Each op's magnitude at level MAX_LEVEL: degrees (rotate, shear), pixels (translate), none (hflip).
_MAX_MAGNITUDE = op_table(GEO_OPS, {
    "hflip": 0.0,
    "rotate": ROTATE_MAX_DEGREES,
    "shearX": SHEAR_MAX_DEGREES,
    "shearY": SHEAR_MAX_DEGREES,
    "translateX": TRANSLATE_MAX_PIXELS,
    "translateY": TRANSLATE_MAX_PIXELS,
})


def magnitude(name: str, level: int) -> float:
    """Degrees (rotate, shear), pixels (translate) or 0 (hflip) of op ``name`` at ``level``, before the sign."""
    return level / MAX_LEVEL * _MAX_MAGNITUDE[name]


def box_rect(box: torch.Tensor | list[float], *, height: int, width: int) -> Rect | None:
    """The pixels an xyxy box covers (partly covered pixels included), clipped; ``None`` if empty."""
    x1, y1, x2, y2 = (float(v) for v in box)
    y0, y1_ = max(math.floor(y1), 0), min(math.ceil(y2), height)
    x0, x1_ = max(math.floor(x1), 0), min(math.ceil(x2), width)
    if y0 >= y1_ or x0 >= x1_:
        return None
    return y0, y1_, x0, x1_


def _inverse_matrix(name: str, degrees: float) -> tuple[float, float, float, float]:
    """``(a, b, c, d)``: output pixel ``(u, v)`` (centred, x right, y down) samples ``(a u + b v, c u + d v)``."""
    t = math.radians(degrees)
    if name == "rotate":
        return math.cos(t), math.sin(t), -math.sin(t), math.cos(t)
    if name == "shearX":  # forward x' = x + tan(t) y
        return 1.0, -math.tan(t), 0.0, 1.0
    if name == "shearY":  # forward y' = y + tan(t) x
        return 1.0, 0.0, -math.tan(t), 1.0
    raise ValueError(f"no affine matrix for op {name!r}")


def affine_crop(crop: torch.Tensor, name: str, degrees: float) -> torch.Tensor:
    """Rotate or shear a uint8 crop ``[3, h, w]`` about its centre; float32 out, mean pixel outside."""
    h, w = crop.shape[-2:]
    a, b, c, d = _inverse_matrix(name, degrees)
    u = torch.arange(w, dtype=torch.float32).add_(0.5 - w / 2)
    v = torch.arange(h, dtype=torch.float32).add_(0.5 - h / 2)
    # grid_sample's normalised coordinates (align_corners=False): a pixel offset from the centre
    # times 2 / size. grid[i, j] = u[j] * per_u + v[i] * per_v, built in one broadcast add.
    per_u = torch.tensor([2 * a / w, 2 * c / h])
    per_v = torch.tensor([2 * b / w, 2 * d / h])
    grid = ((v[:, None] * per_v)[:, None, :] + (u[:, None] * per_u)[None, :, :])[None]
    # Sampling (crop - fill) with zero padding, then adding fill back, is bilinear sampling with
    # the fill outside: interpolation is linear.
    shifted = crop.float().sub_(_FILL)[None]
    out = F.grid_sample(shifted, grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]
    return out.add_(_FILL)


def _transform_crops(name: str, image: torch.Tensor, boxes: torch.Tensor, selected: np.ndarray,
                        degrees: float) -> torch.Tensor:
    height, width = image.shape[-2:]
    out = image.clone()
    for i in np.flatnonzero(selected):
        rect = box_rect(boxes[i].tolist(), height=height, width=width)
        if rect is None:
            continue
        y0, y1, x0, x1 = rect
        crop = image[:, y0:y1, x0:x1]
        if name == "hflip":
            transformed = crop.flip(-1).float()
        else:
            transformed = affine_crop(crop, name, degrees)
        target_pixels = out[:, y0:y1, x0:x1]
        blend_patch(target_pixels, transformed, paste_weights(y1 - y0, x1 - x0), out=target_pixels)
    return out


def _translate(name: str, image: torch.Tensor, target: dict, selected: np.ndarray,
               offset: int) -> tuple[torch.Tensor, dict]:
    height, width = image.shape[-2:]
    boxes, labels = target["boxes"], target["labels"]
    dx, dy = (offset, 0) if name == "translateX" else (0, offset)
    out, new_boxes, new_labels = image, [], []
    for i in np.flatnonzero(selected):
        rect = box_rect(boxes[i].tolist(), height=height, width=width)
        if rect is None:
            continue
        moved = boxes[i:i + 1] + torch.tensor([dx, dy, dx, dy], dtype=boxes.dtype)
        clipped, keep = clip_visible(moved, height=height, width=width)
        if not bool(keep[0]):
            continue
        y0, y1, x0, x1 = rect
        # The copy's pixels, clipped to the image; source and destination stay aligned.
        ty0, ty1 = max(y0 + dy, 0), min(y1 + dy, height)
        tx0, tx1 = max(x0 + dx, 0), min(x1 + dx, width)
        if ty0 >= ty1 or tx0 >= tx1:
            continue
        weights = paste_weights(y1 - y0, x1 - x0)[ty0 - (y0 + dy):ty1 - (y0 + dy), tx0 - (x0 + dx):tx1 - (x0 + dx)]
        source = image[:, ty0 - dy:ty1 - dy, tx0 - dx:tx1 - dx].float()
        if out is image:
            out = image.clone()
        target_pixels = out[:, ty0:ty1, tx0:tx1]
        blend_patch(target_pixels, source, weights, out=target_pixels)
        new_boxes.append(clipped)
        new_labels.append(labels[i:i + 1])
    if not new_boxes:
        return out, target
    target = {**target, "boxes": torch.cat([boxes, *new_boxes]), "labels": torch.cat([labels, *new_labels])}
    return out, target


def geometric_op(name: str, image: torch.Tensor, target: dict, *, level: int, selected: np.ndarray,
                 rng: np.random.Generator, translate_relative: bool = False) -> tuple[torch.Tensor, dict]:
    """Apply op ``name`` to the ``selected`` boxes (bool ``[K]``) of ``(image, target)``.

    ``image`` is uint8 ``[3, H, W]``; ``target`` holds ``boxes`` (float32 xyxy ``[K, 4]``) and ``labels``
    (int64 ``[K]``). One draw from ``rng`` decides the sign. Returns a new image and target (the
    inputs themselves when nothing changes); only translate changes the target, by appending boxes.
    With ``translate_relative``, translate's pixels are scaled by the image's shorter side over
    :data:`REFERENCE_SIDE` (the original's relative strength at any size), rounded to whole pixels.
    """
    if name not in GEO_OPS:
        raise ValueError(f"unknown geometric op {name!r}; expected one of {', '.join(GEO_OPS)}")
    negate = rng.random() < 0.5
    amount = magnitude(name, level) * (-1 if negate else 1)
    if translate_relative and name in ("translateX", "translateY"):
        amount = round(amount * min(image.shape[-2:]) / REFERENCE_SIDE)
    if not selected.any() or (name != "hflip" and amount == 0):
        return image, target
    if name in ("translateX", "translateY"):
        return _translate(name, image, target, selected, int(round(amount)))
    return _transform_crops(name, image, target["boxes"], selected, amount), target
