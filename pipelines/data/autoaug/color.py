"""The seven color ops, computed from whole-image statistics but evaluated only where they are blended.

Every op reads its statistics from the whole uint8 RGB image ``[3, H, W]`` (so AutoContrast and
Equalize use global histograms, Contrast the global mean grey level, as in the original) and
returns the augmented pixels of any rectangle as float32 in 0..255 with no intermediate rounding.
Magnitudes (``level`` 0..10), as in the original on a 0..1 scale:

- AutoContrast, Equalize: ignore ``level``.
- SolarizeAdd: adds ``level / 10 * 0.4296875`` to pixels ``<= 0.5`` (clipped at 1).
- Color, Contrast, Brightness, Sharpness: enhancement factor ``level / 10 * 1.8 + 0.1`` blended
  against grey, the mean grey level, black and a 3x3 smoothing (reflect padded) respectively.

Grey is ``0.2989 R + 0.587 G + 0.114 B``; the original applies these RGB weights to BGR images,
ours are RGB so the weights match the channels.

torchvision's uint8 kernels (``autocontrast``, ``equalize``, ``adjust_*``) were not used: they work on
the whole image (costly for a few boxes: ``adjust_sharpness`` filters every pixel) and round intermediate
values (the grey mean, the smoothed image) or leave the border unsharpened, unlike the original.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .blend import Rect, blend_gaussians, color_gaussians
from ...policy import COLOR_OPS, op_table

GREY_WEIGHTS = (0.2989, 0.587, 0.114)  # R, G, B
SOLARIZE_ADD_MAX = 0.4296875  # 110 / 256 on a 0..1 scale
MAX_LEVEL = 10.0

RegionOp = Callable[[Rect], torch.Tensor]


def enhance_factor(level: int) -> float:
    """Enhancement factor of Color, Contrast, Brightness and Sharpness at ``level``."""
    return level / MAX_LEVEL * 1.8 + 0.1


def _patch(image: torch.Tensor, rect: Rect) -> torch.Tensor:
    y0, y1, x0, x1 = rect
    return image[:, y0:y1, x0:x1]


def _grey(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(0)
    return r.mul(GREY_WEIGHTS[0]).add_(g, alpha=GREY_WEIGHTS[1]).add_(b, alpha=GREY_WEIGHTS[2])


def _clamped(factor: float):
    # Blending towards a degenerate image stays in range for factors <= 1; only extrapolation clips.
    return (lambda t: t.clamp_(0, 255)) if factor > 1 else (lambda t: t)


def _autocontrast(image: torch.Tensor, level: int) -> RegionOp:
    lo = image.amin(dim=(1, 2)).float()
    hi = image.amax(dim=(1, 2)).float()
    stretch = hi > lo  # a flat channel is left as it is
    scale = torch.where(stretch, 255.0 / (hi - lo).clamp(min=1), torch.ones(3)).view(3, 1, 1)
    offset = (torch.where(stretch, -lo, torch.zeros(3)).view(3, 1, 1) * scale)
    return lambda rect: _patch(image, rect).float().mul_(scale).add_(offset)


def _equalize(image: torch.Tensor, level: int) -> RegionOp:
    # PIL's algorithm (as in the original): a per-channel lookup table from the cumulative histogram.
    luts = []
    for channel in image:
        hist = torch.bincount(channel.reshape(-1), minlength=256)
        nonzero = hist[hist > 0]
        step = int(nonzero.sum() - nonzero[-1]) // 255
        if step == 0:
            luts.append(torch.arange(256, dtype=torch.float32))
            continue
        lut = (torch.cumsum(hist, 0) + step // 2) // step
        luts.append(torch.cat([torch.zeros(1), lut[:-1].float()]).clamp_(0, 255))
    lut = torch.stack(luts)  # [3, 256]

    def region(rect: Rect) -> torch.Tensor:
        patch = _patch(image, rect)
        return torch.gather(lut, 1, patch.reshape(3, -1).long()).view(patch.shape)

    return region


def _solarize_add(image: torch.Tensor, level: int) -> RegionOp:
    addition = level / MAX_LEVEL * SOLARIZE_ADD_MAX * 255.0
    # 127 + 0.43 * 255 < 255: the original's clip at 1 never bites.

    def region(rect: Rect) -> torch.Tensor:
        patch = _patch(image, rect)
        # Pixels <= 0.5 on a 0..1 scale (<= 127) get the addition; the top bit is set exactly for the
        # others, and a shift is much cheaper than a comparison on uint8.
        above = (patch >> 7).float()
        return patch.float().add_(addition).sub_(above, alpha=addition)

    return region


def _color(image: torch.Tensor, level: int) -> RegionOp:
    factor = enhance_factor(level)
    clamp = _clamped(factor)

    def region(rect: Rect) -> torch.Tensor:
        x = _patch(image, rect).float()
        grey = _grey(x)
        return clamp(x.mul_(factor).add_(grey, alpha=1.0 - factor))

    return region


def _contrast(image: torch.Tensor, level: int) -> RegionOp:
    factor = enhance_factor(level)
    clamp = _clamped(factor)
    height, width = image.shape[-2:]
    # The channel sums fit in int32 for any image under 8.4 megapixels; int64 beyond.
    dtype = torch.int32 if height * width * 255 < 2**31 else torch.int64
    channel_means = image.sum(dim=(1, 2), dtype=dtype).double() / (height * width)
    mean = float(sum(w * m for w, m in zip(GREY_WEIGHTS, channel_means.tolist())))
    return lambda rect: clamp(_patch(image, rect).float().mul_(factor).add_((1.0 - factor) * mean))


def _brightness(image: torch.Tensor, level: int) -> RegionOp:
    factor = enhance_factor(level)
    clamp = _clamped(factor)
    return lambda rect: clamp(_patch(image, rect).float().mul_(factor))


def _sharpness(image: torch.Tensor, level: int) -> RegionOp:
    factor = enhance_factor(level)
    clamp = _clamped(factor)
    height, width = image.shape[-2:]
    # smooth = (box3x3 + 4 x) / 13 (kernel [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13), and
    # aug = smooth + factor (x - smooth) = a x + b box3x3.
    a, b = factor + 4.0 * (1.0 - factor) / 13.0, (1.0 - factor) / 13.0

    def region(rect: Rect) -> torch.Tensor:
        y0, y1, x0, x1 = rect
        # One pixel of context from the image, reflected where the rectangle meets the border.
        ey0, ey1, ex0, ex1 = max(y0 - 1, 0), min(y1 + 1, height), max(x0 - 1, 0), min(x1 + 1, width)
        context = image[:, ey0:ey1, ex0:ex1].float()
        pad = (int(x0 == ex0), int(x1 == ex1), int(y0 == ey0), int(y1 == ey1))
        if any(pad):
            mode = "reflect" if min(context.shape[-2:]) > 1 else "replicate"
            context = F.pad(context[None], pad, mode=mode)[0]
        rows = context[:, :-2] + context[:, 1:-1]
        rows += context[:, 2:]
        box = rows[:, :, :-2] + rows[:, :, 1:-1]
        box += rows[:, :, 2:]
        return clamp(box.mul_(b).add_(context[:, 1:-1, 1:-1], alpha=a))

    return region


_OPS: dict[str, Callable[[torch.Tensor, int], RegionOp]] = op_table(COLOR_OPS, {
    "AutoContrast": _autocontrast,
    "Equalize": _equalize,
    "SolarizeAdd": _solarize_add,
    "Color": _color,
    "Contrast": _contrast,
    "Brightness": _brightness,
    "Sharpness": _sharpness,
})


def color_transform(name: str, image: torch.Tensor, *, level: int) -> RegionOp:
    """Prepare op ``name`` on ``image`` (uint8 ``[3, H, W]``, RGB).

    Returns a function of a rectangle ``(y0, y1, x0, x1)`` giving that rectangle's augmented pixels
    (a new float32 ``[3, h, w]`` tensor in 0..255).
    """
    if name not in _OPS:
        raise ValueError(f"unknown color op {name!r}; expected one of {', '.join(COLOR_OPS)}")
    return _OPS[name](image, level)


def color_op_on_boxes(name: str, image: torch.Tensor, boxes: torch.Tensor, *, level: int,
                      area_ratios: Sequence[int], scale_splits: Sequence[int]) -> torch.Tensor:
    """Op ``name`` blended into ``image`` around the xyxy ``boxes`` ``[N, 4]`` (the selected ones).

    Returns a new uint8 image, or ``image`` itself when no box can be blended.
    """
    gaussians = color_gaussians(boxes, image_size=tuple(image.shape[-2:]), area_ratios=area_ratios,
                                scale_splits=scale_splits)
    if not gaussians:
        return image
    return blend_gaussians(image, gaussians, color_transform(name, image, level=level))
