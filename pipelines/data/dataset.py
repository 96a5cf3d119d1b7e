"""The detection dataset: images from disk, annotations from a memory-mapped cache."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .annotation_cache import AnnotationCache
from .decode import decode_image
from .transforms import SampleContext


class DetectionDataset(Dataset):
    """Samples ``(image uint8 [3, H, W], target, index)`` from an :class:`AnnotationCache`.

    ``target`` holds ``boxes`` (xyxy float32, after the transforms), ``labels`` (int64 contiguous),
    ``orig_size`` (height, width of the stored image) and ``image_id``. Crowd regions are left out
    when ``skip_crowd`` (training); evaluation reads its ground truth from the JSON instead.

    An item key is an index or ``(index, iteration)`` (as yielded by the iteration-based sampler).
    Randomness comes from ``numpy.random.default_rng((seed, iteration, index))``: the same sample
    at the same iteration is identical whichever worker or rank loads it.
    """

    def __init__(self, cache: AnnotationCache, *, transforms, seed: int = 0, skip_crowd: bool = True):
        self.cache = cache
        self.transforms = transforms
        self.seed = seed
        self.skip_crowd = skip_crowd

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def aspect_groups(self) -> np.ndarray:
        return self.cache.aspect_groups

    def load(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The stored image and its boxes, before any transform."""
        # The header must say the size the cache holds (which prepare checked against the pixel limit)
        # before any pixel is decoded: an image swapped for a larger one since is refused, not decoded.
        width, height = (int(v) for v in self.cache.sizes[index])
        image = decode_image(self.cache.image_path(index), size=(width, height))
        boxes, labels, crowd = self.cache.annotations(index)
        keep = ~crowd if self.skip_crowd else np.ones(len(crowd), dtype=bool)
        target = {
            "boxes": torch.from_numpy(np.array(boxes[keep], dtype=np.float32)).reshape(-1, 4),
            "labels": torch.from_numpy(np.array(labels[keep], dtype=np.int64)),
        }
        return image, target

    def __getitem__(self, key):
        index, iteration = key if isinstance(key, tuple) else (key, 0)
        image, target = self.load(index)
        orig_size = torch.tensor(image.shape[-2:])
        ctx = SampleContext(rng=np.random.default_rng((self.seed, iteration, index)), iteration=iteration,
                            fetch=self.load, num_samples=len(self), seed=self.seed)
        image, target = self.transforms(image, target, ctx)
        boxes = target["boxes"]
        valid = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        target = {
            "boxes": boxes[valid],
            "labels": target["labels"][valid],
            "orig_size": orig_size,
            "image_id": torch.tensor(int(self.cache.image_ids[index])),
        }
        return image, target, index
