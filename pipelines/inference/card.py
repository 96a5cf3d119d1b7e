"""The model card of an exported detector: what a runtime needs to feed the graph and read its outputs.

The card travels with the ONNX file in two places: in the graph's ``metadata_props`` under
:data:`METADATA_KEY` (the copy a runtime reads: a file without it is refused) and as ``model.json``
beside it (:data:`CARD_FILE`, the same JSON, for people and tools that do not open ONNX files). It holds:

* ``categories``: the training data's categories in label order (label ``i`` is ``categories[i]``);
* the input contract: a ``uint8`` RGB batch ``[N, 3, H, W]`` (zero padded at the bottom and right, H
  and W multiples of ``size_divisibility``) of images resized so that the shorter side is
  ``min_size_test``, the longer at most ``max_size_test``; ``pixel_mean`` / ``pixel_std`` (0-255
  scale) are applied inside the graph; images over ``max_image_pixels`` are refused;
* the outputs: per pyramid level ``cls_logits_<l>`` ``[N, h, w, classes]``, ``bbox_regression_<l>``
  ``[N, h, w, 4]`` and ``bbox_ctrness_<l>`` ``[N, h, w, 1]`` and the level's ``anchor_sizes`` entry;
* the post-processing thresholds (``score_thresh``, ``nms_thresh``, ``topk_candidates``,
  ``detections_per_img``) and how the outputs are scored, ``cls_loss`` (the loss the model was trained with,
  ``model.cls_loss``: ``focal``, ``sqrt(sigmoid(cls) * sigmoid(centerness))``; ``qfl``, ``sigmoid(cls)``; a
  card without it is ``focal``), and how NMS's boxes come out (``merge``: ``nms`` or ``vote``, with
  ``vote_thresh``, or ``wbf``, weighted box fusion at ``nms_thresh`` instead of NMS; a card without them is
  ``nms``), as evaluation used them (``evaluate.nms_thresh``,
  ``merge``, ``vote_thresh``);
* how it was made (``exporter``, ``opset``, ``torch_version``; ``trained_precision``, the graph being
  fp32 whatever training used) and, where known, its provenance (``mlflow_run_id``, ``git_commit``,
  ``weights_md5``).

This module imports neither torch nor torchvision (an import-linter contract holds it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, first_line
from ..fileio import atomic_file

FORMAT = 1
CLS_LOSSES = ("focal", "qfl")  # model.cls_loss (pipelines.config.schema.CLS_LOSSES): how the outputs are scored
METADATA_KEY = "detector.card"  # the key of the card in the ONNX file's metadata_props
CARD_FILE = "model.json"  # the card's name beside the ONNX file
INPUT_NAME = "images"
OUTPUT_KINDS = ("cls_logits", "bbox_regression", "bbox_ctrness")
MERGES = ("nms", "vote", "wbf")  # postprocess.MERGES (the card and the post-processing do not import each other)


def output_names(levels: int) -> list[str]:
    """The graph's output names, level by level: ``cls_logits_0, bbox_regression_0, bbox_ctrness_0, ...``."""
    return [f"{kind}_{level}" for level in range(levels) for kind in OUTPUT_KINDS]


@dataclass(frozen=True)
class ModelCard:
    """What a runtime needs to know about an exported detector (see the module's docstring)."""

    categories: list[dict[str, Any]]
    min_size_test: int
    max_size_test: int
    size_divisibility: int
    max_image_pixels: int
    pixel_mean: list[float]
    pixel_std: list[float]
    anchor_sizes: list[int]
    score_thresh: float
    nms_thresh: float
    topk_candidates: int
    detections_per_img: int
    exporter: str
    opset: int
    torch_version: str
    trained_precision: str
    precision: str = "fp32"
    merge: str = "nms"
    vote_thresh: float = 0.8
    input_name: str = INPUT_NAME
    input_layout: str = "uint8 RGB NCHW, zero padded at the bottom and right"
    outputs: list[str] = field(default_factory=list)
    mlflow_run_id: str | None = None
    git_commit: str | None = None
    weights_md5: str | None = None
    format: int = FORMAT
    cls_loss: str = "focal"

    @property
    def levels(self) -> int:
        return len(self.anchor_sizes)

    @property
    def num_classes(self) -> int:
        return len(self.categories)

    def to_json(self) -> str:
        """The card as JSON text (keys sorted, so the same card gives the same bytes)."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str) -> ModelCard:
        """The card in ``text``, read from ``source`` (named in errors).

        Raises:
            CheckpointError: not JSON, another format version, or a field missing or of the wrong type.
        """
        try:
            data = json.loads(text)
        except ValueError as err:
            raise CheckpointError(f"{source}: the model card is not JSON ({first_line(err)})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{source}: the model card is a {type(data).__name__}, expected an object")
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{source}: model card format {data.get('format')!r}, expected {FORMAT}; "
                                  "export the model again with this code")
        known = {f.name: f for f in dataclasses.fields(cls)}
        required = [name for name, f in known.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing := [name for name in required if name not in data]:
            raise CheckpointError(f"{source}: the model card lacks {', '.join(missing)}")
        card = cls(**{k: v for k, v in data.items() if k in known})
        card._check(source)
        return card

    def _check(self, source: str) -> None:
        """The fields a runtime relies on have sensible types and values."""
        def bad(name: str, expected: str) -> CheckpointError:
            return CheckpointError(f"{source}: model card field {name} is {getattr(self, name)!r}, expected {expected}")

        for name in ("min_size_test", "max_size_test", "size_divisibility", "max_image_pixels", "topk_candidates",
                     "detections_per_img", "opset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "a positive integer")
        if self.merge not in MERGES:
            raise bad("merge", f"one of {', '.join(MERGES)}")
        for name in ("score_thresh", "nms_thresh", "vote_thresh"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise bad(name, "a number from 0 to 1")
        for name in ("pixel_mean", "pixel_std"):
            value = getattr(self, name)
            if not (isinstance(value, list) and len(value) == 3
                    and all(isinstance(v, (int, float)) and math.isfinite(v) for v in value)):
                raise bad(name, "3 numbers (one per RGB channel)")
        if not (isinstance(self.categories, list) and self.categories
                and all(isinstance(c, dict) and "id" in c and "name" in c for c in self.categories)):
            raise bad("categories", "a list of {id, name} objects")
        if not (isinstance(self.anchor_sizes, list) and self.anchor_sizes
                and all(isinstance(s, int) and s > 0 for s in self.anchor_sizes)):
            raise bad("anchor_sizes", "a positive integer per pyramid level")
        if self.cls_loss not in CLS_LOSSES:
            raise bad("cls_loss", f"one of {', '.join(CLS_LOSSES)}")
        if self.outputs != output_names(self.levels):
            raise bad("outputs", f"{output_names(self.levels)}")


def card_from_metadata(metadata: dict[str, str], *, source: str) -> ModelCard:
    """The card stored in an ONNX file's ``metadata_props`` (as a mapping), read from ``source``.

    Raises:
        CheckpointError: the mapping holds no card, or one that cannot be read (one line naming ``source``).
    """
    if METADATA_KEY not in metadata:
        raise CheckpointError(f"{source}: an ONNX file without a model card (no {METADATA_KEY!r} in its "
                              "metadata_props); expected a detector exported by this project")
    return ModelCard.from_json(metadata[METADATA_KEY], source=source)


def read_card(path: str | os.PathLike) -> ModelCard:
    """The card of the ONNX file at ``path``, read from its ``metadata_props`` (the weights are not loaded
    where they are stored as external data).

    Raises:
        CheckpointError: the file is missing, not an ONNX model, or has no readable card (one line).
    """
    import onnx  # only here: the runtime reads the card from its session instead

    name = os.fspath(path)
    if not Path(name).is_file():
        raise CheckpointError(f"{name}: ONNX file not found")
    try:
        model = onnx.load(name, load_external_data=False)
    except Exception as err:  # protobuf's DecodeError and others
        raise CheckpointError(f"{name}: not a readable ONNX file ({type(err).__name__}: {first_line(err, 200)})") from None
    return card_from_metadata({p.key: p.value for p in model.metadata_props}, source=name)


def write_card(card: ModelCard, path: str | os.PathLike) -> None:
    """Write ``card`` as JSON to ``path`` (``model.json`` beside the ONNX file), atomically."""
    with atomic_file(path) as tmp:
        Path(tmp).write_text(card.to_json())
