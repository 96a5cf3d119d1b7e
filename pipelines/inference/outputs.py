"""What predict writes into its output folder: annotated images, ``predictions.json``, ``coco.json`` and
``summary.json``.

``predictions.json`` is a COCO results list (``image_id``, ``category_id`` as in the training data, ``bbox``
``[x, y, width, height]`` in the original image's pixels, ``score``; a video frame's also ``frame_index``).
``coco.json`` holds the images (``id``, ``file_name``: the input's relative path, ``width``, ``height``; a
frame's also ``frame_index``) and the categories, so that ``COCO("coco.json").loadRes("predictions.json")``
loads the results on their own. The caller writes into a temporary folder that replaces the output
folder once complete (:func:`pipelines.fileio.atomic_dir`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..data.preview import draw_sample
from ..fileio import write_json
from .ground_truth import GroundTruth

# How an annotated image is encoded, by its input's suffix; another suffix gets a PNG beside its name.
_FORMATS = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP", ".gif": "GIF"}


class Outputs:
    """Collects the detections of each image and frame and writes the output files into ``folder``.

    Image ids come from ``ground_truth`` where it names the input (:class:`.ground_truth.GroundTruth`);
    the others are numbered from 1 (above the ground truth's largest id where there is one), in order.
    """

    def __init__(self, folder: Path, *, categories: list[dict], ground_truth: GroundTruth | None = None):
        self.folder = Path(folder)
        self.categories = [{"id": int(c["id"]), "name": str(c["name"])} for c in categories]
        self.ground_truth = ground_truth
        self.images: list[dict] = []
        self.predictions: list[dict] = []
        self._next_id = (ground_truth.max_id if ground_truth is not None else 0) + 1

    def add(self, relative: str, *, width: int, height: int, detections: dict[str, torch.Tensor],
            frame_index: int | None = None) -> int:
        """Record the detections of one image (or of frame ``frame_index`` of a video): ``boxes`` xyxy in
        the original pixels, ``scores``, ``labels`` (indices into the categories). Returns its image id."""
        image_id = None
        if self.ground_truth is not None and frame_index is None:  # a frame is numbered: no file name to match
            image_id = self.ground_truth.image_id(relative)
        if image_id is None:
            image_id, self._next_id = self._next_id, self._next_id + 1
        entry: dict[str, Any] = {"id": image_id, "file_name": relative, "width": width, "height": height}
        extra = {} if frame_index is None else {"frame_index": frame_index}
        self.images.append({**entry, **extra})
        boxes = detections["boxes"].float().clone()
        boxes[:, 2:] -= boxes[:, :2]
        for box, score, label in zip(boxes.tolist(), detections["scores"].tolist(), detections["labels"].tolist()):
            self.predictions.append({"image_id": image_id, "category_id": self.categories[label]["id"],
                                     "bbox": box, "score": score, **extra})
        return image_id

    def annotated_path(self, relative: str) -> Path:
        """Where the annotated image of the input at ``relative`` goes (its folders made)."""
        path = self.folder / relative
        if path.suffix.lower() not in _FORMATS:
            path = path.with_name(path.name + ".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def video_path(self, relative: str) -> Path:
        """Where the annotated copy of the video at ``relative`` goes (its folders made): the same path, with
        ``.mp4`` added unless it ends so."""
        path = self.folder / relative
        if path.suffix.lower() != ".mp4":
            path = path.with_name(path.name + ".mp4")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def save_annotated(self, relative: str, image: torch.Tensor, detections: dict[str, torch.Tensor], *,
                       vis_thresh: float) -> Path:
        """Write ``image`` (uint8 [3, H, W], as read) with the detections scoring at least ``vis_thresh``."""
        path = self.annotated_path(relative)
        pixels = draw(image, detections, [c["name"] for c in self.categories], vis_thresh=vis_thresh)
        Image.fromarray(pixels).save(path, format=_FORMATS.get(path.suffix.lower(), "PNG"),
                                     **({"quality": 95} if path.suffix.lower() in (".jpg", ".jpeg") else {}))
        return path

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``predictions.json``, ``coco.json`` and ``summary.json``."""
        write_json(self.folder / "predictions.json", self.predictions, indent=None)
        write_json(self.folder / "coco.json", {"images": self.images, "annotations": [],
                                               "categories": self.categories}, indent=None)
        write_json(self.folder / "summary.json", summary)


def draw(image: torch.Tensor, detections: dict[str, torch.Tensor], names: list[str], *,
         vis_thresh: float) -> np.ndarray:
    """``image`` with the detections scoring at least ``vis_thresh`` drawn (the training preview's
    drawing, :func:`pipelines.data.preview.draw_sample`), as ``uint8 [H, W, 3]``."""
    keep = detections["scores"] >= vis_thresh
    shown = {"boxes": detections["boxes"][keep].float(), "labels": detections["labels"][keep],
             "scores": detections["scores"][keep]}
    return draw_sample(image, shown, names).permute(1, 2, 0).contiguous().numpy()
