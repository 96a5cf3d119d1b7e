"""The one image decoder: a file in, ``uint8`` RGB pixels out, or a one-line error naming the file;
and what an image file's header says (size, frames, EXIF orientation), read without decoding a pixel.

Training (:mod:`.dataset`) and validation at prepare (:func:`.coco.validate_coco`) read images
through :func:`decode_image`, so an image that passes prepare is one that training reads, with the
same pixels. The content decides the format, not the file name: JPEG (greyscale and CMYK too), PNG
(8 and 16 bits, palette, alpha), WebP and GIF (the first frame). Nothing that is not a regular file
is opened (a FIFO would block for ever), and with ``size`` or ``max_pixels`` the header is checked
before any pixel is decoded.

:func:`read_image_header` gives an image's size from its header alone (PIL parses the header, no
pixels), so a size or pixel-limit check (:func:`too_many_pixels`, :func:`size_mismatch`) refuses a
decompression bomb before anything decodes it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as _torchvision_decode

from ..errors import ImageError, first_line
from ..fileio import file_problem

# torchvision prefixes its messages with the C++ function and source line: "decode_jpeg, /.../decode_jpeg.cpp:171, ".
_SOURCE_LOCATION = re.compile(r"^[\w:()]+, \S+:\d+, ")
# PIL's own bomb check (a warning above 89 megapixels, an error above 179) would fire at open, in its
# words, before the caller's limit: the header checks below are the limit, and PIL here decodes nothing.
Image.MAX_IMAGE_PIXELS = None
# The formats the decoder reads (torchvision: JPEG, PNG, WebP, GIF); PIL parses only their headers here.
_HEADER_FORMATS = ("JPEG", "PNG", "WEBP", "GIF")
_ORIENTATION_TAG = 0x0112
_ROTATED = {5: "transposed", 6: "turned 90 degrees clockwise", 7: "transversed", 8: "turned 90 degrees counter-clockwise"}


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


@dataclass(frozen=True)
class ImageHeader:
    """What an image file's header says: ``width`` x ``height`` pixels, ``frames`` (an animated GIF's
    decoder decodes them all)."""

    width: int
    height: int
    frames: int = 1

    @property
    def pixels(self) -> int:
        return self.width * self.height * self.frames

    def describe(self) -> str:
        """``30000x30000 pixels (900.0 megapixels)``, ``32x24 pixels x 3 frames``."""
        text = f"{self.width}x{self.height} pixels" + (f" x {self.frames} frames" if self.frames > 1 else "")
        return text + (f" ({self.pixels / 1e6:.1f} megapixels)" if self.pixels >= 10**5 else "")


def read_image_header(file: str | Path) -> ImageHeader | None:
    """The image's size from its header, without decoding its pixels (PIL reads only the header; a
    GIF's frames are counted by skipping through them). None if the file is not one of the formats the
    decoder reads or its header is broken: the decoder then says what is wrong."""
    try:
        with Image.open(file, formats=_HEADER_FORMATS) as image:
            frames = getattr(image, "n_frames", 1) if image.format == "GIF" else 1
            return ImageHeader(image.width, image.height, frames)
    except Exception:  # PIL raises many kinds for a broken header; the decoder's message is the one to give
        return None


def exif_orientation(file: str | Path) -> int:
    """The EXIF orientation (1-8) the file's header carries, 1 if none; nothing is decoded."""
    try:
        with Image.open(file, formats=_HEADER_FORMATS) as image:
            exif = image.info.get("exif")  # read with the header for JPEG, PNG (eXIf before the pixels), WebP
            if not exif:
                return 1
            tags = Image.Exif()
            tags.load(exif)
            value = tags.get(_ORIENTATION_TAG, 1)
            return value if isinstance(value, int) and 1 <= value <= 8 else 1
    except Exception:
        return 1


def too_many_pixels(header: ImageHeader, max_image_pixels: int) -> str | None:
    """Why an image of ``header`` may not be decoded under ``max_image_pixels``; None if it may."""
    if header.pixels <= max_image_pixels:
        return None
    return (f"{header.describe()} is more than dataset.max_image_pixels ({max_image_pixels}); raise that param "
            "to read this image")


def size_mismatch(header: ImageHeader, file: str | Path, width: int, height: int, source: str) -> str | None:
    """Why an image of ``header`` is not the ``width`` x ``height`` that ``source`` says; None if it is.
    Names the EXIF orientation when that explains the swap."""
    if (header.width, header.height) == (width, height):
        return None
    text = f"file is {header.width}x{header.height} but {source} says {width}x{height}"
    if (header.width, header.height) == (height, width):
        orientation = exif_orientation(file)
        if orientation in _ROTATED:
            text += (f", its size as shown with EXIF orientation {orientation} ({_ROTATED[orientation]}); images are "
                     "read as stored, without EXIF rotation: store the pixels rotated (e.g. exiftran -ai) or give the "
                     "stored size")
    return text
