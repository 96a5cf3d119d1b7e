"""The exported detector into the MLflow model registry (``python -m stages.register``), and promotion.

:func:`register` logs the ONNX export as an MLflow pyfunc model, models-from-code: the code file is
:mod:`.served_model` (it names a :class:`~.served.ServedDetector`; nothing is pickled), the ONNX file is
its artifact ``model``, and the torch-free modules it imports ship in its ``code`` folder
(:func:`code_files`); its requirements are onnxruntime, numpy, pillow and mlflow, pinned at the versions
installed here. The model has the signature of :func:`.served.signature` and one val image as its input
example. The export's AP on the ONNX path (``metrics/export.json``'s ``ap_onnx``, or ``ap_onnx_tta`` where
``evaluate.tta`` is on) is logged as a metric of the logged model (and of the run that logs it); the model is
registered as a new version, tagged (:func:`version_tags`), and given the alias ``candidate``.

:func:`promote` moves an alias (``champion``) to a version; with ``if_better``, only when the version's
AP is at least the alias holder's on the same val data (the annotation cache's fingerprint) and TTA
setting.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..config.yamlio import parse_yaml, read_yaml_text
from ..errors import ConfigError, PipelineError
from ..tracking import store
from ..tracking.lineage import COMMIT_TAG, EXP_NAME_TAG, PARAMS_HASH_TAG, STAGE_TAG, TRAINING_RUN_TAG, git_commit
from ..tracking.registry import Registry
from .card import ModelCard
from .served import ARTIFACT, INPUT, signature

log = logging.getLogger("register")

MODEL_NAME = "detector"
CANDIDATE = "candidate"
MODEL_CODE = Path(__file__).with_name("served_model.py")  # the models-from-code file
REQUIREMENTS = ("onnxruntime", "numpy", "pillow", "mlflow")
AP_TAG, METRIC_TAG, TTA_TAG, FINGERPRINT_TAG = "eval.ap", "eval.metric", "eval.tta", "data.val_fingerprint"
PARITY_KEYS = ("max_abs_diff", "match_rate", "ap_torch", "ap_onnx", "ap_torch_tta", "ap_onnx_tta")
LOG_TIMEOUT = 120.0  # seconds for logging the model (its input example is run once) on top of the upload's


@dataclass(frozen=True)
class Evaluation:
    """What ``metrics/export.json`` says of the export: the AP of the ONNX path (``metric`` names it:
    ``ap_onnx``, or ``ap_onnx_tta`` with ``tta``), the val annotation cache's ``val_fingerprint``, the
    training run (``mlflow_run_id``, None if training was not tracked) and the parity figures and APs
    it holds (``parity``: all of them are logged with the model)."""

    ap: float
    metric: str
    tta: bool
    val_fingerprint: str
    training_run_id: str | None
    parity: dict[str, float]


def read_evaluation(path: Path, *, tta: bool) -> Evaluation:
    """The export's figures in ``path`` (the export stage's ``metrics/export.json``, which holds the AP with
    and without test-time views); ``tta``: which of the two the model is scored by (``evaluate.tta``).

    Raises:
        ConfigError: the file is missing or not JSON, or the AP ``tta`` selects, ``val_fingerprint`` or
            ``mlflow_run_id`` is missing or of the wrong type (one line).
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}); run `dvc repro export` first") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object (the export stage's metrics)")

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    metric = "ap_onnx_tta" if tta else "ap_onnx"
    fingerprint, run_id = data.get("val_fingerprint"), data.get("mlflow_run_id")
    for key, fits, expected in ((metric, number(data.get(metric)), "a number"),
                                ("val_fingerprint", isinstance(fingerprint, str) and fingerprint,
                                 "the val annotation cache's fingerprint"),
                                ("mlflow_run_id", run_id is None or (isinstance(run_id, str) and run_id),
                                 "a run id or null")):
        if not fits:
            raise ConfigError(f"{path}: {key} is {data.get(key)!r}, expected {expected}")
    return Evaluation(ap=float(data[metric]), metric=metric, tta=bool(tta), val_fingerprint=fingerprint,
                      training_run_id=run_id,
                      parity={k: float(data[k]) for k in PARITY_KEYS if number(data.get(k))})


def example_image(prepared: Path) -> Path:
    """The first image of the prepared val split (``<prepared>/dataset.json`` names its folder,
    ``<prepared>/val.json`` its images), the model's input example.

    Raises:
        ConfigError: the prepared dataset or its first val image cannot be found (one line).
    """
    try:
        folder = Path(json.loads((prepared / "dataset.json").read_text())["splits"]["val"]["images"])
        images = json.loads((prepared / "val.json").read_text())["images"]
        path = folder / images[0]["file_name"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise ConfigError(f"{prepared}: no prepared val image for the input example ({type(err).__name__}: {err}); "
                          "run `dvc repro prepare` or give --example IMAGE") from None
    if not path.is_file():
        raise ConfigError(f"{path}: the first val image is not a file; give --example IMAGE")
    return path


def code_files(start: Path = MODEL_CODE) -> list[Path]:
    """The project's modules that the served model imports, transitively (package ``__init__`` files
    included), from ``start``: what its ``code`` folder holds. Found by reading the imports, so that a
    module added to the served path ships with it; none of them may import torch (a test and an
    import-linter contract hold that)."""
    root = Path(__file__).resolve().parents[2]  # holds the pipelines package
    seen: set[Path] = set()
    pending = [Path(start).resolve()]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        package = path.relative_to(root).with_suffix("").parts[:-1]
        for parent in range(1, len(package) + 1):
            pending.append(root.joinpath(*package[:parent], "__init__.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[tuple[str, ...]] = []
            if isinstance(node, ast.Import):
                names = [tuple(alias.name.split(".")) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = tuple(package[: len(package) - node.level + 1]) if node.level else ()
                module = base + tuple((node.module or "").split(".")) if node.module else base
                names = [module] + [module + (alias.name,) for alias in node.names]
            for parts in names:
                if parts and parts[0] == "pipelines":
                    for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
                        if candidate.is_file():
                            pending.append(candidate)
    return sorted(p for p in seen if p != Path(start).resolve())


def _stage_code(folder: Path) -> Path:
    """Copy :func:`code_files` into ``folder/pipelines/...``; returns ``folder/pipelines``."""
    root = Path(__file__).resolve().parents[2]
    for path in code_files():
        target = folder / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return folder / "pipelines"


def requirements() -> list[str]:
    """The served model's pip requirements, pinned at the installed versions."""
    return [f"{name}=={metadata.version(name)}" for name in REQUIREMENTS]


def lock_tags(lock_file: Path, onnx: Path) -> dict[str, str]:
    """``dvc.lock/<stage>/<path>: <md5>`` for the ONNX file (or the output folder holding it) and the ``.pth``
    weights where ``lock_file`` records them as outputs of a stage; ``{}`` without a lock file."""
    if not Path(lock_file).is_file():
        return {}
    try:
        tree = parse_yaml(read_yaml_text(Path(lock_file)), str(lock_file))
    except PipelineError as err:
        log.info("%s: not used for the version's tags (%s)", lock_file, err)
        return {}
    stages = tree.get("stages") if hasattr(tree, "get") else None
    wanted = os.path.normpath(os.path.relpath(onnx))
    tags = {}
    for stage, entry in (stages or {}).items():
        for item in (entry or {}).get("outs") or []:
            path, digest = str(item.get("path", "")), item.get("md5")
            holds_onnx = os.path.normpath(path) in (wanted, *map(str, Path(wanted).parents[:-1]))  # it, or its folder
            if digest and (holds_onnx or path.endswith(".pth")):
                tags[f"dvc.lock/{stage}/{path}"] = str(digest)
    return tags


def version_tags(evaluation: Evaluation, card: ModelCard, *, params_file: Path, lock_file: Path, onnx: Path,
                 exp_name: str | None) -> dict[str, str]:
    """The tags of a registered version: the git commit (the card's, else this checkout's), the params'
    SHA-256, the val data's fingerprint, the AP with its metric and TTA setting, the training run, the
    DVC experiment and the weights' md5 (the card's) where known, and the ``dvc.lock`` md5s of the ONNX
    file and the weights."""
    tags = {AP_TAG: repr(evaluation.ap), METRIC_TAG: evaluation.metric, TTA_TAG: str(evaluation.tta).lower(),
            FINGERPRINT_TAG: evaluation.val_fingerprint}
    if commit := card.git_commit or git_commit():
        tags[COMMIT_TAG] = commit
    if Path(params_file).is_file():
        tags[PARAMS_HASH_TAG] = hashlib.sha256(Path(params_file).read_bytes()).hexdigest()
    if evaluation.training_run_id:
        tags[TRAINING_RUN_TAG] = evaluation.training_run_id
    if card.weights_md5:
        tags["weights_md5"] = card.weights_md5
    if exp_name:
        tags[EXP_NAME_TAG] = exp_name
    return tags | lock_tags(lock_file, onnx)


@dataclass(frozen=True)
class Registered:
    """A registered version: the model ``name``, its ``version``, the logged model's id and the run that logged it."""

    name: str
    version: str
    model_id: str
    run_id: str


def register(onnx: Path, *, card: ModelCard, evaluation: Evaluation, example: Path, params_file: Path, lock_file: Path,
             experiment: str, name: str = MODEL_NAME, registry: Registry) -> Registered:
    """Log ``onnx`` as a pyfunc model (see the module's docstring), register it as a new version of
    ``name`` with its tags and the alias ``candidate``; ``card``: its model card (:func:`~.card.read_card`).

    The run that logs it is in the training run's experiment where the store has that run, else in
    ``experiment``.

    Raises:
        ConfigError: the example image is unusable. TrackingError: the store cannot be reached or refuses
            (one line each).
    """
    import mlflow
    import pandas as pd

    blob = _example(example, card)
    training = (registry.call(lambda client: client.get_run(evaluation.training_run_id), missing=True)
                if evaluation.training_run_id else None)
    exp_name = os.environ.get("DVC_EXP_NAME") or (training.data.tags.get(EXP_NAME_TAG) if training else None)
    tags = version_tags(evaluation, card, params_file=params_file, lock_file=lock_file, onnx=onnx, exp_name=exp_name)
    experiment_id = training.info.experiment_id if training else registry.call(
        lambda client: store.experiment_id(client, experiment, artifact_location=store.artifact_location(experiment)))
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    def log_and_register() -> Registered:
        mlflow.set_tracking_uri(registry.uri)
        mlflow.set_registry_uri(registry.uri)
        run_tags = {STAGE_TAG: "register", **({TRAINING_RUN_TAG: evaluation.training_run_id}
                                              if evaluation.training_run_id else {})}
        with tempfile.TemporaryDirectory(prefix="served-code-") as code, \
                mlflow.start_run(experiment_id=experiment_id, run_name=f"register {name}", tags=run_tags) as run:
            info = mlflow.pyfunc.log_model(
                name=name, python_model=str(MODEL_CODE), artifacts={ARTIFACT: str(onnx)},
                code_paths=[str(_stage_code(Path(code)))], signature=signature(card),
                input_example=pd.DataFrame({INPUT: [blob]}), pip_requirements=requirements(),
                tags={k: v for k, v in tags.items() if not k.startswith("dvc.lock/")})
            mlflow.log_metrics({**evaluation.parity, evaluation.metric: evaluation.ap}, model_id=info.model_id)
            version = mlflow.register_model(info.model_uri, name, tags=tags)
        client = registry.client
        client.set_registered_model_alias(name, CANDIDATE, version.version)
        return Registered(name, str(version.version), info.model_id, run.info.run_id)

    timeout = LOG_TIMEOUT + store.CALL_TIMEOUT + Path(onnx).stat().st_size / store.ARTIFACT_RATE
    return registry.call(lambda _client: log_and_register(), timeout=timeout)


def _example(path: Path, card: ModelCard) -> bytes:
    """The example image's bytes, checked to decode under the card's pixel cap."""
    from .preprocess import decode

    try:
        decode(path, max_pixels=card.max_image_pixels)
    except PipelineError as err:
        raise ConfigError(f"--example: {err}") from None
    return Path(path).read_bytes()


def promote(registry: Registry, name: str, version: str, *, alias: str, if_better: bool) -> tuple[bool, str]:
    """Move ``alias`` of model ``name`` to ``version``; with ``if_better``, only if the version's AP is at
    least that of the version holding ``alias`` on the same val data (fingerprint) and TTA setting.

    Returns:
        whether the alias moved, and one line saying what happened or why not.
    """
    def tags_of(v) -> dict[str, str]:
        return dict(v.tags or {})

    ours = tags_of(registry.call(lambda client: client.get_model_version(name, version)))
    holder = registry.version(name, alias)
    if if_better and holder is not None and str(holder.version) != str(version):
        theirs = tags_of(holder)
        who = f"{alias} (version {holder.version})"
        if theirs.get(FINGERPRINT_TAG) != ours.get(FINGERPRINT_TAG):
            return False, (f"not promoted to {alias}: {who} was evaluated on other val data (fingerprint "
                           f"{str(theirs.get(FINGERPRINT_TAG))[:12]}, this version "
                           f"{str(ours.get(FINGERPRINT_TAG))[:12]})")
        if theirs.get(TTA_TAG) != ours.get(TTA_TAG):
            return False, (f"not promoted to {alias}: {who} was evaluated with evaluate.tta={theirs.get(TTA_TAG)}, "
                           f"this version with {ours.get(TTA_TAG)}")
        try:
            mine, best = float(ours[AP_TAG]), float(theirs[AP_TAG])
        except (KeyError, ValueError):
            return False, f"not promoted to {alias}: {who} has no {AP_TAG} tag to compare with"
        if mine < best:
            return False, f"not promoted to {alias}: AP {mine:.4f} is below {who}'s {best:.4f}"
    registry.call(lambda client: client.set_registered_model_alias(name, alias, version))
    was = f" (was version {holder.version})" if holder is not None else ""
    return True, f"{name} version {version} is now {alias}{was}"
