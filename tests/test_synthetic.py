import hashlib
import json

import numpy as np
from PIL import Image

from pipelines.data.coco import LARGE_AREA, SMALL_AREA
from pipelines.data.synthetic import CATEGORY_IDS, generate_split

ARGS = dict(split="val", size=10, num_classes=5, min_side=256, max_side=416, min_objects=2, max_objects=8)


def _digest(folder, coco) -> str:
    h = hashlib.sha256(json.dumps(coco, sort_keys=True).encode())
    for path in sorted(folder.iterdir()):
        h.update(path.read_bytes())
    return h.hexdigest()


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = generate_split(tmp_path / "a", seed=7, **ARGS)
    b = generate_split(tmp_path / "b", seed=7, **ARGS)
    c = generate_split(tmp_path / "c", seed=8, **ARGS)
    assert _digest(tmp_path / "a", a) == _digest(tmp_path / "b", b)
    assert _digest(tmp_path / "a", a) != _digest(tmp_path / "c", c)


def test_dataset_exercises_ids_orientations_and_scales(tmp_path):
    coco = generate_split(tmp_path, seed=0, **{**ARGS, "size": 40})
    ids = [c["id"] for c in coco["categories"]]
    assert ids == list(CATEGORY_IDS[:5]) and ids != list(range(1, 6))  # gaps, like COCO
    assert len({c["name"] for c in coco["categories"]}) == 5

    orientations = {im["width"] > im["height"] for im in coco["images"]}
    assert orientations == {True, False}
    assert all(256 <= im[k] <= 416 for im in coco["images"] for k in ("width", "height"))

    areas = np.array([a["area"] for a in coco["annotations"]])
    assert (areas < SMALL_AREA).mean() > 0.15
    assert ((areas >= SMALL_AREA) & (areas < LARGE_AREA)).mean() > 0.2
    assert (areas >= LARGE_AREA).mean() > 0.15
    assert {a["category_id"] for a in coco["annotations"]} == set(ids)

    for ann in coco["annotations"]:
        image = coco["images"][ann["image_id"] - 1]
        x, y, w, h = ann["bbox"]
        assert w > 0 and h > 0 and x >= 0 and y >= 0
        assert x + w <= image["width"] and y + h <= image["height"]
        assert ann["area"] <= (w + 0.01) * (h + 0.01)  # bbox values are rounded to 2 decimals


def test_images_are_jpegs_of_the_stated_size(tmp_path):
    coco = generate_split(tmp_path, seed=1, **{**ARGS, "size": 3})
    for image in coco["images"]:
        with Image.open(tmp_path / image["file_name"]) as im:
            assert im.format == "JPEG"
            assert im.size == (image["width"], image["height"])
