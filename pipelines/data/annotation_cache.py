"""A compact annotation cache that the data loader memory-maps instead of parsing JSON.

One folder per split holds fixed-dtype ``.npy`` arrays plus ``meta.json``:

=================  ==========  ================================================================
array              dtype       meaning
=================  ==========  ================================================================
``image_ids``      int64 (N)   COCO image id, ascending
``sizes``          int32 (N,2) width, height of the stored image
``aspect_groups``  uint8 (N)   0 landscape (h < w), 1 portrait or square (maskrcnn-benchmark's bins=[1])
``name_offsets``   int64 (N+1) file name ``i`` is ``names[name_offsets[i]:name_offsets[i+1]]``
``names``          uint8       UTF-8 file names, concatenated
``box_offsets``    int64 (N+1) boxes of image ``i`` are rows ``box_offsets[i]:box_offsets[i+1]``
``boxes``          float32 M,4 x0, y0, x1, y1 in stored-image pixels
``labels``         int32 (M)   contiguous label, index into ``meta.json``'s ``categories``
``crowd``          bool (M)    COCO ``iscrowd``
=================  ==========  ================================================================

An image's boxes keep the order they have in the source JSON (the order pycocotools'
``imgToAnns`` gives). ``meta.json`` records the format version, the SHA-256 of the source JSON,
the category mapping, and each array's dtype, shape and SHA-256.

Checks, and what they read:

* every open (:class:`AnnotationCache`): format version, array list, every file's header, dtype,
  shape and length (a truncated file cannot be mapped), offsets that start at 0 and end at the
  array length. It touches a few pages, not the data (each first touch of a page is a page fault,
  so even reading the offsets would cost more than the whole open).
* ``verify=True`` (used by :func:`stale_reason`, hence by the cache stage on every run): also each
  file's SHA-256, which catches corruption that keeps sizes intact, and offsets that never
  decrease. It reads every page, which is why the data loader's opens skip it.
"""

from __future__ import annotations

import json
from itertools import chain
from operator import itemgetter
from pathlib import Path

import numpy as np

from ..errors import CacheError, DatasetError
from ..fileio import atomic_dir, file_problem, file_sha256, gc_paused, write_json
from .coco import INT32_MAX, read_annotations

FORMAT_VERSION = 3  # 2: per-array SHA-256 in meta.json; 3: no unread ``areas`` array
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
}


def build_cache(source: dict | str | Path, out_dir: str | Path, *, image_root: str, drop_empty: bool,
                source_sha256: str | None = None) -> dict:
    """Convert COCO annotations into a cache folder, written atomically (all of it or nothing).

    The input is trusted to be structurally valid, as the prepare stage writes it
    (:func:`pipelines.data.coco.validate_coco`): every annotation has ``image_id``, ``category_id``,
    ``bbox`` and ``iscrowd``; ids are integers. Dangling image or category ids, duplicate image ids,
    integers that the arrays' dtypes cannot hold and boxes that are not finite (a prepared file edited
    by hand) are still caught (cheaply) and raise :class:`DatasetError` naming the id.

    Args:
        source: path of the COCO JSON (parsed by :func:`read_annotations`, the fast way), or the
            already-parsed dict.
        out_dir: the cache folder to (re)write.
        image_root: folder that file names are relative to, stored in the metadata.
        drop_empty: drop images without a usable (non-crowd, positive-size) box, as for training.
        source_sha256: content hash of the source JSON, to know when to rebuild. Required with a
            dict; with a path it is the hash of the bytes read, and a given value must match it.

    Returns:
        The metadata written to ``meta.json``.
    """
    if isinstance(source, dict):
        if source_sha256 is None:
            raise TypeError("build_cache: source_sha256 is required when the annotations are given as a dict")
        name = "annotations"
        columns = _columns(source, name)
    else:
        name = str(source)
        with gc_paused():  # also while the parsed document is freed
            coco, sha256 = read_annotations(source)
            if source_sha256 is not None and source_sha256 != sha256:
                raise DatasetError(
                    f"{name}: changed while the cache was built (SHA-256 {sha256}, expected {source_sha256})"
                )
            source_sha256 = sha256
            columns = _columns(coco, name)
            del coco
    return _write(columns, out_dir, image_root=image_root, drop_empty=drop_empty, source_sha256=source_sha256,
                  name=name)


def _columns(coco: dict, name: str) -> dict:
    """The fields the cache keeps, as numpy columns in file order; no per-box Python objects are made."""

    def column(rows: list[dict], key: str, dtype, what: str) -> np.ndarray:
        try:
            return np.fromiter(map(itemgetter(key), rows), dtype=dtype, count=len(rows))
        except (OverflowError, TypeError, ValueError):  # a value out of the dtype's range, or not an integer
            limits = np.iinfo(dtype)
            for row in rows:
                value = row[key]
                if not isinstance(value, int) or not limits.min <= value <= limits.max:
                    raise DatasetError(f"{name}: {what} {row.get('id')!r}: '{key}' must be an integer from {limits.min} "
                                       f"to {limits.max} (the cache's {limits.dtype}), got {value!r}; run the prepare "
                                       "stage") from None
            raise

    try:
        images, anns, categories = coco["images"], coco["annotations"], coco["categories"]
        m = len(anns)
        bbox_lengths = np.fromiter(map(len, map(itemgetter("bbox"), anns)), dtype=np.int64, count=m)
        if (bbox_lengths != 4).any():
            index = int(np.flatnonzero(bbox_lengths != 4)[0])
            raise DatasetError(f"{name}: annotations[{index}]: 'bbox' must have 4 numbers; run the prepare stage")
        columns = {
            "image_ids": column(images, "id", np.int64, "image id"),
            "widths": column(images, "width", np.int64, "image id"),
            "heights": column(images, "height", np.int64, "image id"),
            "names": [im["file_name"].encode() for im in images],
            "ann_image_ids": column(anns, "image_id", np.int64, "annotation id"),
            "ann_category_ids": column(anns, "category_id", np.int64, "annotation id"),
            "crowd": column(anns, "iscrowd", np.bool_, "annotation id"),
            "xywh": np.fromiter(chain.from_iterable(map(itemgetter("bbox"), anns)), dtype=np.float64,
                                count=4 * m).reshape(m, 4),
            "categories": sorted(({"id": c["id"], "name": c["name"]} for c in categories), key=itemgetter("id")),
        }
        column(categories, "id", np.int64, "category id")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        problem = f"{type(err).__name__}: {err}"
        raise DatasetError(f"{name}: not a validated COCO file ({problem}); run the prepare stage") from None
    for key in ("widths", "heights"):  # stored as int32
        bad = np.flatnonzero((columns[key] < 1) | (columns[key] > INT32_MAX))
        if len(bad):
            raise DatasetError(f"{name}: image id {images[bad[0]]['id']}: '{key[:-1]}' must be from 1 to {INT32_MAX} "
                               f"(the cache's int32), got {int(columns[key][bad[0]])}; run the prepare stage")
    bad = np.flatnonzero(~np.isfinite(columns["xywh"]).all(axis=1))
    if len(bad):
        raise DatasetError(f"{name}: annotation id {anns[bad[0]].get('id')!r}: 'bbox' must be 4 finite numbers, got "
                           f"{anns[bad[0]]['bbox']}; run the prepare stage")
    return columns


def _lookup(sorted_ids: np.ndarray, ids: np.ndarray, name: str, what: str) -> np.ndarray:
    """Row of each of ``ids`` in ``sorted_ids``; a missing id raises :class:`DatasetError`."""
    rows = np.searchsorted(sorted_ids, ids).clip(max=max(len(sorted_ids) - 1, 0))
    missing = np.flatnonzero(sorted_ids[rows] != ids) if len(sorted_ids) else np.arange(len(ids))
    if len(missing):
        raise DatasetError(f"{name}: annotation refers to missing {what} id {int(ids[missing[0]])}")
    return rows


def _write(c: dict, out_dir: str | Path, *, image_root: str, drop_empty: bool, source_sha256: str, name: str) -> dict:
    order = np.argsort(c["image_ids"], kind="stable")
    sorted_ids = c["image_ids"][order]
    duplicate = np.flatnonzero(np.diff(sorted_ids) == 0)
    if len(duplicate):
        raise DatasetError(f"{name}: duplicate image id {int(sorted_ids[duplicate[0]])}")
    category_ids = np.array([cat["id"] for cat in c["categories"]], dtype=np.int64)
    rows = _lookup(sorted_ids, c["ann_image_ids"], name, "image")
    labels = _lookup(category_ids, c["ann_category_ids"], name, "category")
    xywh, crowd = c["xywh"], c["crowd"]

    keep = np.ones(len(sorted_ids), dtype=bool)
    if drop_empty:
        usable = ~crowd & (xywh[:, 2] > 0) & (xywh[:, 3] > 0)
        keep = np.bincount(rows[usable], minlength=len(sorted_ids)) > 0
    new_row = np.cumsum(keep) - 1
    ann_keep = keep[rows]
    ann_row = new_row[rows[ann_keep]]
    ann_order = np.flatnonzero(ann_keep)[np.argsort(ann_row, kind="stable")]  # grouped by image, file order within
    num_images = int(keep.sum())

    images = order[keep]
    names = [c["names"][i] for i in images.tolist()]
    sizes = np.stack([c["widths"][images], c["heights"][images]], axis=1).astype(np.int32).reshape(-1, 2)
    boxes = xywh[ann_order]
    arrays = {
        "image_ids": sorted_ids[keep],
        "sizes": sizes,
        "aspect_groups": (sizes[:, 1] >= sizes[:, 0]).astype(np.uint8),
        "name_offsets": np.concatenate([[0], np.cumsum(np.fromiter(map(len, names), np.int64, len(names)))]),
        "names": np.frombuffer(b"".join(names), dtype=np.uint8),
        "box_offsets": np.concatenate([[0], np.cumsum(np.bincount(ann_row, minlength=num_images))]),
        "boxes": np.concatenate([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], axis=1),  # in float64, then rounded once
        "labels": labels[ann_order],
        "crowd": crowd[ann_order],
    }
    specs = {}
    with atomic_dir(out_dir) as tmp:
        for key, dtype in ARRAYS.items():
            array = np.ascontiguousarray(arrays[key], dtype=dtype)
            np.save(tmp / f"{key}.npy", array)
            sha256 = file_sha256(tmp / f"{key}.npy")
            specs[key] = {"dtype": array.dtype.str, "shape": list(array.shape), "sha256": sha256}
        meta = {
            "format_version": FORMAT_VERSION,
            "source_sha256": source_sha256,
            "image_root": str(image_root),
            "drop_empty": drop_empty,
            "num_images": num_images,
            "num_boxes": len(ann_order),
            "categories": c["categories"],
            "arrays": specs,
        }
        write_json(tmp / "meta.json", meta)
    return meta


def _mapped_view(array: np.ndarray) -> np.ndarray:
    # A plain ndarray over the same mapping: slicing an np.memmap runs Python code on every slice,
    # slicing an ndarray does not.
    return array.view(np.ndarray)


class AnnotationCache:
    """Read-only view of a cache folder.

    Its arrays (``image_ids``, ``sizes``, ``aspect_groups``, ``boxes``, ``labels``, ``crowd``) are
    read-only ndarrays over memory-mapped files: opening reads almost nothing, and
    data-loader workers share the pages instead of copying Python objects. Pickling (e.g. for
    workers started with ``spawn``) sends only the path; the other side maps the files again.

    Args:
        path: the cache folder.
        verify: also check every file's SHA-256 (reads everything; see the module docstring).

    Raises:
        CacheError: if the cache is missing, truncated, corrupt or of another format version.
    """

    def __init__(self, path: str | Path, *, verify: bool = False):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        arrays = {}
        for name, spec in self.meta["arrays"].items():
            file = self.path / f"{name}.npy"
            if file.exists() and (problem := file_problem(file)):  # opening a FIFO would block for ever
                raise CacheError(f"{file}: {problem}; rebuild it with the cache stage")
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
            if verify and file_sha256(file) != spec["sha256"]:
                raise CacheError(
                    f"{file}: content does not match its checksum in meta.json (corrupt); rebuild it with the cache stage"
                )
            arrays[name] = _mapped_view(array)
        self.image_ids = arrays["image_ids"]
        self.sizes = arrays["sizes"]
        self.aspect_groups = arrays["aspect_groups"]
        self._name_offsets = arrays["name_offsets"]
        self._names = arrays["names"]
        self._box_offsets = arrays["box_offsets"]
        self.boxes = arrays["boxes"]
        self.labels = arrays["labels"]
        self.crowd = arrays["crowd"]
        n, m = len(self.image_ids), len(self.boxes)
        for offsets, total, what in ((self._box_offsets, m, "box_offsets"),
                                     (self._name_offsets, len(self._names), "name_offsets")):
            # Monotonic order needs every page of the offsets: checked only with ``verify``.
            ends_wrong = len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != total
            if ends_wrong or (verify and (np.diff(offsets) < 0).any()):
                raise CacheError(f"{self.path / (what + '.npy')}: offsets do not match the arrays; rebuild the cache")
        if len(self.labels) != m or len(self.crowd) != m or len(self.sizes) != n:
            raise CacheError(f"{self.path / 'meta.json'}: array lengths disagree; rebuild the cache")
        self.categories: list[dict] = self.meta["categories"]
        self.image_root = Path(self.meta["image_root"])

    def __reduce__(self):
        return AnnotationCache, (self.path,)

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

    def annotations(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(boxes xyxy float32 [K, 4], labels int32 [K], crowd bool [K])`` of one image, as read-only views."""
        start, end = self._box_offsets[index], self._box_offsets[index + 1]
        return self.boxes[start:end], self.labels[start:end], self.crowd[start:end]


def read_meta(path: str | Path) -> dict:
    """Read and check a cache's ``meta.json``; raises :class:`CacheError` if unusable."""
    file = Path(path) / "meta.json"
    if file.exists() and (problem := file_problem(file)):  # opening a FIFO would block for ever
        raise CacheError(f"{file}: {problem}; rebuild the cache")
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CacheError(f"{file}: not found; build the cache with the cache stage") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CacheError(f"{file}: corrupt ({err}); rebuild the cache") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise CacheError(f"{file}: cache format version {version!r}, expected {FORMAT_VERSION}; rebuild the cache")
    arrays = meta.get("arrays")
    if not isinstance(arrays, dict) or set(arrays) != set(ARRAYS):
        raise CacheError(f"{file}: unexpected array list; rebuild the cache")
    for name, spec in arrays.items():
        if not (isinstance(spec, dict) and isinstance(spec.get("dtype"), str) and isinstance(spec.get("shape"), list)
                and isinstance(spec.get("sha256"), str)):
            raise CacheError(f"{file}: arrays.{name}: expected dtype, shape and sha256; rebuild the cache")
    for key, kind in (("source_sha256", str), ("image_root", str), ("drop_empty", bool), ("categories", list)):
        if not isinstance(meta.get(key), kind):
            raise CacheError(f"{file}: '{key}' missing or not a {kind.__name__}; rebuild the cache")
    return meta


def stale_reason(path: str | Path, *, source_sha256: str, image_root: str, drop_empty: bool) -> str | None:
    """Why the cache at ``path`` must be (re)built, in one line; ``None`` if it is intact and current.

    Intact means readable, of this format version and matching its checksums; current means built
    from a source with this SHA-256 and with the same ``image_root`` and ``drop_empty``.
    """
    try:
        meta = AnnotationCache(path, verify=True).meta
    except CacheError as err:
        return str(err)
    if meta["source_sha256"] != source_sha256:
        return f"{path}: built from another version of the source JSON"
    if (meta["image_root"], meta["drop_empty"]) != (str(image_root), drop_empty):
        return f"{path}: built with other settings (image_root, drop_empty)"
    return None
