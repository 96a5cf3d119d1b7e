import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.coco import read_annotations, validate_coco
from pipelines.data.dataset import DetectionDataset
from pipelines.config.load import params_from_dict
from pipelines.config.schema import CHOICES
from pipelines.errors import ConfigError
from pipelines.evaluation import BACKENDS, STAT_NAMES, CocoMetrics, coco_evaluate, predict
from pipelines.data.loader import make_test_loader
from pipelines.data.transforms import build_transforms

from .conftest import REPO


@pytest.mark.parametrize("backend", BACKENDS)
def test_reproduces_the_known_answer(known_answer, backend):
    detections = json.loads((known_answer / "instances_val2014_fakebbox100_results.json").read_text())
    expected = json.loads((known_answer / "expected_stats_pycocotools.json").read_text())["bbox"]
    metrics = coco_evaluate(known_answer / "instances_val2014_100.json", detections, backend=backend)
    assert [metrics.stats[name] for name in STAT_NAMES] == pytest.approx(expected, abs=1e-12)
    assert "Average Precision" in metrics.summary
    assert len(metrics.pr_curve) == 101
    assert metrics.pr_curve[0]["recall"] == 0.0 and metrics.pr_curve[-1]["recall"] == 1.0
    assert all(0 <= row["precision_iou50"] <= 1 for row in metrics.pr_curve)
    assert 0 < metrics.per_category["person"] <= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_ground_truth_as_detections_scores_one(coco_real, backend):
    annotations, _ = coco_real
    gt, _ = read_annotations(annotations)
    detections = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
                  for a in gt["annotations"] if not a.get("iscrowd")]
    metrics = coco_evaluate(annotations, detections, backend=backend)
    for name in ("AP", "AP50", "AP75", "APs", "APm", "APl"):
        assert metrics.stats[name] == pytest.approx(1.0), name
    assert all(v == pytest.approx(1.0) for v in metrics.per_category.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_detections_scores_zero(coco_real, backend):
    metrics = coco_evaluate(coco_real[0], [], backend=backend)
    assert set(metrics.stats.values()) == {0.0}
    assert set(metrics.per_category.values()) == {0.0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_category_ap_covers_exactly_the_categories_with_ground_truth(coco_real, backend):
    """With or without detections, and whichever categories the detections cover."""
    gt, _ = read_annotations(coco_real[0])
    names = {c["id"]: c["name"] for c in gt["categories"]}
    with_gt = [names[i] for i in sorted({a["category_id"] for a in gt["annotations"] if not a.get("iscrowd")})]
    assert 0 < len(with_gt) < len(names)  # the real subset leaves most of COCO's 80 categories without boxes
    one = next(a for a in gt["annotations"] if not a.get("iscrowd"))
    some = [{"image_id": one["image_id"], "category_id": one["category_id"], "bbox": one["bbox"], "score": 1.0}]
    for detections in ([], some):
        metrics = coco_evaluate(coco_real[0], detections, backend=backend)
        assert list(metrics.per_category) == with_gt  # in category id order
    assert metrics.per_category[names[one["category_id"]]] > 0


# Both backends give the same figures, within floating-point rounding: faster-coco-eval's C++ accumulate
# computes precision as tp / (tp + fp), pycocotools as tp / (tp + fp + np.spacing(1)) (to avoid a division
# by zero that cannot happen: every entry has a detection). So each precision value may differ by up to
# 2 ulp (2.2e-16 near 1; on the known-answer set 93,784 of its 969,600 values do), and the AP figures,
# per-category AP and PR curve, which average them, by a few 1e-16: 1e-14 allows for that and is 11
# orders of magnitude below the 0.001 that COCO reports. Recall has no such term: AR figures are equal.
TOLERANCE = 1e-14
AR_NAMES = tuple(name for name in STAT_NAMES if name.startswith("AR"))


def _both_backends(gt, detections: list[dict]) -> dict[str, CocoMetrics]:
    """Each backend's metrics on its own copy of ``detections`` (``loadRes`` adds fields to them); the
    copies must come back alike, since the evaluate stage writes them to ``detections.json``."""
    copies = {backend: copy.deepcopy(detections) for backend in BACKENDS}
    metrics = {backend: coco_evaluate(gt, copies[backend], backend=backend) for backend in BACKENDS}
    assert copies["faster_coco_eval"] == copies["pycocotools"]
    return metrics


def _assert_same_metrics(metrics: dict[str, CocoMetrics]) -> None:
    reference, faster = metrics["pycocotools"], metrics["faster_coco_eval"]
    assert list(faster.stats) == list(STAT_NAMES)
    for name in STAT_NAMES:
        if reference.stats[name] is None:
            assert faster.stats[name] is None, name
        elif name in AR_NAMES:
            assert faster.stats[name] == reference.stats[name], name
        else:
            assert faster.stats[name] == pytest.approx(reference.stats[name], rel=0, abs=TOLERANCE), name
    assert list(faster.per_category) == list(reference.per_category)
    assert list(faster.per_category.values()) == pytest.approx(list(reference.per_category.values()), rel=0,
                                                               abs=TOLERANCE)
    assert len(faster.pr_curve) == len(reference.pr_curve) == 101
    for ours, theirs in zip(faster.pr_curve, reference.pr_curve):
        assert ours.keys() == theirs.keys() and ours["recall"] == theirs["recall"]
        assert ours == pytest.approx(theirs, rel=0, abs=TOLERANCE)
    assert faster.summary == reference.summary and len(reference.summary.splitlines()) == 12


def test_backends_agree_on_the_known_answer(known_answer):
    detections = json.loads((known_answer / "instances_val2014_fakebbox100_results.json").read_text())
    metrics = _both_backends(known_answer / "instances_val2014_100.json", detections)
    _assert_same_metrics(metrics)
    differing = [name for name in STAT_NAMES if metrics["faster_coco_eval"].stats[name] != metrics["pycocotools"].stats[name]]
    assert set(differing) <= {"AP", "AP50", "AP75", "APs", "APm", "APl"}  # the tolerance is needed, and only for AP


def _generated_case(seed: int) -> tuple[dict, list[dict]]:
    """Ground truth and detections with crowd regions (and detections on them), images without ground
    truth, images without detections, a category whose only boxes are crowd regions, a category
    without any box, ties in scores, an image with more than 100 detections, and boxes of all three
    COCO sizes."""
    rng = np.random.default_rng(seed)
    categories = [{"id": i, "name": f"class_{i}", "supercategory": "shape"} for i in (1, 3, 4, 9, 15, 20)]
    with_boxes, crowd_only, no_boxes = [1, 3, 4, 9], 15, 20
    images, annotations, detections = [], [], []

    def box(width: int, height: int) -> list[float]:
        side = float(np.exp(rng.uniform(np.log(6), np.log(0.8 * min(width, height)))))  # small to large
        w, h = side * rng.uniform(0.6, 1.4), side * rng.uniform(0.6, 1.4)
        w, h = min(w, width - 1.0), min(h, height - 1.0)
        return [round(float(rng.uniform(0, width - w)), 2), round(float(rng.uniform(0, height - h)), 2),
                round(w, 2), round(h, 2)]

    def detect(image_id: int, category_id: int, bbox: list[float]) -> None:
        jitter = rng.normal(0, 0.08, size=4) * [bbox[2], bbox[3], bbox[2], bbox[3]]
        x, y, w, h = (np.array(bbox) + jitter).tolist()
        detections.append({"image_id": image_id, "category_id": category_id,
                           "bbox": [x, y, max(w, 1.0), max(h, 1.0)], "score": round(float(rng.random()), 2)})

    for image_id in range(1, 81):
        width, height = (int(v) for v in rng.integers(160, 640, size=2))
        images.append({"id": image_id, "file_name": f"{image_id:06d}.jpg", "width": width, "height": height})
        if image_id % 9 == 0:
            boxes = []  # no ground truth: every detection is a false positive
        else:
            boxes = [(int(rng.choice(with_boxes)), box(width, height), rng.random() < 0.1)
                     for _ in range(int(rng.integers(1, 9)))]
            if image_id % 11 == 0:
                boxes.append((crowd_only, box(width, height), True))
        for category_id, bbox, crowd in boxes:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category_id,
                                "bbox": bbox, "area": round(bbox[2] * bbox[3], 2), "iscrowd": int(crowd),
                                "segmentation": {"counts": [0, width * height], "size": [height, width]} if crowd else
                                [[bbox[0], bbox[1], bbox[0] + bbox[2], bbox[1], bbox[0] + bbox[2], bbox[1] + bbox[3]]]})
        if image_id % 7 == 0:
            continue  # no detections
        for category_id, bbox, _ in boxes:
            if rng.random() < 0.8:
                detect(image_id, category_id, bbox)  # on crowd regions too: neither true nor false positives
        for _ in range(150 if image_id == 5 else int(rng.integers(0, 4))):
            detect(image_id, int(rng.choice([*with_boxes, crowd_only, no_boxes])), box(width, height))
    return {"images": images, "annotations": annotations, "categories": categories}, detections


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backends_agree_on_crowd_regions_empty_images_and_categories_without_ground_truth(tmp_path, seed):
    gt, detections = _generated_case(seed)
    crowd = [a for a in gt["annotations"] if a["iscrowd"]]
    assert crowd and any(d["category_id"] == 15 for d in detections) and any(d["category_id"] == 20 for d in detections)
    assert {im["id"] for im in gt["images"]} - {d["image_id"] for d in detections}  # images without detections
    assert {im["id"] for im in gt["images"]} - {a["image_id"] for a in gt["annotations"]}  # and without ground truth
    assert len(detections) > 400 and len({d["score"] for d in detections}) <= 101  # ties in scores
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))

    metrics = _both_backends(path, detections)
    _assert_same_metrics(metrics)
    reference = metrics["pycocotools"]
    assert list(reference.per_category) == ["class_1", "class_3", "class_4", "class_9"]  # 15: crowd only, 20: none
    assert all(v is not None and 0 < v < 1 for v in reference.stats.values())
    # Dropping every detection of one image, and the crowd-only category, changes the figures alike.
    fewer = [d for d in detections if d["image_id"] != 1 and d["category_id"] != 15]
    _assert_same_metrics(_both_backends(path, fewer))


def test_a_bad_backend_stops_with_one_line_naming_the_parameter(tmp_path):
    assert CHOICES["evaluate.backend"] == BACKENDS  # pipelines.config cannot import this module (no torch there)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    assert raw["evaluate"]["backend"] == "faster_coco_eval"  # the default; pycocotools is the reference
    raw["evaluate"]["backend"] = "faster-coco-eval"
    expected = "evaluate.backend: expected one of pycocotools, faster_coco_eval, got 'faster-coco-eval'"
    with pytest.raises(ConfigError) as err:
        params_from_dict(raw, source="params.yaml")
    assert str(err.value) == f"params.yaml: {expected}"

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-m", "pipelines.config", "--params", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: {path}: {expected}\n"


class _Oracle(torch.nn.Module):
    """Returns the loader's (resized) ground truth as detections, in loader order."""

    def __init__(self, batches):
        super().__init__()
        self.outputs = [[{"boxes": t["boxes"], "labels": t["labels"], "scores": torch.ones(len(t["labels"]))}
                         for t in b.targets] for b in batches]

    def forward(self, images, image_sizes):
        return self.outputs.pop(0)


def test_predict_maps_boxes_and_labels_back_to_the_json(coco_real, tmp_path):
    """Resized boxes and contiguous labels must come back as original coordinates and category ids."""
    annotations, images = coco_real
    cleaned, _ = validate_coco(annotations, images)
    (tmp_path / "val.json").write_text(json.dumps(cleaned))
    build_cache(cleaned, tmp_path / "cache", image_root=str(images), source_sha256="x", drop_empty=False)
    dataset = DetectionDataset(AnnotationCache(tmp_path / "cache"), skip_crowd=True,
                               transforms=build_transforms(min_sizes=[320], max_size=512))
    batches = list(make_test_loader(dataset, batch_size=4))
    detections = predict(_Oracle(batches), batches, device=torch.device("cpu"),
                         category_ids=dataset.cache.category_ids, progress=False)
    assert {d["category_id"] for d in detections} <= {c["id"] for c in cleaned["categories"]}
    metrics = coco_evaluate(tmp_path / "val.json", detections, backend="pycocotools")
    assert metrics.stats["AP"] > 0.99


class _BrightSquareDetector(torch.nn.Module):
    """Detects the box of pixels brighter than 200 in each image (a geometry-exact stand-in model)."""

    nms_thresh = 0.5
    merge, vote_thresh = "nms", 0.8
    detections_per_img = 100

    def forward(self, images, image_sizes):
        outputs = []
        for image, (h, w) in zip(images, image_sizes):
            ys, xs = torch.nonzero(image[0, :h, :w] > 200, as_tuple=True)
            box = torch.tensor([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], dtype=torch.float32)
            outputs.append({"boxes": box, "scores": torch.ones(1), "labels": torch.zeros(1, dtype=torch.int64)})
        return outputs


def test_test_time_augmentation_maps_every_view_back_and_merges(tmp_path):
    from pipelines.data.collate import BatchCollator
    from pipelines.evaluation import TestTimeAugmentation, detect

    image = torch.zeros(3, 300, 400, dtype=torch.uint8)
    image[:, 40:100, 250:330] = 255  # the object: x 250..330, y 40..100 in the original image
    resized = torch.nn.functional.interpolate(image[None].float(), size=(240, 320)).to(torch.uint8)[0]
    target = {"orig_size": torch.tensor([300, 400])}
    batch = BatchCollator(32)([(resized, target, 0)])
    tta = TestTimeAugmentation(scales=(150, 450), max_size=800, flip=True)
    model = _BrightSquareDetector()

    views = []
    original_view = model.forward
    model.forward = lambda images, sizes: views.append(len(images)) or original_view(images, sizes)
    merged = detect(model, batch, device="cpu", tta=tta)
    assert len(views) == 6  # test scale and 2 extra scales, each plain and flipped
    assert len(merged) == 1 and len(merged[0]["boxes"]) == 1  # all views agree: NMS keeps one box
    torch.testing.assert_close(merged[0]["boxes"][0], torch.tensor([250.0, 40.0, 330.0, 100.0]), atol=4.0, rtol=0)
