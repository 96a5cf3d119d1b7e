"""The built-in synthetic detection dataset: coloured shapes on textured, noisy backgrounds.

Classes differ by shape only (colours are random). Objects span COCO's small, medium and large
area ranges, may overlap a little, and images come in landscape and portrait sizes, so that the
scale APs and aspect-ratio grouping are all exercised. Category ids have gaps, as in COCO.

Everything is drawn from ``numpy.random.default_rng((seed, split, index))``: the same seed gives
byte-identical JPEG and JSON files, whatever the order of generation.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from ..errors import raise_if_stopped

SHAPES = ("circle", "rectangle", "triangle", "star", "cross", "diamond")
CATEGORY_IDS = (1, 3, 4, 9, 15, 22)  # gaps on purpose: exercises the label <-> id mapping
SPLIT_CODES = {"train": 1, "val": 2}

# Area ranges (pixels of shape area) of COCO's scale buckets and their shares of objects.
SCALE_BUCKETS = (("small", 100.0, 1024.0, 0.3), ("medium", 1024.0, 9216.0, 0.4), ("large", 9216.0, 40000.0, 0.3))
JPEG_QUALITY = 90


def generate_split(
    out_dir: Path,
    *,
    split: str,
    size: int,
    seed: int,
    num_classes: int,
    min_side: int,
    max_side: int,
    min_objects: int,
    max_objects: int,
) -> dict:
    """Write ``size`` JPEG images into ``out_dir`` and return their COCO-format annotations.

    ``file_name`` in the returned dict is relative to ``out_dir``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for index in tqdm(range(size), desc=f"synthetic {split}", unit="img", mininterval=2.0):
        raise_if_stopped()  # a stop a finaliser swallowed ends the work here, not after the last image
        image_id = index + 1
        rng = np.random.default_rng((seed, SPLIT_CODES[split], index))
        pixels, objects = _draw_image(rng, num_classes, min_side, max_side, min_objects, max_objects)
        file_name = f"{image_id:06d}.jpg"
        Image.fromarray(pixels).save(out_dir / file_name, quality=JPEG_QUALITY)
        height, width = pixels.shape[:2]
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        for label, polygon in objects:
            x0, y0 = polygon.min(axis=0)
            x1, y1 = polygon.max(axis=0)
            annotations.append({
                "id": len(annotations) + 1,
                "image_id": image_id,
                "category_id": CATEGORY_IDS[label],
                "bbox": [round(float(v), 2) for v in (x0, y0, x1 - x0, y1 - y0)],
                "area": round(_polygon_area(polygon), 2),
                "iscrowd": 0,
                "segmentation": [[round(float(v), 2) for v in polygon.reshape(-1)]],
            })
    categories = [
        {"id": CATEGORY_IDS[k], "name": SHAPES[k], "supercategory": "shape"} for k in range(num_classes)
    ]
    return {
        "info": {"description": f"synthetic shapes, {split} split", "seed": seed},
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }


def _draw_image(rng, num_classes, min_side, max_side, min_objects, max_objects):
    width, height = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
    canvas = _background(rng, height, width)
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)

    placed: list[tuple[int, np.ndarray]] = []
    boxes: list[np.ndarray] = []
    n_objects = int(rng.integers(min_objects, max_objects + 1))
    for _ in range(n_objects):
        label = int(rng.integers(num_classes))
        polygon = _place(rng, SHAPES[label], width, height, boxes)
        if polygon is not None:
            placed.append((label, polygon))
            boxes.append(np.concatenate([polygon.min(axis=0), polygon.max(axis=0)]))

    # Largest first, so that smaller shapes on top stay fully visible.
    placed.sort(key=lambda item: -_polygon_area(item[1]))
    background_mean = canvas.reshape(-1, 3).mean(axis=0)
    for label, polygon in placed:
        draw.polygon([tuple(p) for p in polygon], fill=_colour(rng, background_mean))

    pixels = np.asarray(image, dtype=np.float32)
    pixels += rng.normal(0.0, rng.uniform(4.0, 12.0), size=pixels.shape).astype(np.float32)
    return np.clip(pixels, 0, 255).astype(np.uint8), placed


def _background(rng, height, width):
    """Smooth colour field + oriented stripes + blotches: texture a detector must learn to ignore."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(40, 215, size=3).astype(np.float32)
    field = np.broadcast_to(base, (height, width, 3)).copy()
    for _ in range(int(rng.integers(2, 5))):
        angle = rng.uniform(0, math.pi)
        freq = rng.uniform(0.02, 0.25)
        phase = rng.uniform(0, 2 * math.pi)
        wave = np.sin((xx * math.cos(angle) + yy * math.sin(angle)) * freq + phase)
        field += wave[..., None] * rng.uniform(-30, 30, size=3).astype(np.float32)
    blotches = rng.normal(128, 25, size=(height // 32 + 2, width // 32 + 2, 3)).clip(0, 255).astype(np.uint8)
    blotches = Image.fromarray(blotches).resize((width, height), Image.BILINEAR)
    field += np.asarray(blotches, dtype=np.float32) - 128
    return np.clip(field, 0, 255).astype(np.uint8)


def _colour(rng, background_mean):
    """A random colour that stands out from the background's mean (shapes, not colours, are the cue)."""
    for _ in range(20):
        colour = rng.integers(0, 256, size=3)
        if np.abs(colour - background_mean).sum() > 120:
            break
    return tuple(int(c) for c in colour)


def _place(rng, shape, width, height, boxes):
    """Draw a size bucket and an area, then a position with little overlap; None if nothing fits."""
    shares = np.array([b[3] for b in SCALE_BUCKETS])
    _, lo, hi, _ = SCALE_BUCKETS[int(rng.choice(len(SCALE_BUCKETS), p=shares))]
    hi = min(hi, 0.3 * width * height)
    lo = min(lo, hi / 2)
    area = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    aspect = math.exp(rng.uniform(math.log(0.7), math.log(1.4)))  # width / height of the box
    rotation = rng.uniform(-0.3, 0.3) if shape in ("triangle", "star", "cross") else 0.0
    unit = _unit_polygon(shape, rng)  # in [-1, 1]^2
    unit = unit @ np.array([[math.cos(rotation), math.sin(rotation)], [-math.sin(rotation), math.cos(rotation)]])
    unit_area = _polygon_area(unit * [aspect, 1.0])
    scale = math.sqrt(area / unit_area)
    polygon = unit * [aspect * scale, scale]
    extent = polygon.max(axis=0) - polygon.min(axis=0)
    if extent[0] >= width - 2 or extent[1] >= height - 2:
        polygon *= min((width - 4) / extent[0], (height - 4) / extent[1])
        extent = polygon.max(axis=0) - polygon.min(axis=0)
    for _ in range(20):
        offset = rng.uniform([0, 0], [width - extent[0] - 1, height - extent[1] - 1]) - polygon.min(axis=0)
        candidate = polygon + offset
        box = np.concatenate([candidate.min(axis=0), candidate.max(axis=0)])
        if all(_overlap(box, other) < 0.3 for other in boxes):
            return candidate.astype(np.float64)
    return None


def _unit_polygon(shape, rng):
    if shape == "circle":
        t = np.linspace(0, 2 * math.pi, 32, endpoint=False)
        return np.stack([np.cos(t), np.sin(t)], axis=1)
    if shape == "rectangle":
        return np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=np.float64)
    if shape == "triangle":
        pts = np.array([[0, -1], [1, 1], [-1, 1]], dtype=np.float64)
        return pts * [1, -1] if rng.random() < 0.5 else pts
    if shape == "star":
        t = np.linspace(0, 2 * math.pi, 10, endpoint=False) - math.pi / 2
        r = np.where(np.arange(10) % 2 == 0, 1.0, 0.45)
        return np.stack([r * np.cos(t), r * np.sin(t)], axis=1)
    if shape == "cross":
        a = 0.33
        return np.array([[-a, -1], [a, -1], [a, -a], [1, -a], [1, a], [a, a], [a, 1], [-a, 1],
                         [-a, a], [-1, a], [-1, -a], [-a, -a]], dtype=np.float64)
    if shape == "diamond":
        return np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], dtype=np.float64)
    raise ValueError(f"unknown shape {shape!r}")


def _polygon_area(points: np.ndarray) -> float:
    x, y = points[:, 0], points[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over the smaller box's area: high when one shape would hide much of another."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return float(iw * ih / smaller)
