import json

import pytest
import torch

from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.coco import read_annotations, validate_coco
from pipelines.data.decode import decode_image
from pipelines.data.dataset import DetectionDataset
from pipelines.evaluation import STAT_NAMES, coco_evaluate, predict
from pipelines.data.loader import make_test_loader
from pipelines.data.transforms import build_transforms


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
    gt, _ = read_annotations(annotations)
    detections = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 1.0}
                  for a in gt["annotations"] if not a.get("iscrowd")]
    metrics = coco_evaluate(str(annotations), detections)
    for name in ("AP", "AP50", "AP75", "APs", "APm", "APl"):
        assert metrics.stats[name] == pytest.approx(1.0), name
    assert all(v == pytest.approx(1.0) for v in metrics.per_category.values())


def test_no_detections_scores_zero(coco_real):
    metrics = coco_evaluate(str(coco_real[0]), [])
    assert set(metrics.stats.values()) == {0.0}
    assert set(metrics.per_category.values()) == {0.0}


def test_per_category_ap_covers_exactly_the_categories_with_ground_truth(coco_real):
    """With or without detections, and whichever categories the detections cover."""
    gt, _ = read_annotations(coco_real[0])
    names = {c["id"]: c["name"] for c in gt["categories"]}
    with_gt = [names[i] for i in sorted({a["category_id"] for a in gt["annotations"] if not a.get("iscrowd")})]
    assert 0 < len(with_gt) < len(names)  # the real subset leaves most of COCO's 80 categories without boxes
    one = next(a for a in gt["annotations"] if not a.get("iscrowd"))
    some = [{"image_id": one["image_id"], "category_id": one["category_id"], "bbox": one["bbox"], "score": 1.0}]
    for detections in ([], some):
        metrics = coco_evaluate(str(coco_real[0]), detections)
        assert list(metrics.per_category) == with_gt  # in category id order
    assert metrics.per_category[names[one["category_id"]]] > 0


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
    cleaned, _ = validate_coco(annotations, images, decode=decode_image)
    (tmp_path / "val.json").write_text(json.dumps(cleaned))
    build_cache(cleaned, tmp_path / "cache", image_root=str(images), source_sha256="x", drop_empty=False)
    dataset = DetectionDataset(AnnotationCache(tmp_path / "cache"), skip_crowd=True,
                               transforms=build_transforms(min_sizes=[320], max_size=512))
    batches = list(make_test_loader(dataset, batch_size=4))
    detections = predict(_Oracle(batches), batches, device=torch.device("cpu"),
                         category_ids=dataset.cache.category_ids, progress=False)
    assert {d["category_id"] for d in detections} <= {c["id"] for c in cleaned["categories"]}
    metrics = coco_evaluate(str(tmp_path / "val.json"), detections)
    assert metrics.stats["AP"] > 0.99


class _BrightSquareDetector(torch.nn.Module):
    """Detects the box of pixels brighter than 200 in each image (a geometry-exact stand-in model)."""

    nms_thresh = 0.5
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
