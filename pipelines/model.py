"""The detector: torchvision's FCOS, fed padded ``uint8`` batches from our loader.

:class:`Detector` keeps FCOS's backbone, head, target assignment, losses and post-processing, and
replaces only its input transform: our loader already resized and padded the images, so the model
just normalises them. Backbone and head run under bf16 autocast when asked; head outputs are cast
back to fp32 before the loss and box decoding (bf16 would round box positions to about 2 px).
"""

from __future__ import annotations

import torch
import torchvision
from torch import Tensor, nn
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.fcos import FCOS, FCOSHead
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import FrozenBatchNorm2d
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

from .data.transforms import IMAGE_MEAN, IMAGE_STD

NORM_LAYERS = {
    "batchnorm": nn.BatchNorm2d,
    "groupnorm": lambda channels: nn.GroupNorm(32, channels),
    "frozen_batchnorm": FrozenBatchNorm2d,  # from scratch this means no normalisation at all
}


def build_backbone(*, backbone: str, norm: str, fpn_channels: int) -> BackboneWithFPN:
    """A ResNet (random weights) with an FPN over C3-C5 plus P6-P7: FCOS's five strides 8..128."""
    body = getattr(torchvision.models, backbone)(weights=None, norm_layer=NORM_LAYERS[norm])
    stage1 = body.inplanes // 8  # channels of layer1's output (inplanes ends as layer4's)
    return BackboneWithFPN(
        body,
        return_layers={"layer2": "0", "layer3": "1", "layer4": "2"},
        in_channels_list=[stage1 * 2, stage1 * 4, stage1 * 8],
        out_channels=fpn_channels,
        extra_blocks=LastLevelP6P7(fpn_channels, fpn_channels),
    )


class Detector(FCOS):
    """FCOS whose ``forward(images, image_sizes, targets)`` takes a padded ``uint8`` batch.

    Training returns the loss dict (``classification``, ``bbox_regression``, ``bbox_ctrness``);
    evaluation returns one dict per image with ``boxes`` (xyxy in the resized image), ``scores`` and
    ``labels`` (contiguous).
    """

    def __init__(self, backbone: nn.Module, num_classes: int, *, head_convs: int, precision: str = "fp32",
                 channels_last: bool = False, **fcos_kwargs):
        head = FCOSHead(backbone.out_channels, 1, num_classes, num_convs=head_convs)
        super().__init__(backbone, num_classes, head=head, **fcos_kwargs)
        self.autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        self.channels_last = channels_last
        self.register_buffer("pixel_mean", torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("pixel_std", torch.tensor(IMAGE_STD).view(1, 3, 1, 1) * 255, persistent=False)
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def forward(self, images: Tensor, image_sizes: list[tuple[int, int]], targets: list[dict[str, Tensor]] | None = None):
        x = (images.float() - self.pixel_mean) / self.pixel_std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None):
            features = list(self.backbone(x).values())
            head_outputs = self.head(features)
        head_outputs = {k: v.float() for k, v in head_outputs.items()}

        # The anchor generator reads only shapes (and dtype) of the feature maps.
        grids = [torch.empty(f.shape[-2:], device=x.device) for f in features]
        anchors = self.anchor_generator(ImageList(x, image_sizes), grids)
        num_anchors_per_level = [f.shape[-2] * f.shape[-1] for f in features]

        if self.training:
            if targets is None:
                raise ValueError("targets are required in training mode")
            return self.compute_loss(targets, head_outputs, anchors, num_anchors_per_level)

        split_outputs = {k: list(v.split(num_anchors_per_level, dim=1)) for k, v in head_outputs.items()}
        split_anchors = [list(a.split(num_anchors_per_level)) for a in anchors]
        return self.postprocess_detections(split_outputs, split_anchors, image_sizes)


def build_detector(*, num_classes: int, backbone: str = "resnet18", norm: str = "batchnorm", fpn_channels: int = 128,
                   head_convs: int = 2, precision: str = "fp32", channels_last: bool = False,
                   score_thresh: float = 0.05, nms_thresh: float = 0.6, detections_per_img: int = 100,
                   topk_candidates: int = 1000) -> Detector:
    """Build a randomly initialised :class:`Detector` (nothing is downloaded)."""
    return Detector(
        build_backbone(backbone=backbone, norm=norm, fpn_channels=fpn_channels),
        num_classes,
        head_convs=head_convs,
        precision=precision,
        channels_last=channels_last,
        score_thresh=score_thresh,
        nms_thresh=nms_thresh,
        detections_per_img=detections_per_img,
        topk_candidates=topk_candidates,
    )
