"""Predict on a list of inputs: each image or video read as training reads images, resized by the test
transform, run through evaluation's detection code (:func:`pipelines.evaluation.detect`, test-time
augmentation included) on a backend, and handed to :class:`.outputs.Outputs`.

Images are batched ``batch`` at a time, a video's frames likewise; an input that cannot be read is skipped
with one warning line and listed with its reason, or, with ``strict``, stops the run (its error).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from ..data.collate import BatchCollator
from ..data.decode import decode_image, exif_orientation
from ..data.transforms import SampleContext, TestTimeAugmentation
from ..errors import ImageError
from ..evaluation import detect
from .backend import Backend, category_names
from .outputs import Outputs, draw
from .sources import Input
from .video import VideoReader, VideoWriter

log = logging.getLogger("predict")


@dataclass(frozen=True)
class Settings:
    """How inputs are read and run: the test ``transforms`` (:func:`pipelines.build.data.test_transforms`),
    ``size_divisibility`` of the padded batches, ``tta`` (or None), ``max_pixels`` per image or frame,
    ``batch`` images per call, every ``vid_stride``-th video frame, boxes drawn from ``vis_thresh``."""

    transforms: object
    size_divisibility: int
    tta: TestTimeAugmentation | None
    max_pixels: int
    device: torch.device
    batch: int = 1
    vid_stride: int = 1
    vis_thresh: float = 0.3
    strict: bool = False


@dataclass
class Report:
    """What a run did: inputs used, frames read, detections, the skipped files with their reasons, and the
    seconds spent reading, resizing and detecting."""

    images: int = 0
    videos: int = 0
    frames: int = 0
    detections: int = 0
    skipped: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        done = self.images + self.frames
        return {"images": self.images, "videos": self.videos, "frames": self.frames, "detections": self.detections,
                "skipped": self.skipped,
                "ms_per_image": round(1000 * self.seconds / done, 3) if done else None}


class Runner:
    """Runs ``backend`` over inputs into ``outputs`` as ``settings`` say."""

    def __init__(self, backend: Backend, outputs: Outputs, settings: Settings):
        self.backend = backend.eval()
        self.outputs = outputs
        self.settings = settings
        self.names = category_names(backend)
        self.collate = BatchCollator(settings.size_divisibility)
        self.report = Report()
        self.progress = True

    def run(self, inputs: list[Input], *, progress: bool = True) -> Report:
        """Predict on ``inputs`` in order (a bar over them, and one over each video's frames, where
        ``progress``)."""
        self.progress = progress
        pending: list[tuple[Input, torch.Tensor]] = []
        for item in tqdm(inputs, desc="predict", unit="file", disable=not progress, mininterval=1.0):
            try:
                if item.problem:
                    raise ImageError(item.path, item.problem)
                if item.kind == "video":
                    self._images(pending)
                    pending = []
                    self._video(item)
                    continue
                start = time.perf_counter()
                pending.append((item, self._read(item.path)))
                self.report.seconds += time.perf_counter() - start
                if len(pending) == self.settings.batch:
                    self._images(pending)
                    pending = []
            except ImageError as err:
                self._skip(item, err)
        self._images(pending)
        return self.report

    def _skip(self, item: Input, err: ImageError) -> None:
        if self.settings.strict:
            raise err
        log.warning("skipped %s", err)
        self.report.skipped.append({"file": item.path, "reason": err.reason or str(err)})

    def _read(self, path: str) -> torch.Tensor:
        """The image at ``path`` as training reads it: as stored (no EXIF rotation), within the pixel cap; by
        the backend's own reader where it has one (the ONNX backend's is torch-free, and logs the orientation)."""
        if hasattr(self.backend, "read"):
            return self.backend.read(path, max_pixels=self.settings.max_pixels)
        image = decode_image(path, max_pixels=self.settings.max_pixels)
        orientation = exif_orientation(path)
        if orientation != 1:
            log.warning("%s: EXIF orientation %d: read as stored, without rotation, as training reads images", path,
                        orientation)
        return image

    @torch.inference_mode()
    def _detect(self, images: list[torch.Tensor]) -> list[dict]:
        """Detections (original pixels) of ``images`` (uint8 [3, H, W] as read): by the backend's own path
        where it has one (the ONNX backend's, torch-free), else resized by the test transform and run
        through evaluation's detection code."""
        if hasattr(self.backend, "detect_images"):
            return self.backend.detect_images(images, self.settings.tta)
        empty = {"boxes": torch.zeros((0, 4)), "labels": torch.zeros((0,), dtype=torch.int64)}
        samples = []
        for index, image in enumerate(images):
            resized, _ = self.settings.transforms(image, empty, SampleContext(rng=np.random.default_rng(0)))
            samples.append((resized, {"orig_size": torch.tensor(image.shape[-2:])}, index))
        return detect(self.backend, self.collate(samples), device=self.settings.device, tta=self.settings.tta,
                      size_divisibility=self.settings.size_divisibility, originals=images)

    def _images(self, pending: list[tuple[Input, torch.Tensor]]) -> None:
        if not pending:
            return
        start = time.perf_counter()
        detections = self._detect([image for _, image in pending])
        self.report.seconds += time.perf_counter() - start
        for (item, image), found in zip(pending, detections):
            self.outputs.add(item.relative, width=image.shape[-1], height=image.shape[-2], detections=found)
            self.outputs.save_annotated(item.relative, image, found, vis_thresh=self.settings.vis_thresh)
            self.report.images += 1
            self.report.detections += len(found["scores"])

    def _video(self, item: Input) -> None:
        """Every ``vid_stride``-th frame of the video ``item`` detected, drawn into an annotated copy and
        recorded; a video that fails part way leaves nothing behind (its error is raised)."""
        stride = self.settings.vid_stride
        recorded: list[tuple[int, dict]] = []
        with VideoReader(item.path, max_pixels=self.settings.max_pixels) as reader:
            path = self.outputs.video_path(item.relative)  # its folder made once the video has opened
            writer = VideoWriter(path, rate=reader.rate / stride, width=reader.width, height=reader.height)
            try:
                batch: list[tuple[int, torch.Tensor]] = []
                start = time.perf_counter()
                total = -(-reader.frame_count // stride) if reader.frame_count else None
                for index, frame in tqdm(reader.frames(stride), total=total, desc=item.relative, unit="frame",
                                         leave=False, disable=not self.progress, mininterval=1.0):
                    batch.append((index, frame))
                    if len(batch) == self.settings.batch:
                        self.report.seconds += time.perf_counter() - start
                        recorded += self._frames(batch, writer)
                        batch, start = [], time.perf_counter()
                self.report.seconds += time.perf_counter() - start
                recorded += self._frames(batch, writer)
                writer.close()
            except BaseException:
                writer.container.close()
                path.unlink(missing_ok=True)
                raise
        for index, found in recorded:
            self.outputs.add(item.relative, width=reader.width, height=reader.height, detections=found,
                             frame_index=index)
            self.report.detections += len(found["scores"])
        self.report.videos += 1
        self.report.frames += len(recorded)

    def _frames(self, batch: list[tuple[int, torch.Tensor]], writer: VideoWriter) -> list[tuple[int, dict]]:
        if not batch:
            return []
        start = time.perf_counter()
        detections = self._detect([frame for _, frame in batch])
        self.report.seconds += time.perf_counter() - start
        for (_, frame), found in zip(batch, detections):
            writer.write(draw(frame, found, self.names, vis_thresh=self.settings.vis_thresh))
        return [(index, found) for (index, _), found in zip(batch, detections)]
