"""The trained detector's network (backbone, FPN, head; no post-processing) exported to ONNX, with its card.

:func:`export` writes ``model.onnx`` and, beside it, ``model.json`` (the :class:`~.card.ModelCard`, also
stored in the ONNX file's ``metadata_props``). The graph is fp32 whatever precision training used, in
the default memory layout, in ``eval()`` mode. It takes a ``uint8 [N, 3, H, W]`` RGB batch (N, H and W
dynamic, H and W multiples of the size divisibility), normalises it inside (the detector's mean and
std) and returns per pyramid level the head's ``cls_logits`` ``[N, h, w, classes]``,
``bbox_regression`` ``[N, h, w, 4]`` and ``bbox_ctrness`` ``[N, h, w, 1]``: row-major locations, the
order FCOS's head flattens them in. With ``model.learn_scales`` each level's regression is multiplied by its
learned scale inside the graph; with ``model.dfl_bins`` ``bbox_regression`` is the distribution's expected
distance, computed inside the graph (:mod:`pipelines.box_head`), so the outputs and their post-processing are
the same for every model. Post-processing is left to :mod:`.postprocess` (numpy, torchvision's
semantics): torchvision's detection post-processing does not export with the dynamo exporter
(pytorch/vision#9306) and TorchScript, the other route, is deprecated.

The exporter is ``torch.onnx.export(..., dynamo=True)``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..box_head import BoxRegressionHead
from ..errors import CheckpointError, first_line
from ..fileio import atomic_file
from ..model import Detector
from .card import CARD_FILE, INPUT_NAME, METADATA_KEY, ModelCard, output_names, write_card

EXPORTER = "torch.onnx.export(dynamo=True)"
_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class ExportedNetwork(nn.Module):
    """What is exported: a :class:`~pipelines.model.Detector`'s normalisation, backbone with FPN and head,
    fp32, returning the head's outputs level by level (see the module's docstring)."""

    def __init__(self, detector: Detector):
        super().__init__()
        detector = copy.deepcopy(detector).cpu().float().eval()
        detector.to(memory_format=torch.contiguous_format)
        self.backbone = detector.backbone
        self.classification_head = detector.head.classification_head
        self.regression_head = detector.head.regression_head
        self.register_buffer("pixel_mean", detector.pixel_mean.detach().clone(), persistent=False)
        self.register_buffer("pixel_std", detector.pixel_std.detach().clone(), persistent=False)
        self.eval()

    def forward(self, images: Tensor) -> tuple[Tensor, ...]:
        x = (images.float() - self.pixel_mean) / self.pixel_std
        outputs = []
        for level, feature in enumerate(self.backbone(x).values()):
            n, _, h, w = feature.shape
            logits = self.classification_head([feature])  # [N, h * w, classes], locations row-major
            if isinstance(self.regression_head, BoxRegressionHead):  # its level's scale; the distances
                regression, ctrness, _ = self.regression_head([feature], first_level=level)
            else:
                regression, ctrness = self.regression_head([feature])
            outputs += [logits.reshape(n, h, w, -1), regression.reshape(n, h, w, 4), ctrness.reshape(n, h, w, 1)]
        return tuple(outputs)


@contextlib.contextmanager
def _quiet(*loggers: str):
    """The exporter's libraries log every graph pass at INFO (hundreds of lines): warnings and errors only."""
    levels = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def anchor_sizes(detector: Detector) -> list[int]:
    """The detector's anchor size per pyramid level (FCOS: one square anchor per location)."""
    generator = detector.anchor_generator
    if any(len(s) != 1 for s in generator.sizes) or any(tuple(r) != (1.0,) for r in generator.aspect_ratios):
        raise ValueError(f"expected one square anchor per location, got sizes {generator.sizes} and aspect ratios "
                         f"{generator.aspect_ratios}")
    return [int(s[0]) for s in generator.sizes]


def card_for(detector: Detector, *, categories: list[dict[str, Any]], min_size_test: int, max_size_test: int,
             size_divisibility: int, max_image_pixels: int, opset: int,
             provenance: dict[str, str | None] | None = None) -> ModelCard:
    """The model card of ``detector`` exported with ``opset``: its thresholds, scoring (``cls_loss``), anchors,
    normalisation and training precision, the test sizes and ``categories`` given, and ``provenance`` (``mlflow_run_id``,
    ``git_commit``, ``weights_md5``; each optional)."""
    provenance = dict(provenance or {})
    if unknown := set(provenance) - {"mlflow_run_id", "git_commit", "weights_md5"}:
        raise ValueError(f"unknown provenance fields {sorted(unknown)}")
    if len(categories) != detector.head.classification_head.num_classes:
        raise ValueError(f"{len(categories)} categories for a detector of "
                         f"{detector.head.classification_head.num_classes} classes")
    sizes = anchor_sizes(detector)
    return ModelCard(
        categories=[dict(c) for c in categories],
        min_size_test=int(min_size_test), max_size_test=int(max_size_test),
        size_divisibility=int(size_divisibility), max_image_pixels=int(max_image_pixels),
        pixel_mean=[float(v) for v in detector.pixel_mean.reshape(-1).tolist()],
        pixel_std=[float(v) for v in detector.pixel_std.reshape(-1).tolist()],
        anchor_sizes=sizes,
        score_thresh=float(detector.score_thresh), nms_thresh=float(detector.nms_thresh),
        topk_candidates=int(detector.topk_candidates), detections_per_img=int(detector.detections_per_img),
        merge=str(detector.merge), vote_thresh=float(detector.vote_thresh),
        exporter=EXPORTER, opset=int(opset), torch_version=torch.__version__.split("+")[0],
        trained_precision=_PRECISIONS.get(detector.autocast_dtype, "fp32"),
        outputs=output_names(len(sizes)), cls_loss=detector.head.cls_loss, **provenance,
    )


def example_input(size_divisibility: int, *, batch: int = 2, height: int = 320, width: int = 416) -> Tensor:
    """A random ``uint8`` batch for tracing, its sides rounded up to multiples of ``size_divisibility``
    (two images and unequal sides, so that no dimension is mistaken for a constant)."""
    def up(side: int) -> int:
        return -(-side // size_divisibility) * size_divisibility

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (batch, 3, up(height), up(width)), dtype=torch.uint8, generator=generator)


def export(detector: Detector, path: str | os.PathLike, *, categories: list[dict[str, Any]], min_size_test: int,
           max_size_test: int, size_divisibility: int, max_image_pixels: int,
           provenance: dict[str, str | None] | None = None, opset: int | None = None) -> ModelCard:
    """Export ``detector``'s network to the ONNX file ``path`` and write its card to ``model.json`` beside
    it (both atomically: either is replaced only once written whole).

    Args:
        detector: the trained detector (any device, precision or memory layout: a fp32 copy on the CPU
            is exported).
        path: the ONNX file to write.
        categories: the categories it was trained on, in label order (the checkpoint's ``categories``).
        min_size_test, max_size_test: the test resize (``model.min_size_test``, ``model.max_size_test``).
        size_divisibility: what the input's height and width are multiples of (``loader.size_divisibility``).
        max_image_pixels: the pixel cap of images (``dataset.max_image_pixels``).
        provenance: optional ``mlflow_run_id``, ``git_commit``, ``weights_md5`` for the card.
        opset: the ONNX opset (the exporter's default if None).

    Returns:
        the card written.

    Raises:
        CheckpointError: the exporter failed (one line with its reason).
    """
    import onnx

    path = Path(path)
    network = ExportedNetwork(detector)
    names = output_names(len(anchor_sizes(detector)))
    blocks_h = torch.export.Dim("height_blocks", min=1, max=4096)
    blocks_w = torch.export.Dim("width_blocks", min=1, max=4096)
    dynamic = {"images": {0: torch.export.Dim("batch", min=1, max=4096), 2: size_divisibility * blocks_h,
                          3: size_divisibility * blocks_w}}
    try:
        with torch.no_grad(), _quiet("onnx_ir", "onnxscript", "torch.onnx"):
            program = torch.onnx.export(network, (example_input(size_divisibility),), input_names=[INPUT_NAME],
                                        output_names=names, dynamic_shapes=dynamic, opset_version=opset,
                                        dynamo=True, verbose=False)
    except Exception as err:  # the exporter raises many kinds; the first line says which step failed
        raise CheckpointError(f"{path}: the ONNX export failed ({type(err).__name__}: {first_line(err, 300)})") from None
    model = program.model_proto
    card = card_for(detector, categories=categories, min_size_test=min_size_test, max_size_test=max_size_test,
                    size_divisibility=size_divisibility, max_image_pixels=max_image_pixels,
                    opset=next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                    provenance=provenance)
    onnx.helper.set_model_props(model, {METADATA_KEY: card.to_json()})
    with atomic_file(path) as tmp:
        onnx.save_model(model, os.fspath(tmp))
    write_card(card, path.parent / CARD_FILE)
    return card
