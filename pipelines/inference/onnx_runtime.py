"""The exported detector in ONNX Runtime, without torch: images in, detections in original-image pixels out.

:class:`OnnxDetector` opens an ONNX file written by :mod:`.onnx_export` (its model card, read from the
file's ``metadata_props``, is required), on the CPU provider with ``threads`` intra-op threads (the
caller takes them from the project's thread budget, ``pipelines.hardware.threads_per_process``; this
module does not import torch to ask). :meth:`OnnxDetector.predict` runs :mod:`.preprocess` (decode,
resize, pad), the graph and :mod:`.postprocess`; :meth:`OnnxDetector.network` runs the graph alone on an
already padded batch, which the parity checks compare with PyTorch.

This module imports neither torch nor torchvision (an import-linter contract holds it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, first_line
from .card import OUTPUT_KINDS, ModelCard, card_from_metadata
from .postprocess import Detections, Thresholds, detections
from .preprocess import decode, prepare


SPIN_MICROSECONDS = 20  # how long an idle ONNX Runtime thread spins before it sleeps (see session())


def session(path: str | os.PathLike, *, threads: int):
    """An ONNX Runtime session of the file at ``path`` on the CPU with ``threads`` intra-op threads (and
    one inter-op thread: the graph is a chain) that spin at most :data:`SPIN_MICROSECONDS` waiting for
    work, then sleep. ONNX Runtime's threads otherwise spin long between the graph's operators and after
    the run, on cores that decoding, resizing and post-processing (or torch's threads, or another process)
    then wait for; not spinning at all costs a wake-up between operators, which is slower on idle cores.

    Raises:
        CheckpointError: the file is missing or ONNX Runtime cannot load it (one line).
    """
    import onnxruntime as ort  # imported here: importing the module should not cost ONNX Runtime's start-up

    name = os.fspath(path)
    if not Path(name).is_file():
        raise CheckpointError(f"{name}: ONNX file not found")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.spin_duration_us", str(SPIN_MICROSECONDS))
    options.log_severity_level = 3  # errors only: ONNX Runtime's warnings are not the user's to act on
    try:
        return ort.InferenceSession(name, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as err:  # ONNX Runtime raises its own exception types for unreadable models
        raise CheckpointError(f"{name}: ONNX Runtime cannot load it ({type(err).__name__}: {first_line(err, 200)})") from None


class OnnxDetector:
    """An exported detector (an ONNX file with its model card) run by ONNX Runtime on the CPU.

    Args:
        path: the ONNX file.
        threads: ONNX Runtime's intra-op threads (from the thread budget).

    Raises:
        CheckpointError: the file is missing, not loadable, or holds no model card (one line).
    """

    def __init__(self, path: str | os.PathLike, *, threads: int):
        self.path = os.fspath(path)
        self.session = session(path, threads=threads)
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.card: ModelCard = card_from_metadata(dict(metadata), source=self.path)
        names = [o.name for o in self.session.get_outputs()]
        if names != self.card.outputs:
            raise CheckpointError(f"{self.path}: the graph's outputs {names} are not those its model card names "
                                  f"{self.card.outputs}")

    @property
    def thresholds(self) -> Thresholds:
        """The post-processing settings of the model card."""
        card = self.card
        return Thresholds(card.score_thresh, card.nms_thresh, card.topk_candidates, card.detections_per_img,
                          card.cls_loss, card.merge, card.vote_thresh)

    def network(self, images: np.ndarray) -> dict[str, list[np.ndarray]]:
        """The graph's outputs for a padded ``uint8 [N, 3, H, W]`` batch (H and W multiples of the size
        divisibility): per output kind (``cls_logits``, ``bbox_regression``, ``bbox_ctrness``) the list of
        its per-level float32 arrays ``[N, h, w, k]``."""
        divisor = self.card.size_divisibility
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected a uint8 [N, 3, H, W] batch, got {images.dtype} {list(images.shape)}")
        if images.shape[2] % divisor or images.shape[3] % divisor:
            raise ValueError(f"the batch's height and width ({images.shape[2]}x{images.shape[3]}) must be multiples "
                             f"of {divisor}")
        outputs = self.session.run(None, {self.card.input_name: np.ascontiguousarray(images)})
        return {kind: outputs[k::len(OUTPUT_KINDS)] for k, kind in enumerate(OUTPUT_KINDS)}

    def detect(self, images: np.ndarray, image_sizes: Sequence[tuple[int, int]], *,
               thresholds: Thresholds | None = None) -> list[Detections]:
        """Detections for a padded batch whose images are of ``image_sizes`` ``(height, width)`` before
        padding, in those images' coordinates (post-processing with ``thresholds``, the card's by default)."""
        outputs = self.network(images)
        return detections(outputs["cls_logits"], outputs["bbox_regression"], outputs["bbox_ctrness"],
                          padded_size=(images.shape[2], images.shape[3]), image_sizes=image_sizes,
                          anchor_sizes=self.card.anchor_sizes, thresholds=thresholds or self.thresholds)

    def predict(self, sources: Sequence[str | os.PathLike | bytes | np.ndarray], *,
                score_thresh: float | None = None) -> list[Detections]:
        """Detections for images (paths, file contents, or decoded ``uint8 [H, W, 3]`` RGB arrays), in each
        image's original pixels: decoded with the card's pixel cap, resized and padded as the card says, run
        in one batch and post-processed (``score_thresh`` replaces the card's where given).

        Raises:
            ImageError: an image cannot be decoded or is over the pixel cap (one line naming it).
        """
        pixels = [source if isinstance(source, np.ndarray) else decode(source, max_pixels=self.card.max_image_pixels).pixels
                  for source in sources]
        if not pixels:
            return []
        card = self.card
        batch = prepare(pixels, min_size=card.min_size_test, max_size=card.max_size_test,
                        size_divisibility=card.size_divisibility)
        thresholds = self.thresholds
        if score_thresh is not None:
            thresholds = dataclasses.replace(thresholds, score_thresh=float(score_thresh))
        found = self.detect(batch.images, batch.image_sizes, thresholds=thresholds)
        return [d.scaled(ow / w, oh / h)
                for d, (h, w), (oh, ow) in zip(found, batch.image_sizes, batch.orig_sizes)]
