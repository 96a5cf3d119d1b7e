"""The model from params: how it computes, the detector (fresh or trained) and its resume fingerprint."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import fingerprint as checkpoint_fingerprint
from ..checkpoint import load as load_checkpoint
from ..config.load import training_params
from ..config.schema import Params
from ..errors import CheckpointError, ConfigError, first_line
from ..hardware import Compute, resolve
from ..model import Detector, build_detector


def compute(p: Params, device: torch.device) -> Compute:
    """How the model computes on ``device``: ``model.precision`` and ``model.channels_last`` with
    ``auto`` resolved from the hardware (:func:`pipelines.hardware.resolve`)."""
    return resolve(p.model.precision, p.model.channels_last, device)


def detector(p: Params, *, num_classes: int, compute: Compute, pretrained: bool = True) -> Detector:
    """The detector of ``p.model`` computing as ``compute`` says (seed torch's generator first): random
    weights, then, with ``pretrained``, the ResNet's from ``model.backbone_weights`` (pass ``False`` when
    a trained model's state dict will replace them anyway); ``model.trainable_layers`` sets which stages train.

    Raises:
        ConfigError: ``model.backbone_weights`` cannot be read, downloaded or loaded (one line).
    """
    model = p.model
    try:
        return build_detector(num_classes=num_classes, backbone=model.backbone, norm=model.norm,
                              fpn_channels=model.fpn_channels,
                              backbone_weights=model.backbone_weights if pretrained else None,
                              trainable_layers=model.trainable_layers, head_convs=model.head_convs,
                              precision=compute.precision, channels_last=compute.channels_last,
                              score_thresh=model.score_thresh, nms_thresh=model.nms_thresh,
                              detections_per_img=model.detections_per_img, topk_candidates=model.topk_candidates,
                              cls_loss=model.cls_loss, centerness_weighted_giou=model.centerness_weighted_giou,
                              sync_num_pos=model.sync_num_pos, assigner=model.assigner,
                              learn_scales=model.learn_scales, dfl_bins=model.dfl_bins)
    except ConfigError as err:
        raise ConfigError(f"model.backbone_weights: {err}") from None


# How a trained model may compute where it is used (predict's --precision): as it was trained (stored in
# the file), as ``auto`` resolves on this machine, or in fp32.
USE_PRECISIONS = ("as-trained", "auto", "fp32")


def trained_state(model_file: Path) -> dict:
    """The content of ``model_file`` (a train stage's ``model_final.pth``): ``model`` (the state dict),
    ``categories`` (``[{"id", "name"}, ...]``, the training data's), ``iteration``, ``precision`` and
    ``channels_last`` where it stores them.

    Raises:
        CheckpointError: the file is missing, unreadable, or holds no categories list.
    """
    state = load_checkpoint(model_file)
    categories = state.get("categories")
    if not (isinstance(categories, list) and categories
            and all(isinstance(c, dict) and isinstance(c.get("id"), int) and isinstance(c.get("name"), str)
                    for c in categories)):
        raise CheckpointError(f"{model_file}: holds no categories list ([{{id, name}}, ...]); expected a model "
                              "file written by the train stage")
    return state


def trained_compute(p: Params, state: dict, model_file: Path, device: torch.device, *,
                    precision: str = "as-trained") -> Compute:
    """How the model of ``state`` (read from ``model_file``) computes on ``device``: ``as-trained``, in the
    precision and layout stored with it (for a file that does not say, as ``params.yaml`` resolves here);
    ``auto``, as :func:`pipelines.hardware.resolve` chooses for this machine (native bf16 or fp32, never
    emulated bf16); ``fp32``."""
    if precision == "auto":
        return resolve("auto", "auto", device)
    if precision == "fp32":
        return resolve("fp32", "auto", device, source="--precision fp32")
    if "precision" in state:
        return resolve(state["precision"], bool(state.get("channels_last")), device,
                       source=f"as the model was trained (stored in {model_file})")
    return compute(p, device)


def trained_detector(p: Params, model_file: Path, *, categories: list[dict] | None = None, split: Path | None = None,
                     device: torch.device, precision: str = "as-trained",
                     state: dict | None = None, params_source: str = "params.yaml") -> tuple[Detector, Compute, int]:
    """The model in ``model_file`` (a train stage's ``model_final.pth``) as ``p.model`` builds it, on
    ``device``, computing as ``precision`` says (:func:`trained_compute`; by default in the precision and
    layout it was trained with); and the iteration it was trained to.

    ``categories``, where given, are those it must have been trained on (the annotation cache ``split``'s);
    without them it takes the file's own. ``state``: the file's content where the caller has read it
    already (:func:`trained_state`); ``params_source`` names where ``p`` comes from, in messages.

    Raises:
        CheckpointError: the file cannot be read, was trained on other ``categories`` than those of the
            annotation cache ``split``, or does not match ``p.model``.
    """
    state = load_checkpoint(model_file) if state is None else state
    if categories is not None and state.get("categories") != categories:
        raise CheckpointError(f"{model_file}: trained on other categories than {split}")
    categories = state.get("categories") if categories is None else categories
    if not isinstance(categories, list) or not categories:
        raise CheckpointError(f"{model_file}: holds no categories list; expected a model file written by the train "
                              "stage")
    how = trained_compute(p, state, model_file, device, precision=precision)
    model = detector(p, num_classes=len(categories), compute=how, pretrained=False)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise CheckpointError(f"{model_file}: does not match {params_source}'s model section "
                              f"({first_line(err)})") from None
    return model.to(device), how, int(state.get("iteration", 0))


def use_evaluate(model: Detector, p: Params) -> Detector:
    """``model`` post-processing as ``p.evaluate`` says, within each view and across the test-time views:
    ``evaluate.nms_thresh`` (null: ``model.nms_thresh`` stays), ``merge`` and ``vote_thresh``
    (:meth:`pipelines.model.Detector.postprocess_detections`). Returns ``model``."""
    evaluate = p.evaluate
    if evaluate.nms_thresh is not None:
        model.nms_thresh = float(evaluate.nms_thresh)
    model.merge, model.vote_thresh = evaluate.merge, float(evaluate.vote_thresh)
    return model


def fingerprint(p: Params, compute: Compute, *, data: str) -> str:
    """The resume fingerprint of a training run (:func:`pipelines.checkpoint.fingerprint`): the params that
    change the weights, the resolved precision and layout, ``data`` (the training data's hash) and the code."""
    return checkpoint_fingerprint(params={**training_params(p), **compute.as_params()}, data=data)
