"""A synthetic annotation file at COCO train2017 scale, for the benchmarks (no images are made).

The default is shaped like ``instances_train2017.json``: 118,287 images (640 px on the long side,
a quarter of them portrait) with ids scattered over 1..600,000 and listed in random order; 860,001
annotations, in random order, over COCO's 80 category ids (1..90 with COCO's ten gaps) with a
long-tailed class and per-image count distribution; about 1% crowd annotations with uncompressed
RLE segmentations, the others 4-point polygons; about 0.9% of images without any annotation. Boxes
lie inside their image. With the default sizes the file is about 175 MB.

Everything is drawn from ``numpy.random.default_rng(seed)``: the same seed (and numpy version)
gives a byte-identical file. Usage::

    python -m benchmarks.coco_scale --out /tmp/coco_scale/instances.json [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import orjson

from pipelines.fileio import atomic_write_bytes

COCO_IMAGES = 118_287
COCO_BOXES = 860_001
COCO_GAPS = (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)
COCO_CATEGORY_IDS = tuple(i for i in range(1, 91) if i not in COCO_GAPS)
EMPTY_FRACTION = 1021 / 118_287  # train2017's images without annotations
CROWD_FRACTION = 0.0105
LONG_SIDE = 640


def make_coco_scale(*, seed: int = 0, num_images: int = COCO_IMAGES, num_boxes: int = COCO_BOXES,
                    empty_fraction: float = EMPTY_FRACTION, crowd_fraction: float = CROWD_FRACTION) -> dict:
    """Draw a COCO-format annotation dict (``images``, ``annotations``, ``categories``).

    Args:
        seed: the only source of randomness.
        num_images: number of images.
        num_boxes: exact number of annotations (crowd ones included).
        empty_fraction: share of images without any annotation.
        crowd_fraction: share of annotations with ``iscrowd`` 1 (RLE segmentation).

    Returns:
        The annotations, ready for ``orjson.dumps``.
    """
    rng = np.random.default_rng(seed)
    image_ids = rng.choice(np.arange(1, max(600_000, 2 * num_images)), size=num_images, replace=False)
    short = rng.integers(240, LONG_SIDE + 1, size=num_images)
    portrait = rng.random(num_images) < 0.25
    widths = np.where(portrait, short, LONG_SIDE)
    heights = np.where(portrait, LONG_SIDE, short)

    # Per-image counts: every non-empty image gets one box, the rest follow a long-tailed mix.
    num_empty = min(round(empty_fraction * num_images), num_images - 1) if num_boxes else num_images
    with_boxes = rng.permutation(num_images)[num_empty:]
    weights = rng.gamma(0.8, size=len(with_boxes))
    counts = np.zeros(num_images, dtype=np.int64)
    if len(with_boxes):
        counts[with_boxes] = 1 + rng.multinomial(num_boxes - len(with_boxes), weights / weights.sum())
    owner = rng.permutation(np.repeat(np.arange(num_images), counts))  # annotation -> image row, file order shuffled

    m = len(owner)
    img_w, img_h = widths[owner].astype(np.float64), heights[owner].astype(np.float64)
    frac = np.exp(rng.uniform(np.log(2e-4), np.log(0.7), size=m))  # box area / image area, log-uniform
    aspect = np.exp(rng.uniform(np.log(1 / 3), np.log(3), size=m))  # width / height
    w = np.minimum(np.sqrt(frac * img_w * img_h * aspect), img_w - 1).clip(1, None)
    h = np.minimum(np.sqrt(frac * img_w * img_h / aspect), img_h - 1).clip(1, None)
    x = rng.uniform(0, 1, size=m) * (img_w - w)
    y = rng.uniform(0, 1, size=m) * (img_h - h)
    bbox = np.round(np.stack([x, y, w, h], axis=1), 2)
    x, y, w, h = bbox.T
    # A quadrilateral touching each side of the box: (a, 0), (w, b), (c, h), (0, d) relative to its corner.
    a, b, c, d = rng.uniform(0.2, 0.8, size=(4, m))
    poly = np.round(np.stack([x + a * w, y, x + w, y + b * h, x + c * w, y + h, x, y + d * h], axis=1), 2)
    px, py = poly[:, 0::2], poly[:, 1::2]
    area = np.round(np.abs((px * np.roll(py, -1, axis=1) - py * np.roll(px, -1, axis=1)).sum(axis=1)) / 2, 2)

    class_weights = 1 / np.arange(1, len(COCO_CATEGORY_IDS) + 1) ** 0.9  # long tail: id 1 (person) most often
    category_ids = np.array(COCO_CATEGORY_IDS)[rng.choice(len(COCO_CATEGORY_IDS), size=m, p=class_weights / class_weights.sum())]
    crowd = rng.random(m) < crowd_fraction
    ann_ids = rng.choice(np.arange(1, 2 * m + 2), size=m, replace=False)

    images = [
        {"license": 1, "file_name": f"{i:012d}.jpg", "height": hh, "width": ww, "id": i}
        for i, ww, hh in zip(image_ids.tolist(), widths.tolist(), heights.tolist())
    ]
    annotations = []
    append = annotations.append
    columns = zip(poly.tolist(), area.tolist(), crowd.tolist(), image_ids[owner].tolist(), bbox.tolist(),
                  category_ids.tolist(), ann_ids.tolist(), owner.tolist())
    for segment, ar, is_crowd, image_id, box, category_id, ann_id, row in columns:
        if is_crowd:
            segmentation = _rle(rng, int(heights[row]), int(widths[row]))
            ar = round(box[2] * box[3] * 0.6, 2)
        else:
            segmentation = [segment]
        append({"segmentation": segmentation, "area": ar, "iscrowd": int(is_crowd), "image_id": image_id,
                "bbox": box, "category_id": category_id, "id": ann_id})
    categories = [{"supercategory": "thing", "id": i, "name": f"class_{i}"} for i in COCO_CATEGORY_IDS]
    return {
        "info": {"description": f"COCO-scale synthetic annotations, seed {seed}"},
        "licenses": [{"id": 1, "name": "synthetic", "url": ""}],
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }


def _rle(rng: np.random.Generator, height: int, width: int) -> dict:
    """An uncompressed RLE (as COCO stores crowd regions): a few runs summing to ``height * width``."""
    runs = rng.integers(1, 400, size=2 * int(rng.integers(2, 12)))
    counts = runs.tolist() + [height * width - int(runs.sum())]
    return {"counts": counts, "size": [height, width]}


def write_coco_scale(path: str | Path, **kwargs) -> dict:
    """Write :func:`make_coco_scale` ``(**kwargs)`` to ``path`` (atomically); returns counts and size."""
    was_enabled = gc.isenabled()
    gc.disable()  # millions of fresh containers: the collector would only slow this down
    try:
        coco = make_coco_scale(**kwargs)
        data = orjson.dumps(coco)
        summary = {"images": len(coco["images"]), "annotations": len(coco["annotations"]),
                   "crowd": sum(a["iscrowd"] for a in coco["annotations"]), "bytes": len(data)}
        del coco
    finally:
        if was_enabled:
            gc.enable()
    atomic_write_bytes(path, data)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=COCO_IMAGES)
    parser.add_argument("--boxes", type=int, default=COCO_BOXES)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    summary = write_coco_scale(args.out, seed=args.seed, num_images=args.images, num_boxes=args.boxes)
    print(f"{args.out}: {summary['images']} images, {summary['annotations']} annotations "
          f"({summary['crowd']} crowd), {summary['bytes'] / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
