"""Bad datasets of issue 38: splits that disagree, the same thing said twice, damage that decodes.

Each case runs the prepare stage in-process (``cli.run``, as ``python -m stages.prepare`` does) on the
small dataset of ``test_bad_input.py`` (three tiny JPEGs) and checks what a user sees: one ``error:``
line and exit code 2 with the previous output intact, or a finished run with one warning line.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import zlib
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pipelines.data.damage import DecoderMessages, png_problem
from pipelines.data.json_keys import repeated_key

from .test_bad_input import Data, _snapshot, save_image

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture
def data(tmp_path, base_params) -> Data:
    """The dataset of test_bad_input.py, its val split on copies of the images (nothing shared with train)."""
    d = Data(tmp_path, base_params)
    shutil.copytree(d.images, tmp_path / "val_images")
    d.dataset["val_images"] = str(tmp_path / "val_images")
    return d


def prepare(d: Data, capsys) -> tuple[int, list[str]]:
    """Write ``d`` and run prepare; (exit code, the error and warning lines of stderr)."""
    d.write()
    capsys.readouterr()
    try:
        d.prepare()
        code = 0
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line.split(" WARNING: ", 1)[-1] if " WARNING: " in line else line
                  for line in err.splitlines() if line.startswith("error:") or " WARNING: " in line]


def refused(d: Data, capsys, change) -> str:
    """Prepare the valid ``d``, then ``change(d)``: the one error line of the second run (without ``error: ``);
    the first output is kept and nothing is left half-written."""
    assert prepare(d, capsys) == (0, [])
    before = _snapshot(d)
    change(d)
    code, lines = prepare(d, capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert _snapshot(d) == before
    assert not [p.name for p in d.root.iterdir() if p.name.startswith((".prepared", ".dataset.json"))]
    return lines[0].removeprefix("error: ")


def warned(d: Data, capsys) -> str:
    code, lines = prepare(d, capsys)
    assert code == 0 and len(lines) == 1, lines
    assert (d.out / "val.json").is_file()
    return lines[0]


# --- class 2: splits that disagree -------------------------------------------------------------------------------


def test_a_clean_dataset_prepares_without_a_warning(data, capsys):
    assert prepare(data, capsys) == (0, [])


def test_val_with_other_categories_is_refused_at_prepare(data, capsys):
    line = refused(data, capsys, lambda d: d.val["categories"].append({"id": 5, "name": "bird"}))
    assert line == (f"{data.val_json}: category id 5 ('bird') is not in the train split; expected the categories of "
                    f"{data.train_json} (the model learns them; evaluate scores them)")


def test_val_listing_only_some_of_trains_categories_is_given_trains_list_with_one_warning(data, capsys):
    data.val["categories"].pop()
    data.val["annotations"] = [a for a in data.val["annotations"] if a["category_id"] == 1]
    assert warned(data, capsys) == (f"{data.val_json}: does not list 1 of the train split's 2 categories (dog): "
                                    "given the train split's list; their AP is not measured")
    train, val = (json.loads((data.out / f"{s}.json").read_text())["categories"] for s in ("train", "val"))
    assert val == train  # the cache's categories then match the model's: evaluate scores it


def test_the_same_category_id_under_another_name_is_refused(data, capsys):
    line = refused(data, capsys, lambda d: d.val["categories"][1].update(name="wolf"))
    assert line.startswith(f"{data.val_json}: category id 3 is 'wolf', but 'dog' in the train split")


def test_a_val_split_without_annotations_is_refused(data, capsys):
    line = refused(data, capsys, lambda d: d.val.update(annotations=[]))
    assert line == (f"{data.val_json}: no box to evaluate against (0 annotations: 0 crowd, 0 rejected); expected "
                    "boxes of the train split's categories")


def test_a_val_split_of_crowd_regions_only_is_refused(data, capsys):
    def change(d):
        for ann in d.val["annotations"]:
            ann["iscrowd"] = 1
    line = refused(data, capsys, change)
    assert line.startswith(f"{data.val_json}: no box to evaluate against (4 annotations: 4 crowd")


def test_val_without_boxes_of_a_category_warns_in_one_line(data, capsys):
    data.val["annotations"] = [a for a in data.val["annotations"] if a["category_id"] == 1]
    assert warned(data, capsys) == (f"{data.val_json}: no box of 1 of its 2 categories (dog): their AP is not "
                                    "measured (evaluate averages the others)")


def test_images_in_both_splits_warn_in_one_line(data, capsys):
    data.dataset["val_images"] = str(data.images)
    assert warned(data, capsys) == (f"{data.val_json}: 3 of its 3 images are also in the train split (a.jpg, b.jpg, "
                                    "c.jpg): their scores are not held out")


def test_categories_listed_in_another_order_prepare_alike(data, capsys):
    data.val["categories"].reverse()
    assert prepare(data, capsys) == (0, [])
    train, val = (json.loads((data.out / f"{s}.json").read_text())["categories"] for s in ("train", "val"))
    assert sorted(train, key=lambda c: c["id"]) == sorted(val, key=lambda c: c["id"])


def test_a_model_scored_on_other_categories_than_it_learned_is_refused_before_it_is_built():
    import torch

    from pipelines.build.model import trained_detector
    from pipelines.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"^model_final.pth: trained on other categories than data/cache/val$"):
        trained_detector(None, Path("model_final.pth"), categories=[{"id": 1, "name": "cat"}],
                         split=Path("data/cache/val"), device=torch.device("cpu"),
                         state={"categories": [{"id": 1, "name": "dog"}]})


# --- class 3: the same thing said twice ------------------------------------------------------------------------------


def test_one_image_file_under_two_ids_is_refused(data, capsys):
    def change(d):
        d.train["images"].append({"id": 4, "file_name": "a.jpg", "width": 32, "height": 24})
        d.train["annotations"].append({"id": 9, "image_id": 4, "category_id": 3, "bbox": [1, 1, 5, 5]})
    assert refused(data, capsys, change) == (f"{data.train_json}: image ids 1 and 4 name the same file "
                                             f"{data.images}/a.jpg; expected one entry per image, holding all its boxes")


def test_two_names_linking_to_one_file_are_refused(data, capsys):
    def change(d):
        (d.images / "again.jpg").symlink_to("c.jpg")
        d.train["images"].append({"id": 4, "file_name": "again.jpg", "width": 32, "height": 24})
    assert refused(data, capsys, change).startswith(f"{data.train_json}: image ids 3 and 4 name the same file")


def test_a_key_twice_in_an_annotation_is_refused(data, capsys):
    def change(d):
        d.raw["train"] = json.dumps(d.train).replace('"bbox": [4, 4, 12, 12]',
                                                     '"bbox": [4, 4, 12, 12], "bbox": [0, 0, 1, 1]').encode()
    assert refused(data, capsys, change) == (f"{data.train_json}: annotation id 2 has the key 'bbox' twice; expected "
                                             "each key once in an object (a JSON reader keeps only the last)")


def test_a_top_level_key_twice_is_refused(data, capsys):
    def change(d):
        d.raw["val"] = (json.dumps(d.val)[:-1] + ', "images": ' + json.dumps(d.val["images"][:1]) + "}").encode()
    assert refused(data, capsys, change).startswith(f"{data.val_json}: the top-level object has the key 'images' twice")


def test_one_category_name_under_two_ids_is_refused(data, capsys):
    def change(d):
        for split in (d.train, d.val):
            split["categories"][1]["name"] = "cat"
    assert refused(data, capsys, change) == (f"{data.train_json}: category ids 1 and 3 both have the name 'cat'; "
                                             "expected one id per category")


def test_an_annotation_said_twice_warns_in_one_line(data, capsys):
    data.train["annotations"].append({**data.train["annotations"][1], "id": 7})
    assert warned(data, capsys) == (f"{data.train_json}: 1 annotation(s) repeat the image, category and box of "
                                    "another (annotation id 7 repeats id 2); kept, each counts as an object")


def test_repeated_keys_found_wherever_the_counts_disagree():
    def found(text: str):
        err = repeated_key(text.encode(), orjson.loads(text))
        return err and str(err)

    assert found('{"images": [], "annotations": [{"id": 1, "segmentation": {"counts": [1], "size": [1, 1]}}]}') is None
    assert found('{"a" : 1, "b": ":x", "c": {"d": [{"e": 1}]}}') is None  # counts disagree; the parse finds nothing
    assert found('{"annotations": [{"id": 3, "image_id": 1, "segmentation": {"counts": [1], "counts": [2]}}]}') == \
        "an object with the keys 'counts' has the key 'counts' twice"
    assert found('{"x": [[{"k": 1, "k": 2}]]}') == "an object with the keys 'k' has the key 'k' twice"  # deep
    assert found('{"a" : 1, "a" : 2}') == "an object with the keys 'a' has the key 'a' twice"  # space before ':'
    assert found('{"images": [{"id": 2, "file_name": "x", "id": 2}]}') == "image id 2 has the key 'id' twice"


def test_a_coco_file_without_repeated_keys_is_not_parsed_twice(monkeypatch):
    """The counts agree on COCO's shapes, compact or indented: the slow second parse is not needed."""
    import pipelines.data.json_keys as json_keys

    def second_parse(*_, **__):
        raise AssertionError("parsed a second time")

    coco = {"info": {"year": 2017}, "images": [{"id": 1, "file_name": "a.jpg", "coco_url": "http://x/a.jpg"}],
            "annotations": [{"id": 1, "image_id": 1, "segmentation": [[1.0, 2.0]], "bbox": [1, 2, 3, 4]},
                            {"id": 2, "image_id": 1, "segmentation": {"counts": [1, 2], "size": [2, 2]}}],
            "categories": [{"id": 1, "name": "cat"}]}
    monkeypatch.setattr(json_keys.json, "loads", second_parse)
    for text in (json.dumps(coco), json.dumps(coco, indent=2), json.dumps(coco, separators=(",", ":"))):
        assert repeated_key(text.encode(), orjson.loads(text)) is None


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4), max_leaves=24)


def _dump(value, space: str, repeat_in: int, seen: list[int]) -> str:
    """JSON text of ``value``, with ``space`` around colons, whose ``repeat_in``-th non-empty object (in
    writing order) writes its first key a second time."""
    if isinstance(value, dict):
        items = [(json.dumps(k), _dump(v, space, repeat_in, seen)) for k, v in value.items()]
        if items:
            seen[0] += 1
            if seen[0] == repeat_in:
                items.append((items[0][0], "0"))
        return "{" + ",".join(f"{k}{space}:{space}{v}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dump(v, space, repeat_in, seen) for v in value) + "]"
    return json.dumps(value)


@settings(max_examples=150, deadline=None)
@given(value=st.dictionaries(_TEXT, _JSON, max_size=4), space=st.sampled_from(["", " ", "\n  "]),
       repeat_in=st.integers(0, 6))
def test_a_repeated_key_is_found_wherever_it_is_and_only_then(value, space, repeat_in):
    seen = [0]
    text = _dump(value, space, repeat_in, seen)
    found = repeated_key(text.encode(), orjson.loads(text))
    assert (found is not None) == (1 <= repeat_in <= seen[0]), text


def test_repeated_keys_in_params_yaml_are_refused_already(tmp_path):
    from pipelines.config.yamlio import parse_yaml
    from pipelines.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^params.yaml:2:1: not valid YAML: found duplicate key seed"):
        parse_yaml("seed: 1\nseed: 2\n", "params.yaml")


# --- class 4: damage that decodes ------------------------------------------------------------------------------------


def _corrupt_jpeg(path: Path) -> None:
    """An end-of-image marker in the middle of the entropy-coded data: libjpeg decodes the rest as grey."""
    content = path.read_bytes()
    scan = content.index(b"\xff\xda") + 40
    path.write_bytes(content[:scan] + b"\xff\xd9")


def test_a_corrupt_jpeg_is_named_and_refused(data, capfd):
    """Before: prepare passed, and libjpeg's bare line on stderr named no file."""
    _corrupt_jpeg(data.images / "b.jpg")
    data.write()
    with pytest.raises(SystemExit) as stop:
        data.prepare()
    err = capfd.readouterr().err
    assert stop.value.code == 2
    assert err.splitlines()[-1] == (f"error: {data.train_json}: 1 image the decoder found damaged (Corrupt JPEG data: "
                                    "premature end of data segment): b.jpg (image id 2); expected at most "
                                    "dataset.max_damaged_images (0): replace them, or raise that param to train on "
                                    "them as they decode")
    assert "Corrupt JPEG data" not in err.replace("found damaged (Corrupt JPEG data", "")  # no bare line


def test_damaged_images_up_to_the_limit_are_kept_with_one_warning(data, capsys):
    for name in ("a.jpg", "b.jpg"):
        _corrupt_jpeg(data.images / name)
    data.dataset["max_damaged_images"] = 2
    assert warned(data, capsys) == (f"{data.train_json}: 2 images the decoder found damaged (Corrupt JPEG data: "
                                    "premature end of data segment): a.jpg (image id 1), b.jpg (image id 2); kept, "
                                    "as dataset.max_damaged_images (2) allows")


def test_a_png_with_a_damaged_chunk_is_refused_instead_of_crashing(data, capsys):
    def change(d):
        save_image(d.images / "b.jpg", (24, 32), format="PNG")
        content = bytearray((d.images / "b.jpg").read_bytes())
        content[content.index(b"IDAT") + 30] ^= 0x55
        (d.images / "b.jpg").write_bytes(bytes(content))
    line = refused(data, capsys, change)
    assert line == f"{data.images}/b.jpg: image id 2: damaged PNG: the CRC of its 'IDAT' chunk fails"


def test_a_png_whose_data_does_not_inflate_is_refused(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (32, 24, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "x.png")
    content = bytearray((tmp_path / "x.png").read_bytes())
    start = content.index(b"IDAT")
    length = int.from_bytes(content[start - 4:start], "big")
    content[start + 4 + length // 2] ^= 0x55
    content[start + 4 + length:start + 8 + length] = zlib.crc32(content[start:start + 4 + length]).to_bytes(4, "big")
    (tmp_path / "x.png").write_bytes(bytes(content))
    assert png_problem(tmp_path / "x.png").startswith("damaged PNG: its compressed pixel data does not inflate")
    Image.fromarray(pixels).save(tmp_path / "y.png")
    assert png_problem(tmp_path / "y.png") is None


def test_max_damaged_images_below_zero_is_refused(data, capsys):
    data.dataset["max_damaged_images"] = -1
    code, lines = prepare(data, capsys)
    assert (code, lines) == (2, [f"error: {data.params_file}: dataset.max_damaged_images: expected an integer >= 0 "
                                 "(images of a split), got -1"])


def test_decoder_messages_tie_a_line_to_its_decode_and_pass_the_others_on(capfd):
    def damaged():
        os.write(2, b"Corrupt JPEG data: bad Huffman code\n")

    def other():
        os.write(2, b"libpng warning: iCCP: known incorrect sRGB profile\n")

    def harmless():  # all pixels decoded; bytes after them ignored
        os.write(2, b"Corrupt JPEG data: 2 extraneous bytes before marker 0xd9\n")

    with DecoderMessages() as messages:
        wrote = []
        threads = [threading.Thread(target=lambda f=f: wrote.append(messages.decode(f)[1]))
                   for f in (damaged, other, harmless)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrote == [True, True, True]
        assert messages.decode(lambda: 1) == (1, False)
        assert messages.damage(damaged) == "Corrupt JPEG data: bad Huffman code"
        assert messages.damage(other) is None and messages.damage(harmless) is None
    assert sorted(capfd.readouterr().err.splitlines()) == [
        "Corrupt JPEG data: 2 extraneous bytes before marker 0xd9", "libpng warning: iCCP: known incorrect sRGB profile"]
