"""Inference over a test loader and COCO box evaluation with pycocotools."""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from tqdm import tqdm

log = logging.getLogger(__name__)

STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


@torch.inference_mode()
def predict(model: torch.nn.Module, loader, *, device: torch.device, category_ids: list[int],
            progress: bool = True) -> list[dict]:
    """Run ``model`` over ``loader`` and return COCO-format detections in original image coordinates.

    Boxes are scaled from the resized image back to the stored image's size and labels mapped from
    contiguous indices to JSON category ids.
    """
    model.eval()
    results: list[dict] = []
    for batch in tqdm(loader, desc="inference", unit="batch", disable=not progress, mininterval=2.0):
        outputs = model(batch.images.to(device), batch.image_sizes)
        for output, target, (height, width) in zip(outputs, batch.targets, batch.image_sizes):
            orig_h, orig_w = target["orig_size"].tolist()
            scale = torch.tensor([orig_w / width, orig_h / height] * 2)
            boxes = output["boxes"].cpu() * scale
            boxes[:, 2:] -= boxes[:, :2]
            image_id = int(target["image_id"])
            for box, score, label in zip(boxes.tolist(), output["scores"].tolist(), output["labels"].tolist()):
                results.append({"image_id": image_id, "category_id": category_ids[label], "bbox": box, "score": score})
    return results


@dataclass
class CocoMetrics:
    """Summary statistics, per-category AP and a precision-recall curve."""

    stats: dict[str, float | None]
    per_category: dict[str, float] = field(default_factory=dict)
    pr_curve: list[dict[str, float]] = field(default_factory=list)
    summary: str = ""


def coco_evaluate(gt: COCO | str, detections: list[dict]) -> CocoMetrics:
    """Evaluate COCO-format box detections against ground truth with pycocotools' ``COCOeval``.

    Crowd regions are ignored as COCO specifies. With no detections every figure is 0.
    """
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(gt) if isinstance(gt, str) else gt
    if not detections:
        return CocoMetrics(stats={name: 0.0 for name in STAT_NAMES},
                           per_category={c["name"]: 0.0 for c in coco_gt.loadCats(coco_gt.getCatIds())})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        coco_dt = coco_gt.loadRes(detections)
        evaluator = COCOeval(coco_gt, coco_dt, "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    # COCOeval reports -1 where a figure has no ground truth (e.g. no large objects): None here.
    stats = {name: float(value) if value >= 0 else None for name, value in zip(STAT_NAMES, evaluator.stats)}

    # precision: [iou thresholds, recall thresholds, categories, area ranges, max dets]; area "all", 100 dets
    precision = evaluator.eval["precision"][:, :, :, 0, -1]
    per_category = {}
    for k, cat_id in enumerate(evaluator.params.catIds):
        p = precision[:, :, k]
        if (p > -1).any():
            per_category[coco_gt.cats[int(cat_id)]["name"]] = float(p[p > -1].mean())

    valid = np.where(precision > -1, precision, np.nan)
    with np.errstate(all="ignore"), contextlib.suppress(RuntimeWarning):
        by_iou = np.nanmean(valid, axis=2)  # [iou, recall]
    ious = evaluator.params.iouThrs
    curve = []
    for r, recall in enumerate(evaluator.params.recThrs):
        row = {"recall": round(float(recall), 2)}
        for name, t in (("precision_iou50", np.isclose(ious, 0.5)), ("precision_iou75", np.isclose(ious, 0.75))):
            row[name] = _finite(by_iou[t, r].mean())
        row["precision_iou50_95"] = _finite(np.nanmean(by_iou[:, r]))
        curve.append(row)
    summary = "\n".join(line for line in printed.getvalue().splitlines() if line.startswith(" Average"))
    return CocoMetrics(stats=stats, per_category=per_category, pr_curve=curve, summary=summary)


def _finite(value: float) -> float:
    return float(value) if np.isfinite(value) else 0.0
