"""The search's data: the train split of a prepared dataset divided into the images the baseline and
the fine-tunes train on and a held-out part they are scored on (never the val split)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from ..fileio import atomic_dir, write_json


def split_coco(coco: dict, *, fraction: float, seed: int) -> tuple[dict, dict]:
    """``coco`` (a COCO dict) as (kept, held out): ``round(fraction * images)`` images (at least 1, and
    at least 1 kept) drawn with ``seed``, each with its annotations; categories and info as they are."""
    images = sorted(coco["images"], key=lambda image: image["id"])
    if len(images) < 2:
        raise DatasetError(f"the train split has {len(images)} image(s); holding some out needs at least 2")
    count = min(max(1, round(fraction * len(images))), len(images) - 1)
    chosen = {images[i]["id"] for i in np.random.default_rng(seed).permutation(len(images))[:count]}

    def part(held: bool) -> dict:
        return {**coco, "images": [im for im in images if (im["id"] in chosen) == held],
                "annotations": [a for a in coco["annotations"] if (a["image_id"] in chosen) == held]}

    return part(False), part(True)


def write_holdout(prepared: Path, out: Path, *, fraction: float, seed: int) -> dict[str, int]:
    """Write ``out`` as a prepared dataset (``dataset.json``, ``train.json``, ``val.json``: the held-out
    images) from ``prepared``'s train split, whose image folder both splits keep; atomically. Returns
    the image counts."""
    manifest_path = prepared / "dataset.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        train = manifest["splits"]["train"]
        coco = json.loads((prepared / train["annotations"]).read_text())
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DatasetError(f"{manifest_path}: missing or unreadable prepared dataset ({err}); run the prepare stage") from None
    kept, held = split_coco(coco, fraction=fraction, seed=seed)
    with atomic_dir(out) as tmp:
        write_json(tmp / "train.json", kept, indent=None)
        write_json(tmp / "val.json", held, indent=None)
        write_json(tmp / "dataset.json", {"name": f"{manifest.get('name', 'dataset')} (train, {fraction:g} held out)",
                                          "splits": {"train": {"annotations": "train.json", "images": train["images"]},
                                                     "val": {"annotations": "val.json", "images": train["images"]}}})
    return {"train": len(kept["images"]), "heldout": len(held["images"])}
