"""The export's parity with the PyTorch model it was exported from, measured on an annotated split.

One pass over the split's test loader (the batches evaluation makes) measures four things against the
detector in fp32 (:func:`measure`):

* ``max_abs_diff``: the largest difference between the graph's outputs in ONNX Runtime and the same
  network's in PyTorch, on the same padded batches;
* ``match_rate``: the detections of the two on the same batches matched one to one (:func:`match`);
* ``ap_torch`` / ``ap_torch_tta``: COCO AP of the PyTorch detector through evaluation's code
  (:func:`pipelines.evaluation.detect`), without and with the test-time views;
* ``ap_onnx`` / ``ap_onnx_tta``: COCO AP of the export through the torch-free path end to end, as
  predict's ONNX backend and the served model run it: the image files decoded and resized by
  :mod:`.preprocess` (PIL, not torchvision), the graph in ONNX Runtime, :mod:`.postprocess` and
  :mod:`.tta` (numpy).

The four AP figures are of one image at a time, as predict computes by default and the served model
per request (a batch pads its images to the largest, which moves detections by a hair), so that
``python -m stages.predict`` with ``--coco-gt`` on the split gives them again.

:meth:`Parity.failures` says which figures miss the tolerances the export stage holds them to.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..data.collate import Batch, pad_images
from ..data.transforms import TestTimeAugmentation
from ..evaluation import coco_evaluate, detect
from ..model import Detector
from .onnx_backend import OnnxBackend
from .onnx_export import ExportedNetwork
from .onnx_runtime import OnnxDetector
from .postprocess import Detections
from .preprocess import decode
from .tta import Views, detect_views

HEAD_TOLERANCE = 1e-3  # the largest head-output difference allowed
MATCH_IOU, MATCH_SCORE = 0.99, 1e-3  # a match: same label, IoU at least this, scores within this
MATCH_RATE = 0.99  # the share of detections that must match
AP_TOLERANCE = 0.002  # |AP(onnx) - AP(torch)| allowed, with and without test-time views (at least: ap_tolerance)
IOU_THRESHOLDS = 10  # COCO's 0.50:0.05:0.95, over which AP is averaged


@dataclass(frozen=True)
class Parity:
    """The figures of the module's docstring, and the detections the match rate is over."""

    max_abs_diff: float
    match_rate: float
    detections: int
    ap_torch: float | None
    ap_onnx: float | None
    ap_torch_tta: float | None
    ap_onnx_tta: float | None
    ap_tolerance: float = AP_TOLERANCE  # the larger of AP_TOLERANCE and one box's worth (:func:`ap_tolerance`)

    def as_dict(self) -> dict:
        return asdict(self)

    def failures(self) -> list[str]:
        """What misses its tolerance, each as ``<figure> <value> (<rule>)``; empty when parity holds."""
        found = []
        if not self.max_abs_diff <= HEAD_TOLERANCE:
            found.append(f"max_abs_diff {self.max_abs_diff:.3g} (at most {HEAD_TOLERANCE:g})")
        if not self.match_rate >= MATCH_RATE:
            found.append(f"match_rate {self.match_rate:.4f} (at least {MATCH_RATE:g})")
        for kind in ("", "_tta"):
            theirs, ours = getattr(self, f"ap_torch{kind}"), getattr(self, f"ap_onnx{kind}")
            if (theirs is None) != (ours is None) or (theirs is not None and abs(ours - theirs) > self.ap_tolerance):
                found.append(f"ap_onnx{kind} {ours} against ap_torch{kind} {theirs} (within {self.ap_tolerance:.3g})")
        return found


def ap_tolerance(ground_truth: Path, image_ids: Iterable[int]) -> float:
    """How far the two paths' AP may differ on ``image_ids``: :data:`AP_TOLERANCE`, or where more, one box's
    worth: the AP that one detection matched or missed at one IoU threshold can move, ``1 / (10 x categories
    x boxes of the rarest category)`` over the images' non-crowd boxes. On a few images of a barely trained
    model a hair's difference in the decoded pixels moves a box across a threshold; on the default 128 val
    images one box is worth about 0.0002, and 0.002 holds."""
    wanted = set(image_ids)
    counts: dict[int, int] = {}
    for a in json.loads(Path(ground_truth).read_text())["annotations"]:
        if a["image_id"] in wanted and not a.get("iscrowd", 0):
            counts[a["category_id"]] = counts.get(a["category_id"], 0) + 1
    if not counts:
        return AP_TOLERANCE
    return max(AP_TOLERANCE, 1 / (IOU_THRESHOLDS * len(counts) * min(counts.values())))


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of each xyxy box of ``a`` ``[N, 4]`` with each of ``b`` ``[M, 4]``; boxes of no area (clipped at
    an edge) count as the same box where their corners agree within 0.01 pixel."""
    w = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    h = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = w * h
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None] - inter
    same = np.abs(a[:, None] - b[None]).max(-1) <= 0.01
    return np.where(union > 0, inter / np.maximum(union, 1e-9), same.astype(float))


def match(reference: Iterable[Detections], other: Iterable[Detections]) -> tuple[int, int]:
    """``(matched, total)`` over images: each detection of ``reference``, best score first, matched to an
    unused one of ``other`` for the same image with the same label, IoU >= 0.99 and score within 1e-3;
    ``total`` counts the larger of the two per image."""
    matched = total = 0
    for ref, oth in zip(reference, other, strict=True):
        total += max(len(ref), len(oth))
        if not len(ref) or not len(oth):
            continue
        ious = _iou(ref.boxes.astype(np.float64), oth.boxes.astype(np.float64))
        used = np.zeros(len(oth), bool)
        for i in np.argsort(-ref.scores, kind="stable"):
            fits = (~used & (oth.labels == ref.labels[i]) & (ious[i] >= MATCH_IOU)
                    & (np.abs(oth.scores - ref.scores[i]) <= MATCH_SCORE))
            if fits.any():
                used[np.flatnonzero(fits)[np.argmax(ious[i][fits])]] = True
                matched += 1
    return matched, total


def _as_numpy(found: list[dict]) -> list[Detections]:
    return [Detections(d["boxes"].float().cpu().numpy(), d["scores"].float().cpu().numpy(),
                       d["labels"].cpu().numpy().astype(np.int64)) for d in found]


def _records(image_ids: list[int], found: list[Detections], category_ids: list[int]) -> list[dict]:
    """COCO results (xywh boxes, JSON category ids) of each image's detections."""
    records = []
    for image_id, d in zip(image_ids, found):
        boxes = d.boxes.astype(np.float64)
        boxes[:, 2:] -= boxes[:, :2]
        records += [{"image_id": image_id, "category_id": category_ids[int(label)], "bbox": box, "score": float(score)}
                    for box, score, label in zip(boxes.tolist(), d.scores.tolist(), d.labels.tolist())]
    return records


@torch.inference_mode()
def measure(detector: Detector, runtime: OnnxDetector, loader, *, image_paths: dict[int, Path], ground_truth: Path,
            category_ids: list[int], tta: TestTimeAugmentation, size_divisibility: int, coco_backend: str,
            progress: bool = True) -> Parity:
    """The parity of ``runtime`` (the export) with ``detector`` (fp32, on the CPU) over ``loader``'s batches.

    Args:
        detector: the PyTorch detector the export was made from, in fp32.
        runtime: the export in ONNX Runtime.
        loader: the split's test loader (:func:`pipelines.build.data.test_loader`).
        image_paths: each image id's file, which the torch-free path decodes itself.
        ground_truth: the split's COCO annotations (prepare's ``val.json``).
        category_ids: the JSON category id of each label.
        tta: the test-time views (``evaluate.tta_*``, whether or not ``evaluate.tta`` is on).
        size_divisibility: ``loader.size_divisibility``.
        coco_backend: ``evaluate.backend``.
    """
    detector = detector.eval()
    network = ExportedNetwork(detector)
    backend = OnnxBackend(runtime)
    card, thresholds = runtime.card, backend.thresholds
    numpy_views = Views(tuple(tta.scales), tta.max_size, tta.flip, tta.source)
    cpu = torch.device("cpu")
    worst, matched, total = 0.0, 0, 0
    found: dict[str, list[dict]] = {"torch": [], "onnx": [], "torch_tta": [], "onnx_tta": []}
    seen: list[int] = []
    for batch in tqdm(loader, desc="parity", unit="batch", disable=not progress, mininterval=2.0):
        ids = [int(t["image_id"]) for t in batch.targets]
        seen += ids
        theirs = network(batch.images)
        ours = runtime.network(batch.images.numpy())
        for kind, index in (("cls_logits", 0), ("bbox_regression", 1), ("bbox_ctrness", 2)):
            for level, array in enumerate(ours[kind]):
                worst = max(worst, float(np.abs(theirs[3 * level + index].numpy() - array).max(initial=0.0)))
        reference = _as_numpy(detect(detector, batch, device=cpu, size_divisibility=size_divisibility))
        same_batch = _as_numpy(detect(backend, batch, device=cpu, size_divisibility=size_divisibility))
        hits, count = match(reference, same_batch)
        matched, total = matched + hits, total + count
        for k, image_id in enumerate(ids):  # the figures of predict's default, one image at a time
            height, width = batch.image_sizes[k]
            single = Batch(pad_images([batch.images[k][:, :height, :width]], size_divisibility), [(height, width)],
                           [batch.targets[k]], [batch.indices[k]])
            originals = [loader.dataset.load(batch.indices[k])[0]] if tta.source == "decoded" else None
            for key, views in (("torch", None), ("torch_tta", tta)):
                found[key] += _records([image_id], _as_numpy(detect(detector, single, device=cpu, tta=views,
                                                                     size_divisibility=size_divisibility,
                                                                     originals=originals)),
                                       category_ids)
            pixels = [decode(image_paths[image_id], max_pixels=card.max_image_pixels).pixels]
            for key, views in (("onnx", None), ("onnx_tta", numpy_views)):
                own = detect_views(lambda images, sizes: runtime.detect(images, sizes, thresholds=thresholds), pixels,
                                   min_size=card.min_size_test, max_size=card.max_size_test,
                                   size_divisibility=card.size_divisibility, thresholds=thresholds, views=views)
                found[key] += _records([image_id], own, category_ids)
    ap = {key: coco_evaluate(ground_truth, detections, backend=coco_backend).stats["AP"]
          for key, detections in found.items()}
    return Parity(max_abs_diff=worst, match_rate=matched / total if total else 1.0, detections=total,
                  ap_torch=ap["torch"], ap_onnx=ap["onnx"], ap_torch_tta=ap["torch_tta"], ap_onnx_tta=ap["onnx_tta"],
                  ap_tolerance=ap_tolerance(ground_truth, seen))
