import contextlib
import io
import json

import numpy as np
import pytest
from pycocotools.coco import COCO

from pipelines.annotation_cache import AnnotationCache, build_cache, file_sha256, is_up_to_date
from pipelines.coco import validate_coco
from pipelines.errors import CacheError


def _pycocotools(path) -> COCO:
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(path))


def _assert_matches_pycocotools(cache: AnnotationCache, json_path, *, drop_empty: bool):
    coco = _pycocotools(json_path)
    expected_ids = sorted(coco.getImgIds())
    if drop_empty:
        expected_ids = [i for i in expected_ids if any(not a["iscrowd"] for a in coco.imgToAnns[i])]
    assert cache.image_ids.tolist() == expected_ids
    label_of = {cat_id: k for k, cat_id in enumerate(sorted(coco.getCatIds()))}
    assert cache.category_ids == sorted(coco.getCatIds())
    for index, image_id in enumerate(expected_ids):
        info = coco.imgs[image_id]
        assert cache.size(index) == (info["width"], info["height"])
        assert cache.file_name(index) == info["file_name"]
        assert cache.aspect_groups[index] == (info["height"] >= info["width"])
        anns = coco.imgToAnns[image_id]
        boxes, labels, crowd = cache.annotations(index)
        want = np.array([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)], dtype=np.float32)
        np.testing.assert_array_equal(boxes, want.reshape(-1, 4))
        assert labels.tolist() == [label_of[a["category_id"]] for a in anns]
        assert crowd.tolist() == [bool(a["iscrowd"]) for a in anns]


@pytest.mark.parametrize("drop_empty", [True, False])
def test_round_trip_on_real_coco(coco_real, tmp_path, drop_empty):
    annotations, images = coco_real
    cleaned, _ = validate_coco(annotations, images)
    cleaned_path = tmp_path / "cleaned.json"
    cleaned_path.write_text(json.dumps(cleaned))
    build_cache(cleaned, tmp_path / "cache", image_root=str(images), source_sha256="x", drop_empty=drop_empty)
    cache = AnnotationCache(tmp_path / "cache")
    _assert_matches_pycocotools(cache, cleaned_path, drop_empty=drop_empty)
    assert len(cache) == (32 if drop_empty else 33)  # one real image has no annotations
    assert cache.crowd.any()
    assert cache.image_path(0) == images / cache.file_name(0)


def test_round_trip_on_synthetic(tiny_synthetic, tiny_cache):
    path, _, _ = tiny_synthetic
    _assert_matches_pycocotools(tiny_cache, path, drop_empty=True)


def test_arrays_are_memory_mapped(tiny_cache):
    assert isinstance(tiny_cache.boxes, np.memmap)
    assert tiny_cache.boxes.dtype == np.float32 and not tiny_cache.boxes.flags.writeable


@pytest.fixture
def cache_copy(tiny_synthetic, tmp_path):
    path, images, coco = tiny_synthetic
    settings = dict(image_root=str(images), source_sha256=file_sha256(path), drop_empty=True)
    build_cache(coco, tmp_path / "cache", **settings)
    return tmp_path / "cache", coco, settings


def test_truncated_array_is_detected(cache_copy):
    folder, coco, settings = cache_copy
    data = (folder / "boxes.npy").read_bytes()
    (folder / "boxes.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheError, match=r"boxes.npy: corrupt or truncated"):
        AnnotationCache(folder)
    assert not is_up_to_date(folder, **settings)
    build_cache(coco, folder, **settings)  # what the stage does
    assert is_up_to_date(folder, **settings)
    assert len(AnnotationCache(folder)) == 12


def test_wrong_shape_missing_file_and_other_version_are_detected(cache_copy):
    folder, coco, settings = cache_copy
    np.save(folder / "labels.npy", np.zeros(3, dtype=np.int32))
    with pytest.raises(CacheError, match=r"labels.npy: expected <i4"):
        AnnotationCache(folder)

    build_cache(coco, folder, **settings)
    (folder / "crowd.npy").unlink()
    with pytest.raises(CacheError, match=r"crowd.npy: missing"):
        AnnotationCache(folder)

    build_cache(coco, folder, **settings)
    meta = json.loads((folder / "meta.json").read_text())
    meta["format_version"] = 0
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheError, match="cache format version 0, expected 1"):
        AnnotationCache(folder)
    assert not is_up_to_date(folder, **settings)

    (folder / "meta.json").write_text("{not json")
    with pytest.raises(CacheError, match="meta.json: corrupt"):
        AnnotationCache(folder)


def test_changed_source_or_settings_are_not_up_to_date(cache_copy):
    folder, _, settings = cache_copy
    assert is_up_to_date(folder, **settings)
    assert not is_up_to_date(folder, **{**settings, "source_sha256": "0" * 64})
    assert not is_up_to_date(folder, **{**settings, "drop_empty": False})
