"""The ONNX backend: an exported detector (``model.onnx`` with its model card) run by ONNX Runtime behind the
:class:`~.backend.Backend` interface, so that evaluation's detection and test-time augmentation code
(:func:`pipelines.evaluation.detect`) runs on it unchanged.

Called as a :class:`~.backend.Backend`, the graph runs on the padded ``uint8`` batch the caller builds
(torch tensors are turned into numpy arrays at the call, and the detections back into tensors). Predict
uses it through :meth:`OnnxBackend.read` and :meth:`OnnxBackend.detect_images` instead: the torch-free path
end to end, as the served model runs it and as the export's parity measures it (decoded and resized by
:mod:`.preprocess`, test-time views by :mod:`.tta`). Post-processing is the shared numpy implementation
(:mod:`.postprocess`) with the card's thresholds. It computes in fp32 on the CPU, with ONNX Runtime's
threads from the project's thread budget (:func:`pipelines.hardware.threads_per_process`). The resize
settings, pixel cap and categories come from the card: no params file is needed. Torch, which at most
hands images over and draws boxes around the graph here, gets one thread (:data:`TORCH_THREADS`): its
OpenMP threads spin on the cores after each operation, where ONNX Runtime's threads then compute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..data.transforms import TestTimeAugmentation
from ..hardware import Compute, threads_per_process
from .card import ModelCard
from .onnx_runtime import OnnxDetector
from .postprocess import Thresholds
from .preprocess import decode
from .tta import Views, detect_views

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
        self.merge, self.vote_thresh = str(self.card.merge), float(self.card.vote_thresh)
        threads = detector.session.get_session_options().intra_op_num_threads
        self.compute = Compute(precision="fp32", channels_last=False,
                               reason=f"exported graph in ONNX Runtime on the CPU, {threads} threads")

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.score_thresh, self.nms_thresh, self.card.topk_candidates, self.detections_per_img,
                          self.card.cls_loss, self.merge, self.vote_thresh)

    def eval(self) -> OnnxBackend:
        return self

    def read(self, path: str, *, max_pixels: int) -> torch.Tensor:
        """The image file at ``path`` decoded by :func:`.preprocess.decode` (within ``max_pixels``), as
        ``uint8 [3, H, W]`` for drawing."""
        return torch.from_numpy(decode(path, max_pixels=max_pixels).pixels).permute(2, 0, 1)

    def detect_images(self, images: list[torch.Tensor], tta: TestTimeAugmentation | None) -> list[dict]:
        """Detections in original pixels of ``uint8 [3, H, W]`` images as read, through the torch-free path:
        resized and padded by :mod:`.preprocess` as the card says, with ``tta``'s views (:mod:`.tta`)."""
        card, thresholds = self.card, self.thresholds
        pixels = [image.permute(1, 2, 0).numpy() for image in images]
        views = Views(tuple(tta.scales), tta.max_size, tta.flip, tta.source) if tta is not None else None
        found = detect_views(lambda batch, sizes: self.detector.detect(batch, sizes, thresholds=thresholds), pixels,
                             min_size=card.min_size_test, max_size=card.max_size_test,
                             size_divisibility=card.size_divisibility, thresholds=thresholds, views=views)
        return [{"boxes": torch.from_numpy(d.boxes), "scores": torch.from_numpy(d.scores),
                 "labels": torch.from_numpy(d.labels)} for d in found]

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
