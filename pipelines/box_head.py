"""The FCOS head's box branch with two training levers: a learnable scale per pyramid level and GFL's distribution.

:class:`BoxRegressionHead` is torchvision's ``FCOSRegressionHead`` (same tower, same centerness, the same
random numbers drawn in the same order) with, each optional:

* ``learn_scales`` (``model.learn_scales``): the official FCOS's ``Scale`` module. The regression output of
  level ``l`` is multiplied by a learnable scalar ``scales[l]`` (initialised to 1.0) before the ReLU, so that
  each level can rescale its distances (torchvision shares one conv across levels without it). The scales
  are one parameter ``scales`` of ``levels`` values, saved with the model.
* ``dfl_bins`` ``n`` (``model.dfl_bins``): GFL's general distribution (Li et al., NeurIPS 2020). The last conv
  outputs, per side (left, top, right, bottom), logits over the ``n + 1`` integer distances ``0..n`` in units
  of the level's anchor size (the stride: the units of torchvision's normalised box targets); the distance is
  the softmax's expectation, computed in fp32 (:func:`expectation`). The branch then returns those logits
  too (``[N, HWA, 4, n + 1]``), for :func:`distribution_focal_loss`. With ``learn_scales`` the scale multiplies
  the logits, as GFL's head does.

The expectation is the ``bbox_regression`` output that the box coder decodes, so the detector's
post-processing, its loss on the decoded box and the exported graph (:mod:`pipelines.inference.onnx_export`,
whose ``bbox_regression`` outputs are these distances) are unchanged. With both levers off the detector
keeps torchvision's ``FCOSRegressionHead`` itself (:class:`pipelines.scale_loss.ScaleLossHead`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torchvision.models.detection.fcos import FCOSRegressionHead

DFL_WEIGHT = 0.25  # mmdet's GFL: loss_dfl=dict(type="DistributionFocalLoss", loss_weight=0.25)
DFL_EPS = 0.01  # the targets are clamped to n - DFL_EPS bins, so that the upper of the two nearest bins exists


class BoxRegressionHead(FCOSRegressionHead):
    """``FCOSRegressionHead`` with a learnable scale per level and/or a distribution over ``dfl_bins + 1``
    distances per side (see the module's docstring). ``levels``: the pyramid levels it serves (one scale each)."""

    def __init__(self, in_channels: int, num_anchors: int, num_convs: int = 4, *, levels: int,
                 learn_scales: bool = False, dfl_bins: int | None = None):
        super().__init__(in_channels, num_anchors, num_convs)
        if dfl_bins is not None and dfl_bins < 1:
            raise ValueError(f"dfl_bins: expected None or a positive number of bins, got {dfl_bins!r}")
        self.dfl_bins = dfl_bins
        if dfl_bins is not None:  # torchvision's init (normal 0.01, bias 0): a uniform distribution at first
            self.bbox_reg = nn.Conv2d(in_channels, num_anchors * 4 * (dfl_bins + 1), kernel_size=3, stride=1, padding=1)
            torch.nn.init.normal_(self.bbox_reg.weight, std=0.01)
            torch.nn.init.zeros_(self.bbox_reg.bias)
        self.scales = nn.Parameter(torch.ones(levels)) if learn_scales else None

    def forward(self, x: list[Tensor], first_level: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
        """The features ``x`` of levels ``first_level, first_level + 1, ...`` to the distances ``[N, HWA, 4]``
        (in anchor sizes), the centerness logits ``[N, HWA, 1]`` and, with ``dfl_bins``, the distance logits
        ``[N, HWA, 4, dfl_bins + 1]`` (else ``None``)."""
        regressions, ctrnesses, distributions = [], [], []
        for level, features in enumerate(x, start=first_level):
            feature = self.conv(features)
            raw = self.bbox_reg(feature)
            if self.scales is not None:
                raw = raw * self.scales[level]
            ctrness = self.bbox_ctrness(feature)
            n, _, h, w = raw.shape
            if self.dfl_bins is None:
                regressions.append(F.relu(raw).view(n, -1, 4, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, 4))
            else:
                bins = self.dfl_bins + 1
                logits = raw.view(n, -1, 4, bins, h, w).permute(0, 4, 5, 1, 2, 3).reshape(n, -1, 4, bins)
                regressions.append(expectation(logits))
                distributions.append(logits)
            ctrnesses.append(ctrness.view(n, -1, 1, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, 1))
        distribution = torch.cat(distributions, dim=1) if distributions else None
        return torch.cat(regressions, dim=1), torch.cat(ctrnesses, dim=1), distribution


def expectation(logits: Tensor) -> Tensor:
    """The expected distance of ``logits`` ``[..., n + 1]`` over the bins ``0..n``: ``sum_i softmax_i * i``, in
    fp32 whatever the logits' dtype (bf16 would round the distance to about 1/32 of a stride)."""
    probabilities = logits.float().softmax(dim=-1)
    bins = torch.arange(logits.shape[-1], dtype=probabilities.dtype, device=probabilities.device)
    return (probabilities * bins).sum(dim=-1)  # elementwise: autocast leaves it in fp32


def distribution_focal_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """GFL's distribution focal loss per element: ``logits`` ``[..., n + 1]`` over the bins ``0..n``, ``targets``
    ``[...]`` distances in bins, clamped to ``[0, n - DFL_EPS]``; the cross-entropy to the two nearest bins
    ``floor(y)`` and ``floor(y) + 1``, weighted linearly by the target's nearness to each:
    ``-((y_r - y) log S_l + (y - y_l) log S_r)``."""
    targets = targets.float().clamp(min=0, max=logits.shape[-1] - 1 - DFL_EPS)
    left = targets.floor().long()
    weight_left = (left + 1).float() - targets
    log_probabilities = F.log_softmax(logits.float(), dim=-1)
    at_left = log_probabilities.gather(-1, left[..., None])[..., 0]
    at_right = log_probabilities.gather(-1, (left + 1)[..., None])[..., 0]
    return -(weight_left * at_left + (1 - weight_left) * at_right)
