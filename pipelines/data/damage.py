"""Damage an image decodes through: what libjpeg says of it, tied to the file; and PNG data that would
crash the decoder.

libjpeg (inside torchvision's decoder) decodes a JPEG whose entropy-coded data is corrupt or cut
short into pixels (garbage blocks, grey rows) and says so only as a bare line on the process's
standard error ("Corrupt JPEG data: premature end of data segment"), naming no file.
:class:`DecoderMessages` sends file descriptor 2 to a temporary file while the images are checked;
a decode during which that file grew may have written such a line (another thread's decode may
have), so each such image is decoded again later, alone, to tie the line to its file. Lines that say
no damage (libpng's warnings, libjpeg's extraneous bytes before the end marker, which lose no pixel)
are written to standard error at the end, as the decoder would have written them.

libpng, inside torchvision's decoder, ends the process (a segmentation fault) on a PNG whose
compressed data fails its checks (a flipped byte in an ``IDAT`` chunk): :func:`png_problem` checks
every chunk's CRC and the compressed stream before the decoder sees the file.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

# libjpeg's warnings (jerror.h, JWRN_*) that mean the pixels are not what was encoded.
DAMAGE = re.compile(r"Corrupt JPEG data|Premature end of JPEG file|Invalid SOS parameters|"
                    r"Inconsistent progression sequence")
# All the pixels were decoded; the bytes between the last of them and the end marker are ignored.
HARMLESS = re.compile(r"extraneous bytes before marker 0xd9")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_INFLATE_STEP = 1 << 22  # bytes inflated at a time: the check holds no whole image in memory


class DecoderMessages:
    """While open, what the decoder writes to standard error (fd 2) goes to a temporary file.

    :meth:`decode` runs a decode and says whether that file grew meanwhile; :meth:`damage` decodes one
    image again, alone, and returns the damage line it wrote, if any. On closing, lines that say no
    damage go to standard error. ``stream`` is standard error for Python writes (a progress bar)."""

    def __enter__(self) -> DecoderMessages:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        self.stream = open(os.dup(self._saved), "w", buffering=1)  # noqa: SIM115 (closed in __exit__)
        self._alone = threading.Lock()
        self._checked = None  # the size when the first image was decoded again: what follows repeats lines
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        lines = self._file.read(self._checked).decode("utf-8", "replace").splitlines(keepends=True)
        self._file.close()
        self.stream.write("".join(line for line in lines if not is_damage(line)))
        self.stream.close()

    def _size(self) -> int:
        return os.fstat(self._file.fileno()).st_size

    def decode(self, decode: Callable[[], object]) -> tuple[object, bool]:
        """``decode()``'s result, and whether standard error grew while it ran (its own line, or another
        thread's)."""
        before = self._size()
        result = decode()
        return result, self._size() > before

    def damage(self, decode: Callable[[], object]) -> str | None:
        """Run ``decode()`` alone; the first damage line it wrote, or None."""
        with self._alone:
            before = self._size()
            self._checked = before if self._checked is None else self._checked
            try:
                decode()
            except Exception:  # the first decode succeeded; a file changed meanwhile fails elsewhere
                pass
            self._file.seek(before)
            text = self._file.read().decode("utf-8", "replace")
            self._file.seek(0, os.SEEK_END)
        return next((line.strip() for line in text.splitlines() if is_damage(line)), None)


def is_damage(line: str) -> bool:
    """Whether the decoder's ``line`` says that the pixels are not what was encoded."""
    return bool(DAMAGE.search(line)) and not HARMLESS.search(line)


def png_problem(file: str | os.PathLike) -> str | None:
    """Why the PNG ``file`` would crash or fool the decoder (a chunk whose CRC fails, compressed data
    that does not inflate); None if it checks, or if it is no PNG."""
    with open(file, "rb") as f:
        if f.read(8) != PNG_SIGNATURE:
            return None
        data = f.read()
    pos, inflate = 0, zlib.decompressobj()
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        crc = data[pos + 8 + length:pos + 12 + length]
        if len(body) < length or len(crc) < 4:
            return None  # cut short: the decoder says so in its own words
        if zlib.crc32(kind + body) != int.from_bytes(crc, "big"):
            return f"damaged PNG: the CRC of its {kind.decode('latin-1')!r} chunk fails"
        if kind == b"IDAT":
            try:
                chunk = body
                while chunk:
                    inflate.decompress(chunk, _INFLATE_STEP)
                    chunk = inflate.unconsumed_tail
            except zlib.error as err:
                return f"damaged PNG: its compressed pixel data does not inflate ({err})"
        if kind == b"IEND":
            break
        pos += 12 + length
    return None


def named_files(files: list[tuple[Path, int]], limit: int = 3) -> str:
    """``a.jpg (image id 1), b.jpg (image id 2) and 3 more``."""
    text = ", ".join(f"{file.name} (image id {image_id})" for file, image_id in files[:limit])
    return text + (f" and {len(files) - limit} more" if len(files) > limit else "")
