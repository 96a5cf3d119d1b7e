"""COCO-format annotation I/O and validation.

:func:`read_annotations` is the one COCO JSON reader (orjson, collector paused), used by validation
and by the annotation cache.

:func:`validate_coco` checks an annotation file and its image folder and returns a cleaned copy
plus a summary. Structural problems (bad JSON, duplicate ids, a key written twice in one object, one
image file under two ids, one category name under two ids, dangling references, an empty split,
missing, undecodable or mis-sized images, images above ``dataset.max_image_pixels``, special files
(a FIFO, a device, a folder) where an image or the JSON should be, file names or symlinks that escape
the image folder, a training split without a usable box, integers that the annotation cache's numpy
dtypes or COCO evaluation cannot hold, numbers that are not finite) raise :class:`DatasetError`
naming the file and the offending id; so do more images than ``dataset.max_damaged_images`` that the
decoder decodes through damage (:mod:`.damage`), which up to it are named in a warning, as are
annotations that repeat another's image, category and box. Box problems are repaired or dropped and
counted: boxes slightly outside the image are clipped, degenerate boxes and boxes mostly outside the
image are rejected.

Each image's size is read from its header (:func:`pipelines.data.decode.read_image_header`, no
pixels read) and checked against the pixel limit and the JSON before anything decodes it: a
decompression bomb (a 100 KB PNG of 30000 x 30000 pixels) is refused before a pixel is decoded. The
data loader checks the header against the annotation cache the same way, so no image bigger than the
limit is ever decoded. Images are then decoded by :func:`pipelines.data.decode.decode_image`, the
decoder training uses. The decoder module is imported only when images are checked: the cache stage
imports this module for :func:`read_annotations` alone and so never loads torch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import orjson
from tqdm import tqdm

from ..config.schema import INT64_MAX, INT64_MIN
from ..errors import DatasetError, ImageError
from ..fileio import file_problem, gc_paused
from .damage import DecoderMessages, named_files, png_problem
from .json_keys import repeated_key

log = logging.getLogger(__name__)

# COCO's area ranges for the small / medium / large buckets.
SMALL_AREA = 32**2
LARGE_AREA = 96**2
MIN_INSIDE_FRACTION = 0.5  # a box with less of its area inside the image is rejected
# torchvision's decoders release the GIL, so threads decode in parallel: one per core, plus two to keep
# the cores busy while other threads wait for file reads.
DECODE_THREADS = min(32, len(os.sched_getaffinity(0)) + 2) if hasattr(os, "sched_getaffinity") else 4
# Images above this many pixels are decoded one at a time: the threads' peak memory is then about
# DECODE_THREADS x 48 MB plus one image at the limit (768 MB at 2**28), not DECODE_THREADS of those.
ONE_AT_A_TIME_PIXELS = 2**24
# dataset.max_image_pixels in conf/dataset/*.yaml; the default of a caller that passes none.
MAX_IMAGE_PIXELS = 2**28  # 256 megapixels, 16384 x 16384
# What crosses into numpy: the annotation cache stores image and category ids as int64 (the bounds
# config uses for every integer param) and sizes as int32; COCO evaluation (pycocotools,
# faster-coco-eval) keeps annotation ids in arrays where 0 means "unmatched" (an annotation with id 0
# silently scores as missed) and faster-coco-eval's are int64.
INT32_MAX = 2**31 - 1


def read_annotations(path: str | Path, *, unique_keys: bool = False) -> tuple[dict, str]:
    """Read and parse a COCO JSON file in one pass (orjson, collector paused); with ``unique_keys``, also
    refuse an object that writes a key twice (the parser would keep the last silently).

    Returns:
        ``(annotations, sha256)``: the parsed object and the SHA-256 of exactly the bytes parsed.

    Raises:
        DatasetError: if the file is missing, unreadable or is not a JSON object (or writes a key twice).
    """
    path = Path(path)
    if path.exists() and not path.is_dir() and (problem := file_problem(path)):  # a folder fails at once below
        raise DatasetError(f"{path}: cannot read the annotation file: {problem}")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: annotation file not found") from None
    except OSError as err:  # a folder, no permission
        raise DatasetError(f"{path}: cannot read the annotation file ({err.strerror or err})") from None
    sha256 = hashlib.sha256(data).hexdigest()
    with gc_paused():
        try:
            coco = orjson.loads(data)
        except orjson.JSONDecodeError as err:
            raise DatasetError(f"{path}: not valid JSON ({err}{_not_a_number(data, err.pos)})") from None
        if unique_keys and (twice := repeated_key(data, coco)):
            raise DatasetError(f"{path}: {twice}; expected each key once in an object (a JSON reader keeps only the "
                               "last)")
    if not isinstance(coco, dict):
        raise DatasetError(f"{path}: expected a JSON object with images, annotations and categories")
    return coco, sha256


def _not_a_number(data: bytes, pos: int | None) -> str:
    """A hint when JSON parsing stopped at ``NaN`` or ``Infinity`` (which Python's json.dump writes)."""
    if pos is not None and data[pos:pos + 9].lstrip(b"-").startswith((b"NaN", b"Infinity")):
        return "; numbers must be finite: NaN and Infinity are not JSON"
    return ""


def validate_coco(annotations_path: str | Path, image_dir: str | Path, *, require_boxes: bool = False,
                  max_image_pixels: int = MAX_IMAGE_PIXELS, max_damaged_images: int = 0) -> tuple[dict, dict]:
    """Validate a COCO annotation file against its image folder.

    Every image is decoded in full (in parallel threads, by :func:`pipelines.data.decode.decode_image`,
    the decoder training uses) to check that the file exists inside the image folder (symlinks
    included), decodes, and has the size the JSON states.

    Args:
        annotations_path: the COCO JSON.
        image_dir: the folder that ``file_name`` entries are relative to.
        require_boxes: the split is for training: at least one box must remain that is not a crowd
            region.
        max_image_pixels: the most pixels an image may have (``dataset.max_image_pixels``), checked
            from its header before it is decoded.
        max_damaged_images: the most images the decoder may find damaged and decode through
            (``dataset.max_damaged_images``); up to it they are kept and named in one warning.

    Returns:
        ``(cleaned, summary)``: the annotations with repaired boxes (rejected ones removed, ``area``
        and ``iscrowd`` filled in) and a summary of counts for a metrics file.

    Raises:
        DatasetError: on any structural problem, naming the file and the offending id.
    """
    path = Path(annotations_path)
    data, _ = read_annotations(path, unique_keys=True)
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise DatasetError(f"{path}: '{key}' must be a list")
    if not data["images"]:
        raise DatasetError(f"{path}: no images: the split is empty")

    images = [_check_image_entry(path, i, entry) for i, entry in enumerate(data["images"])]
    categories = [_check_category_entry(path, i, entry) for i, entry in enumerate(data["categories"])]
    _no_duplicates(path, "image", [im["id"] for im in images])
    _no_duplicates(path, "category", [c["id"] for c in categories])
    named: dict[str, int] = {}
    for c in categories:
        if (first := named.setdefault(c["name"], c["id"])) != c["id"]:
            raise DatasetError(f"{path}: category ids {first} and {c['id']} both have the name {_brief(c['name'])}; "
                               "expected one id per category")
    # Only integer ids here: any other id is reported with its entry below.
    annotation_ids = [a["id"] for a in data["annotations"] if isinstance(a, dict) and _is_int(a.get("id"))]
    _no_duplicates(path, "annotation", annotation_ids)

    image_by_id = {im["id"]: im for im in images}
    category_ids = {c["id"] for c in categories}
    for im in images:
        _check_file_name(path, im)
    damaged = _check_image_files(path, Path(image_dir), images, max_image_pixels)
    if damaged:
        what = f"{len(damaged)} image{'s' * (len(damaged) > 1)} the decoder found damaged ({damaged[0][2]}): " \
            f"{named_files([(file, image_id) for file, image_id, _ in damaged])}"
        if len(damaged) > max_damaged_images:
            raise DatasetError(f"{path}: {what}; expected at most dataset.max_damaged_images ({max_damaged_images}): "
                               "replace them, or raise that param to train on them as they decode")
        log.warning("%s: %s; kept, as dataset.max_damaged_images (%d) allows", path, what, max_damaged_images)

    counts: Counter[str] = Counter()
    kept, boxes, repeats = [], {}, []
    for i, ann in enumerate(data["annotations"]):
        ann = _check_annotation_entry(path, i, ann)
        if ann["image_id"] not in image_by_id:
            raise DatasetError(f"{path}: annotation id {ann['id']}: refers to missing image id {ann['image_id']!r}")
        if ann["category_id"] not in category_ids:
            raise DatasetError(
                f"{path}: annotation id {ann['id']}: refers to missing category id {ann['category_id']!r}"
            )
        image = image_by_id[ann["image_id"]]
        verdict, box = _repair_box(ann["bbox"], image["width"], image["height"])
        counts[verdict] += 1
        if verdict.startswith("rejected"):
            continue
        ann["bbox"] = box
        kept.append(ann)
        said = (ann["image_id"], ann["category_id"], ann["iscrowd"], *box)
        if (first := boxes.setdefault(said, ann["id"])) != ann["id"]:
            repeats.append((ann["id"], first))
    if repeats:
        log.warning("%s: %d annotation(s) repeat the image, category and box of another (annotation id %d repeats id "
                    "%d); kept, each counts as an object", path, len(repeats), *repeats[0])

    if require_boxes and not any(not ann["iscrowd"] for ann in kept):
        crowd = sum(ann["iscrowd"] for ann in kept)
        rejected = counts["rejected_degenerate"] + counts["rejected_outside"]
        raise DatasetError(f"{path}: no usable box to train on ({len(data['annotations'])} annotations: "
                           f"{crowd} crowd, {rejected} rejected)")

    cleaned = {
        "info": data.get("info", {}),
        "licenses": data.get("licenses", []),
        "images": images,
        "annotations": kept,
        "categories": categories,
    }
    return cleaned, summarize(cleaned, box_counts=counts)


def summarize(coco: dict, *, box_counts: Counter | None = None) -> dict:
    """Counts of images, annotations, crowd regions, per category and per COCO scale bucket."""
    names = {c["id"]: c["name"] for c in coco["categories"]}
    per_category = Counter({name: 0 for name in names.values()})
    per_scale = Counter({"small": 0, "medium": 0, "large": 0})
    with_boxes = set()
    crowd = 0
    for ann in coco["annotations"]:
        if ann["iscrowd"]:
            crowd += 1
            continue
        with_boxes.add(ann["image_id"])
        per_category[names[ann["category_id"]]] += 1
        area = ann["area"]
        per_scale["small" if area < SMALL_AREA else "medium" if area < LARGE_AREA else "large"] += 1
    box_counts = box_counts or Counter()
    return {
        "images": len(coco["images"]),
        "images_without_boxes": len(coco["images"]) - len(with_boxes),
        "annotations": len(coco["annotations"]),
        "crowd": crowd,
        "boxes_clipped": box_counts["clipped"],
        "boxes_rejected_degenerate": box_counts["rejected_degenerate"],
        "boxes_rejected_outside": box_counts["rejected_outside"],
        "per_category": dict(per_category),
        "per_scale": dict(per_scale),
    }


def _brief(value, limit: int = 80) -> str:
    """``repr(value)``, shortened to ``limit`` characters (a message stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_image_entry(path: Path, index: int, entry) -> dict:
    if not isinstance(entry, dict) or not _is_int(entry.get("id")):
        raise DatasetError(f"{path}: images[{index}]: expected an object with an integer 'id'")
    image_id = entry["id"]
    _check_int64(path, f"image id {image_id}", "id", image_id, INT64_MIN, "the annotation cache's int64 image ids")
    if not isinstance(entry.get("file_name"), str) or not entry["file_name"]:
        raise DatasetError(f"{path}: image id {image_id}: 'file_name' must be a non-empty string")
    for key in ("width", "height"):
        if not _is_int(entry.get(key)) or entry[key] <= 0:
            raise DatasetError(
                f"{path}: image id {image_id}: '{key}' must be a positive integer, got {_brief(entry.get(key))}"
            )
        if entry[key] > INT32_MAX:
            raise DatasetError(f"{path}: image id {image_id}: '{key}' must be at most {INT32_MAX} (the annotation "
                               f"cache's int32 sizes), got {entry[key]}")
    return {"id": image_id, "file_name": entry["file_name"], "width": entry["width"], "height": entry["height"]}


def _check_category_entry(path: Path, index: int, entry) -> dict:
    if not isinstance(entry, dict) or not _is_int(entry.get("id")):
        raise DatasetError(f"{path}: categories[{index}]: expected an object with an integer 'id'")
    _check_int64(path, f"category id {entry['id']}", "id", entry["id"], INT64_MIN,
                 "the annotation cache's int64 category ids")
    if not isinstance(entry.get("name"), str):
        raise DatasetError(f"{path}: category id {entry['id']}: 'name' must be a string")
    return {"id": entry["id"], "name": entry["name"], "supercategory": entry.get("supercategory", "")}


def _check_annotation_entry(path: Path, index: int, entry) -> dict:
    if not isinstance(entry, dict) or not _is_int(entry.get("id")):
        raise DatasetError(f"{path}: annotations[{index}]: expected an object with an integer 'id'")
    ann_id = entry["id"]
    _check_int64(path, f"annotation id {ann_id}", "id", ann_id, 1,
                 "COCO evaluation, where 0 means an unmatched annotation and ids are int64")
    for key in ("image_id", "category_id"):
        if not _is_int(entry.get(key)):
            raise DatasetError(
                f"{path}: annotation id {ann_id}: '{key}' must be an integer, got {_brief(entry.get(key))}"
            )
    bbox = entry.get("bbox")
    if not isinstance(bbox, list) or len(bbox) != 4 or not all(_is_number(v) for v in bbox):
        raise DatasetError(
            f"{path}: annotation id {ann_id}: 'bbox' must be a list of 4 numbers [x, y, w, h], got {_brief(bbox)}"
        )
    if not all(math.isfinite(v) for v in bbox):
        raise DatasetError(f"{path}: annotation id {ann_id}: 'bbox' must be 4 finite numbers, got {_brief(bbox)}")
    iscrowd = entry.get("iscrowd", 0)
    if iscrowd not in (0, 1):
        raise DatasetError(f"{path}: annotation id {ann_id}: 'iscrowd' must be 0 or 1, got {_brief(iscrowd)}")
    area = entry.get("area")
    if area is None:
        area = float(bbox[2]) * float(bbox[3])
        if not math.isfinite(area):
            raise DatasetError(f"{path}: annotation id {ann_id}: 'area' missing and the box's w x h is not finite, "
                               f"got {_brief(bbox)}")
    elif not _is_number(area) or area < 0:
        raise DatasetError(f"{path}: annotation id {ann_id}: 'area' must be a number >= 0, got {_brief(area)}")
    elif not math.isfinite(float(area)):
        raise DatasetError(f"{path}: annotation id {ann_id}: 'area' must be a finite number, got {_brief(area)}")
    cleaned = {
        "id": ann_id,
        "image_id": entry["image_id"],
        "category_id": entry["category_id"],
        "bbox": [float(v) for v in bbox],
        "area": float(area),
        "iscrowd": int(iscrowd),
    }
    if "segmentation" in entry:
        cleaned["segmentation"] = entry["segmentation"]
    return cleaned


def _check_int64(path: Path, where: str, key: str, value: int, low: int, used_by: str) -> None:
    """``value`` (an int) must lie in ``low`` .. 2**63-1, the range of ``used_by``."""
    if not low <= value <= INT64_MAX:
        raise DatasetError(f"{path}: {where}: '{key}' must be from {low} to {INT64_MAX} ({used_by}), got {value}")


def _no_duplicates(path: Path, what: str, ids: list) -> None:
    seen = set()
    for value in ids:
        if value in seen:
            raise DatasetError(f"{path}: duplicate {what} id {value}")
        seen.add(value)


def _check_file_name(path: Path, image: dict) -> None:
    name = image["file_name"]
    if any(ord(c) < 32 or ord(c) == 127 for c in name):  # NUL, newline, ...: no file system or message takes them
        raise DatasetError(
            f"{path}: image id {image['id']}: file_name {_brief(name, 120)} contains a control character"
        )
    parts = PurePosixPath(name.replace("\\", "/"))
    if parts.is_absolute() or os.path.isabs(name) or ".." in parts.parts:
        raise DatasetError(
            f"{path}: image id {image['id']}: file_name {_brief(name, 120)} escapes the image folder "
            "(expected a relative path without '..')"
        )


def _check_image_files(path: Path, image_dir: Path, images: list[dict],
                       max_image_pixels: int) -> list[tuple[Path, int, str]]:
    """Check every image's header, then decode it, in threads; raise on the first problem in the JSON's order.
    Returns the images the decoder found damaged but decoded through: ``(file, image id, its line)``.

    torchvision's decoders release the GIL while they decode, so a pure-Python thread runs at full
    speed while another thread decodes: the threads check and decode in parallel.
    """
    # Imported here, not at the top: the cache stage imports this module for read_annotations alone
    # and never needs torch.
    from .decode import decode_image, read_image_header, size_mismatch, too_many_pixels

    if not image_dir.is_dir():
        raise DatasetError(f"{image_dir}: image folder not found (for {path})")
    root = Path(os.path.realpath(image_dir))
    large = threading.Lock()

    def problem(image: dict) -> tuple[Path, str | None, Path, bool]:
        file = image_dir / image["file_name"]
        real = Path(os.path.realpath(file))
        if real != root and not real.is_relative_to(root):
            return file, f"links to {real}, outside the image folder {root}", real, False
        if text := file_problem(file):
            return file, text, real, False
        header = read_image_header(file)  # sizes from the header: nothing too large is decoded
        if header is not None:
            text = too_many_pixels(header, max_image_pixels) or \
                size_mismatch(header, file, image["width"], image["height"], path.name)
            if text:
                return file, text, real, False
        try:
            if text := png_problem(file):  # libpng would end the process on it
                return file, text, real, False
            with large if header is None or header.pixels > ONE_AT_A_TIME_PIXELS else contextlib.nullcontext():
                pixels, wrote = messages.decode(functools.partial(decode_image, file))
            height, width = pixels.shape[-2:]
        except ImageError as err:
            return file, err.reason or str(err), real, False
        if (width, height) != (image["width"], image["height"]):
            text = f"file is {width}x{height} but {path.name} says {image['width']}x{image['height']}"
            return file, text, real, False
        return file, None, real, wrote

    with DecoderMessages() as messages, tqdm(total=len(images), file=messages.stream, desc=f"check {path.name}",
                                             unit="img", mininterval=2.0, disable=len(images) < 1000) as bar:
        pool = ThreadPoolExecutor(max_workers=DECODE_THREADS)
        try:
            results = pool.map(problem, images)
            first_of: dict[Path, int] = {}
            suspects = []
            for image, (file, text, real, wrote) in zip(images, results):
                bar.update()
                if text:
                    raise DatasetError(f"{file}: image id {image['id']}: {text}")
                if (first := first_of.setdefault(real, image["id"])) != image["id"]:
                    raise DatasetError(f"{path}: image ids {first} and {image['id']} name the same file {file}; "
                                       "expected one entry per image, holding all its boxes")
                if wrote:
                    suspects.append((file, image["id"]))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # on an error, skip the images not yet started
        return [(file, image_id, line) for file, image_id in suspects
                if (line := messages.damage(functools.partial(decode_image, file)))]


def _repair_box(bbox: list[float], width: int, height: int) -> tuple[str, list[float]]:
    """Return ``(verdict, box)``: ``ok``, ``clipped``, ``rejected_degenerate`` or ``rejected_outside``."""
    x, y, w, h = bbox
    if not all(math.isfinite(v) for v in bbox) or w <= 0 or h <= 0:
        return "rejected_degenerate", bbox
    x0, y0 = max(x, 0.0), max(y, 0.0)
    x1, y1 = min(x + w, float(width)), min(y + h, float(height))
    if x1 <= x0 or y1 <= y0 or (x1 - x0) * (y1 - y0) < MIN_INSIDE_FRACTION * w * h:
        return "rejected_outside", bbox
    if (x0, y0, x1, y1) == (x, y, x + w, y + h):
        return "ok", bbox
    return "clipped", [x0, y0, x1 - x0, y1 - y0]
