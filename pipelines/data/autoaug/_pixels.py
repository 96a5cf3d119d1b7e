"""Pixel constants shared by the ops that create pixels, and the two memory layouts of an image."""

from __future__ import annotations

import numpy as np
import torch

from ..transforms import IMAGE_MEAN

# The mean pixel (RGB, 0..255) the detector subtracts: empty areas filled with it normalise to
# zero, which is what the original's fill (applied after normalisation) amounts to.
MEAN_PIXEL: tuple[float, float, float] = tuple(m * 255.0 for m in IMAGE_MEAN)


def interleaved(image: torch.Tensor) -> bool:
    """Whether uint8 ``[3, H, W]`` pixels lie interleaved in memory (``[H, W, 3]``), as decoded images do."""
    return image.shape[0] > 1 and image.stride(0) == 1


def planar(image: torch.Tensor) -> torch.Tensor:
    """``image`` (uint8 ``[3, H, W]``) stored plane by plane: itself if it is, else a copy (numpy transposes
    uint8 about twice as fast as torch). The box-level ops are about twice as fast on planar pixels."""
    if image.is_contiguous():
        return image
    return torch.from_numpy(np.ascontiguousarray(image.numpy()))
