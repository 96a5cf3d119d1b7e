"""The test and training resize's one rule, without torch: the size an image is resized to.

Training's transforms (:mod:`.transforms`), evaluation's test-time views and the torch-free ONNX path
(:mod:`pipelines.inference.preprocess`) all size images by :func:`resized_size`. This module imports
neither torch nor torchvision (an import-linter contract holds it), so that the served model can ship it.
"""

from __future__ import annotations


def resized_size(height: int, width: int, min_size: int, max_size: int) -> tuple[int, int]:
    """Size after scaling the shorter side to ``min_size`` unless the longer would exceed ``max_size``."""
    short, long = min(height, width), max(height, width)
    scale = min(min_size / short, max_size / long)
    return max(1, round(height * scale)), max(1, round(width * scale))
