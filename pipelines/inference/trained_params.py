"""The params a trained model file was built with: the train stage's entry in ``dvc.lock``, or a params file.

A train stage's ``model_final.pth`` holds weights, categories and precision but no architecture; rebuilding
it takes the ``model`` section it was trained with. ``dvc.lock`` records the params each stage read when it
last ran (under ``stages.train.params``, per params file: whole sections such as ``model``, and single keys
under their dotted names such as ``tracking.experiment``), and the md5 of each output it wrote. Those are
laid over ``params.yaml`` beside ``dvc.lock`` (for the sections train does not read: ``evaluate``'s
test-time augmentation, ``dataset.max_image_pixels``). A ``--params`` file is taken as it is.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import OmegaConf

from ..config.load import load_params, params_from_dict
from ..config.schema import Params
from ..config.yamlio import parse_yaml, read_yaml_text
from ..errors import ConfigError
from ..fileio import file_md5

log = logging.getLogger(__name__)
LOCK = "dvc.lock"
TRAIN_STAGE = "train"


def trained_params(model_file: Path, *, params_file: Path | None = None,
                   lock: Path = Path(LOCK)) -> tuple[Params, str]:
    """The params ``model_file`` was trained with, and where they come from (for messages).

    With ``params_file``: that file. Without: the params of ``lock``'s train entry over the
    ``params.yaml`` beside it; a warning says when ``lock`` does not record ``model_file`` as the train
    stage's output with its md5 (the params may then not be those it was trained with).

    Raises:
        ConfigError: the params file or ``lock`` is missing or not valid, ``lock`` has no train entry, or the
            params do not validate; one line naming the file.
    """
    if params_file is not None:
        return load_params(params_file), str(params_file)
    source = f"{lock}'s {TRAIN_STAGE} entry"
    stage = _train_entry(lock)
    by_file = stage.get("params")
    if not isinstance(by_file, dict) or not by_file:
        raise ConfigError(f"{lock}: stage {TRAIN_STAGE} records no params; give --params FILE")
    base_name, recorded = next(iter(by_file.items()))
    base = lock.parent / base_name
    if not base.is_file():
        raise ConfigError(f"{base}: file not found (the params file {lock}'s {TRAIN_STAGE} entry names); give "
                          "--params FILE")
    raw = _read_tree(base)
    if not isinstance(raw, dict) or not isinstance(recorded, dict):
        raise ConfigError(f"{base}: expected a mapping of sections at the top level")
    for key, value in recorded.items():
        _set_dotted(raw, str(key), value)
    params = params_from_dict(raw, source=source)
    _check_recorded(model_file, stage, lock)
    return params, source


def _train_entry(lock: Path) -> dict:
    if not lock.is_file():
        raise ConfigError(f"{lock}: file not found; run from the repository root where the train stage ran, or give "
                          "--params FILE with the params the model was trained with")
    tree = _read_tree(lock)
    stage = (tree.get("stages") or {}).get(TRAIN_STAGE) if isinstance(tree, dict) else None
    if not isinstance(stage, dict):
        raise ConfigError(f"{lock}: no {TRAIN_STAGE} stage recorded (run `dvc repro train`), or give --params FILE")
    return stage


def _read_tree(path: Path):
    """The YAML file at ``path`` as plain containers, read within the bounds of the params reader."""
    tree = parse_yaml(read_yaml_text(path), str(path))
    return OmegaConf.to_container(tree) if tree is not None else {}


def _set_dotted(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{LOCK}: params key {dotted!r} does not fit the params file's sections")
    node[leaf] = value


def _check_recorded(model_file: Path, stage: dict, lock: Path) -> None:
    """Warn unless ``lock``'s train entry records ``model_file`` as an output with the md5 it has now."""
    target = os.path.realpath(model_file)
    for out in stage.get("outs") or []:
        if isinstance(out, dict) and os.path.realpath(lock.parent / str(out.get("path", ""))) == target:
            if out.get("md5") == file_md5(model_file):
                return
            log.warning("%s: not the file %s records (md5 differs): the model is rebuilt with the params of the "
                        "train stage recorded there; give --params FILE if it was trained with others",
                        model_file, lock)
            return
    log.warning("%s: not an output of the %s stage in %s: the model is rebuilt with that stage's params; give "
                "--params FILE if it was trained with others", model_file, TRAIN_STAGE, lock)


