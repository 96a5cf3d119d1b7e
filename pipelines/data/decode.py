"""The one image decoder: a file in, ``uint8`` RGB pixels out, or a one-line error naming the file.

Training (:mod:`.dataset`) and validation at prepare (:func:`.coco.validate_coco`, which the prepare
stage hands this decoder) read images through :func:`decode_image`, so an image that passes prepare
is one that training reads, with the same pixels. The content decides the format, not the file name:
JPEG (greyscale and CMYK too), PNG (8 and 16 bits, palette, alpha), WebP and GIF.
"""

from __future__ import annotations

import os
import re
import stat

import torch
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as _torchvision_decode

from ..errors import ImageError

# torchvision prefixes its messages with the C++ function and source line: "decode_jpeg, /.../decode_jpeg.cpp:171, ".
_SOURCE_LOCATION = re.compile(r"^[\w:()]+, \S+:\d+, ")


def decode_image(path: str | os.PathLike) -> torch.Tensor:
    """Decode the whole image file at ``path``.

    Returns:
        ``uint8 [3, H, W]`` RGB pixels (greyscale is repeated, CMYK converted, alpha dropped, 16-bit
        channels keep their high byte).

    Raises:
        ImageError: the file is missing, not a regular file, empty, truncated or in a format the
            decoder cannot read; one line naming the file and what was wrong.
    """
    name = os.fspath(path)
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        broken = f" (broken symlink to {os.readlink(name)})" if os.path.islink(name) else ""
        raise ImageError(name, "image file not found" + broken) from None
    except (OSError, ValueError) as err:  # permission, name too long, a NUL or undecodable character
        raise ImageError(name, f"cannot read the file ({getattr(err, 'strerror', None) or _first_line(err)})") from None
    if not stat.S_ISREG(mode):
        raise ImageError(name, "not a regular file")
    try:
        image = _torchvision_decode(name, mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError, OSError) as err:
        raise ImageError(name, _reason(name, err)) from None
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
    text = _SOURCE_LOCATION.sub("", _first_line(err))
    if text.startswith("Unsupported image file"):
        return "unreadable image (not a JPEG, PNG, WebP or GIF file)"
    return f"unreadable image ({text})"


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
