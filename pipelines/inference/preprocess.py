"""Images in, the exported graph's input out, without torch: decode (PIL), resize, pad into a batch.

:func:`decode` follows training's decoder (:mod:`pipelines.data.decode`) in what it accepts and gives:
JPEG, PNG, WebP and GIF (the first frame), told apart by content; ``uint8`` RGB (greyscale repeated,
alpha dropped, 16-bit channels keep their high byte); pixels as stored, without EXIF rotation (an
orientation other than 1 is logged in one line); the pixel cap checked from the header before any
pixel is decoded; nothing that is not a regular file opened. It decodes with PIL, not torchvision, and
:func:`resize` resizes with PIL's bilinear filter (antialiased when shrinking), not torchvision's
antialiased bilinear resize: their differences are measured by the export's parity, not assumed away.

:func:`prepare` makes a batch: each image resized as the test transform resizes it (the shorter side
to ``min_size``, the longer at most ``max_size``: training's rule, :func:`pipelines.data.sizes.resized_size`),
padded with zeros at the bottom and right to a common size that is a multiple of ``size_divisibility``, as
``uint8 [N, 3, H, W]``.

This module imports neither torch nor torchvision (an import-linter contract holds it).
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..data.sizes import resized_size
from ..errors import ImageError, first_line
from ..fileio import file_problem

log = logging.getLogger(__name__)

# The pixel cap below is the limit: PIL's own bomb check (an error above 179 megapixels) would refuse
# first, in its words. Training's decoder sets the same (pipelines/data/decode.py).
Image.MAX_IMAGE_PIXELS = None
FORMATS = ("JPEG", "PNG", "WEBP", "GIF")
_ORIENTATION_TAG = 0x0112


@dataclass(frozen=True)
class Decoded:
    """A decoded image: ``pixels`` ``uint8 [H, W, 3]`` RGB, and the EXIF ``orientation`` it carries (1-8,
    1 if none; the pixels are as stored whatever it says)."""

    pixels: np.ndarray
    orientation: int = 1

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)``."""
        return self.pixels.shape[0], self.pixels.shape[1]


@dataclass(frozen=True)
class Batch:
    """The graph's input: ``images`` ``uint8 [N, 3, H, W]`` (H and W multiples of the size divisibility),
    each image's ``(height, width)`` after resizing (``image_sizes``) and before (``orig_sizes``)."""

    images: np.ndarray
    image_sizes: list[tuple[int, int]]
    orig_sizes: list[tuple[int, int]]

    @property
    def padded_size(self) -> tuple[int, int]:
        return self.images.shape[2], self.images.shape[3]


def _describe(width: int, height: int, frames: int) -> str:
    pixels = width * height * frames
    text = f"{width}x{height} pixels" + (f" x {frames} frames" if frames > 1 else "")
    return text + (f" ({pixels / 1e6:.1f} megapixels)" if pixels >= 10**5 else "")


def decode(source: str | os.PathLike | bytes, *, max_pixels: int, name: str | None = None) -> Decoded:
    """Decode an image file (a path) or its bytes.

    Args:
        source: the file's path, or its content.
        max_pixels: the most pixels it may have (``dataset.max_image_pixels``, the model card's
            ``max_image_pixels``; a GIF counts all its frames, as training's decoder decodes them all),
            checked from the header before anything is decoded.
        name: what to call the image in messages (default: the path, or ``<bytes>``).

    Returns:
        the pixels and the EXIF orientation (see :class:`Decoded`).

    Raises:
        ImageError: ``<name>: <reason>`` in one line: not a regular file, empty, not a JPEG, PNG, WebP
            or GIF image, truncated or corrupt, or over ``max_pixels``.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        label = name or "<bytes>"
        data = bytes(source)
        if not data:
            raise ImageError(label, "empty file")
        opened = io.BytesIO(data)
    else:
        label = name or os.fspath(source)
        if problem := file_problem(source):
            raise ImageError(label, problem)
        if os.path.getsize(source) == 0:
            raise ImageError(label, "empty file")
        opened = os.fspath(source)
    try:
        with Image.open(opened, formats=FORMATS) as image:
            frames = getattr(image, "n_frames", 1) if image.format == "GIF" else 1
            if image.width * image.height * frames > max_pixels:
                raise ImageError(label, f"{_describe(image.width, image.height, frames)} is more than "
                                        f"dataset.max_image_pixels ({max_pixels}); raise that param to read this image")
            orientation = _orientation(image)
            image.seek(0)
            image.load()
            pixels = _rgb(image)
    except ImageError:
        raise
    except Image.UnidentifiedImageError:
        raise ImageError(label, "unreadable image (not a JPEG, PNG, WebP or GIF file)") from None
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError and more for broken files
        raise ImageError(label, f"unreadable image ({first_line(err, 200) or type(err).__name__})") from None
    if orientation != 1:
        log.warning("%s: EXIF orientation %d: read as stored, without rotation, as training reads images",
                    label, orientation)
    return Decoded(pixels, orientation)


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation the image carries (1-8), 1 if none or unreadable."""
    try:
        value = image.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block: the pixels are read as stored anyway
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _rgb(image: Image.Image) -> np.ndarray:
    """``uint8 [H, W, 3]`` RGB from a loaded PIL image, as training's decoder gives it."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):  # 16-bit greyscale: keep the high byte
        grey = (np.asarray(image).astype(np.int64) >> 8).clip(0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if image.mode != "RGB":
        image = image.convert("RGB")  # greyscale repeated, palette applied, alpha dropped, CMYK converted
    return np.asarray(image, dtype=np.uint8).copy()


def resize(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``uint8 [H, W, 3]`` pixels resized to ``size`` ``(height, width)`` with PIL's bilinear filter
    (antialiased when shrinking); the same array if already of that size."""
    if pixels.shape[:2] == tuple(size):
        return pixels
    resized = Image.fromarray(pixels).resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return np.array(resized, dtype=np.uint8)  # a writable copy, as callers may draw on it


def pad_batch(images: Sequence[np.ndarray], size_divisibility: int) -> np.ndarray:
    """Stack ``uint8 [H, W, 3]`` images into ``uint8 [N, 3, H', W']``, zero padded at the bottom and right,
    H' and W' the largest height and width rounded up to multiples of ``size_divisibility``."""
    height = max(im.shape[0] for im in images)
    width = max(im.shape[1] for im in images)
    height = -(-height // size_divisibility) * size_divisibility
    width = -(-width // size_divisibility) * size_divisibility
    out = np.zeros((len(images), 3, height, width), dtype=np.uint8)
    for slot, im in zip(out, images):
        slot[:, : im.shape[0], : im.shape[1]] = im.transpose(2, 0, 1)
    return out


def prepare(images: Sequence[np.ndarray], *, min_size: int, max_size: int, size_divisibility: int) -> Batch:
    """The graph's input for decoded ``uint8 [H, W, 3]`` images: each resized (:func:`resized_size`,
    :func:`resize`), then padded into one batch (:func:`pad_batch`)."""
    if not images:
        raise ValueError("no images to prepare")
    orig_sizes = [(im.shape[0], im.shape[1]) for im in images]
    resized = [resize(im, resized_size(h, w, min_size, max_size)) for im, (h, w) in zip(images, orig_sizes)]
    return Batch(pad_batch(resized, size_divisibility), [(im.shape[0], im.shape[1]) for im in resized], orig_sizes)
