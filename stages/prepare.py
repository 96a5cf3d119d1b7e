"""Stage prepare: generate (synthetic) or import (coco) the dataset, validate it, summarise it.

Writes ``<out>/{train,val}.json`` (validated COCO annotations), ``<out>/dataset.json`` (where each
split's images are) and, for the synthetic dataset, ``<out>/images/``; plus the dataset's counts
(images, annotations, crowd, clipped and rejected boxes, boxes per category and per COCO scale) as
rows for ``dvc plots``, a bar chart, not headline metrics: their number grows with the classes. Nothing is replaced unless every split validates: every image decodes (with the
decoder training uses) at the size its JSON states, no image has more than ``dataset.max_image_pixels``
(read from its header, before decoding), no more than ``dataset.max_damaged_images`` images of a split
decode through damage, the train split has at least one usable box, and the two splits agree
(:func:`pipelines.data.splits.compare_splits`: the same categories, a box in val to score).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipelines import cli
from pipelines.config.load import load_params
from pipelines.config.schema import CocoDataset, SyntheticDataset
from pipelines.data.coco import validate_coco
from pipelines.data.splits import compare_splits
from pipelines.data.synthetic import generate_split
from pipelines.fileio import atomic_dir, write_json

log = logging.getLogger("prepare")
SPLITS = ("train", "val")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, output_folders=("out",), output_files=("metrics",),
                          out="folder for the prepared dataset",
                          metrics="the dataset's counts (JSON rows for dvc plots)")
    dataset = load_params(args.params).dataset

    summary, splits, checked = {}, {}, {}
    with atomic_dir(args.out) as tmp:
        for split in SPLITS:
            if isinstance(dataset, SyntheticDataset):
                image_dir, final_image_dir = tmp / "images" / split, args.out / "images" / split
                coco = generate_split(
                    image_dir, split=split, size=getattr(dataset, f"{split}_size"), seed=dataset.seed,
                    num_classes=dataset.num_classes, min_side=dataset.min_side, max_side=dataset.max_side,
                    min_objects=dataset.min_objects, max_objects=dataset.max_objects,
                )
                source = tmp / f"{split}.generated.json"
                write_json(source, coco, indent=None)
            else:
                image_dir = final_image_dir = Path(getattr(dataset, f"{split}_images"))
                source = Path(getattr(dataset, f"{split}_annotations"))
            log.info("validating %s split: %s (images in %s)", split, source, final_image_dir)
            cleaned, summary[split] = validate_coco(source, image_dir, require_boxes=split == "train",
                                                    max_image_pixels=dataset.max_image_pixels,
                                                    max_damaged_images=dataset.max_damaged_images)
            checked[split] = {"path": source if isinstance(dataset, CocoDataset) else split, "images": image_dir,
                              "coco": cleaned, "summary": summary[split]}
            if isinstance(dataset, SyntheticDataset):
                source.unlink()
            splits[split] = {"annotations": f"{split}.json", "images": str(final_image_dir)}
            log.info("%s: %d images, %d annotations, %d boxes clipped, %d rejected", split,
                     summary[split]["images"], summary[split]["annotations"], summary[split]["boxes_clipped"],
                     summary[split]["boxes_rejected_degenerate"] + summary[split]["boxes_rejected_outside"])
        for warning in compare_splits(checked["train"], checked["val"]):
            log.warning("%s", warning)
        for split in SPLITS:
            write_json(tmp / f"{split}.json", checked[split]["coco"], indent=None)
        write_json(tmp / "dataset.json", {"name": dataset.name, "splits": splits})
    write_json(args.metrics, count_rows(summary))


def count_rows(summary: dict[str, dict]) -> list[dict]:
    """``validate_coco``'s summaries by split as rows ``{"item": "train: images", "split": "train",
    "count": 512}``: scalar counts first, then ``boxes of <category>``, then ``<scale> boxes``."""
    rows = []
    for split, counts in summary.items():
        items = {k: v for k, v in counts.items() if not isinstance(v, dict)}
        items.update({f"boxes of {name}": n for name, n in counts["per_category"].items()})
        items.update({f"{scale} boxes": n for scale, n in counts["per_scale"].items()})
        rows += [{"item": f"{split}: {what}", "split": split, "count": n} for what, n in items.items()]
    return rows


if __name__ == "__main__":
    cli.run(main)
