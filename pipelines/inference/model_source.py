"""``--model`` as an MLflow model: a ``models:/`` URI of the registry or a local MLflow model folder (one
holding ``MLmodel``), resolved to the ONNX file inside it, which ``stages.predict`` runs on its ONNX
backend.

A folder must be a model that ``stages.register`` logged: its ``MLmodel`` names the ONNX file as the
python_function flavor's artifact ``model`` (:data:`~.served.ARTIFACT`). A ``models:/`` URI is resolved
in the registry (:class:`~pipelines.tracking.registry.Registry`: a missing name, version or alias, or an
unreachable store, is one line) and its logged model is downloaded into a temporary folder, removed
once the caller has loaded it.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..config.yamlio import parse_yaml, read_yaml_text
from ..errors import CheckpointError, ConfigError
from ..tracking.registry import Registry, is_model_uri
from .served import ARTIFACT

log = logging.getLogger("predict")

MLMODEL = "MLmodel"
DOWNLOAD_TIMEOUT = 300.0  # seconds for downloading a registered model (its ONNX file and code)


def is_mlflow_model(model: str | Path) -> bool:
    """Whether ``model`` names an MLflow model: a ``models:/`` URI, or a folder holding ``MLmodel``."""
    return is_model_uri(str(model)) or (Path(model) / MLMODEL).is_file()


def onnx_in_folder(folder: Path) -> Path:
    """The ONNX file inside the MLflow model ``folder`` (as ``stages.register`` logs it).

    Raises:
        CheckpointError: ``MLmodel`` unreadable, or it names no ``.onnx`` artifact that exists (one line).
    """
    source = folder / MLMODEL
    try:
        tree = parse_yaml(read_yaml_text(source), str(source))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
    try:
        relative = tree["flavors"]["python_function"]["artifacts"][ARTIFACT]["path"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{source}: an MLflow model without the artifact {ARTIFACT!r} of the python_function "
                              "flavor; expected a detector logged by python -m stages.register") from None
    path = folder / str(relative)
    if path.suffix.lower() != ".onnx" or not path.is_file():
        raise CheckpointError(f"{source}: its artifact {ARTIFACT!r} ({relative}) is not an ONNX file in the folder")
    return path


@contextlib.contextmanager
def local_onnx(model: str | Path, *, registry_uri: str | None = None) -> Iterator[Path]:
    """The ONNX file of the MLflow model ``model`` (a ``models:/`` URI or a local folder), for the time of the
    ``with`` block (a registered model's is downloaded into a temporary folder, removed afterwards).

    Raises:
        TrackingError: a ``models:/`` URI that names no registered version or alias, or a store that cannot
            be reached. CheckpointError: the model holds no ONNX file (one line each).
    """
    if not is_model_uri(str(model)):
        yield onnx_in_folder(Path(model))
        return
    uri = str(model)
    registry = Registry(registry_uri)
    version = registry.resolve(uri)
    log.info("%s: registered model %s version %s (%s)", uri, version.name, version.version, version.source)
    with tempfile.TemporaryDirectory(prefix="mlflow-model-") as folder:
        def download() -> str:
            import mlflow

            mlflow.set_tracking_uri(registry.uri)  # a logged model's models:/m-<id> is found in this store
            mlflow.set_registry_uri(registry.uri)
            return mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=folder)

        path = registry.call(lambda _client: download(), timeout=DOWNLOAD_TIMEOUT)
        yield onnx_in_folder(Path(path))
