"""Scale-aware AutoAugment for object detection (Chen et al., CVPR 2021), on uint8 images.

Public names: the policy (:func:`decode_policy`, :class:`Policy` and its parts,
:data:`PUBLISHED_POLICY`, :data:`COLOR_OPS`, :data:`GEO_OPS`) and the transform
(:class:`ScaleAwareAutoAugment`). The ops themselves live in :mod:`.color`, :mod:`.geometric`,
:mod:`.zoom`, with box selection in :mod:`.selection` and blending in :mod:`.blend`.
"""

from .augment import ScaleAwareAutoAugment
from .policy import (
    COLOR_OPS,
    GEO_OPS,
    PUBLISHED_POLICY,
    BoxOp,
    Policy,
    SubPolicy,
    ZoomOp,
    decode_policy,
    policy_length,
)

__all__ = [
    "COLOR_OPS",
    "GEO_OPS",
    "PUBLISHED_POLICY",
    "BoxOp",
    "Policy",
    "ScaleAwareAutoAugment",
    "SubPolicy",
    "ZoomOp",
    "decode_policy",
    "policy_length",
]
