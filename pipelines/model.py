"""The detector: torchvision's FCOS, fed padded ``uint8`` batches from our loader.

:class:`Detector` keeps FCOS's backbone, head, target assignment, losses and post-processing, and
replaces only its input transform: our loader already resized and padded the images, so the model
just normalises them. Backbone and head run under bf16 or fp16 autocast when asked; head outputs are cast
back to fp32 before the loss and box decoding (bf16 would round box positions to about 2 px).
The ResNet body starts from random weights or from pretrained ones (a torchvision weights name or
a local state-dict file), with its lower stages optionally frozen, as torchvision's detectors do.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torchvision
from torch import Tensor, nn
from torchvision.models.detection import _utils as det_utils
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.fcos import FCOS
from torchvision.models.detection.image_list import ImageList
from torchvision.ops import FrozenBatchNorm2d, batched_nms, box_iou, clip_boxes_to_image
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

from .config.backbones import weights_name
from .assign import atss_matched_idxs
from .box_fusion import fuse
from .config.schema import registry
from .data.transforms import IMAGE_MEAN, IMAGE_STD
from .errors import ConfigError
from .scale_loss import ScaleLossHead

# model.norm and model.backbone: the names config validation accepts are these keys (config.registry).
NORM_LAYERS = registry("model.norm", {
    "batchnorm": nn.BatchNorm2d,
    "groupnorm": lambda channels: nn.GroupNorm(32, channels),
    "frozen_batchnorm": FrozenBatchNorm2d,  # from scratch this means no normalisation at all
})
BACKBONES = registry("model.backbone", {  # a random ResNet body, given its norm layer
    # one BasicBlock per stage: half of ResNet-18's convolutions, no published weights
    "resnet10": partial(torchvision.models.resnet.ResNet, torchvision.models.resnet.BasicBlock, [1, 1, 1, 1]),
    "resnet18": partial(torchvision.models.resnet18, weights=None),
    "resnet34": partial(torchvision.models.resnet34, weights=None),
    "resnet50": partial(torchvision.models.resnet50, weights=None),
    "resnet101": partial(torchvision.models.resnet101, weights=None),
})
# evaluate.merge: how the boxes NMS keeps come out, or (wbf) weighted box fusion instead of NMS (names in
# config.MERGES; the numpy twin is pipelines.inference.postprocess.merge).
MERGES = ("nms", "vote", "wbf")
# model.assigner: which locations train on which box (names in config.ASSIGNERS): fcos, torchvision's FCOS
# assignment; atss, ATSS's adaptive training sample selection (pipelines.assign).
ASSIGNERS = ("fcos", "atss")
# The pyramid levels build_backbone gives (P3-P5 from the FPN, P6-P7 from LastLevelP6P7) and FCOS's default
# anchor sizes (8..128) match: one learnable scale each with model.learn_scales.
LEVELS = 5
# The ResNet's stages from the top, as torchvision's ``trainable_backbone_layers`` counts them.
STAGES = ("layer4", "layer3", "layer2", "layer1", "conv1")


def build_backbone(*, backbone: str, norm: str, fpn_channels: int, weights: str | Path | None = None,
                   trainable_layers: int = 5) -> BackboneWithFPN:
    """A ResNet with an FPN over C3-C5 plus P6-P7: FCOS's five strides 8..128.

    The ResNet is initialised at random, then (with ``weights``) overwritten by
    :func:`load_backbone_weights`, so the FPN and head draw the same random numbers either way. Only
    the top ``trainable_layers`` stages keep ``requires_grad`` (torchvision's meaning: 5 all, 3
    layer2-layer4, 0 none).

    Raises:
        ConfigError: the weights cannot be read, downloaded or loaded (the message names the value).
    """
    body = BACKBONES[backbone](norm_layer=NORM_LAYERS[norm])
    if weights is not None:
        load_backbone_weights(body, weights, backbone=backbone)
    trained = STAGES[:trainable_layers] + (("bn1",) if trainable_layers == len(STAGES) else ())
    for name, param in body.named_parameters():
        if not name.startswith(trained):
            param.requires_grad_(False)
    stage1 = body.inplanes // 8  # channels of layer1's output (inplanes ends as layer4's)
    return BackboneWithFPN(
        body,
        return_layers={"layer2": "0", "layer3": "1", "layer4": "2"},
        in_channels_list=[stage1 * 2, stage1 * 4, stage1 * 8],
        out_channels=fpn_channels,
        extra_blocks=LastLevelP6P7(fpn_channels, fpn_channels),
    )


def _constructor(backbone: str) -> str:
    """How torchvision builds ``backbone``, for messages."""
    if backbone == "resnet10":
        return "torchvision.models.resnet.ResNet(BasicBlock, [1, 1, 1, 1])"
    return f"torchvision.models.{backbone}()"


def load_backbone_weights(body: nn.Module, weights: str | Path, *, backbone: str) -> None:
    """Load pretrained weights into the ResNet ``body`` of architecture ``backbone`` (e.g. ``resnet50``).

    ``weights`` is a torchvision weights name of that architecture (``IMAGENET1K_V1``,
    ``ResNet50_Weights.IMAGENET1K_V1``: see :func:`pipelines.config.backbones.weights_name`), fetched through
    torchvision (downloaded once into torch's hub cache), or a file (a :class:`~pathlib.Path`, or a
    string that is no weights name) holding the body's state dict, bare or under ``state_dict`` or
    ``model``. Every key and shape must match, except the classifier ``fc`` (which the detector
    drops) and BatchNorm's ``num_batches_tracked``.

    Raises:
        ConfigError: one line that names ``weights`` and says what was expected.
    """
    if isinstance(weights, str) and weights_name(weights) is not None:
        state = _torchvision_weights(weights, backbone)
    else:
        state = _weights_file(Path(weights), backbone)

    def relevant(key: str) -> bool:
        return not key.startswith("fc.") and not key.endswith(".num_batches_tracked")

    state = {k: v for k, v in state.items() if relevant(k)}
    expected = {k: v for k, v in body.state_dict().items() if relevant(k)}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k} {list(state[k].shape)} instead of {list(v.shape)}"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    problems = [f"{len(found)} {what} ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})"
                for what, found in (("missing keys", missing), ("unexpected keys", unexpected),
                                    ("shape mismatches", mismatched)) if found]
    if problems:
        raise ConfigError(f"{str(weights)!r}: does not match the {backbone} backbone: {'; '.join(problems)}; expected "
                          f"a state dict of {_constructor(backbone)} whose norm layers match model.norm")
    body.load_state_dict(state, strict=False)  # strict in effect: only fc and num_batches_tracked may be absent


def _torchvision_weights(name: str, backbone: str) -> dict[str, Tensor]:
    enum = torchvision.models.get_model_weights(backbone)
    qualifier, member = weights_name(name)
    if qualifier not in (None, enum.__name__) or member not in enum.__members__:
        raise ConfigError(f"{name!r}: no such weights for {backbone}; expected one of "
                          f"{', '.join(enum.__members__)} (or {enum.__name__}.<name>), or a state-dict file")
    found = enum[member]
    try:
        return found.get_state_dict(progress=False, check_hash=True)
    except Exception as err:  # urllib, hash checks and torch.load raise many types
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{name!r}: could not download {found} from {found.url} ({type(err).__name__}: {reason}); "
                          f"expected internet access, the file in {torch.hub.get_dir()}/checkpoints, "
                          f"or a local state-dict file") from None


def _weights_file(path: Path, backbone: str) -> dict[str, Tensor]:
    expected = (f"expected a state dict of {_constructor(backbone)} (e.g. saved from its state_dict()), "
                f"or a torchvision weights name such as IMAGENET1K_V1")
    if not path.is_file():
        raise ConfigError(f"{str(path)!r}: {'not a file' if path.exists() else 'file not found'}; {expected}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for files it cannot read
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{str(path)!r}: not a readable PyTorch file ({type(err).__name__}: {reason}); "
                          f"{expected}") from None
    if isinstance(state, dict):
        for key in ("state_dict", "model"):  # a checkpoint that wraps the state dict
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not (isinstance(state, dict) and state
            and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items())):
        raise ConfigError(f"{str(path)!r}: holds no state dict (a {type(state).__name__} that does not map names "
                          f"to tensors); {expected}")
    return state


class Detector(FCOS):
    """FCOS whose ``forward(images, image_sizes, targets)`` takes a padded ``uint8`` batch.

    Training returns the loss dict (``classification``, ``bbox_regression``, ``bbox_ctrness``; the head
    also sums it by object scale after ``head.measure_scales()``, :mod:`pipelines.scale_loss`);
    evaluation returns one dict per image with ``boxes`` (xyxy in the resized image), ``scores`` and
    ``labels`` (contiguous). ``cls_loss`` (``model.cls_loss``): ``focal``, FCOS's loss and scores; ``qfl``, the
    quality focal loss (:mod:`pipelines.scale_loss`) and scores ``sigmoid(cls)``, without centerness;
    ``centerness_weighted_giou`` and ``sync_num_pos``: the official FCOS's loss details (:mod:`pipelines.scale_loss`).
    ``learn_scales`` (``model.learn_scales``), a learnable scale per pyramid level, and ``dfl_bins``
    (``model.dfl_bins``), GFL's distribution over ``dfl_bins + 1`` distances per side with its distribution focal
    loss (``bbox_dfl``): the box branch's levers (:mod:`pipelines.box_head`); off, torchvision's head as it is.
    ``assigner`` (``model.assigner``): ``fcos``, torchvision's assignment of locations to boxes; ``atss``, ATSS's
    (:mod:`pipelines.assign`), the rest of the loss unchanged.
    ``merge`` (``nms``, NMS's boxes as they are; ``vote``: the kept boxes moved by :func:`vote` over the
    candidates before NMS; ``wbf``: weighted box fusion instead of NMS, :mod:`pipelines.box_fusion`, its
    cluster IoU ``nms_thresh``) and ``vote_thresh`` are set where the model is used
    (:func:`pipelines.build.model.use_evaluate`), like ``nms_thresh``.
    """

    def __init__(self, backbone: nn.Module, num_classes: int, *, head_convs: int, precision: str = "fp32",
                 channels_last: bool = False, cls_loss: str = "focal", centerness_weighted_giou: bool = False,
                 sync_num_pos: bool = False, assigner: str = "fcos", learn_scales: bool = False,
                 dfl_bins: int | None = None, **fcos_kwargs):
        if assigner not in ASSIGNERS:
            raise ValueError(f"assigner: expected one of {', '.join(ASSIGNERS)}, got {assigner!r}")
        head = ScaleLossHead(backbone.out_channels, 1, num_classes, num_convs=head_convs, cls_loss=cls_loss,
                             centerness_weighted_giou=centerness_weighted_giou, sync_num_pos=sync_num_pos,
                             levels=LEVELS, learn_scales=learn_scales, dfl_bins=dfl_bins)
        super().__init__(backbone, num_classes, head=head, **fcos_kwargs)
        if len(self.anchor_generator.sizes) != LEVELS:
            raise ValueError(f"expected {LEVELS} pyramid levels, got anchor sizes {self.anchor_generator.sizes}")
        self.assigner = assigner
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.channels_last = channels_last
        self.merge, self.vote_thresh = "nms", 0.8
        self.register_buffer("pixel_mean", torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("pixel_std", torch.tensor(IMAGE_STD).view(1, 3, 1, 1) * 255, persistent=False)
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def _normalised(self, images: Tensor) -> Tensor:
        x = (images.float() - self.pixel_mean) / self.pixel_std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def _autocast(self, x: Tensor):
        return torch.autocast(x.device.type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    def features(self, images: Tensor) -> list[Tensor]:
        """The backbone's (FPN's) feature maps of a ``uint8 [N, 3, H, W]`` batch, computed as :meth:`forward`
        computes them (what re-estimating the BatchNorm statistics runs, :mod:`pipelines.bn_stats`)."""
        x = self._normalised(images)
        with self._autocast(x):
            return list(self.backbone(x).values())

    def forward(self, images: Tensor, image_sizes: list[tuple[int, int]], targets: list[dict[str, Tensor]] | None = None):
        x = self._normalised(images)
        with self._autocast(x):
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

    def compute_loss(self, targets: list[dict[str, Tensor]], head_outputs: dict[str, Tensor], anchors: list[Tensor],
                     num_anchors_per_level: list[int]) -> dict[str, Tensor]:
        """torchvision's (its assignment, unchanged) with ``assigner`` ``fcos``; with ``atss``, the head's loss
        of ATSS's assignment (:func:`pipelines.assign.atss_matched_idxs`)."""
        if self.assigner == "fcos":
            return super().compute_loss(targets, head_outputs, anchors, num_anchors_per_level)
        matched_idxs = [atss_matched_idxs(image_anchors, target["boxes"], num_anchors_per_level)
                        for image_anchors, target in zip(anchors, targets)]
        return self.head.compute_loss(targets, head_outputs, anchors, matched_idxs)

    def postprocess_detections(self, head_outputs: dict[str, list[Tensor]], anchors: list[list[Tensor]],
                               image_shapes: list[tuple[int, int]]) -> list[dict[str, Tensor]]:
        """torchvision's post-processing (unchanged) for the focal loss with ``merge`` ``nms``; otherwise its
        steps here: the candidates, scored ``sigmoid(cls)`` with the quality focal loss (the centerness
        unused), then NMS, the kept boxes voted on with ``merge`` ``vote``, or weighted box fusion instead of
        NMS with ``merge`` ``wbf`` (:func:`merge`)."""
        if self.head.cls_loss == "focal" and self.merge == "nms":
            return super().postprocess_detections(head_outputs, anchors, image_shapes)
        found = []
        for index, image_shape in enumerate(image_shapes):
            outputs = {kind: [level[index] for level in levels] for kind, levels in head_outputs.items()}
            boxes, scores, labels = self._candidates(outputs, anchors[index], image_shape)
            found.append(merge(boxes, scores, labels, nms_thresh=self.nms_thresh, merge=self.merge,
                               vote_thresh=self.vote_thresh, detections_per_img=self.detections_per_img))
        return found

    def _candidates(self, outputs: dict[str, list[Tensor]], anchors: list[Tensor],
                    image_shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        """One image's candidates before NMS, as ``FCOS.postprocess_detections`` selects and decodes them:
        per level the scores above ``score_thresh``, the best ``topk_candidates``, their boxes clipped."""
        all_boxes, all_scores, all_labels = [], [], []
        for regression, logits, ctrness, level_anchors in zip(outputs["bbox_regression"], outputs["cls_logits"],
                                                              outputs["bbox_ctrness"], anchors):
            num_classes = logits.shape[-1]
            if self.head.cls_loss == "qfl":
                scores = torch.sigmoid(logits).flatten()
            else:
                scores = torch.sqrt(torch.sigmoid(logits) * torch.sigmoid(ctrness)).flatten()
            keep = scores > self.score_thresh
            scores, topk_idxs = scores[keep], torch.where(keep)[0]
            scores, idxs = scores.topk(det_utils._topk_min(topk_idxs, self.topk_candidates, 0))
            topk_idxs = topk_idxs[idxs]
            anchor_idxs = torch.div(topk_idxs, num_classes, rounding_mode="floor")
            boxes = self.box_coder.decode(regression[anchor_idxs], level_anchors[anchor_idxs])
            all_boxes.append(clip_boxes_to_image(boxes, image_shape))
            all_scores.append(scores)
            all_labels.append(topk_idxs % num_classes)
        return torch.cat(all_boxes), torch.cat(all_scores), torch.cat(all_labels)


def vote(kept: Tensor, kept_labels: Tensor, boxes: Tensor, scores: Tensor, labels: Tensor, *,
         thresh: float) -> Tensor:
    """Box voting (Detectron's ``box_voting``, its default ``ID`` scoring): each ``kept`` box (float32
    ``[K, 4]``, label ``kept_labels``) replaced by the mean of the candidate ``boxes`` (``[N, 4]``) of its
    label whose IoU with it is at least ``thresh``, weighted by their ``scores`` (itself among them when it
    is a candidate). The mean is taken in float64 and rounded to float32, so that the numpy twin
    (:func:`pipelines.inference.postprocess.vote`) gives the same boxes. A kept box that no candidate
    reaches stays as it is."""
    if not len(kept) or not len(boxes):
        return kept
    reached = (box_iou(kept, boxes) >= thresh) & (kept_labels[:, None] == labels[None])
    weights = reached * scores[None].double()
    total = weights.sum(1, keepdim=True)
    voted = (weights @ boxes.double()) / total.clamp(min=torch.finfo(torch.float64).tiny)
    return torch.where(total > 0, voted, kept.double()).to(kept.dtype)


def merge(boxes: Tensor, scores: Tensor, labels: Tensor, *, nms_thresh: float, merge: str, vote_thresh: float,
          detections_per_img: int, views: int | None = None) -> dict[str, Tensor]:
    """One image's detections from its candidates: class-wise NMS at ``nms_thresh``, the best
    ``detections_per_img`` kept, their boxes voted on by all the candidates (:func:`vote`) when ``merge``
    is ``vote``; scores and labels as NMS keeps them. With ``merge`` ``wbf``, weighted box fusion instead
    (:func:`pipelines.box_fusion.fuse`, clusters of IoU above ``nms_thresh``), of one view's candidates
    (``views`` None) or of the detections of ``views`` test-time views."""
    if merge == "wbf":
        fused = fuse(boxes.detach().cpu().numpy(), scores.detach().cpu().numpy(), labels.detach().cpu().numpy(),
                     iou_thresh=nms_thresh, views=views, detections_per_img=detections_per_img)
        return {key: torch.from_numpy(value).to(boxes.device)
                for key, value in zip(("boxes", "scores", "labels"), fused)}
    keep = batched_nms(boxes, scores, labels, nms_thresh)[:detections_per_img]
    kept = boxes[keep]
    if merge == "vote":
        kept = vote(kept, labels[keep], boxes, scores, labels, thresh=vote_thresh)
    return {"boxes": kept, "scores": scores[keep], "labels": labels[keep]}


def build_detector(*, num_classes: int, backbone: str = "resnet18", norm: str = "batchnorm", fpn_channels: int = 128,
                   backbone_weights: str | Path | None = None, trainable_layers: int = 5,
                   head_convs: int = 2, precision: str = "fp32", channels_last: bool = False,
                   score_thresh: float = 0.05, nms_thresh: float = 0.6, detections_per_img: int = 100,
                   topk_candidates: int = 1000, cls_loss: str = "focal", centerness_weighted_giou: bool = False,
                   sync_num_pos: bool = False, assigner: str = "fcos", learn_scales: bool = False,
                   dfl_bins: int | None = None) -> Detector:
    """Build a :class:`Detector`: random weights, the ResNet's from ``backbone_weights`` if given
    (see :func:`build_backbone`; without them nothing is downloaded)."""
    return Detector(
        build_backbone(backbone=backbone, norm=norm, fpn_channels=fpn_channels, weights=backbone_weights,
                       trainable_layers=trainable_layers),
        num_classes,
        head_convs=head_convs,
        precision=precision,
        channels_last=channels_last,
        cls_loss=cls_loss,
        centerness_weighted_giou=centerness_weighted_giou,
        sync_num_pos=sync_num_pos,
        assigner=assigner,
        learn_scales=learn_scales,
        dfl_bins=dfl_bins,
        score_thresh=score_thresh,
        nms_thresh=nms_thresh,
        detections_per_img=detections_per_img,
        topk_candidates=topk_candidates,
    )
