"""What runs a trained detector, whatever computes it: the one interface predict uses.

A backend is called the way :func:`pipelines.evaluation.detect` calls a model, so evaluation's detection
and test-time augmentation code runs unchanged on any backend: ``backend(images, image_sizes)`` with
``images`` a ``uint8 [B, 3, H, W]`` batch zero-padded at the bottom and right
(:func:`pipelines.data.collate.pad_images`) and ``image_sizes`` the ``(height, width)`` of each image
before padding; it returns one dict per image, ``boxes`` (``[K, 4]`` xyxy in that image's pixels),
``scores`` (``[K]``) and ``labels`` (``[K]``, indices into :attr:`Backend.categories`), at most
``detections_per_img`` of them, above ``score_thresh``, after class-wise NMS at ``nms_thresh``.
``detect`` reads ``nms_thresh``, ``merge``, ``vote_thresh`` and ``detections_per_img`` to merge test-time
views. This module imports no torch: a backend that does not need it (ONNX Runtime) implements the same
interface.
"""

from __future__ import annotations

from typing import Any, Protocol


class Backend(Protocol):
    """A trained detector ready to run (see the module's docstring for the call)."""

    name: str  # what computes it: "torch", ...
    categories: list[dict]  # the training data's, [{"id", "name"}, ...]: label k is categories[k]
    precision: str  # what it computes in: fp32, bf16 or fp16
    score_thresh: float  # detections scoring at most this are dropped (settable)
    nms_thresh: float
    merge: str  # nms | vote | wbf: how the boxes NMS keeps come out, or fused instead (evaluate.merge)
    vote_thresh: float
    detections_per_img: int

    def __call__(self, images: Any, image_sizes: list[tuple[int, int]]) -> list[dict]: ...

    def eval(self) -> Backend:
        """Inference mode (what :func:`pipelines.evaluation.predict` asks of a model); returns itself."""
        ...


def describe(backend: Backend) -> dict[str, Any]:
    """The backend's settings, as a run's summary records them."""
    return {"backend": backend.name, "precision": backend.precision, "score_thresh": backend.score_thresh,
            "nms_thresh": backend.nms_thresh, "merge": backend.merge, "vote_thresh": backend.vote_thresh,
            "detections_per_img": backend.detections_per_img}


def category_ids(backend: Backend) -> list[int]:
    """The JSON category id of each label."""
    return [int(c["id"]) for c in backend.categories]


def category_names(backend: Backend) -> list[str]:
    """The name of each label."""
    return [str(c["name"]) for c in backend.categories]
