import pytest
import torch
import torchvision
from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
from torchvision.ops import FrozenBatchNorm2d

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


def _recognisable_resnet18_state(seed: int = 7) -> dict[str, torch.Tensor]:
    """A resnet18 state dict whose every entry differs from any random initialisation."""
    generator = torch.Generator().manual_seed(seed)
    return {k: (torch.rand(v.shape, generator=generator) + 10.0 if v.is_floating_point() else v)
            for k, v in torchvision.models.resnet18().state_dict().items()}


@pytest.mark.parametrize("wrap", [None, "state_dict", "model"])
def test_backbone_weights_from_a_local_state_dict_file(tmp_path, wrap):
    state = _recognisable_resnet18_state()
    path = tmp_path / "r18.pth"
    torch.save(state if wrap is None else {wrap: state, "epoch": 3}, path)
    torch.manual_seed(0)
    model = build_detector(num_classes=2, backbone="resnet18", fpn_channels=32, head_convs=1, backbone_weights=path)
    body = model.backbone.body.state_dict()
    assert set(body) == {k for k in state if not k.startswith("fc.")}
    assert all(torch.equal(body[k], state[k]) for k in body)
    # The body is initialised at random first: the FPN and head are the same as without weights.
    torch.manual_seed(0)
    scratch = build_detector(num_classes=2, backbone="resnet18", fpn_channels=32, head_convs=1)
    rest = {k: v for k, v in scratch.state_dict().items() if not k.startswith("backbone.body.")}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in rest.items())
    assert not any(torch.equal(scratch.state_dict()["backbone.body." + k], v) for k, v in body.items()
                   if v.is_floating_point())


@pytest.mark.parametrize("trainable_layers", [0, 1, 2, 3, 4, 5])
def test_trainable_layers_freeze_what_torchvision_freezes(trainable_layers):
    model = build_detector(num_classes=2, norm="frozen_batchnorm", trainable_layers=trainable_layers,
                           fpn_channels=32, head_convs=1)
    reference = _resnet_fpn_extractor(torchvision.models.resnet18(norm_layer=FrozenBatchNorm2d), trainable_layers,
                                      returned_layers=[2, 3, 4])
    ours = {n: p.requires_grad for n, p in model.backbone.body.named_parameters()}
    assert ours == {n: p.requires_grad for n, p in reference.body.named_parameters()}
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("backbone.body."))


def test_frozen_batchnorm_with_three_trainable_stages_trains_only_those(tmp_path):
    path = tmp_path / "r18.pth"
    torch.save(_recognisable_resnet18_state(), path)
    model = build_detector(num_classes=3, norm="frozen_batchnorm", backbone_weights=str(path), trainable_layers=3,
                           fpn_channels=32, head_convs=1)
    body = model.backbone.body
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, FrozenBatchNorm2d) for m in body.modules()) == 20  # every norm of resnet18
    frozen = {n for n, p in body.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in body.named_parameters() if n.startswith(("conv1.", "layer1."))} and frozen
    before = {k: v.clone() for k, v in model.state_dict().items()}

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    images, sizes, targets = _batch()
    model.train()
    sum(model(images, sizes, targets).values()).backward()
    optimizer.step()
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    frozen_stages = tuple(f"backbone.body.{name}." for name in ("conv1", "bn1", "layer1"))
    assert not {k for k in changed if k.startswith(frozen_stages)}
    assert not {k for k in changed if "running_" in k}  # frozen statistics stay in training mode
    assert any(k.startswith("backbone.body.layer4.") for k in changed) and any(k.startswith("head.") for k in changed)
