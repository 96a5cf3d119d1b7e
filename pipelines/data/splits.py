"""The train and val splits compared, once each has validated on its own.

The model learns the train split's categories (by id, in id order, with their names) and the
evaluate stage scores it on the val split only if the val split has exactly those; a val split
without a box to match gives COCO evaluation nothing to score. :func:`compare_splits` refuses a val
category that train lacks or names otherwise, and a val split without a box, at prepare, in one
line, before anything trains. What still gives a meaningful run is a warning (one line each): a val
split that lists only some of train's categories (as tools that export one split at a time write
it; it is given train's list), categories without a box in a split, and images that are in both
splits (the same file, after links), whose scores are not held out.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DatasetError

NAMED = 3  # categories or files named in a warning; the rest are counted


def compare_splits(train: dict, val: dict) -> list[str]:
    """Compare two splits, each ``{"path", "images" (folder), "coco" (validated), "summary"}``.

    Returns:
        Warnings, one line each. A val split that lists only some of train's categories gets train's
        list (``val["coco"]["categories"]`` is replaced).

    Raises:
        DatasetError: the splits have other categories (ids or names), or the val split has no box that
            is not a crowd region.
    """
    expected = f"expected the categories of {train['path']} (the model learns them; evaluate scores them)"
    train_names = {c["id"]: c["name"] for c in train["coco"]["categories"]}
    val_names = {c["id"]: c["name"] for c in val["coco"]["categories"]}
    for category_id in sorted(val_names):
        name, other = train_names.get(category_id), val_names[category_id]
        if name is None:
            raise DatasetError(f"{val['path']}: category id {category_id} ({other!r}) is not in the train split; "
                               f"{expected}")
        if name != other:
            raise DatasetError(f"{val['path']}: category id {category_id} is {other!r}, but {name!r} in the train "
                               f"split; {expected}")
    counts = val["summary"]
    if counts["annotations"] == counts["crowd"]:
        rejected = counts["boxes_rejected_degenerate"] + counts["boxes_rejected_outside"]
        raise DatasetError(f"{val['path']}: no box to evaluate against ({counts['annotations'] + rejected} "
                           f"annotations: {counts['crowd']} crowd, {rejected} rejected); expected boxes of the "
                           "train split's categories")

    warnings = []
    unlisted = [name for category_id, name in train_names.items() if category_id not in val_names]
    if unlisted:
        val["coco"]["categories"] = [dict(c) for c in train["coco"]["categories"]]
        warnings.append(f"{val['path']}: does not list {len(unlisted)} of the train split's {len(train_names)} "
                        f"categories ({_named(unlisted)}): given the train split's list; their AP is not measured")
    for split, consequence in ((train, "the model cannot learn them"),
                               (val, "their AP is not measured (evaluate averages the others)")):
        empty = [name for name, n in split["summary"]["per_category"].items() if n == 0]
        if empty:
            warnings.append(f"{split['path']}: no box of {len(empty)} of its {len(train_names)} categories "
                            f"({_named(empty)}): {consequence}")
    shared = _shared_files(train, val)
    if shared:
        warnings.append(f"{val['path']}: {len(shared)} of its {len(val['coco']['images'])} images are also in the "
                        f"train split ({_named(shared)}): their scores are not held out")
    return warnings


def _shared_files(train: dict, val: dict) -> list[str]:
    """File names of the val images whose file (after links) is also a train image's."""
    def real(split: dict, image: dict) -> str:
        return os.path.realpath(Path(split["images"]) / image["file_name"])

    train_files = {real(train, image) for image in train["coco"]["images"]}
    return [image["file_name"] for image in val["coco"]["images"] if real(val, image) in train_files]


def _named(names: list[str]) -> str:
    return ", ".join(map(str, names[:NAMED])) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
