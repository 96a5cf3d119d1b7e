"""Inference over a test loader and COCO box evaluation with pycocotools or faster-coco-eval, with AP's
bootstrap intervals (:mod:`pipelines.ap_bootstrap`)."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torchvision.ops import batched_nms
from torchvision.transforms.v2 import functional as F
from tqdm import tqdm

from . import ap_bootstrap
from .data.collate import pad_images
from .data.sizes import resized_size
from .data.transforms import TestTimeAugmentation
from .model import merge

log = logging.getLogger(__name__)

# COCO box evaluation backends: pycocotools' reference COCOeval, or faster-coco-eval's C++ port of it.
BACKENDS = ("pycocotools", "faster_coco_eval")
STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def _detect_view(model, images: list[torch.Tensor], orig_sizes: list[tuple[int, int]], *, flip: bool,
                 size_divisibility: int, device) -> list[dict]:
    """Detections of one view (images at some scale, optionally mirrored) in original image coordinates."""
    if flip:
        images = [im.flip(-1) for im in images]
    sizes = [tuple(im.shape[-2:]) for im in images]
    outputs = model(pad_images(images, size_divisibility).to(device), sizes)
    for out, (height, width), (orig_h, orig_w) in zip(outputs, sizes, orig_sizes):
        boxes = out["boxes"].float().cpu()
        if flip:
            boxes = torch.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]], dim=1)
        out["boxes"] = boxes * torch.tensor([orig_w / width, orig_h / height] * 2)
        out["scores"], out["labels"] = out["scores"].cpu(), out["labels"].cpu()
    return outputs


def detect(model, batch, *, device, tta: TestTimeAugmentation | None = None, size_divisibility: int = 32,
           originals: list[torch.Tensor] | None = None) -> list[dict]:
    """Detections for a :class:`~pipelines.data.collate.Batch` in original image coordinates.

    With ``tta``, extra views are made from the batch's (already resized) images and merged per image
    by class-wise NMS at the model's threshold, keeping its ``detections_per_img`` best; with the model's
    ``merge`` ``vote``, the kept boxes are then voted on by all the views' detections; with ``wbf``, the
    views' detections are fused instead of NMS'd, scored for the number of views
    (:func:`pipelines.model.merge`). With ``tta.source`` ``decoded`` the extra scales are resized from
    ``originals`` instead, the decoded ``uint8 [3, H, W]`` images the batch's were resized from.
    """
    images = [im[:, :h, :w] for im, (h, w) in zip(batch.images, batch.image_sizes)]
    orig_sizes = [tuple(t["orig_size"].tolist()) for t in batch.targets]
    views = _detect_view(model, images, orig_sizes, flip=False, size_divisibility=size_divisibility, device=device)
    if tta is None:
        return views
    all_views = [views]
    if tta.flip:
        all_views.append(_detect_view(model, images, orig_sizes, flip=True, size_divisibility=size_divisibility,
                                      device=device))
    if tta.source == "decoded" and originals is None:
        raise ValueError("test-time views from the decoded images: pass originals")
    sources = originals if tta.source == "decoded" else images
    for scale in tta.scales:
        scaled = [F.resize(im, list(resized_size(h, w, scale, tta.max_size)), antialias=True)
                  for im, (h, w) in zip(sources, orig_sizes)]
        for flip in (False, True) if tta.flip else (False,):
            all_views.append(_detect_view(model, scaled, orig_sizes, flip=flip, size_divisibility=size_divisibility,
                                          device=device))
    merged = []
    for per_image in zip(*all_views):
        boxes = torch.cat([d["boxes"] for d in per_image])
        scores = torch.cat([d["scores"] for d in per_image])
        labels = torch.cat([d["labels"] for d in per_image])
        if model.merge == "nms":
            keep = batched_nms(boxes, scores, labels, model.nms_thresh)[: model.detections_per_img]
            merged.append({"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]})
        else:
            merged.append(merge(boxes, scores, labels, nms_thresh=model.nms_thresh, merge=model.merge,
                                vote_thresh=model.vote_thresh, detections_per_img=model.detections_per_img,
                                views=len(all_views)))
    return merged


@torch.inference_mode()
def predict(model: torch.nn.Module, loader, *, device: torch.device, category_ids: list[int],
            tta: TestTimeAugmentation | None = None, size_divisibility: int = 32, progress: bool = True) -> list[dict]:
    """Run ``model`` over ``loader`` and return COCO-format detections in original image coordinates.

    Boxes are scaled from the resized image back to the stored image's size and labels mapped from
    contiguous indices to JSON category ids. With ``tta.source`` ``decoded``, each batch's images are
    decoded again (``loader.dataset.load``) for the extra scales.
    """
    model.eval()
    results: list[dict] = []
    for batch in tqdm(loader, desc="inference", unit="batch", disable=not progress, mininterval=2.0):
        originals = ([loader.dataset.load(index)[0] for index in batch.indices]
                     if tta is not None and tta.source == "decoded" else None)
        outputs = detect(model, batch, device=device, tta=tta, size_divisibility=size_divisibility,
                         originals=originals)
        for output, target in zip(outputs, batch.targets):
            boxes = output["boxes"].clone()
            boxes[:, 2:] -= boxes[:, :2]
            image_id = int(target["image_id"])
            for box, score, label in zip(boxes.tolist(), output["scores"].tolist(), output["labels"].tolist()):
                results.append({"image_id": image_id, "category_id": category_ids[label], "bbox": box, "score": score})
    return results


@dataclass
class CocoMetrics:
    """Summary statistics (the 12 of :data:`STAT_NAMES`), per-category AP and a precision-recall curve.

    ``per_category`` maps the name of every category that has ground truth (at least one box that is
    not a crowd region) to its AP, in category id order, whether or not there are detections;
    categories without ground truth have no AP and are left out. ``per_iou`` holds the AP at each IoU
    threshold (``AP_iou50`` ... ``AP_iou95``, area all, 100 detections; their mean is AP).
    ``intervals`` holds, after a bootstrap of ``resamples`` image resamples, the percentile interval
    ``(low, high)`` of each of :data:`ap_bootstrap.SUMMARY_FIGURES` (None where the figure is None)."""

    stats: dict[str, float | None]
    per_category: dict[str, float] = field(default_factory=dict)
    pr_curve: list[dict[str, float]] = field(default_factory=list)
    summary: str = ""
    per_iou: dict[str, float | None] = field(default_factory=dict)
    intervals: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    resamples: int = 0

    def figures(self) -> dict[str, float | None]:
        """The evaluate stage's ``metrics/eval.json``: the 12 stats, each interval as ``<figure>_low`` and
        ``<figure>_high`` (none without a bootstrap), then the AP at each IoU threshold."""
        bounds = {f"{name}_{side}": None if interval is None else interval[i]
                  for name, interval in self.intervals.items() for i, side in enumerate(("low", "high"))}
        return {**self.stats, **bounds, **self.per_iou}


def coco_evaluate(gt: str | os.PathLike, detections: list[dict], *, backend: str, bootstrap: int = 0,
                  seed: int = 0, progress: bool = False) -> CocoMetrics:
    """Evaluate COCO-format box detections against the ground truth JSON at ``gt``.

    ``backend`` is one of :data:`BACKENDS`: ``pycocotools`` (the reference ``COCOeval``) or
    ``faster_coco_eval`` (its ``COCOeval_faster``, same figures several times faster; its precision
    omits pycocotools' ``+ np.spacing(1)`` in ``tp / (tp + fp)``, so AP figures may differ from
    pycocotools' in the last bits, below 1e-14, and recall figures are identical).

    Crowd regions are ignored as COCO specifies. With no detections every figure is 0. Per-category
    AP covers exactly the categories with ground truth (see :class:`CocoMetrics`). Like both
    libraries' ``loadRes``, this adds ``id``, ``area``, ``iscrowd`` and ``segmentation`` to each
    detection dict.

    With ``bootstrap`` > 0, AP to APl get their 95% percentile intervals over ``bootstrap`` image resamples
    drawn from ``seed`` (:func:`ap_bootstrap.bootstrap`), from pycocotools' per-image matches whichever
    the backend (faster-coco-eval does not expose them: pycocotools' ``evaluate()`` runs too, on copies
    of the detections); ``progress`` shows its bar.
    """
    coco_class, evaluator_class = _backend(backend)
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = coco_class(os.fspath(gt))
    if not detections:
        with_gt = {a["category_id"] for a in coco_gt.dataset.get("annotations", []) if not a.get("iscrowd")}
        return CocoMetrics(stats={name: 0.0 for name in STAT_NAMES},
                           per_category={coco_gt.cats[c]["name"]: 0.0 for c in sorted(coco_gt.getCatIds())
                                         if c in with_gt},
                           per_iou={name: 0.0 for name in ap_bootstrap.IOU_FIGURES},
                           intervals={name: (0.0, 0.0) for name in ap_bootstrap.SUMMARY_FIGURES} if bootstrap else {},
                           resamples=bootstrap)
    # pycocotools' own copies, taken before the backend's loadRes adds its keys to the detections
    copies = [dict(d) for d in detections] if bootstrap and backend != "pycocotools" else None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        coco_dt = coco_gt.loadRes(detections)
        evaluator = evaluator_class(coco_gt, coco_dt, "bbox")
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
        if (p > -1).any():  # -1 throughout: no ground truth (detections or not, a category with some has >= 0)
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
    # faster-coco-eval prints two more recall lines (IoU 0.50 and 0.75) after the 12 figures.
    summary = "\n".join([line for line in printed.getvalue().splitlines() if line.startswith(" Average")][:len(STAT_NAMES)])
    per_iou = {ap_bootstrap.iou_figure_name(t): _mean_valid(precision[i]) for i, t in enumerate(ious)}
    intervals = {}
    if bootstrap:
        evaluated = evaluator if backend == "pycocotools" else _pycocotools_evaluated(gt, copies)
        found = ap_bootstrap.bootstrap(ap_bootstrap.extract_matches(evaluated), bootstrap, seed, progress=progress)
        intervals = {name: None if stats[name] is None else found[name] for name in ap_bootstrap.SUMMARY_FIGURES}
    return CocoMetrics(stats=stats, per_category=per_category, pr_curve=curve, summary=summary, per_iou=per_iou,
                       intervals=intervals, resamples=bootstrap)


def image_matches(gt: str | os.PathLike, detections: list[dict]) -> ap_bootstrap.Matches:
    """The per-image matches of COCO-format ``detections`` (left as they are) against the ground truth
    JSON at ``gt``, for :func:`ap_bootstrap.figures` and its resamples (a paired comparison of models
    evaluated on the same images)."""
    return ap_bootstrap.extract_matches(_pycocotools_evaluated(gt, [dict(d) for d in detections]))


def _pycocotools_evaluated(gt: str | os.PathLike, detections: list[dict]) -> COCOeval:
    """pycocotools' ``COCOeval`` after ``evaluate()`` on ``detections`` (to which its ``loadRes`` adds keys)."""
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(os.fspath(gt))
        evaluator = COCOeval(coco_gt, coco_gt.loadRes(detections), "bbox")
        evaluator.evaluate()
    return evaluator


def _mean_valid(precision: np.ndarray) -> float | None:
    """The mean of the entries that are not -1 (COCOeval's summarize); None where all are."""
    valid = precision[precision > -1]
    return float(valid.mean()) if valid.size else None


def _backend(name: str) -> tuple[type, type]:
    """``(COCO, COCOeval)`` of backend ``name``; faster-coco-eval is imported only when chosen."""
    if name == "pycocotools":
        return COCO, COCOeval
    if name == "faster_coco_eval":
        from faster_coco_eval import COCO as FasterCOCO
        from faster_coco_eval import COCOeval_faster

        # Its evaluator reports through a print function (default: logging); print, like pycocotools.
        return FasterCOCO, functools.partial(COCOeval_faster, print_function=print)
    raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")


def _finite(value: float) -> float:
    return float(value) if np.isfinite(value) else 0.0
