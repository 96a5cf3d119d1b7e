"""Video files in and out through PyAV (FFmpeg inside its wheel; torchvision's video reader is gone).

Frames are read as stored (no rotation metadata applied, as images are read without EXIF rotation),
as ``uint8 [3, H, W]`` RGB; a frame larger than the pixel cap is refused before any is decoded. The
annotated copy is MPEG-4 in an ``.mp4`` container at the input's frame rate (divided by the stride when
only every Nth frame is kept), one output frame per frame read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from fractions import Fraction

import av
import numpy as np
import torch

from ..data.decode import ImageHeader, too_many_pixels
from ..errors import ImageError, first_line
from ..fileio import file_problem

CODEC = "mpeg4"  # in every FFmpeg build (PyAV's wheels need not carry libx264)


class VideoReader:
    """The first video stream of the file at ``path``; refused (:class:`ImageError`, one line) when it is not
    a regular file, not a video FFmpeg reads, or has frames above ``max_pixels``."""

    def __init__(self, path: str, *, max_pixels: int | None = None):
        self.path = path
        if problem := file_problem(path):
            raise ImageError(path, problem.replace("image file", "video file"))
        try:
            self.container = av.open(path, mode="r")
        except (av.FFmpegError, OSError, ValueError) as err:
            raise ImageError(path, f"unreadable video ({_reason(err)})") from None
        if not self.container.streams.video:
            self.close()
            raise ImageError(path, "unreadable video (no video stream)")
        self.stream = self.container.streams.video[0]
        self.width, self.height = int(self.stream.codec_context.width), int(self.stream.codec_context.height)
        if max_pixels is not None and (text := too_many_pixels(ImageHeader(self.width, self.height), max_pixels)):
            self.close()
            raise ImageError(path, "frames of " + text)
        rate = self.stream.average_rate or self.stream.guessed_rate
        self.rate = Fraction(rate) if rate else Fraction(25)
        self.frame_count = int(self.stream.frames) or None  # as the container says; None where it does not

    def frames(self, stride: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
        """``(frame index, uint8 [3, H, W])`` of every ``stride``-th frame from the first.

        Raises:
            ImageError: FFmpeg cannot decode the stream (a truncated or corrupt file).
        """
        try:
            for index, frame in enumerate(self.container.decode(self.stream)):
                if index % stride == 0:
                    pixels = frame.to_ndarray(format="rgb24")
                    yield index, torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous()
        except (av.FFmpegError, OSError, ValueError) as err:
            raise ImageError(self.path, f"unreadable video ({_reason(err)})") from None

    def close(self) -> None:
        self.container.close()

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VideoWriter:
    """An ``.mp4`` file at ``path`` of ``width`` x ``height`` frames at ``rate`` frames per second."""

    def __init__(self, path: str | os.PathLike, *, rate: Fraction, width: int, height: int):
        self.container = av.open(os.fspath(path), mode="w", format="mp4")
        self.stream = self.container.add_stream(CODEC, rate=rate)
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = "yuv420p"
        self.stream.bit_rate = max(1_000_000, width * height * 4)

    def write(self, image: torch.Tensor | np.ndarray) -> None:
        """Append one frame, ``uint8 [3, H, W]`` (tensor) or ``[H, W, 3]`` (array) RGB."""
        pixels = image.permute(1, 2, 0).contiguous().numpy() if isinstance(image, torch.Tensor) else image
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
        if (frame.width, frame.height) != (self.stream.width, self.stream.height):  # a stream that changed size
            frame = frame.reformat(width=self.stream.width, height=self.stream.height)
        for packet in self.stream.encode(frame):
            self.container.mux(packet)

    def close(self) -> None:
        """Flush the encoder and close the file."""
        for packet in self.stream.encode(None):
            self.container.mux(packet)
        self.container.close()


def _reason(err: Exception) -> str:
    """FFmpeg's words for why a file cannot be read (without the errno and the file name PyAV adds)."""
    return getattr(err, "strerror", None) or first_line(err) or type(err).__name__
