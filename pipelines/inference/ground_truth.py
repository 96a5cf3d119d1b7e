"""A COCO ground truth for predict's inputs (``--coco-gt``): image ids by file name, and the 12 COCO figures.

An input takes the id of the ground-truth image whose ``file_name`` is its relative path, or, failing that,
the one image whose ``file_name`` and the input's relative path end alike (``val/0001.jpg`` and
``0001.jpg``). Predictions are scored on the ground-truth images among the inputs only, so a folder that
holds part of a split is scored on that part.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path, PurePosixPath

from ..data.coco import read_annotations
from ..errors import CheckpointError, DatasetError
from ..evaluation import CocoMetrics, coco_evaluate

log = logging.getLogger(__name__)


class GroundTruth:
    """The COCO annotation file at ``path`` (its images, annotations and categories)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        data, _ = read_annotations(self.path)
        if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("images", "categories")):
            raise DatasetError(f"{self.path}: expected a COCO annotation file (an object with 'images' and "
                               "'categories' lists)")
        self.data = data
        self._by_name: dict[str, int] = {}
        for index, image in enumerate(data["images"]):
            if not (isinstance(image, dict) and isinstance(image.get("id"), int)
                    and isinstance(image.get("file_name"), str) and image["file_name"]):
                raise DatasetError(f"{self.path}: images[{index}]: expected an object with an integer 'id' and a "
                                   "'file_name'")
            self._by_name[PurePosixPath(image["file_name"]).as_posix()] = image["id"]
        self.max_id = max([image["id"] for image in data["images"]], default=0)
        self.matched: set[int] = set()
        self._given: dict[int, str] = {}  # image id -> the input that took it

    def check_categories(self, categories: list[dict], model: str) -> None:
        """Raise unless the ground truth has the categories the model was trained on (ids and names)."""
        ours = {(int(c["id"]), str(c["name"])) for c in categories}
        theirs = {(c.get("id"), c.get("name")) for c in self.data["categories"] if isinstance(c, dict)}
        if ours != theirs:
            raise CheckpointError(f"{model}: trained on other categories than {self.path} has (the model's "
                                  f"{_names(ours - theirs)} are not there; its {_names(theirs - ours)} are not "
                                  "the model's)")

    def image_id(self, relative: str) -> int | None:
        """The id of the ground-truth image named ``relative`` (see the module), or None."""
        found = self._by_name.get(relative)
        if found is None:
            ends = [image_id for name, image_id in self._by_name.items()
                    if relative.endswith("/" + name) or name.endswith("/" + relative)]
            found = ends[0] if len(ends) == 1 else None
        if found is not None and self._given.setdefault(found, relative) != relative:
            log.warning("%s: %s and %s both take the name of its image %d: %s is numbered apart", self.path,
                        self._given[found], relative, found, relative)
            return None
        if found is not None:
            self.matched.add(found)
        return found

    def score(self, predictions: list[dict], *, backend: str) -> CocoMetrics | None:
        """The COCO figures of ``predictions`` on the ground-truth images that were matched (None, with a
        warning, where none was)."""
        if not self.matched:
            log.warning("%s: no input has one of its file names: nothing to score", self.path)
            return None
        images = [image for image in self.data["images"] if image["id"] in self.matched]
        predictions = [d for d in predictions if d["image_id"] in self.matched]
        if len(images) == len(self.data["images"]):
            return coco_evaluate(self.path, predictions, backend=backend)
        log.info("%s: scoring on the %d of its %d images that are among the inputs", self.path, len(images),
                 len(self.data["images"]))
        subset = {**self.data, "images": images,
                  "annotations": [a for a in self.data.get("annotations", []) if a.get("image_id") in self.matched]}
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "ground_truth.json"
            path.write_text(json.dumps(subset))
            return coco_evaluate(path, predictions, backend=backend)


def _names(categories: set, shown: int = 4) -> str:
    """``id:name`` of the first ``shown`` categories by id, and how many more."""
    by_id = sorted(categories, key=lambda c: (not isinstance(c[0], int), c[0] if isinstance(c[0], int) else 0,
                                              str(c[0]), str(c[1])))
    names = [f"{i}:{n}" for i, n in by_id]
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "") or "none"
