"""The box branch's levers (pipelines/box_head.py, issue 35): ``model.learn_scales``, a learnable scale per
pyramid level, and ``model.dfl_bins``, GFL's distribution with its distribution focal loss. Off, today's
model bit for bit; on, the head as specified, a loss that trains, checkpoints that load back and an ONNX
export with parity."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torchvision.models.detection.fcos import FCOSHead, FCOSRegressionHead

from pipelines import checkpoint
from pipelines.box_head import DFL_WEIGHT, BoxRegressionHead, distribution_focal_loss, expectation
from pipelines.build import model as build_model
from pipelines.config.load import params_from_dict
from pipelines.data.collate import pad_images
from pipelines.errors import CheckpointError, ConfigError
from pipelines.hardware import resolve
from pipelines.inference import onnx_export, preprocess
from pipelines.inference.card import OUTPUT_KINDS
from pipelines.inference.onnx_runtime import OnnxDetector
from pipelines.model import LEVELS, build_detector
from pipelines.solver import build_optimizer

from .conftest import scene as _scene
from .conftest import set_dotted, spy_on_head_loss
from .test_onnx_export import _match_rate, _spread

pytestmark = pytest.mark.usefixtures("one_thread")

CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 3, "name": "square"}, {"id": 7, "name": "triangle"}]
SMALL = dict(num_classes=3, backbone="resnet10", fpn_channels=32, head_convs=1)
CPU = torch.device("cpu")


def _params(base: dict, **changes):
    raw = copy.deepcopy(base)
    for key, value in {"model.precision": "fp32", "model.channels_last": False, **changes}.items():
        set_dotted(raw, key, value)
    return params_from_dict(raw, source="params.yaml")


def _detector(p):
    torch.manual_seed(0)
    return build_model.detector(p, num_classes=3, compute=resolve("fp32", False, CPU))


def _batch():
    gen = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 255, (3, 128, 160), dtype=torch.uint8, generator=gen) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[20.0, 30.0, 70.0, 90.0], [90.0, 10.0, 150.0, 50.0]]), "labels": torch.tensor([0, 2])},
               {"boxes": torch.tensor([[10.0, 10.0, 120.0, 100.0]]), "labels": torch.tensor([1])}]
    return pad_images(images, 32), [(128, 160)] * 2, targets


def _train(model, steps: int) -> list[dict[str, float]]:
    """``steps`` AdamW steps on :func:`_batch` (the solver's groups); the losses of each step."""
    model.train()
    optimizer = build_optimizer(model, name="adamw", base_lr=1e-3, weight_decay=0.05)
    batch, seen = _batch(), []
    for _ in range(steps):
        losses = model(*batch)
        optimizer.zero_grad()
        sum(losses.values()).backward()
        optimizer.step()
        seen.append({k: v.item() for k, v in losses.items()})
    return seen


def _small(**levers):
    torch.manual_seed(0)
    return build_detector(**SMALL, **levers).train()


# --- off: today's model ------------------------------------------------------------------------------------------------


def test_off_is_torchvisions_head_and_trains_as_before(base_params):
    """With both off (``dfl_bins`` is 16 in the default params since it was adopted) the params build
    torchvision's box branch itself: the same state dict keys and, after two steps, the same losses and weights
    bit for bit as the detector built without the levers."""
    p = _params(base_params, **{"model.dfl_bins": None})
    assert (p.model.learn_scales, p.model.dfl_bins) == (False, None)
    model = _detector(p)
    assert type(model.head.regression_head) is FCOSRegressionHead
    assert model.head.dfl_bins is None
    torch.manual_seed(0)
    before = build_detector(num_classes=3, backbone=p.model.backbone, norm=p.model.norm, fpn_channels=p.model.fpn_channels,
                            head_convs=p.model.head_convs, score_thresh=p.model.score_thresh)
    assert list(model.state_dict()) == list(before.state_dict())
    assert not any("scales" in k for k in model.state_dict())
    assert model.head.regression_head.bbox_reg.out_channels == 4
    assert _train(model, 2) == _train(before, 2)
    for (key, a), b in zip(model.state_dict().items(), before.state_dict().values()):
        assert torch.equal(a, b), key
    # torchvision's own FCOSHead forward, not the branch's
    torch.manual_seed(0)
    head = FCOSHead(32, 1, 3, num_convs=1)
    small = _small()
    head.load_state_dict(small.head.state_dict())
    features = [torch.randn(1, 32, s, s, generator=torch.Generator().manual_seed(s)) for s in (16, 8, 4, 2, 2)]
    ours, theirs = small.head(features), head(features)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


# --- model.learn_scales ------------------------------------------------------------------------------------------------


def test_learn_scales_adds_one_scale_per_level_initialised_to_one_and_nothing_else():
    """The scales are the only new parameters: every other starts as the default's (the same random numbers
    drawn in the same order), so the first outputs and loss are the default's."""
    plain, scaled = _small(), _small(learn_scales=True)
    assert isinstance(scaled.head.regression_head, BoxRegressionHead)
    state, default = scaled.state_dict(), plain.state_dict()
    assert set(state) - set(default) == {"head.regression_head.scales"} and set(default) <= set(state)
    assert torch.equal(state["head.regression_head.scales"], torch.ones(LEVELS))
    assert all(torch.equal(default[k], state[k]) for k in default)
    batch = _batch()
    a, b = plain(*batch), scaled(*batch)
    assert all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)


def test_each_levels_scale_multiplies_its_regression_before_the_relu():
    model = _small(learn_scales=True).eval()
    features = [torch.randn(1, 32, s, s, generator=torch.Generator().manual_seed(s)) for s in (16, 8, 4, 2, 2)]
    sizes = [s * s for s in (16, 8, 4, 2, 2)]
    with torch.no_grad():
        before = model.head(features)["bbox_regression"].split(sizes, dim=1)
        model.head.regression_head.scales.copy_(torch.tensor([1.0, 2.0, 1.0, -1.0, 0.5]))
        after = model.head(features)["bbox_regression"].split(sizes, dim=1)
        raw = [model.head.regression_head.bbox_reg(model.head.regression_head.conv(f)) for f in features]
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[1], 2 * before[1])
    torch.testing.assert_close(after[4], 0.5 * before[4])
    negative = torch.relu(-raw[3]).permute(0, 2, 3, 1).reshape(1, -1, 4)  # the scale applies before the ReLU
    torch.testing.assert_close(after[3], negative)
    assert before[3].any() and after[3].any()  # the ReLU passes distances of either sign of the raw output


def test_learn_scales_trains_the_scales_without_weight_decay():
    model = _small(learn_scales=True)
    optimizer = build_optimizer(model, name="adamw", base_lr=1e-3, weight_decay=0.05)
    scales = model.head.regression_head.scales
    assert any(q is scales for q in optimizer.param_groups[1]["params"]) and optimizer.param_groups[1]["weight_decay"] == 0
    totals = [sum(step.values()) for step in _train(model, 6)]
    assert all(math.isfinite(t) for t in totals) and totals[-1] < totals[0]
    assert not torch.equal(scales.detach(), torch.ones(LEVELS))


# --- model.dfl_bins ------------------------------------------------------------------------------------------------------


def test_the_distribution_focal_loss_is_the_formula():
    logits = torch.randn(5, 9, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0.0, 2.3, 7.5, 8.0, 12.0])  # the last two clamp to 8 - 0.01
    log_p = torch.log_softmax(logits, dim=-1)
    clamped = targets.clamp(max=8 - 0.01)
    left = clamped.floor().long()
    expected = -((left + 1 - clamped) * log_p[torch.arange(5), left] + (clamped - left) * log_p[torch.arange(5), left + 1])
    torch.testing.assert_close(distribution_focal_loss(logits, targets), expected)
    torch.testing.assert_close(distribution_focal_loss(logits, targets)[1],
                               -(0.7 * log_p[1, 2] + 0.3 * log_p[1, 3]))
    peaked = torch.full((1, 9), -30.0)
    peaked[0, 3] = 30.0
    assert distribution_focal_loss(peaked, torch.tensor([3.0]))[0] < 1e-6  # all on the target's bin: no loss
    torch.testing.assert_close(expectation(logits), (logits.softmax(-1) * torch.arange(9.0)).sum(-1))


def test_dfl_head_predicts_a_distribution_per_side_and_decodes_its_expectation():
    model = _small(dfl_bins=8)
    assert model.head.regression_head.bbox_reg.out_channels == 4 * 9
    assert not any("scales" in k for k in model.state_dict())
    seen = spy_on_head_loss(model)
    model(*_batch())
    outputs = seen["outputs"]
    locations = sum(h * w for h, w in ((16, 20), (8, 10), (4, 5), (2, 3), (1, 2)))  # 128 x 160, strides 8..128
    assert outputs["bbox_distribution"].shape == (2, locations, 4, 9)
    assert outputs["bbox_regression"].shape == (2, locations, 4)
    torch.testing.assert_close(outputs["bbox_regression"],
                               (outputs["bbox_distribution"].softmax(-1) * torch.arange(9.0)).sum(-1))
    # at init the distribution is nearly uniform: every distance is about n / 2
    assert (outputs["bbox_regression"] - 4).abs().max() < 1
    # the channels of one location are its sides' bins, side by side
    model.eval()
    with torch.no_grad():
        feature = torch.randn(1, 32, 3, 4)
        raw = model.head.regression_head.bbox_reg(model.head.regression_head.conv(feature))  # [1, 36, 3, 4]
        _, _, logits = model.head.regression_head([feature])
    torch.testing.assert_close(logits[0, 1 * 4 + 2], raw[0, :, 1, 2].reshape(4, 9), rtol=0, atol=0)


def test_dfl_loss_is_the_weighted_cross_entropy_of_the_positives_sides_plus_giou_on_the_decoded_box():
    model = _small(dfl_bins=8)
    seen = spy_on_head_loss(model)
    batch = _batch()
    losses = model(*batch)
    assert set(losses) == {"classification", "bbox_regression", "bbox_ctrness", "bbox_dfl"}
    dfl, giou, positives = 0.0, 0.0, 0
    from torchvision.ops import generalized_box_iou_loss

    for i, target in enumerate(batch[2]):
        matched = seen["matched"][i]
        for location in torch.nonzero(matched >= 0).flatten().tolist():
            box = target["boxes"][matched[location]]
            anchor = seen["anchors"][i][location]
            size = anchor[2] - anchor[0]
            centre = (anchor[:2] + anchor[2:]) / 2
            sides = torch.cat([centre - box[:2], box[2:] - centre]) / size  # l, t, r, b in anchor sizes
            sides = sides.clamp(0, 8 - 0.01)
            log_p = torch.log_softmax(seen["outputs"]["bbox_distribution"][i][location].double(), dim=-1)
            low = sides.floor().long()
            weight = (low + 1 - sides).double()
            dfl += (-(weight * log_p[range(4), low] + (1 - weight) * log_p[range(4), low + 1])).mean().item()
            predicted = model.head.box_coder.decode(seen["outputs"]["bbox_regression"][i][location][None, None],
                                                    anchor[None])[0]
            giou += generalized_box_iou_loss(predicted, box[None]).item()
            positives += 1
    assert positives > 5
    assert losses["bbox_dfl"].item() == pytest.approx(DFL_WEIGHT * dfl / positives, rel=1e-5)
    assert losses["bbox_regression"].item() == pytest.approx(giou / positives, rel=1e-5)


@pytest.mark.parametrize("levers", [{"dfl_bins": 8}, {"dfl_bins": 16, "learn_scales": True, "cls_loss": "qfl"},
                                    {"dfl_bins": 8, "centerness_weighted_giou": True}],
                         ids=["dfl8", "dfl16-scales-qfl", "dfl8-weighted"])
def test_a_dfl_detector_overfits_a_batch_and_detects(levers):
    model = _small(**levers)
    steps = _train(model, 6)
    assert all(math.isfinite(v) for step in steps for v in step.values())
    assert steps[-1]["bbox_dfl"] < steps[0]["bbox_dfl"] and sum(steps[-1].values()) < sum(steps[0].values())
    model.eval()
    with torch.no_grad():
        found = model(*_batch()[:2])
    assert len(found) == 2 and all(torch.isfinite(f["boxes"]).all() for f in found)


# --- both: params, checkpoints, export ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "message"), [
    ("model.dfl_bins", 1, "params.yaml: model.dfl_bins: expected null or a number of bins from 2 to 64 "
                          "(distances 0..n strides per side), got 1"),
    ("model.dfl_bins", 65, "params.yaml: model.dfl_bins: expected null or a number of bins from 2 to 64"),
    ("model.dfl_bins", "eight", "params.yaml: model.dfl_bins: expected an integer, got 'eight'"),
    ("model.dfl_bins", 8.5, "params.yaml: model.dfl_bins: expected an integer, got 8.5"),
    ("model.learn_scales", "maybe", "params.yaml: model.learn_scales: expected true or false, got 'maybe'"),
    ("model.learn_scales", KeyError, "params.yaml: model.learn_scales: missing value"),
])
def test_bad_values_stop_with_one_line_naming_the_param(base_params, key, value, message):
    with pytest.raises(ConfigError) as err:
        _params(base_params, **{key: value})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("levers", [{"model.learn_scales": True}, {"model.dfl_bins": 8},
                                    {"model.learn_scales": True, "model.dfl_bins": 8}],
                         ids=["scales", "dfl", "both"])
def test_a_checkpoint_round_trips_with_the_levers_and_is_refused_without_them(base_params, tmp_path, levers):
    p = _params(base_params, **levers)
    model = _detector(p)
    _train(model, 2)
    if p.model.learn_scales:
        assert not torch.equal(model.head.regression_head.scales.detach(), torch.ones(LEVELS))
    path = tmp_path / "model_final.pth"
    checkpoint.save(path, model=model.state_dict(), categories=CATEGORIES, iteration=2, precision="fp32",
                    channels_last=False)
    loaded, _, iteration = build_model.trained_detector(p, path, device=CPU)
    assert iteration == 2
    for (key, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), key
    model.eval(), loaded.eval()
    with torch.no_grad():
        images, sizes, _ = _batch()
        a, b = model(images, sizes), loaded(images, sizes)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    with pytest.raises(CheckpointError, match=r"model_final.pth: does not match params.yaml's model section \("):
        build_model.trained_detector(_params(base_params), path, device=CPU)


def _exportable(**levers):
    torch.manual_seed(0)
    model = build_detector(num_classes=3, backbone="resnet10", norm="batchnorm", fpn_channels=64, head_convs=2,
                           score_thresh=0.2, **levers)
    _spread(model)
    return model.eval()


def _exported_outputs(model, images):
    """The exported module's outputs, and the detector's head outputs on the same images."""
    with torch.no_grad():
        outputs = onnx_export.ExportedNetwork(model)(images)
        x = (images.float() - model.pixel_mean) / model.pixel_std
        head = model.head(list(model.backbone(x).values()))
    return outputs, head


@pytest.mark.parametrize("levers", [{"learn_scales": True}, {"dfl_bins": 8}, {"learn_scales": True, "dfl_bins": 8}],
                         ids=["scales", "dfl", "scales-dfl"])
def test_the_exported_network_applies_each_levels_scale_and_the_expectation(levers):
    """The exported module (built level by level) gives the detector's head outputs, level by level."""
    model = _exportable(**levers)
    images = torch.randint(0, 256, (2, 3, 256, 320), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    outputs, head = _exported_outputs(model, images)
    for k, kind in enumerate(OUTPUT_KINDS):
        levels = outputs[k::3]
        torch.testing.assert_close(torch.cat([o.reshape(2, -1, o.shape[-1]) for o in levels], 1), head[kind],
                                   rtol=0, atol=0)


def test_a_model_with_both_levers_exports_with_parity(tmp_path):
    """onnxruntime's outputs match the exported module's, and the numpy post-processing of them gives the
    detector's detections (the parity the export stage measures, as tests/test_onnx_export.py checks it for
    the default model)."""
    model = _exportable(learn_scales=True, dfl_bins=8)
    images = torch.randint(0, 256, (2, 3, 256, 320), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    outputs, _ = _exported_outputs(model, images)
    path = tmp_path / "model.onnx"
    onnx_export.export(model, path, categories=CATEGORIES, min_size_test=320, max_size_test=416, size_divisibility=32,
                       max_image_pixels=10**7, provenance={"git_commit": "0" * 40, "weights_md5": "f" * 32})
    runtime = OnnxDetector(path, threads=1)
    found = runtime.session.run(None, {"images": images.numpy()})
    assert max(float(np.abs(f - e.numpy()).max()) for f, e in zip(found, outputs)) < 1e-4

    scenes = [_scene(240, 320, 0), _scene(300, 200, 1), _scene(320, 320, 2), _scene(180, 400, 3)]
    batch = preprocess.prepare(scenes, min_size=320, max_size=416, size_divisibility=32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(batch.images), batch.image_sizes)
    ours = runtime.detect(batch.images, batch.image_sizes, thresholds=runtime.thresholds)
    rate, count = _match_rate(ours, theirs)
    assert count >= 50 and rate >= 0.99, (rate, count)
