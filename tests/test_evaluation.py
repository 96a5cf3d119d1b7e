import json

import pytest
import torch

from pipelines.annotation_cache import AnnotationCache, build_cache
from pipelines.coco import load_json, validate_coco
from pipelines.dataset import DetectionDataset
from pipelines.evaluation import STAT_NAMES, coco_evaluate, predict
from pipelines.loader import make_test_loader
from pipelines.transforms import build_transforms


def test_reproduces_the_known_answer(known_answer):
    detections = json.loads((known_answer / "instances_val2014_fakebbox100_results.json").read_text())
    expected = json.loads((known_answer / "expected_stats_pycocotools.json").read_text())["bbox"]
    metrics = coco_evaluate(str(known_answer / "instances_val2014_100.json"), detections)
    assert [metrics.stats[name] for name in STAT_NAMES] == pytest.approx(expected, abs=1e-12)
    assert "Average Precision" in metrics.summary
    assert len(metrics.pr_curve) == 101
    assert metrics.pr_curve[0]["recall"] == 0.0 and metrics.pr_curve[-1]["recall"] == 1.0
    assert all(0 <= row["precision_iou50"] <= 1 for row in metrics.pr_curve)
    assert 0 < metrics.per_category["person"] <= 1


def test_ground_truth_as_detections_scores_one(coco_real):
    annotations, _ = coco_real
    gt = load_json(annotations)
    detections = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
                  for a in gt["annotations"] if not a.get("iscrowd")]
    metrics = coco_evaluate(str(annotations), detections)
    for name in ("AP", "AP50", "AP75", "APs", "APm", "APl"):
        assert metrics.stats[name] == pytest.approx(1.0), name
    assert all(v == pytest.approx(1.0) for v in metrics.per_category.values())


def test_no_detections_scores_zero(coco_real):
    metrics = coco_evaluate(str(coco_real[0]), [])
    assert set(metrics.stats.values()) == {0.0}


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
                               transforms=build_transforms(train=False, min_sizes=[320], max_size=512))
    batches = list(make_test_loader(dataset, ims_per_batch=4))
    detections = predict(_Oracle(batches), batches, device=torch.device("cpu"),
                         category_ids=dataset.cache.category_ids, progress=False)
    assert {d["category_id"] for d in detections} <= {c["id"] for c in cleaned["categories"]}
    metrics = coco_evaluate(str(tmp_path / "val.json"), detections)
    assert metrics.stats["AP"] > 0.99
