"""Benchmark: how much of the training pixels is padding, as the params batch the training images.

The train stage's own batching (:func:`pipelines.build.train.train_loader`'s batch sampler, every process of
``train.nproc``, the whole schedule of ``train.max_iter`` iterations) is replayed from the annotation cache's
image sizes: no image is decoded and nothing is trained. Each image is resized as training resizes it (one
``model.min_size_train``: exact; with several, the first, as an estimate) and each batch padded to its largest
image rounded up to ``loader.size_divisibility``. Printed: the padding's share of the padded pixels, the padded
pixels in all, the images per process batch and the number of padded shapes. Compare the batchings with
``--set loader.padded_shape_grouping=true``. Usage::

    python -m benchmarks.padding --cache data/cache/train [--params params.yaml] [--set KEY=VALUE ...] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pipelines.build import train as build_train
from pipelines.config.load import load_params
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.data.sizes import resized_size


def padding(p, cache: AnnotationCache) -> dict:
    """The figures of the module's docstring for params ``p`` over the images of ``cache``."""
    model, divisor = p.model, p.loader.size_divisibility
    resized = np.array([resized_size(int(h), int(w), model.min_size_train[0], model.max_size_train)
                        for w, h in np.asarray(cache.sizes)], dtype=np.int64).reshape(-1, 2)
    dataset = DetectionDataset(cache, transforms=None, seed=p.seed)
    world = p.train.nproc
    image = padded = images = batches = 0
    shapes = set()
    for rank in range(world):
        loader = build_train.train_loader(p, dataset, rank=rank, world_size=world, device=torch.device("cpu"))
        for batch in loader.batch_sampler:
            idx = [index for index, _ in batch]
            shape = tuple(int(-(-resized[idx, k].max() // divisor) * divisor) for k in (0, 1))
            image += int((resized[idx, 0] * resized[idx, 1]).sum())
            padded += shape[0] * shape[1] * len(idx)
            images += len(idx)
            batches += 1
            shapes.add(shape)
    return {"padding": 1 - image / padded, "padded_pixels": padded, "images_per_batch": images / batches,
            "padded_shapes": len(shapes), "exact": len(model.min_size_train) == 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, required=True, help="the training split's annotation cache")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a param over --params")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    figures = padding(load_params(args.params, overrides=args.set), AnnotationCache(args.cache))
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"padding {figures['padding']:.2%} of {figures['padded_pixels']} padded pixels; "
          f"{figures['images_per_batch']:.3f} images per process batch; {figures['padded_shapes']} padded shapes"
          f"{'' if figures['exact'] else ' (several training sizes: estimated at the first)'}")


if __name__ == "__main__":
    main()
