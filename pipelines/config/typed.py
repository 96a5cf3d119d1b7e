"""Plain dictionaries made typed: OmegaConf merges them into a structured config (a dataclass of
:mod:`pipelines.config.schema`), and its errors become one line naming the dotted key and what was
expected.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Iterator
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from ..errors import ConfigError, first_line


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
        raise ConfigError(f"{source}: {key}: unknown key (expected one of: {expected})") from None
    except MissingMandatoryValue as err:
        raise ConfigError(f"{source}: {prefix}{err.full_key}: missing value") from None
    except ValidationError as err:
        raise ConfigError(f"{source}: {prefix}{err.full_key}: {(first_line(err) or type(err).__name__)}") from None
    except OverflowError:  # an integer beyond float range where a float goes (OmegaConf names no key)
        key, value = next(_huge_floats(schema, raw, prefix), (prefix.rstrip("."), None))
        raise ConfigError(f"{source}: {key}: expected a finite number, got {show(value)}") from None
    except OmegaConfBaseException as err:
        key = prefix + (getattr(err, "full_key", "") or "")
        raise ConfigError(f"{source}: {key}: {(first_line(err) or type(err).__name__)}") from None


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
