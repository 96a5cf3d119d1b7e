"""Image-level zoom ops: zoom_in (enlarge and crop) and zoom_out (shrink into a mosaic).

``level`` indexes a ratio table, it is not a strength: zoom_in enlarges by
``linspace(1, 1.5, 11)[1:][level]`` (level 3: 1.2), zoom_out shrinks by
``linspace(1, 0.5, 11)[1:][level]`` (level 9: 0.5). Both keep the image size. A box is kept only if
at least half of its (scaled) area stays inside the crop or mosaic region, clipped to it.

Both resample by nearest neighbour, as the original does (``F.interpolate(mode="nearest")``, pixel
for pixel), but compute only the pixels they keep: zoom_in only its crop of the enlarged image,
zoom_out only the part of each filler that its region shows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from ._boxes import clip_visible
from ._pixels import MEAN_PIXEL, interleaved

ZOOM_IN_RATIOS = tuple(float(r) for r in np.linspace(1.0, 1.5, 11)[1:])
ZOOM_OUT_RATIOS = tuple(float(r) for r in np.linspace(1.0, 0.5, 11)[1:])

Sample = tuple[torch.Tensor, dict]

_MEAN_U8 = np.array([round(m) for m in MEAN_PIXEL], dtype=np.uint8).reshape(3, 1, 1)
_CHANNELS = np.arange(3).reshape(3, 1)


def zoom_in_ratio(level: int) -> float:
    """Enlargement of zoom_in at ``level`` (0..9): 1.05 .. 1.5."""
    return ZOOM_IN_RATIOS[level]


def zoom_out_ratio(level: int) -> float:
    """Shrink factor of zoom_out at ``level`` (0..9): 0.95 .. 0.5."""
    return ZOOM_OUT_RATIOS[level]


def zoom_out_size(height: int, width: int, ratio: float) -> tuple[int, int]:
    """``(height, width)`` that zoom_out shrinks an image (and each filler) to."""
    return max(int(ratio * height), 1), max(int(ratio * width), 1)


@functools.lru_cache(maxsize=256)
def nearest_indices(size: int, new_size: int) -> np.ndarray | slice:
    """Source index of each of ``new_size`` positions when resizing ``size`` pixels by nearest neighbour.

    As torch's ``nearest`` mode: ``floor(i * (size / new_size))`` in float32, capped at ``size - 1``.
    An integer shrink (or no change) is returned as the equivalent ``slice``, which copies faster.
    The result is cached and shared: read-only.
    """
    if size % new_size == 0:
        return slice(0, size, size // new_size)
    scale = np.float32(size) / np.float32(new_size)
    index = np.minimum(np.floor(np.arange(new_size, dtype=np.float32) * scale).astype(np.intp), size - 1)
    index.flags.writeable = False
    return index


def _crop(index: np.ndarray | slice, start: int, stop: int) -> np.ndarray | slice:
    if isinstance(index, slice):
        step = index.step
        return slice(start * step, stop * step, step)
    return index[start:stop]


def _take(image: torch.Tensor, rows: np.ndarray | slice, cols: np.ndarray | slice, out: np.ndarray) -> None:
    """``out[:] = image[:, rows][:, :, cols]``: ``out`` a planar uint8 ``[3, h, w]`` array, ``image`` of either layout.

    Rows are picked first, in the image's own layout (whole rows are contiguous in both). From
    interleaved pixels the columns are then gathered byte by byte straight into planes: numpy's
    gather of single bytes is faster than of 3-byte pixels, and it saves a separate transpose.
    """
    if interleaved(image):
        pixels = image.numpy().transpose(1, 2, 0)  # [H, W, 3], rows contiguous
        picked = pixels[rows] if isinstance(rows, slice) else np.take(pixels, rows, axis=0, mode="clip")
        if isinstance(cols, slice):
            np.copyto(out, picked[:, cols].transpose(2, 0, 1))
        else:  # channel c of output column j is byte 3 cols[j] + c of its row
            gathered = np.take(picked.reshape(len(picked), -1), 3 * cols + _CHANNELS, axis=1, mode="clip")
            np.copyto(out, gathered.transpose(1, 0, 2))
        return
    pixels = image.numpy()
    picked = pixels[:, rows] if isinstance(rows, slice) else np.take(pixels, rows, axis=1, mode="clip")
    if isinstance(cols, slice):
        np.copyto(out, picked[:, :, cols])
    elif out.flags.c_contiguous:
        np.take(picked, cols, axis=2, out=out, mode="clip")
    else:  # numpy would copy ``out`` in and back out
        np.copyto(out, np.take(picked, cols, axis=2, mode="clip"))


def resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Nearest-neighbour resize of uint8 ``[3, H, W]`` to ``size`` (planar), as ``F.interpolate(mode="nearest")``."""
    height, width = image.shape[-2:]
    out = np.empty((3, *size), dtype=np.uint8)
    _take(image, nearest_indices(height, size[0]), nearest_indices(width, size[1]), out)
    return torch.from_numpy(out)


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
    sx, sy = new_w / width, new_h / height
    boxes = target["boxes"] * torch.tensor([sx, sy, sx, sy], dtype=target["boxes"].dtype)
    boxes.sub_(torch.tensor([left, top, left, top], dtype=boxes.dtype))
    clipped, keep = clip_visible(boxes, height=height, width=width)
    if not bool(keep.any()):
        return image, target
    out = np.empty((3, height, width), dtype=np.uint8)
    _take(image, _crop(nearest_indices(height, new_h), top, top + height),
          _crop(nearest_indices(width, new_w), left, left + width), out)
    return torch.from_numpy(out), {**target, "boxes": clipped[keep], "labels": target["labels"][keep]}


def zoom_out(image: torch.Tensor, target: dict, *, ratio: float, fillers: Sequence[Sample]) -> Sample:
    """Shrink by ``ratio`` into the top-left corner of a mosaic of the original size.

    The right, bottom and bottom-right regions are filled with the top-left crops of ``fillers[0..2]``
    (images with their targets, boxes in the filler image's pixels), each first rescaled to the
    shrunken size; their boxes that keep at least half of their area inside their region are added,
    offset into place. With fewer than three fillers only the shrunken image is placed; whatever no
    image covers (also a row or column left over by an odd size) is the mean pixel.
    """
    height, width = image.shape[-2:]
    new_h, new_w = zoom_out_size(height, width, ratio)
    canvas = np.empty((3, height, width), dtype=np.uint8)
    _take(image, nearest_indices(height, new_h), nearest_indices(width, new_w), canvas[:, :new_h, :new_w])
    sx, sy = new_w / width, new_h / height
    own = target["boxes"] * torch.tensor([sx, sy, sx, sy], dtype=target["boxes"].dtype)
    if len(fillers) < 3:
        canvas[:, new_h:, :] = _MEAN_U8
        canvas[:, :new_h, new_w:] = _MEAN_U8
        return torch.from_numpy(canvas), {**target, "boxes": own, "labels": target["labels"]}
    # The regions are the shrunken size, cut at the image border (ratio > 0.5) or one row or column
    # short of it (ratio 0.5, odd size): right, bottom, bottom-right, as (top, left, height, width).
    rh, rw = min(height - new_h, new_h), min(width - new_w, new_w)
    regions = [(0, new_w, new_h, rw), (new_h, 0, rh, new_w), (new_h, new_w, rh, rw)]
    canvas[:, new_h + rh:, :] = _MEAN_U8
    canvas[:, :, new_w + rw:] = _MEAN_U8
    scales, limits, offsets = [], [], []
    for (filler_image, filler_target), (top, left, h, w) in zip(fillers, regions):
        fh, fw = filler_image.shape[-2:]
        # Only the region's top-left crop of the rescaled filler is computed.
        _take(filler_image, _crop(nearest_indices(fh, new_h), 0, h), _crop(nearest_indices(fw, new_w), 0, w),
              canvas[:, top:top + h, left:left + w])
        n = len(filler_target["boxes"])
        scales.append(torch.tensor([new_w / fw, new_h / fh] * 2, dtype=torch.float32).expand(n, 4))
        limits.append(torch.tensor([w, h] * 2, dtype=torch.float32).expand(n, 4))
        offsets.append(torch.tensor([left, top] * 2, dtype=torch.float32).expand(n, 4))
    # All fillers' boxes at once: scale into the region, clip to it, keep half-visible ones, offset.
    scaled = torch.cat([t["boxes"] for _, t in fillers[:3]]).to(torch.float32) * torch.cat(scales)
    clipped, keep = clip_visible(scaled, limits=torch.cat(limits))
    placed = clipped.add_(torch.cat(offsets))[keep]
    labels = torch.cat([t["labels"] for _, t in fillers[:3]])[keep]
    boxes = torch.cat([own, placed.to(own.dtype)])
    return torch.from_numpy(canvas), {**target, "boxes": boxes, "labels": torch.cat([target["labels"], labels])}
