"""The exported detector as an MLflow pyfunc model: image bytes in, detections in original pixels out.

:class:`ServedDetector` is what ``mlflow models serve`` (and ``mlflow.pyfunc.load_model``) runs. It is
logged as models-from-code (:mod:`.served_model` is the code file; :mod:`.registration` logs it), so no
Python object is pickled: at load, MLflow runs that file, which builds a :class:`ServedDetector`, and
:meth:`ServedDetector.load_context` opens the logged ``model.onnx`` (artifact :data:`ARTIFACT`) in an
:class:`~.onnx_runtime.OnnxDetector`. Decoding, resizing, the graph and post-processing are those of
``stages.predict``'s ONNX backend: the same detections.

The contract (:func:`signature`):

* input: a column ``image`` of type binary, one image file's bytes per row (JPEG, PNG, WebP or GIF);
  in JSON, base64 (``{"dataframe_split": {"columns": ["image"], "data": [["<base64>"]]}}``). Only
  bytes: a string (a path, a URL) is refused, nothing is read from disk or the network;
* the parameter ``score_thresh`` (default: the model card's);
* output, one row per image: ``boxes`` (``[x1, y1, x2, y2]`` in the original image's pixels),
  ``scores``, ``category_ids`` (the training data's), ``names``, and the image's ``width`` and ``height``.

An image that cannot be used (not an image, truncated, over the card's pixel cap, not bytes) or a bad
``score_thresh`` raises :class:`BadRequest`, which the scoring server answers with HTTP 400 and its
one-line message.

The served code ships with the model (``code_paths``: this module and the torch-free modules it imports,
see :func:`code_files`), so its imports are absolute and none of them imports torch or torchvision (an
import-linter contract holds it): the model's requirements are ``onnxruntime``, ``numpy``, ``pillow``
and ``mlflow`` only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

from pipelines.errors import PipelineError
from pipelines.inference.card import ModelCard
from pipelines.inference.onnx_runtime import OnnxDetector
from pipelines.inference.preprocess import decode

ARTIFACT = "model"  # the ONNX file's key in the logged model's artifacts
INPUT = "image"
SCORE_PARAM = "score_thresh"
OUTPUTS = ("boxes", "scores", "category_ids", "names", "width", "height")
THREADS_ENV = "PIPELINES_THREADS"  # the project's thread budget (pipelines.hardware reads it too, with torch)


class BadRequest(MlflowException):
    """A request the model cannot answer (an unusable image, a bad parameter): HTTP 400 with one line.

    The scoring server prefixes the message of an ``MlflowException`` raised in ``predict`` with a dump of
    the request's data (it assigns ``message``); this one keeps its own line, which names the image (its
    row) and what was expected."""

    def __init__(self, line: str):
        super().__init__(line, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._line

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_line"):
            self._line = value


def threads() -> int:
    """ONNX Runtime's threads in a serving process: ``PIPELINES_THREADS`` where set, else the cores this
    process may run on (its affinity mask)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def signature(card: ModelCard):
    """The model's MLflow signature: the input and output columns and the ``score_thresh`` parameter (its
    default the card's)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array

    inputs = Schema([ColSpec(DataType.binary, INPUT)])
    outputs = Schema([ColSpec(Array(Array(DataType.double)), "boxes"), ColSpec(Array(DataType.double), "scores"),
                      ColSpec(Array(DataType.long), "category_ids"), ColSpec(Array(DataType.string), "names"),
                      ColSpec(DataType.long, "width"), ColSpec(DataType.long, "height")])
    params = ParamSchema([ParamSpec(SCORE_PARAM, DataType.double, float(card.score_thresh))])
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


def score_thresh(params: dict[str, Any] | None) -> float | None:
    """The request's ``score_thresh`` (None: the card's).

    Raises:
        BadRequest: not a number from 0 to 1.
    """
    value = (params or {}).get(SCORE_PARAM)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not 0 <= float(value) <= 1:
        raise BadRequest(f"params.{SCORE_PARAM}: expected a number from 0 to 1, got {value!r}")
    return float(value)


def images(model_input: Any) -> list[bytes]:
    """The image bytes of each row of the request's ``image`` column.

    Raises:
        BadRequest: no ``image`` column, or a row that is not bytes (a path or a URL, say).
    """
    try:
        column = model_input[INPUT]
    except (KeyError, TypeError, IndexError):
        raise BadRequest(f"expected a column {INPUT!r} of image bytes (base64 in JSON)") from None
    values = list(column)
    for row, value in enumerate(values):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise BadRequest(f"{INPUT}[{row}]: expected an image file's bytes (base64 in JSON), got "
                             f"{type(value).__name__}; paths and URLs are not read")
    return [bytes(v) for v in values]


def answer(detector: OnnxDetector, blobs: list[bytes], *, score: float | None) -> list[dict[str, Any]]:
    """One output row per image (see the module's docstring), in the order given.

    Raises:
        BadRequest: an image cannot be decoded or is over the card's pixel cap (naming its row).
    """
    card = detector.card
    ids = [int(c["id"]) for c in card.categories]
    names = [str(c["name"]) for c in card.categories]
    rows = []
    for row, blob in enumerate(blobs):
        try:
            decoded = decode(blob, max_pixels=card.max_image_pixels, name=f"{INPUT}[{row}]").pixels
            found = detector.predict([decoded], score_thresh=score)[0]
        except PipelineError as err:  # ImageError: not an image, truncated, over the pixel cap
            raise BadRequest(str(err)) from None
        labels = found.labels.tolist()
        rows.append({"boxes": found.boxes.astype(np.float64).tolist(),
                     "scores": found.scores.astype(np.float64).tolist(),
                     "category_ids": [ids[k] for k in labels], "names": [names[k] for k in labels],
                     "width": int(decoded.shape[1]), "height": int(decoded.shape[0])})
    return rows


class ServedDetector(PythonModel):
    """The exported detector behind MLflow's pyfunc interface (see the module's docstring)."""

    def load_context(self, context) -> None:
        self.detector = OnnxDetector(context.artifacts[ARTIFACT], threads=threads())

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        rows = answer(self.detector, images(model_input), score=score_thresh(params))
        return pd.DataFrame(rows, columns=list(OUTPUTS))
