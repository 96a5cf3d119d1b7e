"""Batch collation: images padded to a common size that is a multiple of ``size_divisibility``."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Batch(NamedTuple):
    """A collated batch.

    ``images`` is ``uint8 [B, 3, H, W]`` (zero padded at the bottom and right), ``image_sizes`` the
    ``(height, width)`` of each image before padding, ``targets`` one dict per image and
    ``indices`` the dataset indices.
    """

    images: torch.Tensor
    image_sizes: list[tuple[int, int]]
    targets: list[dict[str, torch.Tensor]]
    indices: list[int]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.images.to(device, non_blocking=non_blocking),
            self.image_sizes,
            [{k: v.to(device, non_blocking=non_blocking) for k, v in t.items()} for t in self.targets],
            self.indices,
        )


def pad_images(images: list[torch.Tensor], size_divisibility: int = 32) -> torch.Tensor:
    """Stack ``[C, H, W]`` images into ``[B, C, H', W']`` with H', W' the maxima rounded up."""
    height = max(im.shape[-2] for im in images)
    width = max(im.shape[-1] for im in images)
    if size_divisibility > 1:
        height = -(-height // size_divisibility) * size_divisibility
        width = -(-width // size_divisibility) * size_divisibility
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    for slot, im in zip(out, images):
        slot[:, : im.shape[-2], : im.shape[-1]].copy_(im)
    return out


class BatchCollator:
    """``collate_fn`` for the data loader: samples ``(image, target, index)`` -> :class:`Batch`."""

    def __init__(self, size_divisibility: int = 32):
        self.size_divisibility = size_divisibility

    def __call__(self, samples: list[tuple[torch.Tensor, dict, int]]) -> Batch:
        images, targets, indices = zip(*samples)
        return Batch(
            images=pad_images(list(images), self.size_divisibility),
            image_sizes=[tuple(im.shape[-2:]) for im in images],
            targets=list(targets),
            indices=list(indices),
        )
