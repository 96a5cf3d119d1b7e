"""Test-time augmentation without torch: the views evaluation makes, run through any ``detect`` function and
merged as evaluation merges them (:func:`pipelines.evaluation.detect` is the PyTorch original).

The views of a batch of decoded images are: each image resized to the test size; mirrored, when ``flip``;
and per extra scale, the test-size image resized again (or the decoded image, with ``source``
``decoded``; shorter side to the scale, longer at most ``max_size``, sizes computed from the original
image), mirrored too when ``flip``. Each view's detections
go back to original pixels; all of an image's are merged by class-wise NMS at the model's threshold,
keeping its ``detections_per_img`` best, voted on by all the views' detections with ``merge`` ``vote``; with
``merge`` ``wbf`` fused instead, scored for the number of views (:func:`.postprocess.merge`).

This module imports neither torch nor torchvision (an import-linter contract holds it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..data.sizes import resized_size
from .postprocess import Detections, Thresholds, merge
from .preprocess import pad_batch, resize

SOURCES = ("resized", "decoded")  # evaluate.tta_source's names (pipelines.data.transforms.TTA_SOURCES)
Detect = Callable[[np.ndarray, list[tuple[int, int]]], list[Detections]]  # padded batch, sizes -> detections


@dataclass(frozen=True)
class Views:
    """The extra views: shorter sides ``scales`` (longer at most ``max_size``), each also mirrored when
    ``flip``, resized from the test-size image or, with ``source`` ``decoded``, from the decoded image
    (``evaluate.tta_scales``, ``tta_max_size``, ``tta_flip``, ``tta_source``)."""

    scales: tuple[int, ...] = ()
    max_size: int = 1333
    flip: bool = True
    source: str = "resized"  # the extra scales from the test-size image, or from the decoded one (decoded)


def _view(detect: Detect, images: list[np.ndarray], orig_sizes: list[tuple[int, int]], *, flip: bool,
          size_divisibility: int) -> list[Detections]:
    """One view's detections (images at one scale, optionally mirrored), in original pixels."""
    if flip:
        images = [im[:, ::-1] for im in images]
    sizes = [(im.shape[0], im.shape[1]) for im in images]
    found = detect(pad_batch(images, size_divisibility), sizes)
    out = []
    for d, (height, width), (orig_h, orig_w) in zip(found, sizes, orig_sizes):
        boxes = d.boxes
        if flip:
            boxes = np.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], axis=1)
        out.append(Detections(boxes, d.scores, d.labels).scaled(orig_w / width, orig_h / height))
    return out


def detect_views(detect: Detect, pixels: Sequence[np.ndarray], *, min_size: int, max_size: int,
                 size_divisibility: int, thresholds: Thresholds, views: Views | None = None) -> list[Detections]:
    """Detections of decoded ``uint8 [H, W, 3]`` images in original pixels: the test-size view alone, or
    with ``views`` every view, merged (see the module's docstring). ``detect`` runs a padded batch (an
    :class:`~.onnx_runtime.OnnxDetector`'s ``detect`` with ``thresholds``)."""
    orig_sizes = [(im.shape[0], im.shape[1]) for im in pixels]
    images = [resize(im, resized_size(h, w, min_size, max_size)) for im, (h, w) in zip(pixels, orig_sizes)]
    all_views = [_view(detect, images, orig_sizes, flip=False, size_divisibility=size_divisibility)]
    if views is None:
        return all_views[0]
    if views.flip:
        all_views.append(_view(detect, images, orig_sizes, flip=True, size_divisibility=size_divisibility))
    sources = pixels if views.source == "decoded" else images
    for scale in views.scales:
        scaled = [resize(im, resized_size(h, w, scale, views.max_size)) for im, (h, w) in zip(sources, orig_sizes)]
        for flip in (False, True) if views.flip else (False,):
            all_views.append(_view(detect, scaled, orig_sizes, flip=flip, size_divisibility=size_divisibility))
    merged = []
    for per_image in zip(*all_views):
        boxes = np.concatenate([d.boxes for d in per_image]).astype(np.float32, copy=False)
        scores = np.concatenate([d.scores for d in per_image]).astype(np.float32, copy=False)
        labels = np.concatenate([d.labels for d in per_image])
        merged.append(merge(boxes, scores, labels, thresholds, views=len(all_views)))
    return merged
