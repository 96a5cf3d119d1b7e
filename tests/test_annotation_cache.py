import contextlib
import io
import json
import mmap
import pickle

import numpy as np
import pytest
from pycocotools.coco import COCO

from benchmarks.coco_scale import write_coco_scale
from pipelines.data.annotation_cache import FORMAT_VERSION, AnnotationCache, build_cache, read_meta, stale_reason
from pipelines.data.coco import validate_coco
from pipelines.errors import CacheError, DatasetError
from pipelines.fileio import file_sha256


def _pycocotools(path) -> COCO:
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(path))


def _assert_matches_pycocotools(cache: AnnotationCache, json_path, *, drop_empty: bool):
    coco = _pycocotools(json_path)
    expected_ids = sorted(coco.getImgIds())
    if drop_empty:
        usable = lambda a: not a["iscrowd"] and a["bbox"][2] > 0 and a["bbox"][3] > 0  # noqa: E731
        expected_ids = [i for i in expected_ids if any(usable(a) for a in coco.imgToAnns[i])]
    assert cache.image_ids.tolist() == expected_ids
    label_of = {cat_id: k for k, cat_id in enumerate(sorted(coco.getCatIds()))}
    assert cache.category_ids == sorted(coco.getCatIds())
    for index, image_id in enumerate(expected_ids):
        info = coco.imgs[image_id]
        assert cache.sizes[index].tolist() == [info["width"], info["height"]]
        assert cache.file_name(index) == info["file_name"]
        assert cache.aspect_groups[index] == (info["height"] >= info["width"])
        anns = coco.imgToAnns[image_id]
        boxes, labels, crowd = cache.annotations(index)
        want = np.array([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)], dtype=np.float32)
        np.testing.assert_array_equal(boxes, want.reshape(-1, 4))
        assert labels.tolist() == [label_of[a["category_id"]] for a in anns]
        assert crowd.tolist() == [bool(a["iscrowd"]) for a in anns]
    assert len(cache.boxes) == sum(len(coco.imgToAnns[i]) for i in expected_ids)


@pytest.fixture(scope="module")
def coco_real_cleaned(coco_real, tmp_path_factory):
    """The real COCO sample as the prepare stage writes it: ``(cleaned JSON path, cleaned dict, images)``."""
    annotations, images = coco_real
    cleaned, _ = validate_coco(annotations, images)
    path = tmp_path_factory.mktemp("real") / "cleaned.json"
    path.write_text(json.dumps(cleaned))
    return path, cleaned, images


@pytest.fixture(scope="module")
def coco_like(tmp_path_factory):
    """A 3,000-image file from the COCO-scale generator: shuffled ids, crowd RLE, empty images, COCO's id gaps."""
    path = tmp_path_factory.mktemp("coco_like") / "instances.json"
    write_coco_scale(path, seed=5, num_images=3000, num_boxes=22000, empty_fraction=0.02, crowd_fraction=0.05)
    return path


@pytest.mark.parametrize("drop_empty", [True, False])
@pytest.mark.parametrize("from_path", [True, False], ids=["path", "dict"])
def test_round_trip_on_real_coco(coco_real_cleaned, tmp_path, drop_empty, from_path):
    path, cleaned, images = coco_real_cleaned
    source = path if from_path else cleaned
    sha = None if from_path else file_sha256(path)
    meta = build_cache(source, tmp_path / "cache", image_root=str(images), source_sha256=sha, drop_empty=drop_empty)
    assert meta["source_sha256"] == file_sha256(path)
    cache = AnnotationCache(tmp_path / "cache")
    _assert_matches_pycocotools(cache, path, drop_empty=drop_empty)
    assert len(cache) == (32 if drop_empty else 33)  # one real image has no annotations
    assert cache.crowd.any()
    assert cache.category_ids == sorted(c["id"] for c in cleaned["categories"]) and 12 not in cache.category_ids
    assert cache.image_path(0) == images / cache.file_name(0)


def test_round_trip_on_synthetic(tiny_synthetic, tiny_cache, tmp_path):
    path, images, _ = tiny_synthetic
    _assert_matches_pycocotools(tiny_cache, path, drop_empty=True)
    build_cache(path, tmp_path / "cache", image_root=str(images), drop_empty=True)
    from_path = AnnotationCache(tmp_path / "cache")
    for name in ("image_ids", "sizes", "boxes", "labels", "crowd"):
        np.testing.assert_array_equal(getattr(from_path, name), getattr(tiny_cache, name))


@pytest.mark.parametrize("drop_empty", [True, False])
def test_round_trip_on_coco_scale_generator_output(coco_like, tmp_path, drop_empty):
    build_cache(coco_like, tmp_path / "cache", image_root="images", drop_empty=drop_empty)
    cache = AnnotationCache(tmp_path / "cache")
    _assert_matches_pycocotools(cache, coco_like, drop_empty=drop_empty)
    coco = _pycocotools(coco_like)
    empty = [i for i in coco.getImgIds() if not coco.imgToAnns[i]]
    only_crowd = [i for i in coco.getImgIds() if coco.imgToAnns[i] and all(a["iscrowd"] for a in coco.imgToAnns[i])]
    assert len(empty) == 60 and only_crowd  # the generator made both kinds
    kept = set(cache.image_ids.tolist())
    if drop_empty:  # training: no image without a usable box
        assert kept.isdisjoint(empty) and kept.isdisjoint(only_crowd)
        assert all((~cache.annotations(i)[2]).any() for i in range(len(cache)))
    else:  # val: every image, empty ones with zero rows
        assert len(cache) == 3000 and set(empty) <= kept
        assert sum(1 for i in range(len(cache)) if len(cache.annotations(i)[0]) == 0) == len(empty)


def test_arrays_are_read_only_views_of_memory_mapped_files(tiny_cache):
    for array in (tiny_cache.boxes, tiny_cache.labels, tiny_cache.crowd, tiny_cache.image_ids, tiny_cache.sizes):
        base = array
        while base is not None and not isinstance(base, mmap.mmap):
            base = base.base
        assert isinstance(base, mmap.mmap), "array is not backed by a file mapping"
        assert not array.flags.writeable
    assert tiny_cache.boxes.dtype == np.float32
    boxes, labels, crowd = tiny_cache.annotations(0)
    assert type(boxes) is np.ndarray and np.shares_memory(boxes, tiny_cache.boxes)


def test_pickling_sends_the_path_and_maps_again(tiny_cache):
    data = pickle.dumps(tiny_cache)
    assert len(data) < 1000  # not the arrays
    copy = pickle.loads(data)
    np.testing.assert_array_equal(copy.boxes, tiny_cache.boxes)
    assert copy.path == tiny_cache.path


@pytest.fixture
def cache_copy(tiny_synthetic, tmp_path):
    path, images, _ = tiny_synthetic
    settings = dict(image_root=str(images), source_sha256=file_sha256(path), drop_empty=True)
    build_cache(path, tmp_path / "cache", **settings)
    return tmp_path / "cache", path, settings


def test_truncated_array_is_detected(cache_copy):
    folder, source, settings = cache_copy
    data = (folder / "boxes.npy").read_bytes()
    (folder / "boxes.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheError, match=r"boxes.npy: corrupt or truncated"):
        AnnotationCache(folder)
    assert stale_reason(folder, **settings) is not None
    build_cache(source, folder, **settings)  # what the stage does
    assert stale_reason(folder, **settings) is None
    assert len(AnnotationCache(folder)) == 12


def test_corruption_that_keeps_sizes_fails_the_checksum(cache_copy):
    folder, _, settings = cache_copy
    data = bytearray((folder / "labels.npy").read_bytes())
    data[-1] ^= 0xFF
    (folder / "labels.npy").write_bytes(bytes(data))
    AnnotationCache(folder)  # the fast open checks structure only ...
    with pytest.raises(CacheError, match=r"labels.npy: content does not match its checksum"):
        AnnotationCache(folder, verify=True)  # ... the stage's check reads everything
    assert "labels.npy" in stale_reason(folder, **settings)


def test_decreasing_offsets_are_detected(cache_copy):
    folder, _, _ = cache_copy
    offsets = np.load(folder / "box_offsets.npy")
    offsets[3], offsets[4] = offsets[4], offsets[3]
    np.save(folder / "box_offsets.npy", offsets)
    AnnotationCache(folder)  # sizes and ends are right: only the full check sees it
    with pytest.raises(CacheError, match=r"box_offsets.npy: content does not match its checksum"):
        AnnotationCache(folder, verify=True)
    meta = json.loads((folder / "meta.json").read_text())
    meta["arrays"]["box_offsets"]["sha256"] = file_sha256(folder / "box_offsets.npy")
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheError, match=r"box_offsets.npy: offsets do not match"):
        AnnotationCache(folder, verify=True)
    offsets[-1] += 1
    np.save(folder / "box_offsets.npy", offsets)
    with pytest.raises(CacheError, match=r"box_offsets.npy: offsets do not match"):
        AnnotationCache(folder)


def test_wrong_shape_missing_file_and_other_version_are_detected(cache_copy):
    folder, source, settings = cache_copy
    np.save(folder / "labels.npy", np.zeros(3, dtype=np.int32))
    with pytest.raises(CacheError, match=r"labels.npy: expected <i4"):
        AnnotationCache(folder)

    build_cache(source, folder, **settings)
    (folder / "crowd.npy").unlink()
    with pytest.raises(CacheError, match=r"crowd.npy: missing"):
        AnnotationCache(folder)

    for version in (0, FORMAT_VERSION - 1, FORMAT_VERSION + 1):
        build_cache(source, folder, **settings)
        meta = json.loads((folder / "meta.json").read_text())
        meta["format_version"] = version
        (folder / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CacheError, match=f"cache format version {version}, expected {FORMAT_VERSION}"):
            AnnotationCache(folder)
        assert stale_reason(folder, **settings) is not None

    (folder / "meta.json").write_text("{not json")
    with pytest.raises(CacheError, match="meta.json: corrupt"):
        AnnotationCache(folder)

    build_cache(source, folder, **settings)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["arrays"]["boxes"]["sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheError, match=r"arrays.boxes: expected dtype, shape and sha256"):
        read_meta(folder)


def test_changed_source_or_settings_are_not_up_to_date(cache_copy):
    folder, _, settings = cache_copy
    assert stale_reason(folder, **settings) is None
    assert "another version of the source" in stale_reason(folder, **{**settings, "source_sha256": "0" * 64})
    assert stale_reason(folder, **{**settings, "drop_empty": False}) is not None


def test_a_failed_build_leaves_the_old_cache_alone(cache_copy, tmp_path):
    folder, source, settings = cache_copy
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    coco = json.loads(source.read_text())
    coco["annotations"][0]["category_id"] = 999
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(coco))
    with pytest.raises(DatasetError, match=r"broken.json: annotation refers to missing category id 999"):
        build_cache(broken, folder, image_root=settings["image_root"], drop_empty=True)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".cache")] == []


def test_build_reports_bad_input_naming_the_file(tiny_synthetic, tmp_path):
    path, _, coco = tiny_synthetic
    out = tmp_path / "cache"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DatasetError, match=r"bad.json: not valid JSON"):
        build_cache(bad, out, image_root="x", drop_empty=True)
    with pytest.raises(DatasetError, match=r"missing.json: annotation file not found"):
        build_cache(tmp_path / "missing.json", out, image_root="x", drop_empty=True)

    dangling = json.loads(path.read_text())
    dangling["annotations"][0]["image_id"] = 424242
    bad.write_text(json.dumps(dangling))
    with pytest.raises(DatasetError, match=r"bad.json: annotation refers to missing image id 424242"):
        build_cache(bad, out, image_root="x", drop_empty=True)

    duplicate = json.loads(path.read_text())
    duplicate["images"][1]["id"] = duplicate["images"][0]["id"]
    bad.write_text(json.dumps(duplicate))
    with pytest.raises(DatasetError, match=r"bad.json: duplicate image id"):
        build_cache(bad, out, image_root="x", drop_empty=True)

    no_crowd = json.loads(path.read_text())
    del no_crowd["annotations"][2]["iscrowd"]
    bad.write_text(json.dumps(no_crowd))
    with pytest.raises(DatasetError, match=r"bad.json: not a validated COCO file \(KeyError: 'iscrowd'\)"):
        build_cache(bad, out, image_root="x", drop_empty=True)

    short_box = json.loads(path.read_text())
    short_box["annotations"][3]["bbox"] = [1.0, 2.0, 3.0]
    bad.write_text(json.dumps(short_box))
    with pytest.raises(DatasetError, match=r"bad.json: annotations\[3\]: 'bbox' must have 4 numbers"):
        build_cache(bad, out, image_root="x", drop_empty=True)

    with pytest.raises(DatasetError, match=r"changed while the cache was built"):
        build_cache(path, out, image_root="x", drop_empty=True, source_sha256="0" * 64)
    with pytest.raises(TypeError, match="source_sha256 is required"):
        build_cache(coco, out, image_root="x", drop_empty=True)
    assert not out.exists()



@pytest.mark.slow
def test_round_trip_at_coco_scale(tmp_path):
    """The full 118,287-image, 860,001-box file against pycocotools, compared as whole arrays (about 15 s)."""
    source = tmp_path / "instances.json"
    write_coco_scale(source, seed=0)
    build_cache(source, tmp_path / "cache", image_root="images", drop_empty=False)
    cache = AnnotationCache(tmp_path / "cache", verify=True)
    coco = _pycocotools(source)
    ids = sorted(coco.getImgIds())
    assert cache.image_ids.tolist() == ids and len(ids) == 118_287
    assert cache.sizes.tolist() == [[coco.imgs[i]["width"], coco.imgs[i]["height"]] for i in ids]
    anns = [a for i in ids for a in coco.imgToAnns[i]]
    assert len(anns) == 860_001 and np.diff(cache._box_offsets).tolist() == [len(coco.imgToAnns[i]) for i in ids]
    xywh = np.array([a["bbox"] for a in anns], dtype=np.float64)
    np.testing.assert_array_equal(cache.boxes, np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1).astype(np.float32))
    label_of = {cat_id: k for k, cat_id in enumerate(sorted(coco.getCatIds()))}
    assert cache.labels.tolist() == [label_of[a["category_id"]] for a in anns]
    assert cache.crowd.tolist() == [bool(a["iscrowd"]) for a in anns]
    assert 0 < cache.crowd.sum() < len(anns) and (np.diff(cache._box_offsets) == 0).sum() == 1021
