"""Per-sample transforms on ``(image, target)`` pairs, before normalisation.

A transform is a callable ``(image, target, ctx) -> (image, target)``. ``image`` is a ``uint8``
tensor ``[3, H, W]``; ``target`` holds ``boxes`` (float32 ``[K, 4]`` xyxy pixels) and ``labels``
(int64 ``[K]``). Every random choice comes from ``ctx.rng``, a ``numpy.random.Generator`` seeded per
sample by the dataset from ``(seed, iteration, index)``, so results do not depend on which worker
process or rank draws them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from .sizes import resized_size

Target = dict[str, torch.Tensor]

# The per-channel statistics (RGB, 0..1) the detector normalises with; pixel-creating transforms
# fill with the mean so that empty areas normalise to zero.
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)


@dataclass
class SampleContext:
    """What a transform may know about its sample besides the pixels and boxes.

    Attributes:
        rng: the sample's random generator.
        iteration: the global training iteration the sample is drawn for (0 outside training).
        fetch: loads another sample of the same split by index, as stored (no transform), for
            augmentations that mix images; ``None`` when unavailable.
        num_samples: how many indices ``fetch`` accepts.
        seed: the dataset's seed (what ``rng`` is seeded with besides the iteration and index), for
            choices shared by the samples of an iteration, such as zoom_out's filler pool.
    """

    rng: np.random.Generator
    iteration: int = 0
    fetch: Callable[[int], tuple[torch.Tensor, Target]] | None = None
    num_samples: int = 0
    seed: int = 0


class Compose:
    def __init__(self, transforms: Sequence):
        self.transforms = list(transforms)

    def __call__(self, image: torch.Tensor, target: Target, ctx: SampleContext) -> tuple[torch.Tensor, Target]:
        for t in self.transforms:
            image, target = t(image, target, ctx)
        return image, target

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.transforms))})"


class ResizeShorterSide:
    """Resize so that the shorter side is one of ``min_sizes`` (drawn per image), capped by ``max_size``."""

    def __init__(self, min_sizes: Sequence[int], max_size: int):
        self.min_sizes = list(min_sizes)
        self.max_size = max_size

    def __call__(self, image, target, ctx):
        min_size = self.min_sizes[int(ctx.rng.integers(len(self.min_sizes)))] if len(self.min_sizes) > 1 else self.min_sizes[0]
        height, width = image.shape[-2:]
        size = list(resized_size(height, width, min_size, self.max_size))
        if size == [height, width]:
            return image, target
        image = F.resize(image, size, antialias=True)
        boxes = tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=(height, width))
        target = {**target, "boxes": F.resize(boxes, size).as_subclass(torch.Tensor)}
        return image, target

    def __repr__(self) -> str:
        return f"ResizeShorterSide(min_sizes={self.min_sizes}, max_size={self.max_size})"


class RandomHorizontalFlip:
    def __init__(self, prob: float = 0.5):
        self.prob = prob

    def __call__(self, image, target, ctx):
        if self.prob <= 0 or ctx.rng.random() >= self.prob:
            return image, target
        height, width = image.shape[-2:]
        boxes = tv_tensors.BoundingBoxes(target["boxes"], format="XYXY", canvas_size=(height, width))
        target = {**target, "boxes": F.horizontal_flip(boxes).as_subclass(torch.Tensor)}
        return F.horizontal_flip(image), target

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(prob={self.prob})"


def build_transforms(*, min_sizes: Sequence[int], max_size: int, augment: Callable | None = None) -> Compose:
    """Resize by the shorter side (one of ``min_sizes``, longer side at most ``max_size``), then
    ``augment`` if given: the training augmentation, a transform like those here (see
    :func:`pipelines.build.data.augmentation` for the presets)."""
    return Compose([ResizeShorterSide(min_sizes, max_size), *([augment] if augment is not None else [])])


# evaluate.tta_source's names (config.CHOICES; pipelines.inference.tta.SOURCES is the numpy twin's)
TTA_SOURCES = ("resized", "decoded")


@dataclass(frozen=True)
class TestTimeAugmentation:
    """The seed's BBOX_AUG: the test scale plus ``scales`` (shorter sides, longer at most
    ``max_size``), each also flipped when ``flip``; detections merged by class-wise NMS. ``source``: the
    extra scales are resized from the test-size image (``resized``) or from the decoded image
    (``decoded``, :data:`TTA_SOURCES`)."""

    scales: tuple[int, ...] = ()
    max_size: int = 1333
    flip: bool = True
    source: str = "resized"
