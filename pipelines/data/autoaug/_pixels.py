"""Pixel constants shared by the ops that create pixels."""

from __future__ import annotations

from ..transforms import IMAGE_MEAN

# The mean pixel (RGB, 0..255) the detector subtracts: empty areas filled with it normalise to
# zero, which is what the original's fill (applied after normalisation) amounts to.
MEAN_PIXEL: tuple[float, float, float] = tuple(m * 255.0 for m in IMAGE_MEAN)
