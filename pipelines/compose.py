"""Compose ``conf/`` into ``params.yaml`` exactly as ``dvc exp run`` does (DVC's Hydra support).

``dvc repro`` never composes; after editing ``conf/`` run ``python -m pipelines.compose`` (with
optional Hydra overrides such as ``model=fcos_r50``) or use ``dvc exp run -S ...``. The result is
validated as every stage validates ``params.yaml`` and written only if valid, in one rename: a failed
compose leaves the previous file as it was. Errors are one line, ``error: ...``, exit code 2.

``--edit KEY=VALUE ...`` changes the current ``params.yaml`` instead of composing ``conf/``: for a
change on top of an applied experiment (``dvc exp apply``), whose own overrides a new composition
would lose (docs/team.md); then ``dvc repro`` re-runs what the change affects.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import tempfile
import typing
from pathlib import Path

from omegaconf import OmegaConf

from . import cli
from .config.load import params_from_text, with_overrides
from .config.presets import group_presets
from .config.schema import Params
from .config.typed import elsewhere
from .config.yamlio import parse_yaml, read_yaml_text
from .errors import ConfigError, OutputError
from .fileio import atomic_file


def compose_params(root: str | Path = ".", overrides: list[str] | None = None) -> str:
    """The YAML text that DVC would write to ``params.yaml`` for these overrides.

    Raises:
        ConfigError: a YAML file of ``conf/`` is malformed or expands without bound (``FILE:LINE:COL: ...``),
            or Hydra cannot compose (an unknown option or key, a malformed override), in one line.
    """
    from dvc.utils.hydra import compose_and_dump
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    root = Path(root).resolve()
    conf = root / "conf"
    for path in sorted(conf.rglob("*.yaml")):  # Hydra would expand an alias bomb before anything sees it
        parse_yaml(read_yaml_text(path), str(path.relative_to(root)))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "params.yaml"
        try:
            compose_and_dump(out, str(conf), None, "config", str(root), list(overrides or []))
        except (HydraException, OmegaConfBaseException) as err:
            override = getattr(err, "override", None)  # a malformed override names itself
            where = f"override {override!r}: " if isinstance(override, str) and override else ""
            raise ConfigError(f"conf/: {where}{_not_in_conf(str(err), overrides or [], conf) or _one_line(err)}") \
                from None
        return out.read_text()


def _not_in_conf(message: str, overrides: list[str], conf: Path) -> str:
    """Hydra's "Could not override 'modle'. To append to your config use +modle=..." (advice that only leads
    to "unknown key") as what is wrong and the likely intent: a config group (``model=fcos_r50``), a key of
    another section (``model.min_size_train``) or of the same one (``train.max_iter``); "" for other messages."""
    found = re.match(r"Could not override '([^']+)'", message)
    if not found:
        return ""
    key = found[1]
    setting = next((o.lstrip("+~") for o in overrides if o.lstrip("+~").partition("=")[0] == key), key)
    value = setting.partition("=")[2]
    section, _, name = key.rpartition(".")
    sections = [f.name for f in dataclasses.fields(Params)]
    if not section:
        groups = sorted(p.name for p in conf.iterdir() if p.is_dir())
        close = difflib.get_close_matches(key, groups, n=1)
        hint = f"; did you mean {close[0]}={value} (config groups: {', '.join(groups)})?" if close else ""
    elif section not in sections:
        close = difflib.get_close_matches(section, sections, n=1)
        hint = f"; did you mean {close[0]}.{name}={value}?" if close else ""
    elif section == "dataset":
        fits = [n for n, preset in group_presets("dataset", conf).items() if name in preset]
        hint = f"; {key} is a key of dataset={' or '.join(fits)}" if fits else elsewhere(key)
    else:
        schema = typing.get_type_hints(Params)[section]
        names = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
        hint = elsewhere(key) or (f"; did you mean {section}.{close[0]}={value}?" if close else "")
    return f"override {setting!r}: no such key or config group in conf/{hint}"


def _one_line(err: Exception) -> str:
    """Hydra's message in one line: its list of options joined, the search path and links left out."""
    parts: list[str] = []
    for line in str(err).splitlines():
        line = line.strip()
        if line.startswith("Config search path") or line.startswith("full_key:"):
            break
        if not line or line.startswith("See https://"):
            continue
        if parts and parts[-1].endswith("."):
            parts[-1] = parts[-1][:-1]
        if parts and parts[-1].endswith(":"):
            parts[-1] += " " + line
        elif parts and parts[-1].startswith("Available options") and not line.endswith(":"):
            parts[-1] += ", " + line
        else:
            parts.append(line)
    text = "; ".join(parts) or type(err).__name__
    return re.sub(r"\s+", " ", text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=fcos_r50 train.base_lr=0.002")
    parser.add_argument("--out", default="params.yaml", type=Path)
    parser.add_argument("--edit", action="store_true",
                        help="set KEY=VALUE in the current --out instead of composing conf/ (an applied experiment)")
    args = parser.parse_args(argv)
    if args.edit:
        if not args.out.is_file():
            raise ConfigError(f"{args.out}: file not found (nothing to edit)")
        text = OmegaConf.to_yaml(with_overrides(read_yaml_text(args.out), source=str(args.out), overrides=args.overrides))
        params_from_text(text, source=str(args.out))
    else:
        text = compose_params(".", args.overrides)
        params_from_text(text, source=f"{args.out} (composed from conf/)")
    try:
        with atomic_file(args.out) as tmp:
            tmp.write_text(text)
    except OSError as err:
        raise OutputError(f"{args.out}: cannot be written ({err.strerror or err})") from None


if __name__ == "__main__":
    cli.run(main)
