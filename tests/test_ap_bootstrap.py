"""The AP bootstrap: COCOeval's figures from per-image matches under image weights, and its intervals."""

from __future__ import annotations

import contextlib
import copy
import io
import json

import numpy as np
import pytest
import yaml

from pipelines import ap_bootstrap
from pipelines.ap_bootstrap import FIGURES, IOU_FIGURES, SUMMARY_FIGURES
from pipelines.config.load import params_from_dict
from pipelines.errors import ConfigError
from pipelines.evaluation import BACKENDS, STAT_NAMES, coco_evaluate

from .conftest import REPO

pytestmark = pytest.mark.filterwarnings("error")  # no numpy warning ("Mean of empty slice" ...) goes unseen

CATEGORIES = [{"id": i, "name": f"class_{i}"} for i in (1, 2, 5, 7)]  # 5: crowd regions only, 7: no boxes


def _case(seed: int, *, images: int = 30, distinct_scores: bool = True) -> tuple[dict, list[dict]]:
    """Ground truth and detections: boxes of all three COCO sizes, crowd regions (and detections on them),
    a category with crowd regions only, one without any box (but detections), images without ground
    truth, images without detections, and an image with more than 100 detections."""
    rng = np.random.default_rng(seed)
    gt = {"images": [], "annotations": [], "categories": CATEGORIES}
    detections = []

    def box(width: int, height: int) -> list[float]:
        side = float(np.exp(rng.uniform(np.log(5), np.log(0.8 * min(width, height)))))
        w, h = min(side * rng.uniform(0.6, 1.4), width - 1.0), min(side * rng.uniform(0.6, 1.4), height - 1.0)
        return [float(rng.uniform(0, width - w)), float(rng.uniform(0, height - h)), w, h]

    def detect(image_id: int, category_id: int, bbox: list[float]) -> None:
        x, y, w, h = (np.array(bbox) + rng.normal(0, 0.08, 4) * [bbox[2], bbox[3], bbox[2], bbox[3]]).tolist()
        score = float(rng.random()) if distinct_scores else round(float(rng.random()), 1)
        detections.append({"image_id": image_id, "category_id": category_id, "bbox": [x, y, max(w, 1.0), max(h, 1.0)],
                           "score": score})

    for image_id in range(1, images + 1):
        width, height = (int(v) for v in rng.integers(200, 500, size=2))
        gt["images"].append({"id": image_id, "file_name": f"{image_id}.jpg", "width": width, "height": height})
        boxes = [] if image_id % 6 == 0 else [(int(rng.choice([1, 2])), box(width, height), rng.random() < 0.1)
                                                for _ in range(int(rng.integers(1, 7)))]
        if image_id % 5 == 0:
            boxes.append((5, box(width, height), True))
        for category_id, bbox, crowd in boxes:
            gt["annotations"].append({
                "id": len(gt["annotations"]) + 1, "image_id": image_id, "category_id": category_id, "bbox": bbox,
                "area": bbox[2] * bbox[3], "iscrowd": int(crowd),
                "segmentation": {"counts": [0, width * height], "size": [height, width]} if crowd else
                [[bbox[0], bbox[1], bbox[0] + bbox[2], bbox[1], bbox[0] + bbox[2], bbox[1] + bbox[3]]]})
        if image_id % 7 == 0:
            continue  # no detections
        for category_id, bbox, _ in boxes:
            if rng.random() < 0.8:
                detect(image_id, category_id, bbox)
        for _ in range(120 if image_id == 3 else int(rng.integers(0, 4))):
            detect(image_id, int(rng.choice([1, 2, 5, 7])), box(width, height))
    return gt, detections


def _cocoeval(gt: dict, detections: list[dict]):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = copy.deepcopy(gt)
        coco.createIndex()
        evaluator = COCOeval(coco, coco.loadRes(copy.deepcopy(detections)), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator


def _reference(evaluator) -> np.ndarray:
    """COCOeval's figures in FIGURES' order: its first six stats, then the mean of its precision array per
    IoU threshold (area all, 100 detections); NaN for its -1."""
    precision = evaluator.eval["precision"][:, :, :, 0, -1]
    per_iou = [precision[t][precision[t] > -1].mean() if (precision[t] > -1).any() else -1 for t in range(10)]
    return np.array([v if v > -1 else np.nan for v in [*evaluator.stats[:6], *per_iou]])


def _assert_same(ours: np.ndarray, reference: np.ndarray) -> None:
    assert np.array_equal(np.isnan(ours), np.isnan(reference))
    assert np.nanmax(np.abs(ours - reference)) <= 1e-12


def test_unit_weights_give_cocoeval_on_the_known_answer(known_answer):
    gt = json.loads((known_answer / "instances_val2014_100.json").read_text())
    detections = json.loads((known_answer / "instances_val2014_fakebbox100_results.json").read_text())
    evaluator = _cocoeval(gt, detections)
    expected = json.loads((known_answer / "expected_stats_pycocotools.json").read_text())["bbox"][:6]
    assert evaluator.stats[:6] == pytest.approx(expected, abs=1e-12)
    matches = ap_bootstrap.extract_matches(evaluator)
    assert matches.images == 100 and len(matches.category_ids) == 80
    _assert_same(ap_bootstrap.figures(matches), _reference(evaluator))
    assert np.array_equal(ap_bootstrap.precision(matches), evaluator.eval["precision"][..., -1])  # bit for bit


@pytest.mark.parametrize("seed", [0, 1])
def test_unit_weights_give_cocoeval_with_crowds_areas_empty_images_and_tied_scores(seed):
    gt, detections = _case(seed, distinct_scores=False)
    assert any(a["iscrowd"] for a in gt["annotations"]) and {d["category_id"] for d in detections} >= {5, 7}
    assert len({d["score"] for d in detections}) <= 11  # ties
    evaluator = _cocoeval(gt, detections)
    matches = ap_bootstrap.extract_matches(evaluator)
    reference = _reference(evaluator)
    assert not np.isnan(reference).any()  # every figure defined, small to large
    _assert_same(ap_bootstrap.figures(matches), reference)
    precision = ap_bootstrap.precision(matches)
    assert np.array_equal(precision, evaluator.eval["precision"][..., -1])  # bit for bit
    assert (precision[:, :, 2:, :] == -1).all()  # categories 5 and 7: no ground truth that counts


def _repeated(gt: dict, detections: list[dict], weights: np.ndarray) -> tuple[dict, list[dict]]:
    """The dataset where image i appears weights[i] times: copies under new image and annotation ids."""
    out = {"images": [], "annotations": [], "categories": gt["categories"]}
    copies = []
    next_image, next_annotation = max(im["id"] for im in gt["images"]) + 1, len(gt["annotations"]) + 1
    for image, weight in zip(gt["images"], weights):
        for c in range(int(weight)):
            new_id = image["id"] if c == 0 else next_image
            next_image += c > 0
            out["images"].append({**image, "id": new_id})
            for a in gt["annotations"]:
                if a["image_id"] == image["id"]:
                    out["annotations"].append({**a, "id": next_annotation, "image_id": new_id})
                    next_annotation += 1
            copies += [{**d, "image_id": new_id} for d in detections if d["image_id"] == image["id"]]
    return out, copies


def test_an_image_drawn_k_times_counts_as_k_copies_of_it():
    gt, detections = _case(2)
    matches = ap_bootstrap.extract_matches(_cocoeval(gt, detections))
    # the weights of resample 0 as resampled_figures draws it, and weights up to 3 with zeros
    drawn = np.bincount(np.random.default_rng(5).integers(0, 30, 30), minlength=30)
    assert drawn.max() >= 2 and (drawn == 0).any()
    for weights in (drawn, np.random.default_rng(1).integers(0, 4, 30)):
        evaluator = _cocoeval(*_repeated(gt, detections, weights))
        _assert_same(ap_bootstrap.figures(matches, weights), _reference(evaluator))
        assert np.array_equal(ap_bootstrap.precision(matches, weights), evaluator.eval["precision"][..., -1])
    assert np.array_equal(ap_bootstrap.resampled_figures([matches], 1, 5)[0, 0], ap_bootstrap.figures(matches, drawn))


def test_intervals_are_seeded_hold_the_figure_and_pair_the_models():
    gt, detections = _case(3)
    one = ap_bootstrap.extract_matches(_cocoeval(gt, detections))
    worse = [{**d, "score": d["score"] * 0.5} if i % 3 == 0 else d for i, d in enumerate(detections)]
    two = ap_bootstrap.extract_matches(_cocoeval(gt, worse))
    first = ap_bootstrap.bootstrap(one, 200, seed=4)
    assert first == ap_bootstrap.bootstrap(one, 200, seed=4) != ap_bootstrap.bootstrap(one, 200, seed=5)
    point = dict(zip(FIGURES, ap_bootstrap.figures(one)))
    for name in FIGURES:
        low, high = first[name]
        assert low <= point[name] <= high and (low < high or name not in SUMMARY_FIGURES), name
    # every model gets the same draws: the figures of each do not depend on the others
    both = ap_bootstrap.resampled_figures([one, two], 50, seed=4)
    assert both.shape == (50, 2, len(FIGURES))
    assert np.array_equal(both[:, 0], ap_bootstrap.resampled_figures([one], 50, seed=4)[:, 0])
    assert np.array_equal(both[:, 1], ap_bootstrap.resampled_figures([two], 50, seed=4)[:, 0])
    other = ap_bootstrap.extract_matches(_cocoeval(*_case(3, images=29)))
    with pytest.raises(ValueError, match="different images"):
        ap_bootstrap.resampled_figures([one, other], 5, seed=0)


def test_a_figure_without_ground_truth_has_no_interval():
    gt, detections = _case(4)
    gt["annotations"] = [a for a in gt["annotations"] if a["area"] <= 96 ** 2]  # no large objects
    intervals = ap_bootstrap.bootstrap(ap_bootstrap.extract_matches(_cocoeval(gt, detections)), 20, seed=0)
    assert intervals["APl"] is None and intervals["AP"] is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_coco_evaluate_writes_intervals_and_per_iou_ap_the_same_bytes_each_time(tmp_path, backend):
    gt, detections = _case(5)
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt))
    runs = [coco_evaluate(path, copy.deepcopy(detections), backend=backend, bootstrap=100, seed=7) for _ in range(2)]
    figures = runs[0].figures()
    assert json.dumps(figures) == json.dumps(runs[1].figures())
    bounds = [f"{name}_{side}" for name in SUMMARY_FIGURES for side in ("low", "high")]
    assert list(figures) == [*STAT_NAMES, *bounds, *IOU_FIGURES]
    for name in SUMMARY_FIGURES:
        assert figures[f"{name}_low"] <= figures[name] <= figures[f"{name}_high"]
    assert figures["AP_low"] < figures["AP_high"]
    assert abs(np.mean([figures[name] for name in IOU_FIGURES]) - figures["AP"]) <= 1e-9
    assert figures["AP_iou50"] == pytest.approx(figures["AP50"], abs=1e-15)
    # without a bootstrap: no interval keys, the same figures
    plain = coco_evaluate(path, copy.deepcopy(detections), backend=backend).figures()
    assert list(plain) == [*STAT_NAMES, *IOU_FIGURES]
    assert plain == {k: v for k, v in figures.items() if k not in bounds}
    empty = coco_evaluate(path, [], backend=backend, bootstrap=10, seed=0).figures()
    assert empty["AP_low"] == empty["AP_high"] == empty["AP_iou95"] == 0.0


def test_the_bootstrap_param_is_a_count_of_resamples():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    assert raw["evaluate"]["bootstrap"] == 1000
    for value in (0, 100_000):
        raw["evaluate"]["bootstrap"] = value
        assert params_from_dict(raw, source="params.yaml").evaluate.bootstrap == value
    raw["evaluate"]["bootstrap"] = 100_001  # a negative count: tests/test_bad_input_params.py
    with pytest.raises(ConfigError, match="evaluate.bootstrap: expected a number of image resamples"):
        params_from_dict(raw, source="params.yaml")
