"""``conf/``'s config groups read as presets, and the hints they give: ``model.name`` names a model
preset, and a value that names a group's option (``model: fcos_r50``) gets "did you mean
``-S model=fcos_r50``?".
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .yamlio import parse_yaml, read_yaml_text

# conf/, composed by Hydra: its group options give the "did you mean `-S model=fcos_r50`?" hints, and
# conf/model/ holds the model presets that model.name names.
CONF = Path(__file__).resolve().parents[2] / "conf"
# Config groups by the params section they fill (conf/solver/ is packaged into ``train``).
GROUP_OF_SECTION = {"dataset": "dataset", "model": "model", "augment": "augment", "train": "solver"}


@functools.lru_cache(maxsize=16)
def _presets(folder: Path) -> dict[str, dict]:
    presets = {}
    for path in sorted(folder.glob("*.yaml")):
        raw = parse_yaml(read_yaml_text(path), str(path))
        presets[path.stem] = OmegaConf.to_container(raw) if isinstance(raw, DictConfig) else {}
    return presets


def group_presets(group: str, conf: Path = CONF) -> dict[str, dict]:
    """The options of a config group, ``conf/<group>/<name>.yaml``: name -> its values (read once per
    process; empty without ``conf/``)."""
    return _presets(conf / group)


def model_presets(conf: Path = CONF) -> dict[str, dict]:
    """The model presets, ``conf/model/<name>.yaml``: name -> its values."""
    return group_presets("model", conf)


def group_hint(section: str, value: Any) -> str:
    """``; did you mean `-S <group>=<value>`?`` when ``value`` names an option of the config group that fills
    ``section`` (``conf/<group>/<value>.yaml``), else ``""``."""
    group = GROUP_OF_SECTION.get(section)
    if group is None or not isinstance(value, str) or not re.fullmatch(r"\w[\w.-]*", value):
        return ""
    return f"; did you mean `-S {group}={value}`?" if (CONF / group / f"{value}.yaml").is_file() else ""
