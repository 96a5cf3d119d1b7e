"""The ONNX export's parity with PyTorch fp32: the graph at several sizes, and the numpy post-processing
against torchvision's; the model card; the NMS against torchvision's."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import numpy as np
import onnx
import pytest
import torch
from PIL import Image
from torchvision.ops import batched_nms, box_iou, nms

from pipelines import checkpoint
from pipelines.errors import CheckpointError
from pipelines.inference import card as model_card
from pipelines.inference import onnx_export, postprocess, preprocess
from pipelines.inference.onnx_runtime import OnnxDetector
from pipelines import model as detector_module
from pipelines.model import build_detector

from .conftest import scene as _scene

CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 3, "name": "square"}, {"id": 7, "name": "triangle"}]
TINY = dict(backbone="resnet10", norm="batchnorm", fpn_channels=64, head_convs=2)  # fcos_tiny's network
SHAPES = [(320, 416), (416, 320), (256, 416), (320, 448)]


def _spread(model) -> None:
    """Random head weights of a usable scale: a fresh FCOS head outputs nearly the same score and an empty
    box everywhere (its init is made for training), which would compare ties, not detections. A head with
    learnable scales gets distinct ones; with DFL's bins the box bias stays as initialised."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.head.named_parameters():
            if name.endswith("weight") and param.ndim == 4:
                param.copy_(torch.randn(param.shape, generator=generator) * (2.0 / param[0].numel()) ** 0.5)
        model.head.classification_head.cls_logits.bias.fill_(-1.0)
        if getattr(model.head, "dfl_bins", None) is None:
            model.head.regression_head.bbox_reg.bias.fill_(1.0)
        if getattr(model.head.regression_head, "scales", None) is not None:
            model.head.regression_head.scales.copy_(torch.tensor([1.5, 0.8, 1.2, 0.6, 2.0]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fcos_tiny-sized detector saved as the train stage saves ``model_final.pth`` and loaded back."""
    torch.manual_seed(0)
    model = build_detector(num_classes=len(CATEGORIES), **TINY, score_thresh=0.2)
    _spread(model)
    path = tmp_path_factory.mktemp("train") / "model_final.pth"
    checkpoint.save(path, model=model.state_dict(), categories=CATEGORIES, iteration=0, precision="fp32",
                    channels_last=False)
    state = checkpoint.load(path)
    loaded = build_detector(num_classes=len(state["categories"]), **TINY, score_thresh=0.2)
    loaded.load_state_dict(state["model"])
    return loaded.eval()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """``(onnx path, card, seconds the export took)``."""
    path = tmp_path_factory.mktemp("export") / "model.onnx"
    start = time.perf_counter()
    card = onnx_export.export(trained, path, categories=CATEGORIES, min_size_test=320, max_size_test=416,
                              size_divisibility=32, max_image_pixels=10**7,
                              provenance={"git_commit": "0" * 40, "weights_md5": "f" * 32})
    return path, card, time.perf_counter() - start


@pytest.fixture(scope="module")
def runtime(exported):
    return OnnxDetector(exported[0], threads=1)


def test_graph_matches_pytorch_at_every_shape(trained, exported, runtime):
    """The shapes rule: no size is baked into the graph; its head outputs match eager fp32 at each size."""
    network = onnx_export.ExportedNetwork(trained)
    generator = torch.Generator().manual_seed(2)
    worst = {}
    for height, width in SHAPES:
        images = torch.randint(0, 256, (2, 3, height, width), dtype=torch.uint8, generator=generator)
        with torch.no_grad():
            expected = [t.numpy() for t in network(images)]
        found = runtime.session.run(None, {"images": images.numpy()})
        assert [f.shape for f in found] == [e.shape for e in expected]
        worst[(height, width)] = max(float(np.abs(f - e).max()) for f, e in zip(found, expected))
        assert worst[(height, width)] < 1e-4, worst
    print(f"export {exported[2]:.1f} s; max abs diff per shape: {worst}")


def test_exported_network_is_the_detectors(trained):
    """The exported module's per-level outputs are the detector's head outputs, level by level."""
    images = torch.randint(0, 256, (1, 3, 256, 320), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outputs = onnx_export.ExportedNetwork(trained)(images)
        x = (images.float() - trained.pixel_mean) / trained.pixel_std
        head = trained.head(list(trained.backbone(x).values()))
    for k, kind in enumerate(model_card.OUTPUT_KINDS):
        levels = outputs[k::3]
        torch.testing.assert_close(torch.cat([o.reshape(1, -1, o.shape[-1]) for o in levels], 1), head[kind],
                                   rtol=0, atol=0)


def _match_rate(ours: list[postprocess.Detections], theirs: list[dict]) -> tuple[float, int]:
    """Share of detections matched one to one (same label, IoU >= 0.99, scores within 1e-3), over the
    larger of the two sets per image; and the number of PyTorch's detections. Two boxes of no area (clipped
    flat at the image's edge) have IoU 1 where their corners agree."""
    matched = total = count = 0
    for mine, other in zip(ours, theirs):
        boxes, scores, labels = (other[k].numpy() for k in ("boxes", "scores", "labels"))
        count += len(scores)
        total += max(len(scores), len(mine))
        used = np.zeros(len(mine), dtype=bool)
        for box, score, label in zip(boxes, scores, labels):
            x1 = np.maximum(box[0], mine.boxes[:, 0])
            y1 = np.maximum(box[1], mine.boxes[:, 1])
            x2 = np.minimum(box[2], mine.boxes[:, 2])
            y2 = np.minimum(box[3], mine.boxes[:, 3])
            inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
            area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
            union = area(box) + area(mine.boxes) - inter
            same = np.abs(mine.boxes - box).max(axis=1) <= 1e-3  # also boxes clipped flat at the image's edge
            iou = np.where(union > 0, inter / np.maximum(union, 1e-9), same.astype(float))
            ok = ~used & (mine.labels == label) & (iou >= 0.99) & (np.abs(mine.scores - score) <= 1e-3)
            if ok.any():
                used[np.flatnonzero(ok)[np.argmax(iou[ok])]] = True
                matched += 1
    return matched / max(total, 1), count


# evaluate.nms_thresh / merge / vote_thresh: off (today's), and each lever on
LEVERS = [pytest.param({}, id="default"), pytest.param({"nms_thresh": 0.3}, id="nms0.3"),
          pytest.param({"merge": "vote", "vote_thresh": 0.7}, id="vote0.7"),
          pytest.param({"merge": "wbf", "nms_thresh": 0.55}, id="wbf0.55")]


@contextlib.contextmanager
def _post_processing(model, runtime=None, **levers):
    """``model`` post-processing with ``levers`` (as :func:`pipelines.build.model.use_evaluate` sets them), and
    the numpy post-processing's thresholds of ``runtime``'s card with the same; restored after."""
    before = {k: getattr(model, k) for k in ("nms_thresh", "merge", "vote_thresh")}
    for key, value in levers.items():
        setattr(model, key, value)
    try:
        yield None if runtime is None else dataclasses.replace(runtime.thresholds, **levers)
    finally:
        for key, value in before.items():
            setattr(model, key, value)


@pytest.mark.parametrize("levers", [LEVERS[0], pytest.param({"nms_thresh": 0.5, "merge": "vote", "vote_thresh": 0.7},
                                                             id="nms0.5-vote0.7"), LEVERS[3]])
def test_numpy_postprocessing_on_onnx_outputs_matches_pytorch(trained, runtime, levers):
    """End to end on one batch: ONNX graph + numpy post-processing against the PyTorch model's own, with
    evaluation's post-processing levers off and on."""
    images = [_scene(240, 320, 0), _scene(300, 200, 1), _scene(320, 320, 2), _scene(180, 400, 3)]
    batch = preprocess.prepare(images, min_size=320, max_size=416, size_divisibility=32)
    with _post_processing(trained, runtime, **levers) as thresholds, torch.no_grad():
        theirs = trained(torch.from_numpy(batch.images), batch.image_sizes)
        ours = runtime.detect(batch.images, batch.image_sizes, thresholds=thresholds)
    rate, count = _match_rate(ours, theirs)
    print(f"{levers}: match rate {rate:.4f} over {count} PyTorch detections")
    assert count >= 100 and rate >= 0.99


def _head_outputs(trained):
    """Random head outputs of two images padded to 256x352, the same every call: ``(padded, sizes, grids,
    outputs, flat, split)``, with ``flat`` as the detector's post-processing takes them and ``split`` its
    anchors per level."""
    generator = torch.Generator().manual_seed(4)
    padded, sizes = (256, 352), [(256, 340), (230, 352)]
    grids = [(32, 44), (16, 22), (8, 11), (4, 6), (2, 3)]
    outputs = {"cls_logits": [torch.randn(2, h, w, 3, generator=generator) for h, w in grids],
               "bbox_regression": [torch.rand(2, h, w, 4, generator=generator) * 3 for h, w in grids],
               "bbox_ctrness": [torch.randn(2, h, w, 1, generator=generator) for h, w in grids]}
    flat = {k: [t.reshape(2, -1, t.shape[-1]) for t in v] for k, v in outputs.items()}
    features = [torch.empty(2, 1, h, w) for h, w in grids]
    from torchvision.models.detection.image_list import ImageList

    anchors = trained.anchor_generator(ImageList(torch.empty(2, 3, *padded), sizes), features)
    split = [list(a.split([h * w for h, w in grids])) for a in anchors]
    return padded, sizes, grids, outputs, flat, split


@pytest.mark.parametrize("levers", LEVERS)
def test_postprocessing_is_torchvisions_on_the_same_outputs(trained, levers):
    """Fed the very same head outputs, the numpy post-processing gives torchvision's detections (scores
    without ties: torchvision's top-k orders equal scores as its partial sort leaves them); with the levers
    on, the detector's own post-processing (its candidates, NMS at ``nms_thresh``, box voting)."""
    padded, sizes, grids, outputs, flat, split = _head_outputs(trained)
    thresholds = postprocess.Thresholds(trained.score_thresh, trained.nms_thresh, trained.topk_candidates,
                                        trained.detections_per_img)
    for level, (grid, stride) in enumerate(zip(grids, postprocess.level_strides(padded, grids))):
        np.testing.assert_array_equal(postprocess.level_anchors(grid, stride, 8 * 2**level), split[0][level].numpy())
    plain = trained.postprocess_detections(flat, split, sizes)
    with _post_processing(trained, **levers):
        expected = trained.postprocess_detections(flat, split, sizes)
    found = postprocess.detections(*([t.numpy() for t in outputs[k]] for k in model_card.OUTPUT_KINDS),
                                   padded_size=padded, image_sizes=sizes, anchor_sizes=[8, 16, 32, 64, 128],
                                   thresholds=dataclasses.replace(thresholds, **levers))
    for mine, theirs, before in zip(found, expected, plain):
        assert len(mine) > 50
        np.testing.assert_array_equal(mine.labels, theirs["labels"].numpy())
        np.testing.assert_allclose(mine.scores, theirs["scores"].numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(mine.boxes, theirs["boxes"].numpy(), rtol=0, atol=1e-4)
        if levers.get("merge") == "wbf":  # fused boxes: some moved, fewer or as many as NMS kept
            assert len(theirs["boxes"]) <= len(before["boxes"]) or levers["nms_thresh"] > trained.nms_thresh
            assert not torch.equal(theirs["boxes"], before["boxes"][:len(theirs["boxes"])])
            continue
        if "nms_thresh" in levers:  # no two kept boxes of a class overlap above it (at 0.6 some did)
            def overlap(found):
                same = found["labels"][:, None] == found["labels"][None]
                return (box_iou(found["boxes"], found["boxes"]) * same).triu(1).max()

            assert overlap(theirs) <= levers["nms_thresh"] < overlap(before)
        if "merge" in levers:  # NMS keeps the same boxes and scores; voting moves some of the boxes
            torch.testing.assert_close(theirs["scores"], before["scores"], rtol=0, atol=0)
            moved = (theirs["boxes"] - before["boxes"]).abs().amax(1) > 1e-3
            assert 0 < int(moved.sum()) < len(moved)


@pytest.mark.parametrize("cls_loss", ["focal", "qfl"])
def test_postprocessing_scores_as_the_detector_for_either_loss(trained, cls_loss, monkeypatch):
    """Fed the very same head outputs, the numpy post-processing gives torchvision's detections (scores
    without ties: torchvision's top-k orders equal scores as its partial sort leaves them); with ``qfl``, the
    detector's own scores ``sigmoid(cls)``, which the centerness does not change."""
    monkeypatch.setattr(trained.head, "cls_loss", cls_loss)
    padded, sizes, grids, outputs, flat, split = _head_outputs(trained)
    thresholds = postprocess.Thresholds(trained.score_thresh, trained.nms_thresh, trained.topk_candidates,
                                        trained.detections_per_img, cls_loss)
    for level, (grid, stride) in enumerate(zip(grids, postprocess.level_strides(padded, grids))):
        np.testing.assert_array_equal(postprocess.level_anchors(grid, stride, 8 * 2**level), split[0][level].numpy())
    expected = trained.postprocess_detections(flat, split, sizes)
    found = postprocess.detections(*([t.numpy() for t in outputs[k]] for k in model_card.OUTPUT_KINDS),
                                   padded_size=padded, image_sizes=sizes, anchor_sizes=[8, 16, 32, 64, 128],
                                   thresholds=thresholds)
    for mine, theirs in zip(found, expected):
        assert len(mine) > 50
        np.testing.assert_array_equal(mine.labels, theirs["labels"].numpy())
        np.testing.assert_allclose(mine.scores, theirs["scores"].numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(mine.boxes, theirs["boxes"].numpy(), rtol=0, atol=1e-4)
    if cls_loss == "qfl":
        sigmoid = torch.sigmoid(torch.cat([t.reshape(2, -1) for t in outputs["cls_logits"]], dim=1))
        for image, theirs in enumerate(expected):  # every score is a class probability as it is
            assert torch.isin(theirs["scores"], sigmoid[image]).all()
        outputs["bbox_ctrness"] = [t - 5 for t in outputs["bbox_ctrness"]]
        again = postprocess.detections(*([t.numpy() for t in outputs[k]] for k in model_card.OUTPUT_KINDS),
                                       padded_size=padded, image_sizes=sizes, anchor_sizes=[8, 16, 32, 64, 128],
                                       thresholds=thresholds)
        assert all(np.array_equal(a.scores, b.scores) and np.array_equal(a.boxes, b.boxes) for a, b in zip(again, found))


# Box voting by hand: a kept box A, a same-class box B of IoU 0.818 with it (suppressed at 0.6, votes at
# 0.8), a same-class C of IoU 0.667 (suppressed, does not vote), a box D of another class on B's place and
# a far box E.
VOTE_BOXES = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [2, 0, 12, 10], [1, 0, 11, 10], [50, 50, 60, 60]],
                      np.float32)
VOTE_SCORES = np.array([0.9, 0.6, 0.3, 0.5, 0.4], np.float32)
VOTE_LABELS = np.array([0, 0, 0, 1, 0], np.int64)


@pytest.mark.parametrize("merge, expected", [
    ("nms", VOTE_BOXES[[0, 3, 4]]),  # plain NMS: the kept boxes as they are
    # A moves to (0.9 * A + 0.6 * B) / 1.5; D (alone in its class) and E (alone where it is) stay
    ("vote", np.array([[0.4, 0, 10.4, 10], [1, 0, 11, 10], [50, 50, 60, 60]], np.float32)),
])
def test_box_voting_by_hand_in_torch_and_numpy(merge, expected):
    thresholds = postprocess.Thresholds(0.05, 0.6, 1000, 100, merge=merge, vote_thresh=0.8)
    ours = postprocess.merge(VOTE_BOXES, VOTE_SCORES, VOTE_LABELS, thresholds)
    theirs = detector_module.merge(torch.from_numpy(VOTE_BOXES), torch.from_numpy(VOTE_SCORES),
                                   torch.from_numpy(VOTE_LABELS), nms_thresh=0.6, merge=merge, vote_thresh=0.8,
                                   detections_per_img=100)
    np.testing.assert_allclose(ours.boxes, expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ours.boxes, theirs["boxes"].numpy())  # the same float32 bits
    np.testing.assert_array_equal(ours.scores, VOTE_SCORES[[0, 3, 4]])  # the kept scores, not averaged
    np.testing.assert_array_equal(theirs["scores"].numpy(), VOTE_SCORES[[0, 3, 4]])
    np.testing.assert_array_equal(ours.labels, theirs["labels"].numpy())
    # at a threshold float32 rounds down (0.7), a candidate of IoU exactly float32(0.7) votes in both
    edge = np.array([[0, 0, 10, 10], [0, 0, 10, 7]], np.float32)  # IoU 70 / 100 = float32(0.7)
    at_edge = postprocess.Thresholds(0.05, 0.6, 1000, 100, merge="vote", vote_thresh=0.7)
    ours_edge = postprocess.merge(edge, VOTE_SCORES[:2], VOTE_LABELS[:2], at_edge).boxes
    theirs_edge = detector_module.merge(torch.from_numpy(edge), torch.from_numpy(VOTE_SCORES[:2]),
                                        torch.from_numpy(VOTE_LABELS[:2]), nms_thresh=0.6, merge="vote",
                                        vote_thresh=0.7, detections_per_img=100)["boxes"].numpy()
    np.testing.assert_array_equal(ours_edge, theirs_edge)
    assert ours_edge[0, 3] < 10  # the second box voted
    if merge == "nms":  # the default is exactly torchvision's batched NMS
        keep = batched_nms(torch.from_numpy(VOTE_BOXES), torch.from_numpy(VOTE_SCORES), torch.from_numpy(VOTE_LABELS),
                           0.6).numpy()
        np.testing.assert_array_equal(ours.boxes, VOTE_BOXES[keep])


def test_weighted_box_fusion_by_hand_in_torch_and_numpy():
    """``merge`` ``wbf`` at IoU 0.6 on the voting boxes: A, B and C cluster (B's IoU with A 0.818, C's with the
    fused A+B above 0.6), their box the score-weighted mean; D (another class) and E stay alone. Within a view
    a cluster scores its best; over 2 views its mean times min(2, size) / 2. Both paths, the same bits."""
    fused_box = (0.9 * VOTE_BOXES[0] + 0.6 * VOTE_BOXES[1] + 0.3 * VOTE_BOXES[2]) / 1.8  # [0.667, 0, 10.667, 10]
    thresholds = postprocess.Thresholds(0.05, 0.6, 1000, 100, merge="wbf")
    for views, scores in ((None, [0.9, 0.5, 0.4]), (2, [0.6, 0.25, 0.2])):
        ours = postprocess.merge(VOTE_BOXES, VOTE_SCORES, VOTE_LABELS, thresholds, views=views)
        theirs = detector_module.merge(torch.from_numpy(VOTE_BOXES), torch.from_numpy(VOTE_SCORES),
                                       torch.from_numpy(VOTE_LABELS), nms_thresh=0.6, merge="wbf", vote_thresh=0.8,
                                       detections_per_img=100, views=views)
        np.testing.assert_allclose(ours.boxes, [fused_box, VOTE_BOXES[3], VOTE_BOXES[4]], rtol=0, atol=1e-5)
        np.testing.assert_allclose(ours.scores, scores, rtol=0, atol=1e-7)
        np.testing.assert_array_equal(ours.labels, [0, 1, 0])
        for key, value in (("boxes", ours.boxes), ("scores", ours.scores), ("labels", ours.labels)):
            np.testing.assert_array_equal(theirs[key].numpy(), value)
    # the input order does not matter; detections_per_img cuts the fused detections, best first
    shuffled = [4, 2, 0, 3, 1]
    again = postprocess.merge(VOTE_BOXES[shuffled], VOTE_SCORES[shuffled], VOTE_LABELS[shuffled], thresholds)
    np.testing.assert_array_equal(again.boxes, postprocess.merge(VOTE_BOXES, VOTE_SCORES, VOTE_LABELS, thresholds).boxes)
    one = postprocess.merge(VOTE_BOXES, VOTE_SCORES, VOTE_LABELS, dataclasses.replace(thresholds, detections_per_img=1))
    np.testing.assert_allclose(one.boxes, [fused_box], rtol=0, atol=1e-5)


@pytest.mark.parametrize("count", [300, 1500])  # torchvision's two strategies: coordinate trick, per class
@pytest.mark.parametrize("ties", [False, True])
def test_nms_is_torchvisions(count, ties):
    """The same boxes kept in the same order; with ties of scores, the same order too up to 1000 boxes
    (torchvision's stable sort), beyond that the same boxes and scores (its per-class merge orders equal
    scores as an unstable sort leaves them)."""
    rng = np.random.default_rng(count)
    corners = rng.uniform(0, 200, (count, 2)).astype(np.float32)
    boxes = np.concatenate([corners, corners + rng.uniform(0, 60, (count, 2)).astype(np.float32)], 1)
    scores = rng.uniform(0, 1, count).astype(np.float32)
    if ties:
        scores = np.round(scores, 2)
    labels = rng.integers(0, 5, count)
    for threshold in (0.3, 0.5, 0.6):
        expected = batched_nms(torch.from_numpy(boxes), torch.from_numpy(scores), torch.from_numpy(labels),
                               threshold).numpy()
        found = postprocess.batched_nms(boxes, scores, labels, threshold)
        if ties and count > 1000:
            assert sorted(found) == sorted(expected)
            np.testing.assert_array_equal(scores[found], scores[expected])
        else:
            np.testing.assert_array_equal(found, expected)
        np.testing.assert_array_equal(postprocess.nms(boxes, scores, threshold),
                                      nms(torch.from_numpy(boxes), torch.from_numpy(scores), threshold).numpy())
        for cut in (1, 25, 100):  # stopping early keeps the same first boxes
            np.testing.assert_array_equal(postprocess.batched_nms(boxes, scores, labels, threshold, max_keep=cut),
                                          found[:cut])
    for k in (0, 1, 7, 100, count, count + 5):
        np.testing.assert_array_equal(postprocess.top_order(scores, k), np.argsort(-scores, kind="stable")[:k])


@pytest.mark.parametrize("score_thresh", [0.05, 0.3, 0.0])
def test_the_logit_cut_keeps_every_score_that_passes(score_thresh):
    """Post-processing scores only the logits above its cut (the logit of ``score_thresh ** 2``, less a
    margin): logits crowded around that cut, with centerness from certain to unlikely, and boxes that never
    overlap, give every score above the threshold that scoring all of them gives, bit for bit, best first."""
    rng = np.random.default_rng(6)
    square = score_thresh**2
    cut = np.log(square / (1 - square)) if square else 0.0
    grids, classes = [(8, 10), (4, 5)], 7
    logits = [(cut + rng.uniform(-0.01, 0.01, (1, h, w, classes))).astype(np.float32) for h, w in grids]
    logits[0][0, 0, 0, :3] = [np.nextafter(np.float32(cut), np.float32(9)), np.float32(cut), np.nan]
    ctrness = [rng.choice(np.float32([30, 9, 2, 0, -2]), (1, h, w, 1)) for h, w in grids]
    regression = [np.full((1, h, w, 4), 0.05, np.float32) for h, w in grids]
    thresholds = postprocess.Thresholds(score_thresh, 1.0, 10**6, 10**6)  # nothing suppressed or cut
    found = postprocess.detections(logits, regression, ctrness, padded_size=(64, 80), image_sizes=[(64, 80)],
                                   anchor_sizes=[8, 16], thresholds=thresholds)[0]
    sigmoid = lambda x: np.float32(1) / (np.float32(1) + np.exp(-x))  # noqa: E731
    with np.errstate(invalid="ignore"):
        every = np.concatenate([np.sqrt(sigmoid(c[0]) * sigmoid(t[0])).reshape(-1) for c, t in zip(logits, ctrness)])
    passed = every[every > np.float32(score_thresh)]
    assert 20 < len(passed) < len(every) - 20 or score_thresh == 0
    np.testing.assert_array_equal(found.scores, passed[np.argsort(-passed, kind="stable")])


def test_predict_gives_original_pixels(runtime, tmp_path):
    """From files (and bytes) to detections in each image's own pixels, as evaluation scales them back."""
    images = [_scene(240, 320, 5), _scene(500, 280, 6)]
    paths = []
    for k, image in enumerate(images):
        paths.append(tmp_path / f"{k}.png")
        Image.fromarray(image).save(paths[-1])
    found = runtime.predict([paths[0], paths[1].read_bytes()])
    batch = preprocess.prepare(images, min_size=320, max_size=416, size_divisibility=32)
    direct = runtime.detect(batch.images, batch.image_sizes)
    for mine, other, (h, w), (oh, ow) in zip(found, direct, batch.image_sizes, batch.orig_sizes):
        assert len(mine) > 0
        np.testing.assert_array_equal(mine.boxes, other.boxes * np.array([ow / w, oh / h] * 2, dtype=np.float32))
    assert len(runtime.predict([paths[0]], score_thresh=0.99)[0]) <= len(found[0])


def test_the_card_carries_evaluations_post_processing(trained):
    """The card has the detector's post-processing as evaluation sets it (the numpy path reads it from there);
    a card written before the levers reads as plain NMS; a bad merge is refused in one line."""
    with _post_processing(trained, nms_thresh=0.5, merge="vote", vote_thresh=0.75):
        card = onnx_export.card_for(trained, categories=CATEGORIES, min_size_test=320, max_size_test=416,
                                    size_divisibility=32, max_image_pixels=10**7, opset=20)
    assert (card.nms_thresh, card.merge, card.vote_thresh) == (0.5, "vote", 0.75)
    assert model_card.ModelCard.from_json(card.to_json(), source="m") == card
    older = {k: v for k, v in json.loads(card.to_json()).items() if k not in ("merge", "vote_thresh")}
    assert model_card.ModelCard.from_json(json.dumps(older), source="m").merge == "nms"
    with _post_processing(trained, merge="wbf"):
        fused = onnx_export.card_for(trained, categories=CATEGORIES, min_size_test=320, max_size_test=416,
                                     size_divisibility=32, max_image_pixels=10**7, opset=20)
    assert model_card.ModelCard.from_json(fused.to_json(), source="m").merge == "wbf"
    with pytest.raises(CheckpointError, match=r"^m: model card field merge is 'soft', expected one of nms, vote, wbf$"):
        model_card.ModelCard.from_json(json.dumps({**older, "merge": "soft"}), source="m")


def test_card_is_in_the_onnx_file_and_beside_it(exported, trained):
    path, card, _ = exported
    assert model_card.read_card(path) == card
    assert json.loads((path.parent / "model.json").read_text()) == json.loads(card.to_json())
    assert card.categories == CATEGORIES and card.anchor_sizes == [8, 16, 32, 64, 128]
    assert (card.score_thresh, card.nms_thresh, card.topk_candidates, card.detections_per_img) == (0.2, 0.6, 1000, 100)
    assert (card.merge, card.vote_thresh) == ("nms", 0.8)  # the detector's own: plain NMS
    assert card.pixel_mean == pytest.approx([0.485 * 255, 0.456 * 255, 0.406 * 255])
    assert card.opset >= 18 and card.exporter == "torch.onnx.export(dynamo=True)" and card.trained_precision == "fp32"
    assert card.git_commit == "0" * 40 and card.mlflow_run_id is None
    assert card.cls_loss == "focal"


def test_the_card_carries_how_the_model_scores(trained, exported, monkeypatch):
    """A quality-focal-loss model's card says ``qfl`` (the runtime then scores ``sigmoid(cls)``); a card
    without the field is an older focal-loss model's; another value is refused in one line."""
    monkeypatch.setattr(trained.head, "cls_loss", "qfl")
    card = onnx_export.card_for(trained, categories=CATEGORIES, min_size_test=320, max_size_test=416,
                                size_divisibility=32, max_image_pixels=10**7, opset=18)
    assert card.cls_loss == "qfl" and model_card.ModelCard.from_json(card.to_json(), source="x") == card
    data = json.loads(exported[1].to_json())
    del data["cls_loss"]
    assert model_card.ModelCard.from_json(json.dumps(data), source="old").cls_loss == "focal"
    with pytest.raises(CheckpointError, match="^bad: model card field cls_loss is 'dfl', expected one of focal, qfl$"):
        model_card.ModelCard.from_json(json.dumps({**data, "cls_loss": "dfl"}), source="bad")
    from pipelines.config.schema import CLS_LOSSES

    assert model_card.CLS_LOSSES == CLS_LOSSES


def test_an_onnx_file_without_the_card_is_refused(exported, tmp_path):
    model = onnx.load(exported[0])
    del model.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(model, bare)
    message = (f"{bare}: an ONNX file without a model card (no 'detector.card' in its metadata_props); expected a "
               "detector exported by this project")
    with pytest.raises(CheckpointError) as caught:
        model_card.read_card(bare)
    assert str(caught.value) == message
    with pytest.raises(CheckpointError) as caught:
        OnnxDetector(bare, threads=1)
    assert str(caught.value) == message
    text = tmp_path / "text.onnx"
    text.write_text("hello\n")
    for read in (model_card.read_card, lambda p: OnnxDetector(p, threads=1)):
        with pytest.raises(CheckpointError, match=rf"^{text}: not a readable ONNX file|^{text}: ONNX Runtime cannot"):
            read(text)


def test_a_bf16_channels_last_model_exports_as_fp32(trained):
    """Whatever precision and layout training used, the exported network is the fp32 one, contiguous; the
    card says how it was trained."""
    mixed = build_detector(num_classes=len(CATEGORIES), **TINY, precision="bf16", channels_last=True)
    mixed.load_state_dict(trained.state_dict())
    network = onnx_export.ExportedNetwork(mixed)
    assert all(p.dtype == torch.float32 and p.is_contiguous() for p in network.parameters())
    images = torch.randint(0, 256, (1, 3, 128, 160), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for found, expected in zip(network(images), onnx_export.ExportedNetwork(trained)(images)):
            torch.testing.assert_close(found, expected, rtol=0, atol=0)
    card = onnx_export.card_for(mixed, categories=CATEGORIES, min_size_test=320, max_size_test=416,
                                size_divisibility=32, max_image_pixels=10**7, opset=20)
    assert card.trained_precision == "bf16" and card.precision == "fp32"


def test_the_parity_ap_tolerance_is_one_boxs_worth_where_that_is_more_than_0002(tmp_path):
    """AP may differ by 0.002 between the paths, or by what one detection at one IoU threshold moves where the
    images hold few boxes: 1 / (10 x categories x boxes of the rarest), crowd boxes and other images left out."""
    from pipelines.inference import parity

    boxes = [(1, 1), (1, 1), (1, 2), (1, 2), (1, 2), (2, 1), (3, 2)]  # (image, category)
    gt = {"annotations": [{"image_id": i, "category_id": c, "iscrowd": 0} for i, c in boxes]
          + [{"image_id": 1, "category_id": 3, "iscrowd": 1}]}
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    assert parity.ap_tolerance(tmp_path / "gt.json", [1, 2]) == pytest.approx(1 / (10 * 2 * 3))  # 3 of category 1
    assert parity.ap_tolerance(tmp_path / "gt.json", [9]) == parity.AP_TOLERANCE  # no box: the fixed tolerance
    many = {"annotations": [{"image_id": i, "category_id": 1 + i % 5, "iscrowd": 0} for i in range(600)]}
    (tmp_path / "many.json").write_text(json.dumps(many))
    assert parity.ap_tolerance(tmp_path / "many.json", range(600)) == parity.AP_TOLERANCE  # 1 / 6000 < 0.002
    within = parity.Parity(0.0, 1.0, 10, 0.020, 0.0175, 0.004, 0.004, ap_tolerance=1 / 60)
    assert within.failures() == []
    assert parity.Parity(0.0, 1.0, 10, 0.020, 0.0175, 0.004, 0.004).failures() == [
        "ap_onnx 0.0175 against ap_torch 0.02 (within 0.002)"]
