"""Bad input as a table: each broken dataset (or ``dataset`` section of params.yaml) stops the prepare stage
with one exact line, ``error: ...`` and exit code 2, and leaves the previous output as it was.

A second table holds unusual input that must work: it goes through prepare, the cache stage and a
2-iteration training run. Prepare and cache run in-process (``cli.run``, as ``python -m`` does);
training runs as a user starts it, in a subprocess.

Broken params, YAML and compose calls are in ``test_bad_input_params.py``; special files and a full disk
where the stages keep their own state, in ``test_bad_input_state.py``.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import stages.cache
import stages.prepare
from pipelines import cli
from pipelines.build import data as build_data
from pipelines.config.load import load_params
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.errors import CacheError, ImageError

from .conftest import REPO, train_outputs

SIZES = {"a.jpg": (32, 24), "b.jpg": (24, 32), "c.jpg": (32, 24)}  # file name: (width, height)
DATASET_KEYS = ("name, train_images, train_annotations, val_images, val_annotations, max_image_pixels, "
                "max_damaged_images")


def save_image(path: Path, size: tuple[int, int], *, seed: int = 0, mode: str = "RGB", **options) -> None:
    """Random pixels of ``size`` (width, height) in ``mode``, saved in the format ``options`` or the suffix say."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).convert(mode).save(path, **options)


class Data:
    """A small valid COCO dataset to break: train and val JSON over one folder of three tiny JPEGs.

    Tests change ``train``, ``val`` (the JSON objects), ``raw`` (bytes that replace a split's JSON),
    ``params`` (the whole params.yaml) or the files, then :meth:`write` and :meth:`prepare`.
    """

    def __init__(self, root: Path, base_params: dict):
        self.root, self.images = root, root / "images"
        self.train_json, self.val_json = root / "train.json", root / "val.json"
        self.params_file, self.out, self.metrics = root / "params.yaml", root / "prepared", root / "dataset.json"
        for seed, (name, size) in enumerate(SIZES.items()):
            save_image(self.images / name, size, seed=seed, quality=90)
        images = [{"id": i, "file_name": name, "width": w, "height": h}
                  for i, (name, (w, h)) in enumerate(SIZES.items(), start=1)]
        boxes = [(1, 1, [2, 2, 10, 8]), (2, 3, [4, 4, 12, 12]), (3, 1, [0, 0, 8, 8]), (3, 3, [10, 5, 12, 10])]
        annotations = [{"id": i, "image_id": image_id, "category_id": category_id, "bbox": bbox,
                        "area": float(bbox[2] * bbox[3]), "iscrowd": 0}
                       for i, (image_id, category_id, bbox) in enumerate(boxes, start=1)]
        categories = [{"id": 1, "name": "cat", "supercategory": "animal"},
                      {"id": 3, "name": "dog", "supercategory": "animal"}]
        self.train = {"images": images, "annotations": annotations, "categories": categories}
        self.val = copy.deepcopy(self.train)
        self.raw: dict[str, bytes] = {}
        self.params = copy.deepcopy(base_params)
        self.params["dataset"] = {"name": "coco", "train_images": str(self.images),
                                  "train_annotations": str(self.train_json), "val_images": str(self.images),
                                  "val_annotations": str(self.val_json), "max_image_pixels": 2**28,
                                  "max_damaged_images": 0}

    def add_image(self, name: str, size: tuple[int, int], *, boxes=((1, [2, 2, 8, 6], None),), **save_options) -> int:
        """Save an image of random pixels as ``name`` and add it, with ``boxes`` ``(category id, bbox, crowd
        segmentation or None)``, to both splits. Returns its image id."""
        image_id = max(im["id"] for im in self.train["images"]) + 1
        save_image(self.images / name, size, seed=image_id, **save_options)
        next_id = max(a["id"] for a in self.train["annotations"]) + 1
        annotations = [{"id": next_id + i, "image_id": image_id, "category_id": category_id, "bbox": bbox,
                        "area": float(bbox[2] * bbox[3]), "iscrowd": int(rle is not None),
                        **({"segmentation": rle} if rle is not None else {})}
                       for i, (category_id, bbox, rle) in enumerate(boxes)]
        for coco in (self.train, self.val):
            coco["images"].append({"id": image_id, "file_name": name, "width": size[0], "height": size[1]})
            coco["annotations"] += copy.deepcopy(annotations)
        return image_id

    @property
    def dataset(self) -> dict:
        return self.params["dataset"]

    def write(self) -> None:
        for split, path in (("train", self.train_json), ("val", self.val_json)):
            path.write_bytes(self.raw[split] if split in self.raw else json.dumps(getattr(self, split)).encode())
        self.params_file.write_text(yaml.safe_dump(self.params, sort_keys=False))

    def prepare(self) -> None:
        """Run the prepare stage as ``python -m stages.prepare`` would; SystemExit on an error."""
        cli.run(stages.prepare.main, ["--params", str(self.params_file), "--out", str(self.out),
                                      "--metrics", str(self.metrics)])

    def format(self, template: str) -> str:
        return template.format(train=self.train_json, val=self.val_json, images=self.images, root=self.root,
                               params=self.params_file, real_root=self.root.resolve(),
                               real_images=self.images.resolve())


pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture
def data(tmp_path, base_params) -> Data:
    return Data(tmp_path, base_params)


# -- helpers for the table: each changes a Data in place -------------------------------------------------------


def raw(split: str, content: bytes) -> Callable[[Data], None]:
    def change(d: Data) -> None:
        d.raw[split] = content
    return change


def edit(code: Callable[[Data], object]) -> Callable[[Data], None]:
    """A change written as one expression (``__setitem__``/``__delitem__`` for assignments); its value is ignored."""
    def change(d: Data) -> None:
        code(d)
    return change


def set_key(split: str, section: str, index: int, key: str, value) -> Callable[[Data], None]:
    return edit(lambda d: getattr(d, split)[section][index].__setitem__(key, value))


def del_key(split: str, section: str, index: int, key: str) -> Callable[[Data], None]:
    return edit(lambda d: getattr(d, split)[section][index].__delitem__(key))


def set_section(split: str, section: str, value) -> Callable[[Data], None]:
    return edit(lambda d: getattr(d, split).__setitem__(section, value))


def replace_file(name: str, content: bytes) -> Callable[[Data], None]:
    return edit(lambda d: (d.images / name).write_bytes(content))


def truncate(name: str) -> Callable[[Data], None]:
    return edit(lambda d: (d.images / name).write_bytes((d.images / name).read_bytes()[:-40]))


def symlink_outside(d: Data) -> None:
    save_image(d.root / "outside" / "b.jpg", SIZES["b.jpg"])
    (d.images / "b.jpg").unlink()
    (d.images / "b.jpg").symlink_to(d.root / "outside" / "b.jpg")


def symlink_loop(d: Data) -> None:
    (d.images / "b.jpg").unlink()
    (d.images / "b.jpg").symlink_to(d.images / "b.jpg")


def folder_named_like_an_image(d: Data) -> None:
    (d.images / "b.jpg").unlink()
    (d.images / "b.jpg").mkdir()


def every_box(change: Callable[[dict], None]) -> Callable[[Data], None]:
    def apply(d: Data) -> None:
        for ann in d.train["annotations"]:
            change(ann)
    return apply


def set_dataset(key: str, value) -> Callable[[Data], None]:
    return edit(lambda d: d.dataset.__setitem__(key, value))


BAD = [
    # the JSON itself
    pytest.param(raw("train", b'{"images": ['), "{train}: not valid JSON (unexpected end of data: line 1 column 13 "
                 "(char 12))", id="truncated-json"),
    pytest.param(raw("train", b"\xff\xfe{}"), "{train}: not valid JSON (str is not valid UTF-8: surrogates not "
                 "allowed: line 1 column 1 (char 0))", id="not-utf8"),
    pytest.param(raw("val", b""), "{val}: not valid JSON (Input is a zero-length, empty document: line 1 column 1 "
                 "(char 0))", id="empty-json-file"),
    pytest.param(raw("train", b"[1, 2]"), "{train}: expected a JSON object with images, annotations and categories",
                 id="top-level-list"),
    pytest.param(set_section("train", "images", {"1": "a.jpg"}), "{train}: 'images' must be a list",
                 id="images-an-object"),
    pytest.param(edit(lambda d: d.train.pop("annotations")), "{train}: 'annotations' must be a list",
                 id="annotations-missing"),
    pytest.param(set_section("val", "categories", "cat"), "{val}: 'categories' must be a list",
                 id="categories-a-string"),
    # images
    pytest.param(edit(lambda d: d.train["images"].__setitem__(1, 5)),
                 "{train}: images[1]: expected an object with an integer 'id'", id="image-not-an-object"),
    pytest.param(del_key("train", "images", 0, "id"), "{train}: images[0]: expected an object with an integer 'id'",
                 id="image-id-missing"),
    pytest.param(set_key("train", "images", 2, "id", "3"),
                 "{train}: images[2]: expected an object with an integer 'id'", id="image-id-a-string"),
    pytest.param(set_key("train", "images", 1, "id", 1), "{train}: duplicate image id 1", id="duplicate-image-id"),
    pytest.param(del_key("train", "images", 1, "file_name"),
                 "{train}: image id 2: 'file_name' must be a non-empty string", id="file-name-missing"),
    pytest.param(set_key("train", "images", 0, "width", 0),
                 "{train}: image id 1: 'width' must be a positive integer, got 0", id="width-zero"),
    pytest.param(set_key("train", "images", 0, "height", "24"),
                 "{train}: image id 1: 'height' must be a positive integer, got '24'", id="height-a-string"),
    pytest.param(set_key("train", "images", 0, "width", 32.0),
                 "{train}: image id 1: 'width' must be a positive integer, got 32.0", id="width-a-float"),
    # categories and annotations
    pytest.param(set_key("train", "categories", 1, "id", 1), "{train}: duplicate category id 1",
                 id="duplicate-category-id"),
    pytest.param(set_key("train", "categories", 0, "name", None), "{train}: category id 1: 'name' must be a string",
                 id="category-name-null"),
    pytest.param(set_key("train", "annotations", 3, "id", 1), "{train}: duplicate annotation id 1",
                 id="duplicate-annotation-id"),
    pytest.param(del_key("train", "annotations", 2, "id"),
                 "{train}: annotations[2]: expected an object with an integer 'id'", id="annotation-id-missing"),
    pytest.param(set_key("train", "annotations", 0, "image_id", 99),
                 "{train}: annotation id 1: refers to missing image id 99", id="dangling-image-id"),
    pytest.param(set_key("val", "annotations", 1, "category_id", 2),
                 "{val}: annotation id 2: refers to missing category id 2", id="dangling-category-id-in-val"),
    pytest.param(set_key("train", "annotations", 0, "image_id", "1"),
                 "{train}: annotation id 1: 'image_id' must be an integer, got '1'", id="image-id-ref-a-string"),
    pytest.param(set_key("train", "annotations", 0, "bbox", [1, 2, 3]),
                 "{train}: annotation id 1: 'bbox' must be a list of 4 numbers [x, y, w, h], got [1, 2, 3]",
                 id="bbox-three-numbers"),
    pytest.param(set_key("train", "annotations", 1, "bbox", ["1", "2", "3", "4"]),
                 "{train}: annotation id 2: 'bbox' must be a list of 4 numbers [x, y, w, h], got ['1', '2', '3', '4']",
                 id="bbox-strings"),
    pytest.param(set_key("train", "annotations", 1, "bbox", None),
                 "{train}: annotation id 2: 'bbox' must be a list of 4 numbers [x, y, w, h], got None",
                 id="bbox-null"),
    pytest.param(set_key("train", "annotations", 1, "bbox", {"x": 1, "y": 2, "w": 3, "h": 4}),
                 "{train}: annotation id 2: 'bbox' must be a list of 4 numbers [x, y, w, h], got "
                 "{{'x': 1, 'y': 2, 'w': 3, 'h': 4}}", id="bbox-an-object"),
    pytest.param(set_key("train", "annotations", 1, "bbox", [True, 2, 3, 4]),
                 "{train}: annotation id 2: 'bbox' must be a list of 4 numbers [x, y, w, h], got [True, 2, 3, 4]",
                 id="bbox-a-bool"),
    pytest.param(set_key("train", "annotations", 1, "bbox", list(range(1000))),
                 "{train}: annotation id 2: 'bbox' must be a list of 4 numbers [x, y, w, h], got [0, 1, 2, 3, 4, 5, "
                 "6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21...", id="bbox-long-list-shortened"),
    pytest.param(set_key("train", "annotations", 2, "iscrowd", 2),
                 "{train}: annotation id 3: 'iscrowd' must be 0 or 1, got 2", id="iscrowd-two"),
    pytest.param(set_key("train", "annotations", 2, "iscrowd", "no"),
                 "{train}: annotation id 3: 'iscrowd' must be 0 or 1, got 'no'", id="iscrowd-a-string"),
    pytest.param(set_key("train", "annotations", 3, "area", "big"),
                 "{train}: annotation id 4: 'area' must be a number >= 0, got 'big'", id="area-a-string"),
    pytest.param(set_key("train", "annotations", 3, "area", -5),
                 "{train}: annotation id 4: 'area' must be a number >= 0, got -5", id="area-negative"),
    # file names and image files
    pytest.param(set_key("train", "images", 1, "file_name", "../b.jpg"),
                 "{train}: image id 2: file_name '../b.jpg' escapes the image folder (expected a relative path "
                 "without '..')", id="file-name-dotdot"),
    pytest.param(edit(lambda d: d.train["images"][1].__setitem__("file_name", str(d.images / "b.jpg"))),
                 "{train}: image id 2: file_name '{images}/b.jpg' escapes the image folder (expected a relative "
                 "path without '..')", id="file-name-absolute"),
    pytest.param(set_key("train", "images", 1, "file_name", "b.jpg\0.png"),
                 "{train}: image id 2: file_name 'b.jpg\\x00.png' contains a control character", id="file-name-nul"),
    pytest.param(set_key("val", "images", 2, "file_name", "c.jpg\n"),
                 "{val}: image id 3: file_name 'c.jpg\\n' contains a control character", id="file-name-newline"),
    pytest.param(edit(lambda d: (d.images / "b.jpg").unlink()), "{images}/b.jpg: image id 2: image file not found",
                 id="image-missing"),
    pytest.param(truncate("c.jpg"), "{images}/c.jpg: image id 3: unreadable image (Image is incomplete or truncated)",
                 id="truncated-jpeg"),
    pytest.param(replace_file("a.jpg", b"GIF89a but not really"),
                 "{images}/a.jpg: image id 1: unreadable image (DGifSlurp() failed - 107)",
                 id="fake-gif-header"),
    pytest.param(replace_file("b.jpg", b"just some text\n"),
                 "{images}/b.jpg: image id 2: unreadable image (not a JPEG, PNG, WebP or GIF file)",
                 id="text-file-named-jpg"),
    pytest.param(replace_file("b.jpg", b""), "{images}/b.jpg: image id 2: empty file", id="empty-image-file"),
    pytest.param(edit(lambda d: save_image(d.images / "b.jpg", (32, 24))),
                 "{images}/b.jpg: image id 2: file is 32x24 but train.json says 24x32", id="other-size"),
    pytest.param(edit(lambda d: save_image(d.images / "b.jpg", (24, 32), format="BMP")),
                 "{images}/b.jpg: image id 2: unreadable image (not a JPEG, PNG, WebP or GIF file)",
                 id="bmp-named-jpg"),
    pytest.param(symlink_outside, "{images}/b.jpg: image id 2: links to {real_root}/outside/b.jpg, outside the "
                 "image folder {real_images}", id="symlink-outside"),
    pytest.param(symlink_loop, "{images}/b.jpg: image id 2: cannot read the file (Too many levels of symbolic links)",
                 id="symlink-loop"),
    pytest.param(folder_named_like_an_image, "{images}/b.jpg: image id 2: not a regular file (a folder)",
                 id="folder-named-jpg"),
    # empty or useless splits
    pytest.param(edit(lambda d: d.train.update(images=[], annotations=[])), "{train}: no images: the split is empty",
                 id="empty-train-split"),
    pytest.param(edit(lambda d: d.val.update(images=[], annotations=[])), "{val}: no images: the split is empty",
                 id="empty-val-split"),
    pytest.param(every_box(lambda ann: ann.update(iscrowd=1)),
                 "{train}: no usable box to train on (4 annotations: 4 crowd, 0 rejected)", id="train-all-crowd"),
    pytest.param(every_box(lambda ann: ann.update(bbox=[40, 40, 5, 5])),
                 "{train}: no usable box to train on (4 annotations: 0 crowd, 4 rejected)", id="train-all-outside"),
    pytest.param(set_section("train", "annotations", []),
                 "{train}: no usable box to train on (0 annotations: 0 crowd, 0 rejected)", id="train-no-annotations"),
    # paths in params.yaml
    pytest.param(edit(lambda d: d.dataset.update(train_annotations=str(d.root / "absent.json"))),
                 "{root}/absent.json: annotation file not found", id="annotation-file-missing"),
    pytest.param(edit(lambda d: d.dataset.update(val_annotations=str(d.images))),
                 "{images}: cannot read the annotation file (Is a directory)", id="annotation-path-a-folder"),
    pytest.param(edit(lambda d: d.dataset.update(val_images=str(d.root / "nowhere"))),
                 "{root}/nowhere: image folder not found (for {val})", id="image-folder-missing"),
    # the dataset section of params.yaml
    pytest.param(set_dataset("colour", "red"),
                 f"{{params}}: dataset.colour: unknown key (expected one of: {DATASET_KEYS})", id="params-unknown-key"),
    pytest.param(set_dataset("train_images", [1, 2]),
                 "{params}: dataset.train_images: Cannot convert 'ListConfig' to string: '[1, 2]'",
                 id="params-wrong-type"),
    pytest.param(set_dataset("name", "imagenet"), "{params}: dataset.name: expected one of synthetic, coco, got "
                 "'imagenet'", id="params-unknown-dataset"),
    pytest.param(edit(lambda d: d.dataset.pop("val_annotations")), "{params}: dataset.val_annotations: missing value",
                 id="params-missing-key"),
    pytest.param(edit(lambda d: d.params.__setitem__("dataset", "coco")),
                 "{params}: dataset: expected a section with a 'name' (synthetic | coco)", id="params-not-a-section"),
]


def _snapshot(d: Data) -> dict[str, bytes]:
    files = {str(p.relative_to(d.root)): p.read_bytes() for p in sorted(d.out.rglob("*")) if p.is_file()}
    return {**files, "metrics": d.metrics.read_bytes()}


@pytest.mark.parametrize("change, expected", BAD)
def test_bad_input_stops_prepare_in_one_line(data, capsys, change, expected):
    data.write()
    data.prepare()  # a previous, valid output to keep
    before = _snapshot(data)
    capsys.readouterr()

    change(data)
    data.write()
    with pytest.raises(SystemExit) as stop:
        data.prepare()
    stderr = capsys.readouterr().err
    assert stop.value.code == 2, stderr
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == ["error: " + data.format(expected)]
    assert stderr.rstrip().splitlines()[-1] == "error: " + data.format(expected)
    assert _snapshot(data) == before  # the previous output is intact
    leftovers = [p.name for p in data.root.iterdir() if p.name.startswith((".prepared", ".dataset.json"))]
    assert not leftovers  # no half-written folder or file


def test_the_bad_input_table_is_large_and_its_ids_unique():
    ids = [case.id for case in BAD]
    assert len(ids) >= 30 and len(set(ids)) == len(ids)


# -- input that must work: prepare, cache, 2 iterations of training ------------------------------------------------
# Each case adds images (and boxes) to the valid dataset; together they make one dataset too.


def greyscale(d: Data) -> None:
    d.add_image("grey.jpg", (30, 20), mode="L")


def cmyk(d: Data) -> None:
    d.add_image("cmyk.jpg", (20, 30), mode="CMYK")


def png_named_jpg(d: Data) -> None:
    d.add_image("png.jpg", (30, 20), format="PNG")


def unicode_and_spaces(d: Data) -> None:
    d.add_image("chat noir 1.jpg", (30, 20))
    d.add_image("ünï côdé/猫 と 犬.jpg", (20, 30))


def symlink_inside(d: Data) -> None:
    image_id = d.add_image("originals/inside.jpg", (30, 20))
    (d.images / "inside.jpg").symlink_to(Path("originals") / "inside.jpg")
    for coco in (d.train, d.val):
        next(im for im in coco["images"] if im["id"] == image_id)["file_name"] = "inside.jpg"


def crowd_rle(d: Data) -> None:
    w, h = 30, 20
    rle = {"counts": [100, 60, 40, 80, h * w - 280], "size": [h, w]}
    d.add_image("crowd.jpg", (w, h), boxes=[(1, [4, 2, 20, 16], rle), (3, [1, 1, 9, 9], None)])


def many_boxes(d: Data) -> None:
    rng = np.random.default_rng(1)
    xy, wh = rng.uniform(0, 100, (5000, 2)).round(1).tolist(), rng.uniform(2, 28, (5000, 2)).round(1).tolist()
    d.add_image("many.jpg", (128, 96), boxes=[((1, 3)[i % 2], [x, y, bw, bh], None)
                                              for i, ((x, y), (bw, bh)) in enumerate(zip(xy, wh))])


GOOD = [greyscale, cmyk, png_named_jpg, unicode_and_spaces, symlink_inside, crowd_rle, many_boxes]


def _tiny_training_params(params: dict) -> dict:
    params = copy.deepcopy(params)
    params["train"].update(max_iter=2, nproc=1, ims_per_batch=2, checkpoint_period=1, warmup_iters=1, log_period=1)
    params["loader"]["num_workers"] = 0
    params["model"].update(min_size_train=[128], max_size_train=192, min_size_test=128, max_size_test=192)
    params["evaluate"]["ims_per_batch"] = 2
    return params


def _prepare_and_cache(d: Data) -> Path:
    """Prepare and cache ``d``; check the counts on the way. Returns the cache folder."""
    d.write()
    d.prepare()
    summary = {r["item"].split(": ", 1)[1]: r["count"] for r in json.loads(d.metrics.read_text()) if r["split"] == "train"}
    rejected = summary["boxes_rejected_degenerate"] + summary["boxes_rejected_outside"]
    assert summary["images"] == len(d.train["images"])
    assert summary["annotations"] + rejected == len(d.train["annotations"])
    assert summary["crowd"] == sum(a["iscrowd"] for a in d.train["annotations"])
    cache = d.root / "cache"
    cli.run(stages.cache.main, ["--prepared", str(d.out), "--out", str(cache)])
    assert len(AnnotationCache(cache / "val")) == len(d.val["images"])
    return cache


def _train(d: Data, cache: Path, mlflow_uri: str) -> None:
    """A 2-iteration, single-process run of the train stage, started as a user starts it."""
    d.params = _tiny_training_params(d.params)
    d.write()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PIPELINES_"))}
    env.update(PYTHONPATH=str(REPO), MLFLOW_TRACKING_URI=mlflow_uri, OMP_NUM_THREADS="1")
    out = d.root / "train"
    done = subprocess.run([sys.executable, "-m", "stages.train", "--params", str(d.params_file),
                           "--cache", str(cache), *train_outputs(out), "--train-log", str(d.root / "log.csv"),
                           "--preview", str(d.root / "preview.png")],
                          cwd=d.root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model_final.pth").is_file()


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """One MLflow store for the module: its tables are created once."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.mark.parametrize("change", GOOD, ids=lambda f: f.__name__)
def test_unusual_valid_input_prepares_caches_and_loads(data, change):
    """Through prepare and cache, then every training sample through the training transforms at full strength."""
    change(data)
    cache = _prepare_and_cache(data)
    data.params = _tiny_training_params(data.params)
    data.write()
    p = load_params(data.params_file)
    transforms = build_data.train_transforms(p, build_data.augmentation(p))
    dataset = DetectionDataset(AnnotationCache(cache / "train"), transforms=transforms, seed=p.seed)
    for index in range(len(dataset)):
        image, target, _ = dataset[(index, p.train.max_iter)]
        assert image.dtype == torch.uint8 and image.shape[0] == 3 and len(target["boxes"]) == len(target["labels"])


def test_all_unusual_valid_input_together_trains(data, mlflow_uri):
    """Each one alone is loaded through the training transforms above; training on all of them at once
    shows they also batch, train and checkpoint (one run: each alone adds about 7 s and nothing else)."""
    for change in GOOD:
        change(data)
    _train(data, _prepare_and_cache(data), mlflow_uri)


# --- images, ids, special files, full disks ---------------------------------------------------------------------
# Members of the classes of issue 15 on the data side: resources bounded only by the machine (an image's
# pixels, read from its header before anything decodes it), numbers checked only by their type (every
# integer that crosses from the JSON into numpy: the annotation cache's int64 ids and int32 sizes, COCO
# evaluation's annotation ids), special files where an image or a JSON should be, and a full disk during
# any write. The table runs through the same check as BAD above.


def png_header_bomb(path: Path, width: int, height: int) -> None:
    """A valid 1-bit PNG of ``width`` x ``height`` black pixels, compressed row by row: 30000 x 30000 is
    about 110 KB on disk and 112 MB of rows (2.7 GB as RGB) for a decoder, and never more than a row here."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte, then the bits
    packer, parts = zlib.compressobj(9), []
    for _ in range(height):
        parts.append(packer.compress(row))
    parts.append(packer.flush())
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b""))


def bomb(d: Data) -> None:
    png_header_bomb(d.images / "a.jpg", 30000, 30000)  # the JSON still says 32x24: the limit is checked first


def animated_gif(d: Data) -> None:
    """c.jpg as a GIF of 3 frames of 32x24 (the size the JSON says): 2304 pixels to decode, against a limit of 2000."""
    frames = [Image.new("RGB", SIZES["c.jpg"], (40 * i, 0, 0)) for i in range(3)]
    frames[0].save(d.images / "c.jpg", format="GIF", save_all=True, append_images=frames[1:])
    d.dataset["max_image_pixels"] = 2000


def exif_rotated(d: Data) -> None:
    """b.jpg, which the JSON says is 24x32, stored as 32x24 with EXIF orientation 6 (shown 24x32)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    save_image(d.images / "b.jpg", (32, 24), exif=exif.tobytes())


def non_finite_json(d: Data) -> None:
    d.train["annotations"][1]["bbox"] = [4, 4, float("inf"), 12]  # json.dumps writes Infinity
    d.raw["train"] = json.dumps(d.train).encode()


def make_fifo(path: Path) -> None:
    """A FIFO at ``path`` (replacing a file). If anything opens it for reading, a watchdog opens the other
    end and closes it at once: a regression fails (the reader gets an empty file) rather than blocking for ever."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)

    def unblock() -> None:
        for _ in range(1200):  # 60 s
            time.sleep(0.05)
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only with a reader waiting
            except OSError:
                continue
    threading.Thread(target=unblock, daemon=True).start()


def fifo(name: str) -> Callable[[Data], None]:
    return edit(lambda d: make_fifo(d.images / name))


def special_file(name: str, mode: int, device: int = 0) -> Callable[[Data], None]:
    def change(d: Data) -> None:
        (d.images / name).unlink()
        try:
            os.mknod(d.images / name, mode | 0o644, device)
        except PermissionError:
            pytest.skip("creating a device node needs root")
    return change


def annotations_fifo(d: Data) -> None:
    make_fifo(d.root / "fifo.json")
    d.dataset["train_annotations"] = str(d.root / "fifo.json")


BAD_FILES_AND_NUMBERS = [
    # resources bounded only by the machine: pixels, read from the header
    pytest.param(bomb, "{images}/a.jpg: image id 1: 30000x30000 pixels (900.0 megapixels) is more than "
                 "dataset.max_image_pixels (268435456); raise that param to read this image", id="png-bomb-30000x30000"),
    pytest.param(animated_gif, "{images}/c.jpg: image id 3: 32x24 pixels x 3 frames is more than "
                 "dataset.max_image_pixels (2000); raise that param to read this image", id="gif-frames-over-limit"),
    pytest.param(set_dataset("max_image_pixels", 700), "{images}/a.jpg: image id 1: 32x24 pixels is more than "
                 "dataset.max_image_pixels (700); raise that param to read this image", id="limit-lowered"),
    pytest.param(exif_rotated, "{images}/b.jpg: image id 2: file is 32x24 but train.json says 24x32, its size as "
                 "shown with EXIF orientation 6 (turned 90 degrees clockwise); images are read as stored, without "
                 "EXIF rotation: store the pixels rotated (e.g. exiftran -ai) or give the stored size",
                 id="exif-rotated-size-mismatch"),
    # numbers checked against what numpy holds, not only their type
    pytest.param(set_key("train", "images", 0, "id", 2**63),
                 "{train}: image id 9223372036854775808: 'id' must be from -9223372036854775808 to 9223372036854775807 "
                 "(the annotation cache's int64 image ids), got 9223372036854775808", id="image-id-2**63"),
    pytest.param(set_key("val", "images", 2, "id", -(2**63) - 1),  # beyond 64 bits, orjson reads a float
                 "{val}: images[2]: expected an object with an integer 'id'", id="image-id-below-int64"),
    pytest.param(set_key("train", "annotations", 2, "id", 2**63),
                 "{train}: annotation id 9223372036854775808: 'id' must be from 1 to 9223372036854775807 (COCO "
                 "evaluation, where 0 means an unmatched annotation and ids are int64), got 9223372036854775808",
                 id="annotation-id-2**63"),
    pytest.param(set_key("train", "annotations", 0, "id", 0),
                 "{train}: annotation id 0: 'id' must be from 1 to 9223372036854775807 (COCO evaluation, where 0 "
                 "means an unmatched annotation and ids are int64), got 0", id="annotation-id-0"),
    pytest.param(set_key("train", "categories", 1, "id", 2**64 - 1),
                 "{train}: category id 18446744073709551615: 'id' must be from -9223372036854775808 to "
                 "9223372036854775807 (the annotation cache's int64 category ids), got 18446744073709551615",
                 id="category-id-beyond-int64"),
    pytest.param(set_key("train", "images", 1, "height", 2**31),
                 "{train}: image id 2: 'height' must be at most 2147483647 (the annotation cache's int32 sizes), got "
                 "2147483648", id="height-beyond-int32"),
    pytest.param(edit(lambda d: (d.train["annotations"][1].__setitem__("bbox", [4, 4, 1e200, 1e200]),
                                 d.train["annotations"][1].__delitem__("area"))),
                 "{train}: annotation id 2: 'area' missing and the box's w x h is not finite, got [4, 4, 1e+200, "
                 "1e+200]", id="area-of-huge-box-overflows"),
    pytest.param(non_finite_json, "{train}: not valid JSON (unexpected character, expected a JSON value: line 1 "
                 "column 363 (char 362); numbers must be finite: NaN and Infinity are not JSON)", id="bbox-infinity"),
    pytest.param(raw("val", b'{"images": [], "annotations": [{"bbox": [1, NaN, 3, 4]}]}'),
                 "{val}: not valid JSON (unexpected character, expected a JSON value: line 1 column 45 (char 44); "
                 "numbers must be finite: NaN and Infinity are not JSON)", id="bbox-nan"),
    pytest.param(raw("val", b'{"images": [], "annotations": [{"bbox": [1, 1e400, 3, 4]}]}'),
                 "{val}: not valid JSON (number is infinity when parsed as double: line 1 column 45 (char 44))",
                 id="bbox-1e400"),
    # special files
    pytest.param(fifo("a.jpg"), "{images}/a.jpg: image id 1: not a regular file (a FIFO)", id="fifo-named-jpg"),
    pytest.param(special_file("c.jpg", stat.S_IFSOCK), "{images}/c.jpg: image id 3: not a regular file (a socket)",
                 id="socket-named-jpg"),
    pytest.param(special_file("b.jpg", stat.S_IFCHR, os.makedev(1, 3)),
                 "{images}/b.jpg: image id 2: not a regular file (a character device)", id="device-named-jpg"),
    pytest.param(annotations_fifo, "{root}/fifo.json: cannot read the annotation file: not a regular file (a FIFO)",
                 id="annotation-json-a-fifo"),
]


@pytest.mark.parametrize("change, expected", BAD_FILES_AND_NUMBERS)
def test_bad_images_numbers_and_special_files_stop_prepare_in_one_line(data, capsys, change, expected):
    test_bad_input_stops_prepare_in_one_line(data, capsys, change, expected)


def _no_free_space(monkeypatch) -> None:
    """The other half of a simulated full disk (the caller patches a write to fail): 0 bytes free."""
    monkeypatch.setattr("pipelines.fileio.shutil.disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))


def test_a_full_disk_during_prepare_keeps_the_previous_output(data, capsys, monkeypatch):
    data.write()
    data.prepare()
    before = _snapshot(data)
    capsys.readouterr()
    real_write = Path.write_bytes

    def write_half(path: Path, content: bytes) -> int:
        real_write(path, content[: len(content) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_bytes", write_half)
    _no_free_space(monkeypatch)
    data.train["annotations"][0]["bbox"] = [3, 3, 10, 8]  # an input that changes the output
    real_write(data.train_json, json.dumps(data.train).encode())
    with pytest.raises(SystemExit) as stop:
        data.prepare()
    monkeypatch.undo()
    stderr = capsys.readouterr().err
    assert stop.value.code == 2, stderr
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert re.fullmatch(rf"error: {re.escape(str(data.out))}/train\.json: no space left on device while writing it "
                        r"\(about \d+(\.\d)?( KB| bytes) needed, 0 bytes free\); nothing was replaced", line), line
    assert _snapshot(data) == before
    assert not [p.name for p in data.root.iterdir() if p.name.startswith((".prepared", ".dataset.json"))]


@pytest.mark.parametrize("failure", [
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
    RuntimeError("basic_ios::clear: iostream error"),
    OSError(errno.ENOSPC, "No space left on device"),
], ids=["torch-enforce-fail", "torch-iostream", "enospc"])
def test_a_full_disk_during_a_checkpoint_save_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch, failure):
    from pipelines import checkpoint

    path = tmp_path / "model_0000004.pth"
    checkpoint.save(path, model={"w": torch.ones(3)}, iteration=4)
    before = path.read_bytes()
    capsys.readouterr()

    def save_half(state, file) -> None:  # checkpoint.save gives torch.save an open file
        file.write(before[:100])
        file.flush()
        raise failure

    monkeypatch.setattr(checkpoint.torch, "save", save_half)
    _no_free_space(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        cli.run(lambda argv: checkpoint.save(path, model={"w": torch.zeros(3)}, iteration=6), [])
    stderr = capsys.readouterr().err
    assert stop.value.code == 2, stderr
    assert stderr.strip().splitlines() == [f"error: {path}: no space left on device while writing it (more than "
                                           "100 bytes needed, 0 bytes free); nothing was replaced"]
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_a_torch_write_failure_with_space_left_is_not_called_a_full_disk(tmp_path, monkeypatch):
    from pipelines import checkpoint

    def fail(state, file) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(checkpoint.torch, "save", fail)
    monkeypatch.setattr("pipelines.fileio.shutil.disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, 10**12))
    with pytest.raises(RuntimeError, match="inline_container"):
        checkpoint.save(tmp_path / "m.pth", model={})
    assert list(tmp_path.iterdir()) == []


HAND_EDITS = [
    pytest.param(lambda coco: [coco["images"][0].__setitem__("id", 2**63)] + [
        a.__setitem__("image_id", 2**63) for a in coco["annotations"] if a["image_id"] == 1],
        "{prepared}/train.json: image id 9223372036854775808: 'id' must be an integer from -9223372036854775808 to "
        "9223372036854775807 (the cache's int64), got 9223372036854775808; run the prepare stage", id="image-id-2**63"),
    pytest.param(lambda coco: coco["annotations"][1].__setitem__("category_id", 2**64 - 1),
                 "{prepared}/train.json: annotation id 2: 'category_id' must be an integer from -9223372036854775808 "
                 "to 9223372036854775807 (the cache's int64), got 18446744073709551615; run the prepare stage",
                 id="category-ref-beyond-int64"),
    pytest.param(lambda coco: coco["images"][2].__setitem__("width", 2**31),
                 "{prepared}/train.json: image id 3: 'width' must be from 1 to 2147483647 (the cache's int32), got "
                 "2147483648; run the prepare stage", id="width-beyond-int32"),
]


@pytest.mark.parametrize("edit_json, expected", HAND_EDITS)
def test_the_cache_stage_names_an_out_of_range_number_in_a_hand_edited_prepared_folder(data, capsys, edit_json,
                                                                                        expected):
    cache = _prepare_and_cache(data)
    before = {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}
    train = data.out / "train.json"
    coco = json.loads(train.read_text())
    edit_json(coco)
    train.write_text(json.dumps(coco))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.run(stages.cache.main, ["--prepared", str(data.out), "--out", str(cache)])
    stderr = capsys.readouterr().err
    assert stop.value.code == 2, stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == \
        ["error: " + expected.format(prepared=data.out)]
    assert {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()} == before


@pytest.mark.parametrize("name", ["meta.json", "boxes.npy"])
def test_a_fifo_in_the_cache_is_named_by_the_loader_and_rebuilt_by_the_cache_stage(data, name):
    cache = _prepare_and_cache(data)
    make_fifo(cache / "train" / name)
    with pytest.raises(CacheError, match=rf"^{re.escape(str(cache / 'train' / name))}: not a regular file \(a FIFO\); "
                                         "rebuild"):
        AnnotationCache(cache / "train")
    cli.run(stages.cache.main, ["--prepared", str(data.out), "--out", str(cache)])  # rebuilds it, no wait
    assert len(AnnotationCache(cache / "train", verify=True)) == len(data.train["images"])


def test_the_data_loader_checks_the_header_before_decoding(data, monkeypatch):
    """An image swapped for a bomb after prepare: the loader compares the header with the cache and
    refuses it without decoding a pixel."""
    cache = _prepare_and_cache(data)
    png_header_bomb(data.images / "a.jpg", 30000, 30000)
    import pipelines.data.decode as decode

    def never(*args, **kwargs):
        raise AssertionError("the decoder was called")

    monkeypatch.setattr(decode, "_torchvision_decode", never)
    dataset = DetectionDataset(AnnotationCache(cache / "val"), transforms=None)
    index = int(np.flatnonzero(dataset.cache.image_ids == 1)[0])
    with pytest.raises(ImageError) as err:
        dataset.load(index)
    assert str(err.value) == (f"{data.images}/a.jpg: file is 30000x30000 but the annotation cache says 32x24; the file "
                              "changed after the prepare stage: run it again")


def test_a_store_that_cannot_be_opened_fails_at_once_not_after_mlflow_retries(tmp_path, monkeypatch):
    """A SQLite store whose file cannot be opened at all (here a folder in its place, as root can write
    anywhere; a read-only folder without the database for other users) used to wait out OPEN_TIMEOUT
    (30 s) through MLflow's 9 retries, past the documented 20 s bound; now it fails on the first open."""
    import mlflow  # noqa: F401  (imported before the clock starts)

    from pipelines.tracking import store
    from pipelines.tracking.tracker import Tracker

    (tmp_path / "mlflow.db").mkdir()
    for key in store.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)  # restored after the test: the tracker sets them
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(store, "OPEN_TIMEOUT", 8.0)  # a regression fails in 8 s rather than 30
    started = time.monotonic()
    tracker = Tracker.start(experiment="e", params={"a": 1})
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.finish()
    assert tracker.run_id is None and tracker._offline
    assert time.monotonic() - started < 5.0
