"""Fuzzing the validators of user input with hypothesis: whatever goes in, the answer is a valid result or a
one-line :class:`PipelineError`, never another exception.

``validate_coco`` gets arbitrary JSON documents, raw bytes, and documents close to valid COCO (the right keys
with values of random types) over a tiny real image folder; ``decode_policy`` gets arbitrary values.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays
from PIL import Image

from pipelines.data.coco import validate_coco
from pipelines.errors import PipelineError
from pipelines.policy import decode_policy, policy_length

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-3, 12)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


FILES = {"a.jpg": (8, 6), "b.png": (6, 8)}  # the real images of the fixture's folder: name -> (width, height)
OTHER_NAMES = ["absent.jpg", "text.jpg", "empty.jpg", "outside.jpg", "sub", "../a.jpg", "/etc/hostname",
               "sub/../a.jpg", "", ".", "a.jpg\n", "a\0.jpg", "./a.jpg", "sub//../b.png"]
numbers = st.integers(-20, 20) | st.floats(-50, 50) | st.floats(allow_nan=False)


@st.composite
def near_coco(draw) -> dict:
    """A valid COCO document over the fixture's folder, then a few random changes: a key set to any value,
    a key deleted, an entry replaced, an id or file name taken from elsewhere."""
    images = []
    for i in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(sorted(FILES)))
        width, height = FILES[name]
        images.append({"id": i + 1, "file_name": name, "width": width, "height": height})
    categories = [{"id": c, "name": f"c{c}"} for c in draw(st.lists(st.integers(1, 9), min_size=1, max_size=3,
                                                                       unique=True))]
    annotations = []
    for i in range(draw(st.integers(0, 6))):
        ann = {"id": 100 + i, "image_id": draw(st.sampled_from([im["id"] for im in images])),
               "category_id": draw(st.sampled_from([c["id"] for c in categories])),
               "bbox": draw(st.lists(st.integers(-2, 9) | st.floats(-2, 9), min_size=4, max_size=4))}
        for key, values in (("iscrowd", st.sampled_from([0, 1])), ("area", st.floats(0, 100)),
                            ("segmentation", json_values)):
            if draw(st.booleans()):
                ann[key] = draw(values)
        annotations.append(ann)
    document = {"images": images, "annotations": annotations, "categories": categories}
    keys = {"images": ["id", "file_name", "width", "height"], "categories": ["id", "name", "supercategory"],
            "annotations": ["id", "image_id", "category_id", "bbox", "iscrowd", "area", "segmentation"]}
    for _ in range(draw(st.integers(0, 3))):
        section = draw(st.sampled_from(sorted(keys)))
        entries = document[section]
        if not entries:
            continue
        index = draw(st.integers(0, len(entries) - 1))
        key = draw(st.sampled_from(keys[section]))
        change = draw(st.sampled_from(["set", "small", "delete", "entry", "name", "name"]))
        if not isinstance(entries[index], dict):  # replaced by an earlier change
            continue
        if change == "set":
            entries[index][key] = draw(json_values)
        elif change == "small":
            entries[index][key] = draw(st.integers(0, 4) | numbers)
        elif change == "delete":
            entries[index].pop(key, None)
        elif change == "entry":
            entries[index] = draw(json_values)
        elif section == "images":
            entries[index]["file_name"] = draw(st.sampled_from(OTHER_NAMES) | st.text(max_size=12))
    return document


documents = near_coco() | near_coco() | near_coco() | json_values | st.fixed_dictionaries(
    {}, optional={"images": json_values, "annotations": json_values, "categories": json_values})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``(annotation file to overwrite, image folder)``: two real images (8x6 JPEG, 6x8 PNG), a text file named
    .jpg, an empty file, a sub-folder and a symlink that points outside."""
    root = tmp_path_factory.mktemp("fuzz")
    image_dir = root / "images"
    (image_dir / "sub").mkdir(parents=True)
    Image.new("RGB", (8, 6), (200, 10, 10)).save(image_dir / "a.jpg")
    Image.new("RGB", (6, 8), (10, 200, 10)).save(image_dir / "b.png")
    (image_dir / "text.jpg").write_text("not an image")
    (image_dir / "empty.jpg").write_bytes(b"")
    Image.new("RGB", (8, 6)).save(root / "outside.jpg")
    (image_dir / "outside.jpg").symlink_to(root / "outside.jpg")
    return root / "instances.json", image_dir


def _check(path, image_dir, require_boxes: bool) -> None:
    try:
        cleaned, summary = validate_coco(path, image_dir, require_boxes=require_boxes)
    except PipelineError as err:
        text = str(err)
        assert text and "\n" not in text and "\r" not in text, text
        return
    assert summary["images"] == len(cleaned["images"]) >= 1
    assert summary["annotations"] == len(cleaned["annotations"])
    for ann in cleaned["annotations"]:
        assert all(math.isfinite(v) for v in ann["bbox"]) and ann["bbox"][2] > 0 and ann["bbox"][3] > 0
    if require_boxes:
        assert summary["annotations"] > summary["crowd"]
    json.dumps(cleaned, allow_nan=False)  # what prepare writes


@FAST
@given(document=documents, require_boxes=st.booleans())
def test_validate_coco_on_json_documents(folder, document, require_boxes):
    path, image_dir = folder
    path.write_text(json.dumps(document))
    _check(path, image_dir, require_boxes)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_validate_coco_on_raw_bytes(folder, data):
    path, image_dir = folder
    path.write_bytes(data)
    _check(path, image_dir, require_boxes=False)


def test_the_fuzzer_reaches_valid_documents(folder):
    """The near-COCO strategy is close enough to produce valid input too (otherwise it fuzzes only the front)."""
    path, image_dir = folder
    document = {"images": [{"id": 1, "file_name": "a.jpg", "width": 8, "height": 6}],
                "annotations": [{"id": 1, "image_id": 1, "category_id": 2, "bbox": [1, 1, 4, 3]}],
                "categories": [{"id": 2, "name": "x"}]}
    path.write_text(json.dumps(document))
    cleaned, summary = validate_coco(path, image_dir, require_boxes=True)
    assert summary["annotations"] == 1 and cleaned["annotations"][0]["bbox"] == [1.0, 1.0, 4.0, 3.0]


def _gene_lists(n):
    length = policy_length(n)
    genes = st.integers(0, 9) | st.integers(0, 9) | st.integers(0, 9) | scalars
    return st.lists(genes, min_size=length, max_size=length) | st.lists(st.integers(0, 9), max_size=length + 1)


anything = (json_values | st.tuples(st.integers(0, 9)) | st.binary(max_size=8) | st.frozensets(st.integers(0, 9))
            | arrays(np.int64, array_shapes(min_dims=0, max_dims=2, max_side=42), elements=st.integers(0, 9))
            | arrays(np.float64, st.just(40)) | st.builds(iter, st.lists(st.integers(0, 9), max_size=40)))
n_subpolicies = st.integers(1, 6) | st.integers(1, 6) | st.integers() | st.integers(0, 6).map(np.int64) | scalars


@FAST
@given(data=st.data())
def test_decode_policy_on_anything(data):
    n = data.draw(n_subpolicies)
    near = _gene_lists(n) if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 6 else st.nothing()
    genes = data.draw(near | near | anything)
    try:
        policy = decode_policy(genes, n)
    except PipelineError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert len(policy.subpolicies) == n
    assert all(0 <= op.prob <= 0.9 and 0 <= op.level <= 9 for sub in policy.subpolicies
               for op in (sub.color, sub.geometric))
    str(policy)
