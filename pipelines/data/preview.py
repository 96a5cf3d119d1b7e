"""A picture of what the training augmentation does: samples before and after it, boxes drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torchvision.io import encode_png
from torchvision.utils import draw_bounding_boxes, make_grid

from ..fileio import atomic_write_bytes
from .collate import pad_images

PALETTE = ("#e6194b", "#3cb44b", "#ffe119", "#4363d8", "#f58231", "#911eb4", "#46f0f0", "#f032e6", "#bcf60c",
           "#fabebe", "#008080", "#e6beff", "#9a6324", "#fffac8", "#800000", "#aaffc3")


def draw_sample(image: torch.Tensor, target: dict, names: Sequence[str]) -> torch.Tensor:
    """``image`` (uint8 [3, H, W]) with its boxes outlined, one colour per class, class names on top (with
    the score, where ``target`` has ``scores``: detections)."""
    labels = target["labels"].tolist()
    if not labels:
        return image
    captions = [names[k] for k in labels]
    if "scores" in target:
        captions = [f"{caption} {score:.2f}" for caption, score in zip(captions, target["scores"].tolist())]
    return draw_bounding_boxes(image, target["boxes"], labels=captions,
                               colors=[PALETTE[k % len(PALETTE)] for k in labels], width=2)


def augmentation_preview(plain, augmented, *, count: int, iteration: int, path: str | Path) -> Path:
    """Write a PNG grid: row 1 the first ``count`` samples after the base transforms, row 2 after the
    training augmentation.

    ``plain`` and ``augmented`` are :class:`~pipelines.data.dataset.DetectionDataset` s over the same
    images; samples are drawn at ``iteration`` (e.g. ``max_iter`` to show the augmentation at full
    strength).
    """
    names = [c["name"] for c in augmented.cache.categories]
    indices = range(min(count, len(augmented)))
    tiles = [draw_sample(*dataset[(i, iteration)][:2], names) for dataset in (plain, augmented) for i in indices]
    grid = make_grid(list(pad_images(tiles, 1)), nrow=len(indices), padding=4, pad_value=255)
    path = Path(path)
    # Encoded in memory and written by Python: torchvision's write_png leaves a truncated file, without
    # an error, on a full disk.
    atomic_write_bytes(path, encode_png(grid).numpy().tobytes())
    return path
