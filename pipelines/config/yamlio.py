"""The bounded YAML reader of params files, ``conf/`` presets and ``dvc.lock``: a size bound on the file,
well-formedness, and an alias-expansion bound (no "billion laughs"), each refused with one line that
names the file, and the parse as OmegaConf makes it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, first_line

# A params file is a few kB; YAML aliases may not expand it beyond this
# many values (a "billion laughs" document is a few hundred bytes that expand to 10**9).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000


def read_yaml_text(path: Path) -> str:
    """The text of the YAML file ``path``, refused beyond :data:`MAX_YAML_BYTES` or when not UTF-8.

    Raises:
        ConfigError: one line naming the file.
    """
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise ConfigError(f"{path}: {size} bytes; expected a YAML file of at most {MAX_YAML_BYTES} bytes")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not valid YAML (not UTF-8 text: byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err})") from None


def parse_yaml(text: str, source: str) -> DictConfig | Any:
    """Parse YAML ``text`` as OmegaConf does (``OmegaConf.load``), after checking that it is well-formed
    and that its aliases expand to at most :data:`MAX_YAML_VALUES` values (nor into themselves).

    Raises:
        ConfigError: ``<source>:LINE:COL: <problem>`` for a syntax error or an expansion beyond the bound.
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes: an alias is a reference, not a copy
        if node is not None:
            _count_values(node, source, {}, set())
        return OmegaConf.load(io.StringIO(text))
    except yaml.MarkedYAMLError as err:
        raise ConfigError(_yaml_error(source, err)) from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML (nested too deeply)") from None
    except ConfigError:
        raise
    except Exception as err:  # YAML and OmegaConf errors come in many types
        raise ConfigError(f"{source}: not valid YAML ({(first_line(err) or type(err).__name__)})") from None


def _yaml_error(source: str, err: yaml.MarkedYAMLError) -> str:
    mark = err.problem_mark or err.context_mark
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = err.problem or err.context or type(err).__name__
    context = err.context if err.problem else None
    if context and err.context_mark is not None and err.context_mark is not mark:
        context += f" at {err.context_mark.line + 1}:{err.context_mark.column + 1}"
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def _count_values(node: yaml.Node, source: str, counted: dict[int, int], open_: set[int]) -> int:
    """Values ``node`` stands for once its aliases are expanded, counted without expanding them (each
    node once). Raises ConfigError at the first node beyond :data:`MAX_YAML_VALUES` or inside itself."""
    key = id(node)
    if key in counted:
        return counted[key]
    mark = node.start_mark
    if key in open_:
        raise ConfigError(f"{source}:{mark.line + 1}:{mark.column + 1}: an alias inside the value it refers to "
                          f"(expands without end); expected values written out")
    open_.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_count_values(child, source, counted, open_) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_count_values(k, source, counted, open_) + _count_values(v, source, counted, open_)
                     for k, v in node.value)
    open_.discard(key)
    if total > MAX_YAML_VALUES:
        raise ConfigError(f"{source}:{mark.line + 1}:{mark.column + 1}: YAML aliases expand this to more than "
                          f"{MAX_YAML_VALUES} values; expected a file of at most {MAX_YAML_VALUES} values")
    counted[key] = total
    return total
