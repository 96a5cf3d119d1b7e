import pytest
import torch

from pipelines.data.collate import pad_images
from pipelines.model import build_detector


def _batch():
    images = [torch.randint(0, 255, (3, 120, 160), dtype=torch.uint8), torch.randint(0, 255, (3, 128, 100), dtype=torch.uint8)]
    targets = [
        {"boxes": torch.tensor([[10.0, 10.0, 60.0, 70.0], [80.0, 20.0, 150.0, 100.0]]), "labels": torch.tensor([0, 2])},
        {"boxes": torch.tensor([[5.0, 5.0, 40.0, 30.0]]), "labels": torch.tensor([1])},
    ]
    return pad_images(images, 32), [tuple(im.shape[-2:]) for im in images], targets


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_step_and_inference(precision):
    torch.manual_seed(0)
    model = build_detector(num_classes=3, backbone="resnet18", fpn_channels=32, head_convs=1, precision=precision,
                           channels_last=True, score_thresh=0.0)
    images, sizes, targets = _batch()
    model.train()
    losses = model(images, sizes, targets)
    assert set(losses) == {"classification", "bbox_regression", "bbox_ctrness"}
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)

    model.eval()
    with torch.inference_mode():
        detections = model(images, sizes)
    assert len(detections) == 2
    for det, (h, w) in zip(detections, sizes):
        assert det["boxes"].dtype == torch.float32
        assert len(det["boxes"]) > 0 and len(det["boxes"]) <= 100
        assert (det["boxes"][:, 2] <= w).all() and (det["boxes"][:, 3] <= h).all()
        assert det["labels"].max() < 3


def test_norm_choices_and_fpn_width():
    gn = build_detector(num_classes=2, norm="groupnorm", fpn_channels=64, head_convs=1)
    assert any(isinstance(m, torch.nn.GroupNorm) for m in gn.backbone.body.modules())
    assert gn.backbone.out_channels == 64
    bn = build_detector(num_classes=2, norm="batchnorm", fpn_channels=32, head_convs=1)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in bn.backbone.body.modules())
