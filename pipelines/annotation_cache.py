"""A compact annotation cache that the data loader memory-maps instead of parsing JSON.

One folder per split holds fixed-dtype ``.npy`` arrays plus ``meta.json``:

=================  ==========  ================================================================
array              dtype       meaning
=================  ==========  ================================================================
``image_ids``      int64 (N)   COCO image id
``sizes``          int32 (N,2) width, height of the stored image
``aspect_groups``  uint8 (N)   0 landscape (h < w), 1 portrait or square (the seed's bins=[1])
``name_offsets``   int64 (N+1) file name ``i`` is ``names[name_offsets[i]:name_offsets[i+1]]``
``names``          uint8       UTF-8 file names, concatenated
``box_offsets``    int64 (N+1) boxes of image ``i`` are rows ``box_offsets[i]:box_offsets[i+1]``
``boxes``          float32 M,4 x0, y0, x1, y1 in stored-image pixels
``labels``         int32 (M)   contiguous label, index into ``meta.json``'s ``categories``
``crowd``          bool (M)    COCO ``iscrowd``
``areas``          float32 (M) COCO ``area`` (segment area; used for the scale buckets)
=================  ==========  ================================================================

Opening a cache checks its format version and every array's dtype and shape against
``meta.json``, so a truncated, corrupt or outdated cache raises :class:`CacheError` instead of being
used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .errors import CacheError
from .fileio import atomic_dir, write_json

FORMAT_VERSION = 1
ARRAYS = {
    "image_ids": np.int64,
    "sizes": np.int32,
    "aspect_groups": np.uint8,
    "name_offsets": np.int64,
    "names": np.uint8,
    "box_offsets": np.int64,
    "boxes": np.float32,
    "labels": np.int32,
    "crowd": np.bool_,
    "areas": np.float32,
}


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_cache(coco: dict, out_dir: str | Path, *, image_root: str, source_sha256: str, drop_empty: bool) -> dict:
    """Convert validated COCO annotations into a cache folder (written atomically).

    Args:
        coco: annotations as returned by :func:`pipelines.coco.validate_coco`.
        out_dir: the cache folder to (re)write.
        image_root: folder that file names are relative to, stored in the metadata.
        source_sha256: content hash of the source JSON, to know when to rebuild.
        drop_empty: drop images without a usable (non-crowd, positive-size) box, as for training.

    Returns:
        The metadata written to ``meta.json``.
    """
    categories = sorted(coco["categories"], key=lambda c: c["id"])
    label_of = {c["id"]: k for k, c in enumerate(categories)}

    anns_by_image: dict[int, list[dict]] = {}
    for ann in coco["annotations"]:
        anns_by_image.setdefault(ann["image_id"], []).append(ann)

    images = sorted(coco["images"], key=lambda im: im["id"])
    if drop_empty:
        images = [im for im in images if any(_usable(a) for a in anns_by_image.get(im["id"], ()))]

    names = [im["file_name"].encode() for im in images]
    per_image = [anns_by_image.get(im["id"], []) for im in images]
    anns = [a for group in per_image for a in group]
    xywh = np.array([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4)
    sizes = np.array([(im["width"], im["height"]) for im in images], dtype=np.int32).reshape(-1, 2)
    arrays = {
        "image_ids": np.array([im["id"] for im in images], dtype=np.int64),
        "sizes": sizes,
        "aspect_groups": (sizes[:, 1] >= sizes[:, 0]).astype(np.uint8),
        "name_offsets": np.concatenate([[0], np.cumsum([len(n) for n in names])]).astype(np.int64),
        "names": np.frombuffer(b"".join(names), dtype=np.uint8),
        "box_offsets": np.concatenate([[0], np.cumsum([len(g) for g in per_image])]).astype(np.int64),
        "boxes": np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1).astype(np.float32),
        "labels": np.array([label_of[a["category_id"]] for a in anns], dtype=np.int32),
        "crowd": np.array([bool(a["iscrowd"]) for a in anns], dtype=np.bool_),
        "areas": np.array([a["area"] for a in anns], dtype=np.float32),
    }
    meta = {
        "format_version": FORMAT_VERSION,
        "source_sha256": source_sha256,
        "image_root": str(image_root),
        "drop_empty": drop_empty,
        "num_images": len(images),
        "num_boxes": len(anns),
        "categories": [{"id": c["id"], "name": c["name"]} for c in categories],
        "arrays": {name: {"dtype": np.dtype(ARRAYS[name]).str, "shape": list(arrays[name].shape)} for name in ARRAYS},
    }
    with atomic_dir(out_dir) as tmp:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array, dtype=ARRAYS[name]))
        write_json(tmp / "meta.json", meta)
    return meta


def _usable(ann: dict) -> bool:
    return not ann["iscrowd"] and ann["bbox"][2] > 0 and ann["bbox"][3] > 0


class AnnotationCache:
    """Read-only view of a cache folder; arrays are memory-mapped, so worker processes share pages."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        arrays = {}
        for name, spec in self.meta["arrays"].items():
            file = self.path / f"{name}.npy"
            try:
                array = np.load(file, mmap_mode="r")
            except FileNotFoundError:
                raise CacheError(f"{file}: missing from the cache; rebuild it with the cache stage") from None
            except (ValueError, OSError) as err:
                raise CacheError(f"{file}: corrupt or truncated ({err}); rebuild it with the cache stage") from None
            if array.dtype.str != spec["dtype"] or list(array.shape) != spec["shape"]:
                raise CacheError(
                    f"{file}: expected {spec['dtype']} {spec['shape']}, found {array.dtype.str} {list(array.shape)}; "
                    "rebuild it with the cache stage"
                )
            arrays[name] = array
        self.image_ids = arrays["image_ids"]
        self.sizes = arrays["sizes"]
        self.aspect_groups = arrays["aspect_groups"]
        self._name_offsets = arrays["name_offsets"]
        self._names = arrays["names"]
        self._box_offsets = arrays["box_offsets"]
        self.boxes = arrays["boxes"]
        self.labels = arrays["labels"]
        self.crowd = arrays["crowd"]
        self.areas = arrays["areas"]
        n, m = len(self.image_ids), len(self.boxes)
        for offsets, total, what in ((self._box_offsets, m, "box_offsets"), (self._name_offsets, len(self._names), "name_offsets")):
            if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != total:
                raise CacheError(f"{self.path / (what + '.npy')}: offsets do not match the arrays; rebuild the cache")
        self.categories: list[dict] = self.meta["categories"]
        self.image_root = Path(self.meta["image_root"])

    def __len__(self) -> int:
        return len(self.image_ids)

    @property
    def category_ids(self) -> list[int]:
        """JSON category id of each contiguous label."""
        return [c["id"] for c in self.categories]

    def file_name(self, index: int) -> str:
        start, end = self._name_offsets[index], self._name_offsets[index + 1]
        return bytes(self._names[start:end]).decode()

    def image_path(self, index: int) -> Path:
        return self.image_root / self.file_name(index)

    def size(self, index: int) -> tuple[int, int]:
        """``(width, height)`` of the stored image."""
        width, height = self.sizes[index]
        return int(width), int(height)

    def annotations(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(boxes xyxy float32 [K, 4], labels int32 [K], crowd bool [K])`` of one image, as views."""
        start, end = self._box_offsets[index], self._box_offsets[index + 1]
        return self.boxes[start:end], self.labels[start:end], self.crowd[start:end]


def read_meta(path: str | Path) -> dict:
    """Read and check a cache's ``meta.json``; raises :class:`CacheError` if unusable."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CacheError(f"{file}: not found; build the cache with the cache stage") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CacheError(f"{file}: corrupt ({err}); rebuild the cache") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise CacheError(f"{file}: cache format version {version!r}, expected {FORMAT_VERSION}; rebuild the cache")
    if set(meta.get("arrays", {})) != set(ARRAYS):
        raise CacheError(f"{file}: unexpected array list; rebuild the cache")
    return meta


def is_up_to_date(path: str | Path, *, source_sha256: str, image_root: str, drop_empty: bool) -> bool:
    """True if ``path`` holds a readable cache of this format built from the same source and settings."""
    try:
        meta = AnnotationCache(path).meta
    except CacheError:
        return False
    return (meta["source_sha256"], meta["image_root"], meta["drop_empty"]) == (source_sha256, str(image_root), drop_empty)
