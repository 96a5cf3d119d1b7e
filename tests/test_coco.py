import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as torchvision_decode_image

from pipelines.data.coco import validate_coco
from pipelines.data.decode import decode_image
from pipelines.errors import DatasetError, ImageError


@pytest.fixture
def dataset(tmp_path, tiny_synthetic):
    """A writable copy of a small valid dataset: ``(write(coco) -> path, image folder, coco)``."""
    _, images, coco = tiny_synthetic
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    for image in coco["images"][:4]:
        (image_dir / image["file_name"]).write_bytes((images / image["file_name"]).read_bytes())
    coco = copy.deepcopy(coco)
    coco["images"] = coco["images"][:4]
    coco["annotations"] = [a for a in coco["annotations"] if a["image_id"] <= 4]

    def write(data) -> str:
        path = tmp_path / "instances.json"
        path.write_text(json.dumps(data))
        return str(path)

    return write, image_dir, coco


def test_valid_dataset_passes(dataset):
    write, images, coco = dataset
    cleaned, summary = validate_coco(write(coco), images)
    assert summary["images"] == 4
    assert summary["annotations"] == len(coco["annotations"])
    assert sum(summary["per_scale"].values()) == len(coco["annotations"])
    assert cleaned["annotations"][0]["bbox"] == coco["annotations"][0]["bbox"]


def _error(write, images, coco) -> str:
    with pytest.raises(DatasetError) as err:
        validate_coco(write(coco), images)
    text = str(err.value)
    assert "\n" not in text
    return text


def test_validation_needs_no_torch():
    """The cache stage imports this module for the JSON reader: the decoder is imported only when validating."""
    code = "import sys, pipelines.data.coco; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_structural_errors_name_file_and_id(dataset):
    write, images, coco = dataset
    c = copy.deepcopy(coco)
    c["images"].append(dict(c["images"][0]))
    assert "duplicate image id 1" in _error(write, images, c)

    c = copy.deepcopy(coco)
    c["annotations"][1]["id"] = c["annotations"][0]["id"]
    assert f"duplicate annotation id {c['annotations'][0]['id']}" in _error(write, images, c)

    c = copy.deepcopy(coco)
    c["annotations"][0]["image_id"] = 999
    text = _error(write, images, c)
    assert "instances.json" in text and f"annotation id {c['annotations'][0]['id']}" in text
    assert "missing image id 999" in text

    c = copy.deepcopy(coco)
    c["annotations"][0]["category_id"] = 2  # a gap in the synthetic ids
    assert "missing category id 2" in _error(write, images, c)

    c = copy.deepcopy(coco)
    del c["categories"]
    assert "'categories' must be a list" in _error(write, images, c)

    c = copy.deepcopy(coco)
    c["annotations"][0]["bbox"] = [1, 2, 3]
    assert "'bbox' must be a list of 4 numbers" in _error(write, images, c)

    c = copy.deepcopy(coco)
    c["images"][0]["width"] = -5
    assert "image id 1: 'width' must be a positive integer" in _error(write, images, c)


def test_invalid_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"images": [')
    with pytest.raises(DatasetError, match=r"broken.json: not valid JSON"):
        validate_coco(path, tmp_path)
    with pytest.raises(DatasetError, match="annotation file not found"):
        validate_coco(tmp_path / "absent.json", tmp_path)


@pytest.mark.parametrize("name", ["../outside.jpg", "/etc/passwd", "a/../../b.jpg"])
def test_file_names_may_not_escape_the_image_folder(dataset, name):
    write, images, coco = dataset
    coco["images"][2]["file_name"] = name
    assert f"image id 3: file_name {name!r} escapes the image folder" in _error(write, images, coco)


def test_missing_unreadable_and_mismatched_images(dataset):
    write, images, coco = dataset
    (images / coco["images"][1]["file_name"]).unlink()
    assert "image id 2: image file not found" in _error(write, images, coco)

    (images / coco["images"][1]["file_name"]).write_bytes(b"not a jpeg")
    assert "image id 2: unreadable image" in _error(write, images, coco)

    Image.new("RGB", (10, 20)).save(images / coco["images"][1]["file_name"])
    assert "image id 2: file is 10x20 but instances.json says" in _error(write, images, coco)


def test_images_are_decoded_in_full(dataset):
    """A truncated JPEG has a valid header (opening it used to pass); decoding the whole file does not."""
    write, images, coco = dataset
    file = images / coco["images"][2]["file_name"]
    file.write_bytes(file.read_bytes()[:-200])
    assert _error(write, images, coco) == f"{file}: image id 3: unreadable image (Image is incomplete or truncated)"


def test_symlinks_must_stay_inside_the_image_folder(dataset, tmp_path):
    write, images, coco = dataset
    name = coco["images"][0]["file_name"]
    (images / "sub").mkdir()
    os.replace(images / name, images / "sub" / name)
    (images / name).symlink_to(images / "sub" / name)  # inside the folder: fine
    cleaned, _ = validate_coco(write(coco), images)
    assert cleaned["images"][0]["file_name"] == name

    outside = tmp_path / "elsewhere.jpg"
    os.replace(images / "sub" / name, outside)
    (images / name).unlink()
    (images / name).symlink_to(outside)
    assert _error(write, images, coco) == (
        f"{images / name}: image id 1: links to {outside.resolve()}, outside the image folder {images.resolve()}"
    )


def test_an_image_folder_reached_through_a_symlink_is_fine(dataset, tmp_path):
    write, images, coco = dataset
    link = tmp_path / "link"
    link.symlink_to(images, target_is_directory=True)
    _, summary = validate_coco(write(coco), link)
    assert summary["images"] == 4


def test_empty_split_and_train_split_without_usable_boxes(dataset):
    write, images, coco = dataset
    c = copy.deepcopy(coco)
    c["images"], c["annotations"] = [], []
    assert _error(write, images, c).endswith("instances.json: no images: the split is empty")

    c = copy.deepcopy(coco)
    for i, ann in enumerate(c["annotations"]):
        if i % 2:
            ann["iscrowd"] = 1
        else:
            ann["bbox"] = [1, 1, 0, 5]  # degenerate: rejected
    validate_coco(write(c), images)  # a val split may have no usable box
    crowd = len(c["annotations"]) // 2
    with pytest.raises(DatasetError) as err:
        validate_coco(write(c), images, require_boxes=True)
    assert str(err.value).endswith(f"instances.json: no usable box to train on ({len(c['annotations'])} annotations: "
                                   f"{crowd} crowd, {len(c['annotations']) - crowd} rejected)")


def test_decoder_gives_the_training_pixels_or_one_line(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "rgb.jpg", quality=90)
    image = decode_image(tmp_path / "rgb.jpg")
    assert torch.equal(image, torchvision_decode_image(str(tmp_path / "rgb.jpg"), mode=ImageReadMode.RGB))

    Image.fromarray(pixels).convert("L").save(tmp_path / "grey.jpg")
    Image.fromarray(pixels).convert("CMYK").save(tmp_path / "cmyk.jpg")
    Image.fromarray(pixels).save(tmp_path / "png.jpg", format="PNG")
    Image.fromarray(pixels).convert("RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(pixels[..., 0].astype(np.uint16) * 257).save(tmp_path / "deep.png")
    for name in ("grey.jpg", "cmyk.jpg", "png.jpg", "rgba.png", "deep.png"):
        image = decode_image(tmp_path / name)
        assert image.dtype == torch.uint8 and image.shape == (3, 24, 40), name
    assert torch.equal(decode_image(tmp_path / "deep.png")[0], torch.from_numpy(pixels[..., 0]))

    data = (tmp_path / "rgb.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.jpg").write_text("not an image")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "folder.jpg").mkdir()
    expected = {
        "cut.jpg": "unreadable image (Image is incomplete or truncated)",
        "text.jpg": "unreadable image (not a JPEG, PNG, WebP or GIF file)",
        "empty.jpg": "empty file",
        "folder.jpg": "not a regular file (a folder)",
        "absent.jpg": "image file not found",
    }
    for name, reason in expected.items():
        with pytest.raises(ImageError) as err:
            decode_image(tmp_path / name)
        assert str(err.value) == f"{tmp_path / name}: {reason}"
        assert err.value.reason == reason


def test_boxes_are_clipped_or_rejected_and_counted(dataset):
    write, images, coco = dataset
    width = coco["images"][0]["width"]
    base = {"image_id": 1, "category_id": coco["categories"][0]["id"], "iscrowd": 0, "area": 100.0}
    coco["annotations"] += [
        {**base, "id": 9001, "bbox": [width - 20, 10, 25, 30]},  # 5 px outside: clipped
        {**base, "id": 9002, "bbox": [10, 10, 0, 30]},  # zero width: rejected
        {**base, "id": 9003, "bbox": [width - 5, 10, 50, 30]},  # mostly outside: rejected
        {**base, "id": 9004, "bbox": [-2, -3, 12, 13]},  # slightly negative: clipped
    ]
    cleaned, summary = validate_coco(write(coco), images)
    assert summary["boxes_clipped"] == 2
    assert summary["boxes_rejected_degenerate"] == 1
    assert summary["boxes_rejected_outside"] == 1
    by_id = {a["id"]: a for a in cleaned["annotations"]}
    assert by_id[9001]["bbox"] == [width - 20, 10, 20, 30]
    assert by_id[9004]["bbox"] == [0, 0, 10, 10]
    assert 9002 not in by_id and 9003 not in by_id


def test_real_coco_images_validate(coco_real):
    annotations, images = coco_real
    cleaned, summary = validate_coco(annotations, images)
    assert summary["images"] == 33
    assert summary["annotations"] == 246
    assert summary["crowd"] >= 1
    assert summary["images_without_boxes"] >= 1
    assert len(cleaned["categories"]) == 80
