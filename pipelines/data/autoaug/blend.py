"""Gaussian blending: how box-level ops are mixed into the image around their boxes.

A box-level op is blended as ``out = img * (1 - G) + aug * G`` where ``G`` is a sum of peak-1
Gaussians, one centred on each selected box, clamped to ``[0, 1]`` (the original lets overlapping
boxes push the sum above 1).

Color ops (``color_sigmas``): for a box ``h x w`` in an image ``H x W``,
``sigma_y = (h / H) * r`` and ``sigma_x = (w / W) * r`` with ``r = sqrt(s * H * W / (2 pi))``, so the
Gaussian's effective area ``2 pi sigma_y sigma_x`` is ``s * h * w``. With
``R = BLEND_AREA_RATIOS`` and ``a`` the policy's area genes, ``s * h * w`` is ``R[a[0]] * split[0]``
for a small box, ``R[a[1]] * (split[0] + split[1]) / 2`` for a medium one, ``R[a[2]] * split[2]``
for a large one below ``split[2]`` and ``R[a[2]] * h * w`` above it.

Geometric ops (``paste_weights``) paste a transformed crop back with ``s = 1`` computed on the crop
itself, as the original does: an isotropic Gaussian with ``sigma = sqrt(h * w / (2 pi))`` centred on
the crop, which never reaches beyond the box.

Each Gaussian is evaluated only inside a window of ``WINDOW_SIGMAS`` sigma around its centre (the
original evaluates every Gaussian over the whole image): beyond 4 sigma the weight is below
3.4e-4, less than a tenth of a grey level for the largest possible difference, so rounding to
uint8 leaves those pixels unchanged anyway. Pixel ``(i, j)`` sits at ``(i + 0.5, j + 0.5)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Multipliers of the reference blend area indexed by the ``area`` genes (0..9).
BLEND_AREA_RATIOS = (0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0)
WINDOW_SIGMAS = 4.0
STRIP_PIXELS = 1 << 17

Rect = tuple[int, int, int, int]  # y0, y1, x0, x1: rows y0..y1-1, columns x0..x1-1


@dataclass(frozen=True)
class Gaussian:
    """A peak-1 axis-aligned Gaussian centred at ``(cy, cx)`` (pixels) with sigmas ``(sy, sx)``."""

    cy: float
    cx: float
    sy: float
    sx: float

    def window(self, height: int, width: int) -> Rect:
        """Rows and columns within ``WINDOW_SIGMAS`` sigma of the centre, clipped to the image."""
        ry, rx = WINDOW_SIGMAS * self.sy, WINDOW_SIGMAS * self.sx
        y0 = min(max(math.floor(self.cy - ry), 0), height)
        y1 = min(max(math.ceil(self.cy + ry), 0), height)
        x0 = min(max(math.floor(self.cx - rx), 0), width)
        x1 = min(max(math.ceil(self.cx + rx), 0), width)
        return y0, y1, x0, x1

    def profile(self, start: int, stop: int, *, axis: int) -> torch.Tensor:
        """The 1-D factor (float32) over pixel rows (``axis=0``) or columns (``axis=1``) ``start..stop-1``."""
        centre, sigma = (self.cy, self.sy) if axis == 0 else (self.cx, self.sx)
        pos = torch.arange(start, stop, dtype=torch.float32).add_(0.5 - centre).div_(sigma)
        return pos.mul_(pos).mul_(-0.5).exp_()


def blend_scale(area: float, *, area_ratios: Sequence[int], scale_splits: Sequence[int]) -> float:
    """``s`` of a box of ``area`` pixels: its blend region's effective area divided by ``area``."""
    if area < scale_splits[0]:
        return BLEND_AREA_RATIOS[area_ratios[0]] * scale_splits[0] / area
    if area < scale_splits[1]:
        return BLEND_AREA_RATIOS[area_ratios[1]] * (scale_splits[0] + scale_splits[1]) / 2 / area
    if area < scale_splits[2]:
        return BLEND_AREA_RATIOS[area_ratios[2]] * scale_splits[2] / area
    return BLEND_AREA_RATIOS[area_ratios[2]]


def color_gaussians(boxes: torch.Tensor, *, image_size: tuple[int, int], area_ratios: Sequence[int],
                    scale_splits: Sequence[int]) -> list[Gaussian]:
    """One Gaussian per xyxy box ``[N, 4]`` in an image of ``image_size = (H, W)``; empty boxes get none."""
    height, width = image_size
    out = []
    for x1, y1, x2, y2 in boxes.detach().to(torch.float64).reshape(-1, 4).tolist():
        h, w = y2 - y1, x2 - x1
        if h <= 0 or w <= 0:
            continue
        s = blend_scale(h * w, area_ratios=area_ratios, scale_splits=scale_splits)
        r = math.sqrt(s * height * width / (2 * math.pi))
        out.append(Gaussian(cy=(y1 + y2) / 2, cx=(x1 + x2) / 2, sy=h / height * r, sx=w / width * r))
    return out


def paste_weights(height: int, width: int) -> torch.Tensor:
    """Weights ``[height, width]`` (float32) for pasting a transformed crop back onto its box (s = 1)."""
    sigma = math.sqrt(height * width / (2 * math.pi))
    g = Gaussian(cy=height / 2, cx=width / 2, sy=sigma, sx=sigma)
    return torch.outer(g.profile(0, height, axis=0), g.profile(0, width, axis=1))


def _overlap(a: Rect, b: Rect) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def merge_windows(windows: Sequence[Rect]) -> list[tuple[Rect, list[int]]]:
    """Group overlapping windows: disjoint bounding rectangles, each with the indices it contains.

    Each window lies inside exactly one rectangle, so a rectangle's weights depend only on its members.
    """
    groups = [(w, [i]) for i, w in enumerate(windows) if w[0] < w[1] and w[2] < w[3]]
    merged = True
    while merged:
        merged = False
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                if _overlap(groups[i][0], groups[j][0]):
                    (a, ma), (b, mb) = groups[i], groups.pop(j)
                    groups[i] = ((min(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), max(a[3], b[3])), ma + mb)
                    merged = True
                    break
            if merged:
                break
    return groups


def blend_patch(patch: torch.Tensor, augmented: torch.Tensor, weights: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``patch + weights * (augmented - patch)`` rounded to uint8.

    ``patch`` is uint8 ``[3, h, w]``, ``augmented`` float ``[3, h, w]`` in 0..255, ``weights`` float
    ``[h, w]`` in 0..1. Written into ``out`` (uint8 ``[3, h, w]``, may be ``patch`` itself) if given.
    """
    mixed = torch.lerp(patch.float(), augmented, weights)
    # The result lies between two values in 0..255, so adding 0.5 and truncating rounds it.
    mixed.add_(0.5)
    if out is None:
        out = torch.empty(patch.shape, dtype=torch.uint8)
    # numpy's float to uint8 cast is faster than torch's on CPU.
    np.copyto(out.numpy(), mixed.numpy(), casting="unsafe")
    return out


def blend_gaussians(image: torch.Tensor, gaussians: Sequence[Gaussian],
                    augment: Callable[[Rect], torch.Tensor]) -> torch.Tensor:
    """Blend ``augment`` into a copy of ``image`` (uint8 ``[3, H, W]``) under the Gaussians' sum ``G``.

    ``augment(rect)`` returns the augmented pixels of ``rect`` as a new float32 ``[3, h, w]`` tensor in
    0..255; it is called only for the rectangles the Gaussians' windows cover.
    """
    if not gaussians:
        return image
    height, width = image.shape[-2:]
    windows = [g.window(height, width) for g in gaussians]
    out = image.clone()
    for (y0, y1, x0, x1), members in merge_windows(windows):
        # Each Gaussian is separable: G_i = outer(row profile, column profile) inside its window.
        parts = [(windows[i], gaussians[i].profile(windows[i][0], windows[i][1], axis=0),
                  gaussians[i].profile(windows[i][2], windows[i][3], axis=1)) for i in members]
        # Strips of about STRIP_PIXELS keep every temporary small: large fresh buffers cost more in
        # page faults than the arithmetic done in them.
        step = max(1, STRIP_PIXELS // (x1 - x0))
        for s0 in range(y0, y1, step):
            s1 = min(s0 + step, y1)
            weights = torch.zeros(s1 - s0, x1 - x0)
            for (wy0, wy1, wx0, wx1), rows, cols in parts:
                a, b = max(wy0, s0), min(wy1, s1)
                if a < b:
                    weights[a - s0:b - s0, wx0 - x0:wx1 - x0].addr_(rows[a - wy0:b - wy0], cols)
            if len(parts) > 1:
                weights.clamp_(max=1.0)
            blend_patch(image[:, s0:s1, x0:x1], augment((s0, s1, x0, x1)), weights, out=out[:, s0:s1, x0:x1])
    return out
