"""The one image decoder: a file in, ``uint8`` RGB pixels out, or a one-line error naming the file.

Training (:mod:`.dataset`) and validation at prepare (:func:`.coco.validate_coco`, which the prepare
stage hands this decoder) read images through :func:`decode_image`, so an image that passes prepare
is one that training reads, with the same pixels. The content decides the format, not the file name:
JPEG (greyscale and CMYK too), PNG (8 and 16 bits, palette, alpha), WebP and GIF (the first frame).
Nothing that is not a regular file is opened (a FIFO would block for ever), and with ``size`` or
``max_pixels`` the header is checked before any pixel is decoded.
"""

from __future__ import annotations

import os
import re

import torch
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as _torchvision_decode

from ..errors import ImageError, first_line
from .coco import file_problem, read_image_header, size_mismatch, too_many_pixels

# torchvision prefixes its messages with the C++ function and source line: "decode_jpeg, /.../decode_jpeg.cpp:171, ".
_SOURCE_LOCATION = re.compile(r"^[\w:()]+, \S+:\d+, ")


def decode_image(path: str | os.PathLike, *, size: tuple[int, int] | None = None,
                 max_pixels: int | None = None) -> torch.Tensor:
    """Decode the whole image file at ``path``.

    Args:
        path: the image file.
        size: ``(width, height)`` it must have (the data loader passes the annotation cache's, which the
            prepare stage checked against ``dataset.max_image_pixels``), checked from the header first.
        max_pixels: the most pixels it may have, checked from the header first.

    Returns:
        ``uint8 [3, H, W]`` RGB pixels (greyscale is repeated, CMYK converted, alpha dropped, 16-bit
        channels keep their high byte; an animated GIF gives its first frame).

    Raises:
        ImageError: the file is missing, not a regular file, empty, truncated, in a format the decoder
            cannot read, larger than ``max_pixels`` or not of ``size``; one line naming the file and
            what was wrong.
    """
    name = os.fspath(path)
    if problem := file_problem(name):
        raise ImageError(name, problem)
    if size is not None or max_pixels is not None:
        header = read_image_header(name)  # None: not a format the decoder reads, which it says below
        if header is not None:
            if max_pixels is not None and (text := too_many_pixels(header, max_pixels)):
                raise ImageError(name, text)
            if size is not None and (text := size_mismatch(header, name, *size, "the annotation cache")):
                raise ImageError(name, text + "; the file changed after the prepare stage: run it again")
    try:
        image = _torchvision_decode(name, mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError, OSError) as err:
        raise ImageError(name, _reason(name, err)) from None
    if image.ndim == 4:  # an animated GIF: [frames, 3, H, W]
        image = image[0]
    if image.dtype != torch.uint8:  # 16-bit PNG: keep the high byte, as torchvision's to_dtype(scale=True) does
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    return image


def _reason(name: str, err: Exception) -> str:
    """Why ``name`` could not be decoded, in words, from the decoder's error."""
    try:
        if os.path.getsize(name) == 0:
            return "empty file"
    except OSError:
        pass
    text = _SOURCE_LOCATION.sub("", first_line(err) or type(err).__name__)
    if text.startswith("Unsupported image file"):
        return "unreadable image (not a JPEG, PNG, WebP or GIF file)"
    return f"unreadable image ({text})"
