"""The PyTorch backend: a train stage's ``model_final.pth`` rebuilt as the detector it was trained as.

The file holds the weights, the training data's categories and the precision and layout it was trained in;
the architecture comes from the params it was trained with (:mod:`.trained_params`). No annotation cache
is needed: the categories are the file's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..build import model as build_model
from ..errors import ConfigError
from ..hardware import Compute, threads_per_process
from ..model import Detector
from .trained_params import trained_params


class TorchBackend:
    """A :class:`~pipelines.model.Detector` behind the :class:`~.backend.Backend` interface."""

    name = "torch"

    def __init__(self, detector: Detector, *, categories: list[dict], compute: Compute, iteration: int = 0,
                 params_source: str = ""):
        self.detector = detector.eval()
        self.categories = categories
        self.compute = compute
        self.iteration = iteration
        self.params_source = params_source  # where the model's params came from

    @property
    def precision(self) -> str:
        return self.compute.precision

    @property
    def score_thresh(self) -> float:
        return float(self.detector.score_thresh)

    @score_thresh.setter
    def score_thresh(self, value: float) -> None:
        self.detector.score_thresh = float(value)

    @property
    def nms_thresh(self) -> float:
        return float(self.detector.nms_thresh)

    @property
    def merge(self) -> str:
        return str(self.detector.merge)

    @property
    def vote_thresh(self) -> float:
        return float(self.detector.vote_thresh)

    @property
    def detections_per_img(self) -> int:
        return int(self.detector.detections_per_img)

    def eval(self) -> TorchBackend:
        self.detector.eval()
        return self

    @torch.inference_mode()
    def __call__(self, images: torch.Tensor, image_sizes: list[tuple[int, int]]) -> list[dict]:
        return self.detector(images, image_sizes)


def load(model_file: Path, *, device: torch.device, precision: str = "auto", params_file: Path | None = None,
         score_thresh: float | None = None):
    """The model in ``model_file`` as a :class:`TorchBackend` on ``device``, and the params it was built with.

    ``precision`` is one of :data:`pipelines.build.model.USE_PRECISIONS`: ``auto`` (this machine's choice:
    native bf16 or fp32, never emulated bf16), ``fp32``, or ``as-trained`` (stored in the file).
    ``params_file``: the params it was trained with; without, ``dvc.lock``'s train entry
    (:func:`.trained_params.trained_params`). ``score_thresh``: instead of ``model.score_thresh``. The
    post-processing is evaluation's (``evaluate.nms_thresh``, ``merge``, ``vote_thresh``).

    Raises:
        CheckpointError: the file is missing or unreadable, or does not match the params' model section.
        ConfigError: the params cannot be found or read.
    """
    state = build_model.trained_state(model_file)
    p, source = trained_params(model_file, params_file=params_file)
    detector, compute, iteration = build_model.trained_detector(p, model_file, device=device, precision=precision,
                                                                state=state, params_source=source)
    build_model.use_evaluate(detector, p)
    backend = TorchBackend(detector, categories=state["categories"], compute=compute, iteration=iteration,
                           params_source=source)
    if score_thresh is not None:
        backend.score_thresh = score_thresh
    return backend, p


def choose_device(name: str | None) -> torch.device:
    """The device ``--device`` names (``cpu``, ``cuda``, ``cuda:1``), by default CUDA where present; on the CPU
    torch takes the cores this process may use (:func:`pipelines.hardware.threads_per_process`).

    Raises:
        ConfigError: not a device name, or a CUDA device this machine does not have.
    """
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ConfigError(f"--device {name}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"--device {name}: no such CUDA device here ({torch.cuda.device_count()} found); "
                          "use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: expected cpu, cuda or cuda:N")
    if device.type == "cpu":
        torch.set_num_threads(threads_per_process(1))
    return device
