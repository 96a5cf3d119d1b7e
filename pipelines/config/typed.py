"""Plain dictionaries made typed: OmegaConf merges them into a structured config (a dataclass of
:mod:`pipelines.config.schema`), and its errors become one line naming the dotted key and what was
expected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import typing
from collections.abc import Iterator
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from ..errors import ConfigError, first_line
from .schema import DATASETS, Params


def typed(schema: type, raw: dict, source: str, prefix: str) -> Any:
    """``raw`` as an instance of the dataclass ``schema``; ``prefix`` (``dataset.``) leads its keys in messages.

    Raises:
        ConfigError: ``<source>: <key>: <problem>`` for an unknown key, a missing value, a wrong type.
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)
    except ConfigKeyError as err:
        key = prefix + (err.full_key or str(err.key))
        parent = err.object_type
        expected = ", ".join(f.name for f in dataclasses.fields(parent)) if dataclasses.is_dataclass(parent) else ""
        raise ConfigError(f"{source}: {key}: unknown key (expected one of: {expected}){elsewhere(key)}") from None
    except MissingMandatoryValue as err:
        raise ConfigError(f"{source}: {prefix}{err.full_key}: missing value") from None
    except ValidationError as err:
        problem = _conversion(first_line(err)) or type(err).__name__
        raise ConfigError(f"{source}: {prefix}{err.full_key}: {problem}") from None
    except OverflowError:  # an integer beyond float range where a float goes (OmegaConf names no key)
        key, value = next(_huge_floats(schema, raw, prefix), (prefix.rstrip("."), None))
        raise ConfigError(f"{source}: {key}: expected a finite number, got {show(value)}") from None
    except OmegaConfBaseException as err:
        key = prefix + (getattr(err, "full_key", "") or "")
        raise ConfigError(f"{source}: {key}: {(first_line(err) or type(err).__name__)}") from None


_CONVERSION = re.compile(r"Value '(.*)' of type '(\w+)' could not be converted to (Integer|Float|Boolean)$")
_NOT_BOOL = re.compile(r"Value '(.*)' is not a valid bool \(type (\w+)\)$")
_EXPECTED = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def _conversion(message: str) -> str:
    """OmegaConf's "Value '2.5' of type 'float' could not be converted to Integer" as what was expected and what
    came: ``expected an integer, got 2.5``; a whole number written as a float (``1e3``) gets the integer to write,
    one above int64 (``1e20``) the bound, as an integer above it does. Other messages are kept."""
    found = _CONVERSION.match(message) or _NOT_BOOL.match(message)
    if not found:
        return message
    text, kind, target = (*found.groups(), "Boolean")[:3]
    got = text.lower() if kind == "bool" else text if kind in ("int", "float") else repr(text)
    if target == "Integer" and kind in ("float", "str"):
        with contextlib.suppress(ValueError, OverflowError):
            whole = float(text)
            if whole == int(whole):
                if whole > 2**63 - 1:
                    return f"expected an integer at most 2**63-1 (numpy and torch hold it as int64), got {got}"
                if whole >= -(2**63):
                    return f"expected an integer, got {got} (write {int(whole)}: no decimal point or exponent)"
    return f"expected {_EXPECTED[target]}, got {got}"


def elsewhere(key: str) -> str:
    """``; did you mean model.min_size_train?`` for an unknown dotted ``key`` whose last part is a key of another
    section (``train.min_size_train``) or of the top level (``train.seed``: ``seed``), else ``""``. A key of another
    dataset (``dataset.seed`` for coco) gets none here: the dataset's own hint names the preset."""
    section, _, name = key.rpartition(".")
    hints = typing.get_type_hints(Params)
    if section == "dataset" and any(name in {f.name for f in dataclasses.fields(d)} for d in DATASETS.values()):
        return ""
    found = [name] if name in hints and not dataclasses.is_dataclass(hints[name]) and name != "dataset" else []
    sections = [(other, kind) for other, kind in hints.items() if dataclasses.is_dataclass(kind)]
    sections += [("dataset", preset) for preset in DATASETS.values()]
    found += [f"{other}.{name}" for other, schema in sections
              if other != section and name in {f.name for f in dataclasses.fields(schema)}]
    return f"; did you mean {' or '.join(dict.fromkeys(found))}?" if found else ""


def _huge_floats(schema: type, raw: Any, prefix: str) -> Iterator[tuple[str, int]]:
    """``(dotted key, value)`` of the integers in ``raw`` too large for the float fields of ``schema``."""
    if not isinstance(raw, dict):
        return
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        value, kind = raw.get(f.name), hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _huge_floats(kind, value, f"{prefix}{f.name}.")
        elif kind in (float, Optional[float]) and isinstance(value, int) and abs(value) > sys.float_info.max:
            yield f"{prefix}{f.name}", value


def show(value: Any) -> str:
    """``repr(value)``, with an integer of more than 30 digits given by its size (one readable line)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)
