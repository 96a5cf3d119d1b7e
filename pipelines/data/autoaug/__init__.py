"""Scale-aware AutoAugment for object detection (Chen et al., CVPR 2021), on uint8 images.

The transform is :class:`.augment.ScaleAwareAutoAugment`; its policy (the gene list and its decoded
form) is :mod:`pipelines.policy`, which validation uses without importing torch. The ops live in
:mod:`.color`, :mod:`.geometric` and :mod:`.zoom`, box selection in :mod:`.selection` and blending in
:mod:`.blend`.
"""
