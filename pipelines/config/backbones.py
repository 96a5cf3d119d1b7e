"""Which backbones exist and which torchvision weights fit them: the model facts that validation and
:mod:`pipelines.model` both read, here without torch so that params are checked before torch loads.

A backbone is added here (its name, how messages write it, torchvision's weights enum if there is
one) and, with its constructor, in :data:`pipelines.model.BACKBONES`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Backbone:
    title: str  # as messages write it
    weights: str | None  # torchvision's enum of its published weights; None where torchvision publishes none


# model.backbone: the names validation accepts, in this order (pipelines.model.BACKBONES builds each).
BACKBONES = {
    "resnet10": Backbone("ResNet-10", None),  # one BasicBlock per stage
    "resnet18": Backbone("ResNet-18", "ResNet18_Weights"),
    "resnet34": Backbone("ResNet-34", "ResNet34_Weights"),
    "resnet50": Backbone("ResNet-50", "ResNet50_Weights"),
    "resnet101": Backbone("ResNet-101", "ResNet101_Weights"),
}

# The model.norm values that torchvision's published weights fit: those weights hold BatchNorm layers.
WEIGHTS_NORMS = ("batchnorm", "frozen_batchnorm")

_WEIGHTS_NAME = re.compile(r"(?:(\w+_Weights)\.)?([A-Z][A-Z0-9_]*)")


def weights_name(value: str) -> tuple[str | None, str] | None:
    """``(enum, member)`` when ``model.backbone_weights`` names torchvision weights (``IMAGENET1K_V1``:
    ``(None, "IMAGENET1K_V1")``; ``ResNet50_Weights.IMAGENET1K_V1``), ``None`` when it is a file path
    (anything else; ``./IMAGENET1K_V1`` is a file)."""
    match = _WEIGHTS_NAME.fullmatch(value)
    return (match.group(1), match.group(2)) if match else None


def weights_enum(backbone: str) -> str | None:
    """The name of torchvision's weights enum of ``backbone`` (``resnet50`` -> ``ResNet50_Weights``),
    ``None`` where torchvision publishes no weights for it."""
    return BACKBONES[backbone].weights
