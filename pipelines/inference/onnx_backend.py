"""The ONNX backend: an exported detector (``model.onnx`` with its model card) run by ONNX Runtime behind the
:class:`~.backend.Backend` interface, so that evaluation's detection and test-time augmentation code
(:func:`pipelines.evaluation.detect`) runs on it unchanged.

The graph runs on the padded ``uint8`` batch the caller builds (torch tensors are turned into numpy arrays
at the call, and the detections back into tensors); post-processing is the shared numpy implementation
(:mod:`.postprocess`) with the card's thresholds. It computes in fp32 on the CPU, with ONNX Runtime's
threads from the project's thread budget (:func:`pipelines.hardware.threads_per_process`). The resize
settings, pixel cap and categories come from the card: no params file is needed. Torch, which only reads,
resizes and pads the images around the graph here, gets one thread (:data:`TORCH_THREADS`): its OpenMP
threads spin on the cores after each operation, where ONNX Runtime's threads then compute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..hardware import Compute, threads_per_process
from .card import ModelCard
from .onnx_runtime import OnnxDetector
from .postprocess import Thresholds

SUFFIX = ".onnx"
TORCH_THREADS = 1  # torch's threads beside an OnnxBackend loaded by load()


def is_onnx(model_file: Path) -> bool:
    """Whether ``model_file`` names an exported ONNX model (by its suffix)."""
    return Path(model_file).suffix.lower() == SUFFIX


class OnnxBackend:
    """An :class:`~.onnx_runtime.OnnxDetector` behind the :class:`~.backend.Backend` interface."""

    name = "onnx"
    precision = "fp32"  # the exported graph's, whatever training used
    iteration = None  # not recorded in the card
    params_source = "the model card"

    def __init__(self, detector: OnnxDetector):
        self.detector = detector
        self.card: ModelCard = detector.card
        self.categories = self.card.categories
        self.score_thresh = float(self.card.score_thresh)
        self.nms_thresh = float(self.card.nms_thresh)
        self.detections_per_img = int(self.card.detections_per_img)
        threads = detector.session.get_session_options().intra_op_num_threads
        self.compute = Compute(precision="fp32", channels_last=False,
                               reason=f"exported graph in ONNX Runtime on the CPU, {threads} threads")

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.score_thresh, self.nms_thresh, self.card.topk_candidates, self.detections_per_img)

    def eval(self) -> OnnxBackend:
        return self

    def __call__(self, images: torch.Tensor, image_sizes: list[tuple[int, int]]) -> list[dict]:
        batch = images.detach().cpu().numpy().astype(np.uint8, copy=False)
        found = self.detector.detect(batch, [(int(h), int(w)) for h, w in image_sizes], thresholds=self.thresholds)
        return [{"boxes": torch.from_numpy(d.boxes), "scores": torch.from_numpy(d.scores),
                 "labels": torch.from_numpy(d.labels)} for d in found]


def load(model_file: Path, *, score_thresh: float | None = None, threads: int | None = None) -> OnnxBackend:
    """The exported model in ``model_file`` as an :class:`OnnxBackend` (``score_thresh`` instead of the
    card's where given; ``threads``: ONNX Runtime's, by default the thread budget of one process); torch's
    threads are set to :data:`TORCH_THREADS`.

    Raises:
        CheckpointError: the file is missing, not loadable, or holds no model card (one line).
    """
    backend = OnnxBackend(OnnxDetector(model_file, threads=threads or threads_per_process(1)))
    torch.set_num_threads(TORCH_THREADS)
    if score_thresh is not None:
        backend.score_thresh = float(score_thresh)
    return backend
