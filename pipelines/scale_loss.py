"""FCOS's loss by object scale: the measurement Scale-aware AutoAugment's search scores candidates with.

:class:`ScaleLossHead` is torchvision's ``FCOSHead`` (same parameters, same loss, bit for bit) that,
while ``bounds`` is set, also adds the loss of every positive location into bins by the area of the
ground-truth box the location is matched to, as the original search does: bin 0 holds areas below
``bounds[0]``, bin k areas from ``bounds[k-1]`` up to ``bounds[k]``, the last bin the rest (areas in
pixels of the resized training image, so with the original's bounds (2048, 10240, 51200) the 4 bins
are small, medium, large and very large objects). What goes in:

* a location's classification loss: its sigmoid focal loss summed over the classes, as FCOS sums it (its
  quality focal loss with ``cls_loss="qfl"``);
* its regression loss: the GIoU loss of its decoded box against the matched box;
* not the centerness loss, which the original's bins leave out too (centerness measures where in a
  box a location sits, not how well the box was found);
* not the background locations' classification loss, which belongs to no object.

A box whose area is exactly on a bound counts in the upper bin. The original's strict comparisons
put it in no bin at all, which drops its loss from the score; with real boxes (float areas after
resizing) the difference is rare. The sums are not divided by the number of positive locations: the
search's score divides the bins by their total.

With ``cls_loss="qfl"`` (``model.cls_loss``) the head trains GFL's quality focal loss instead (Li et al., NeurIPS
2020): at a positive location the target of its ground truth's class is the IoU of the location's decoded box
with that ground-truth box (detached), elsewhere 0; the loss is :func:`quality_focal_loss` (beta 2) summed and
divided by the number of positive locations, as the focal loss is. The centerness branch is not trained (its
loss is 0, kept as a term so that every parameter gets a gradient, as DDP requires) and the detector scores
``sigmoid(cls)`` without it (:meth:`pipelines.model.Detector.postprocess_detections`).

Two details of the official FCOS that torchvision's loss leaves out, each optional: ``centerness_weighted_giou``
weighs each positive location's GIoU loss by its centerness target and divides the sum by the sum of those
targets (instead of by the number of positives); ``sync_num_pos`` divides by the number of positive locations
(and the centerness targets' sum) averaged over the training processes, all-reduced, instead of this process's.
The bins above keep the unweighted GIoU loss.

With ``dfl_bins`` (``model.dfl_bins``) the box branch is :class:`~pipelines.box_head.BoxRegressionHead`'s
distribution and the loss adds ``bbox_dfl``: the distribution focal loss of each positive location (the mean over
its four sides, targets in anchor sizes), weighted and normalised as its GIoU loss, times ``DFL_WEIGHT``; the GIoU
loss is on the box decoded from the expectation. With ``learn_scales`` alone the loss is torchvision's.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor
from torch import distributed as dist
from torch.nn import functional as F
from torch import nn
from torchvision.models.detection._utils import BoxLinearCoder
from torchvision.models.detection.fcos import FCOSClassificationHead, FCOSHead
from torchvision.ops import generalized_box_iou_loss, sigmoid_focal_loss

from .box_head import DFL_WEIGHT, BoxRegressionHead, distribution_focal_loss
from .config.schema import registry

SEARCH_BOUNDS = (2048.0, 10240.0, 51200.0)  # the original search's bins, in pixels of the resized image
QFL_BETA = 2.0  # GFL's


def quality_focal_loss(logits: Tensor, targets: Tensor, beta: float = QFL_BETA) -> Tensor:
    """GFL's quality focal loss per element: ``BCE(sigmoid(logits), targets) * |targets - sigmoid(logits)| ** beta``
    (``targets`` in [0, 1]: 0 for background, the box quality at a positive's class)."""
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="none") * (targets - logits.sigmoid()).abs().pow(beta)


# model.cls_loss: the names config validation accepts are these keys (config.registry); each is the
# classification loss per element given its targets (one-hot for focal, the positives' IoU for qfl).
CLS_LOSSES = registry("model.cls_loss", {"focal": partial(sigmoid_focal_loss, reduction="none"),
                                         "qfl": quality_focal_loss})


def paired_iou(a: Tensor, b: Tensor) -> Tensor:
    """The IoU of each box of ``a`` (``[K, 4]`` xyxy) with the box of ``b`` in the same row."""
    inter = ((torch.minimum(a[:, 2], b[:, 2]) - torch.maximum(a[:, 0], b[:, 0])).clamp(min=0)
             * (torch.minimum(a[:, 3], b[:, 3]) - torch.maximum(a[:, 1], b[:, 1])).clamp(min=0))
    union = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1]) + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    return inter / union.clamp(min=torch.finfo(union.dtype).eps)


class ScaleLossHead(FCOSHead):
    """``FCOSHead`` whose loss, while :attr:`bounds` is set, also sums into :attr:`scale_losses`
    (one value per bin, accumulated over calls until :meth:`take_scale_losses`)."""

    def __init__(self, in_channels: int, num_anchors: int, num_classes: int, num_convs: int = 4, *,
                 cls_loss: str = "focal", centerness_weighted_giou: bool = False, sync_num_pos: bool = False,
                 levels: int = 5, learn_scales: bool = False, dfl_bins: int | None = None):
        if not learn_scales and dfl_bins is None:
            super().__init__(in_channels, num_anchors, num_classes, num_convs)  # torchvision's head, as it is
        else:  # FCOSHead.__init__ with its box branch replaced, drawing the same random numbers in the same order
            nn.Module.__init__(self)
            self.box_coder = BoxLinearCoder(normalize_by_size=True)
            self.classification_head = FCOSClassificationHead(in_channels, num_anchors, num_classes, num_convs)
            self.regression_head = BoxRegressionHead(in_channels, num_anchors, num_convs, levels=levels,
                                                     learn_scales=learn_scales, dfl_bins=dfl_bins)
        if cls_loss not in CLS_LOSSES:
            raise ValueError(f"cls_loss: expected one of {', '.join(CLS_LOSSES)}, got {cls_loss!r}")
        self.dfl_bins = dfl_bins
        self.cls_loss = cls_loss
        self.centerness_weighted_giou = bool(centerness_weighted_giou)
        self.sync_num_pos = bool(sync_num_pos)
        self.bounds: tuple[float, ...] | None = None
        self.scale_losses: Tensor | None = None

    def measure_scales(self, bounds: Sequence[float] | None = SEARCH_BOUNDS) -> None:
        """Start adding the loss into bins at ``bounds`` (increasing areas); ``None`` stops it."""
        if bounds is not None and any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"scale bounds must increase, got {list(bounds)}")
        self.bounds = tuple(float(b) for b in bounds) if bounds is not None else None
        self.scale_losses = None

    def take_scale_losses(self) -> Tensor:
        """The bins summed since the last call (zeros if nothing was added), and start again."""
        if self.bounds is None:
            raise RuntimeError("measure_scales() was not called")
        taken = self.scale_losses if self.scale_losses is not None else torch.zeros(len(self.bounds) + 1, dtype=torch.float64)
        self.scale_losses = None
        return taken

    def forward(self, x: list[Tensor]) -> dict[str, Tensor]:
        """``FCOSHead.forward``; with :class:`~pipelines.box_head.BoxRegressionHead`'s distribution, also its
        logits as ``bbox_distribution`` ``[N, HWA, 4, dfl_bins + 1]``."""
        if not isinstance(self.regression_head, BoxRegressionHead):
            return super().forward(x)
        regression, ctrness, distribution = self.regression_head(x)
        outputs = {"cls_logits": self.classification_head(x), "bbox_regression": regression, "bbox_ctrness": ctrness}
        if distribution is not None:
            outputs["bbox_distribution"] = distribution
        return outputs

    def compute_loss(self, targets: list[dict[str, Tensor]], head_outputs: dict[str, Tensor], anchors: list[Tensor],
                     matched_idxs: list[Tensor]) -> dict[str, Tensor]:
        if (self.cls_loss == "focal" and not self.centerness_weighted_giou and not self.sync_num_pos
                and self.dfl_bins is None):
            losses = super().compute_loss(targets, head_outputs, anchors, matched_idxs)  # torchvision's, as it is
        else:
            losses = self._loss(targets, head_outputs, anchors, matched_idxs)
        if self.bounds is not None:
            with torch.no_grad():
                bins = scale_binned_loss(targets, head_outputs, anchors, matched_idxs, box_coder=self.box_coder,
                                         bounds=self.bounds, cls_loss=self.cls_loss)
            self.scale_losses = bins if self.scale_losses is None else self.scale_losses + bins
        return losses

    def _loss(self, targets: list[dict[str, Tensor]], head_outputs: dict[str, Tensor], anchors: list[Tensor],
              matched_idxs: list[Tensor]) -> dict[str, Tensor]:
        """The loss with the quality focal loss or the official FCOS's details (see the module's docstring)."""
        cls_logits, bbox_regression = head_outputs["cls_logits"], head_outputs["bbox_regression"]
        classes, boxes = [], []
        for target, matched in zip(targets, matched_idxs):
            if len(target["labels"]) == 0:
                classes.append(target["labels"].new_full((len(matched),), -1))
                boxes.append(target["boxes"].new_zeros((len(matched), 4)))
            else:
                classes.append(torch.where(matched >= 0, target["labels"][matched.clip(min=0)], -1))
                boxes.append(target["boxes"][matched.clip(min=0)])
        classes, boxes, anchors = torch.stack(classes), torch.stack(boxes), torch.stack(anchors)
        foreground = classes >= 0
        num_foreground = foreground.sum().item()
        normaliser = max(1.0, self._over_processes(float(num_foreground)))
        predicted = self.box_coder.decode(bbox_regression, anchors)[foreground]
        matched_boxes = boxes[foreground]
        cls_targets = torch.zeros_like(cls_logits)
        if self.cls_loss == "focal":
            cls_targets[foreground, classes[foreground]] = 1.0
            classification = CLS_LOSSES["focal"](cls_logits, cls_targets).sum()
        else:
            quality = paired_iou(predicted.detach(), matched_boxes).to(cls_targets.dtype)
            cls_targets[foreground, classes[foreground]] = quality
            classification = CLS_LOSSES["qfl"](cls_logits, cls_targets).sum()
        distances = self.box_coder.encode(anchors[foreground], matched_boxes)  # in anchor sizes
        centerness = centerness_targets(distances)
        giou = generalized_box_iou_loss(predicted, matched_boxes, reduction="none")
        if self.centerness_weighted_giou:
            box_weights, box_normaliser = centerness, max(1e-6, self._over_processes(centerness.sum().item()))
            regression = (giou * centerness).sum() / box_normaliser
        else:
            box_weights, box_normaliser = None, normaliser
            regression = giou.sum() / normaliser
        if self.cls_loss == "focal":
            ctrness = F.binary_cross_entropy_with_logits(head_outputs["bbox_ctrness"].squeeze(dim=2)[foreground],
                                                         centerness, reduction="sum") / normaliser
        else:
            ctrness = head_outputs["bbox_ctrness"].sum() * 0.0  # not trained; a term for DDP's gradients
        losses = {"classification": classification / normaliser, "bbox_regression": regression, "bbox_ctrness": ctrness}
        if self.dfl_bins is not None:  # per location the mean over its four sides, weighted as its GIoU loss
            dfl = distribution_focal_loss(head_outputs["bbox_distribution"][foreground], distances).mean(dim=-1)
            dfl = dfl if box_weights is None else dfl * box_weights
            losses["bbox_dfl"] = DFL_WEIGHT * dfl.sum() / box_normaliser
        return losses

    def _over_processes(self, value: float) -> float:
        """With ``sync_num_pos``, ``value``'s mean over the training processes (the official FCOS's
        ``reduce_sum / num_gpus``); without, or in one process, ``value``."""
        if not (self.sync_num_pos and dist.is_available() and dist.is_initialized()):
            return value
        total = torch.tensor([value], dtype=torch.float64,
                             device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(total)
        return total.item() / dist.get_world_size()


def centerness_targets(reg_targets: Tensor) -> Tensor:
    """FCOS's centerness target of locations whose regression targets (distances to the left, top, right and
    bottom sides) are ``reg_targets`` ``[K, 4]``: ``sqrt(min(l, r) / max(l, r) * min(t, b) / max(t, b))``."""
    left_right, top_bottom = reg_targets[:, [0, 2]], reg_targets[:, [1, 3]]
    return torch.sqrt((left_right.min(dim=-1)[0] / left_right.max(dim=-1)[0])
                      * (top_bottom.min(dim=-1)[0] / top_bottom.max(dim=-1)[0]))


def scale_binned_loss(targets: list[dict[str, Tensor]], head_outputs: dict[str, Tensor], anchors: list[Tensor],
                      matched_idxs: list[Tensor], *, box_coder, bounds: Sequence[float], cls_loss: str = "focal") -> Tensor:
    """Classification (``cls_loss``'s) plus regression loss of the positive locations, summed per area bin (on
    the CPU, float64, ``len(bounds) + 1`` values); the inputs are those of ``FCOSHead.compute_loss``."""
    bins = torch.zeros(len(bounds) + 1, dtype=torch.float64)
    edges = torch.tensor(list(bounds), dtype=torch.float32)
    for i, (target, matched) in enumerate(zip(targets, matched_idxs)):
        positive = matched >= 0
        if not positive.any():
            continue
        boxes = target["boxes"][matched[positive]].float()
        logits = head_outputs["cls_logits"][i][positive].float()
        onehot = torch.zeros_like(logits)
        predicted = box_coder.decode(head_outputs["bbox_regression"][i][positive].float()[None],
                                     anchors[i][positive][None])[0]
        if cls_loss == "focal":
            onehot[torch.arange(len(boxes)), target["labels"][matched[positive]]] = 1.0
            classification = sigmoid_focal_loss(logits, onehot, reduction="none").sum(dim=1)
        else:
            onehot[torch.arange(len(boxes)), target["labels"][matched[positive]]] = paired_iou(predicted, boxes)
            classification = quality_focal_loss(logits, onehot).sum(dim=1)
        regression = generalized_box_iou_loss(predicted, boxes, reduction="none")
        areas = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).cpu()
        which = torch.bucketize(areas, edges, right=True)  # bounds[k-1] <= area < bounds[k]
        bins.index_add_(0, which, (classification + regression).detach().cpu().double())
    return bins
