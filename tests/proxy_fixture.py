"""A tiny search proxy for the search tests: an untrained baseline and the caches of a few synthetic images."""

import dataclasses
import json
from pathlib import Path

import torch

from pipelines import checkpoint
from pipelines.build import model as build_model
from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.synthetic import generate_split
from pipelines.hardware import resolve
from pipelines.search.proxy import Proxy, search_params


def with_values(p, section: str, **values):
    """``p`` with ``values`` replaced in its ``section``."""
    return dataclasses.replace(p, **{section: dataclasses.replace(getattr(p, section), **values)})


def tiny_proxy(root: Path, params, *, max_side: int, max_objects: int, **search) -> Proxy:
    """A baseline model (untrained, seed 0), the caches of 6 train and 3 held-out synthetic images of 128 to
    ``max_side`` pixels, and ``params`` for a 2-iteration fine-tune with the ``search`` values."""
    for split, size in (("train", 6), ("val", 3)):
        coco = generate_split(root / "images" / split, split=split, size=size, seed=4, num_classes=3, min_side=128,
                              max_side=max_side, min_objects=2, max_objects=max_objects)
        (root / f"{split}.json").write_text(json.dumps(coco))
        build_cache(root / f"{split}.json", root / "cache" / split, image_root=str(root / "images" / split),
                    drop_empty=split == "train")
    p = with_values(params, "model", min_size_train=[128], max_size_train=max_side, min_size_test=128,
                    max_size_test=max_side)
    p = with_values(with_values(p, "train", ims_per_batch=2), "search", fine_tune_iters=2, **search)
    p = search_params(with_values(with_values(p, "evaluate", ims_per_batch=3), "loader", num_workers=0))
    categories = AnnotationCache(root / "cache" / "train").categories
    torch.manual_seed(0)
    model = build_model.detector(p, num_classes=len(categories), compute=resolve("fp32", False, torch.device("cpu")),
                                 pretrained=False)
    checkpoint.save(root / "model_final.pth", model=model.state_dict(), categories=categories, iteration=8,
                    precision="fp32", channels_last=False)
    return Proxy(p, root / "model_final.pth", root / "cache", root / "val.json")
