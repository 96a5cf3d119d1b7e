"""Params as the stages read them: ``params.yaml`` (or YAML text, or a dictionary) with ``KEY=VALUE``
overrides, typed and validated (:func:`load_params`); a search's policy file read into them
(:func:`read_policy_file`); and params flattened to dotted keys, as MLflow records them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, first_line
from ..policy import decode_policy
from .presets import group_hint, group_presets
from .schema import DATASETS, Params
from .typed import typed
from .validate import check_values
from .yamlio import parse_yaml, read_yaml_text

_ABSENT = object()


def load_params(path: str | Path = "params.yaml", *, world_size: int | None = None,
                overrides: Sequence[str] = ()) -> Params:
    """Read and validate ``params.yaml``.

    Args:
        path: the parameters file.
        world_size: the number of processes actually running, when known; batch sizes must divide.
        overrides: ``KEY=VALUE`` settings applied over the file (dotted keys it has, YAML values).

    Returns:
        The typed :class:`Params`.

    Raises:
        ConfigError: on a missing file, unknown key, wrong type or impossible value.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path}: not a regular file; expected the parameters (YAML)")
    if not path.is_file():
        raise ConfigError(f"{path}: file not found (run from the repository root, or compose conf/)")
    return params_from_text(read_yaml_text(path), source=str(path), world_size=world_size, overrides=overrides)


def params_from_text(text: str, *, source: str, world_size: int | None = None,
                     overrides: Sequence[str] = ()) -> Params:
    """Validate the YAML ``text`` of a params file (as :func:`load_params` does); ``source`` names it in
    messages."""
    raw = with_overrides(text, source=source, overrides=overrides)
    return params_from_dict(OmegaConf.to_container(raw), source=source, world_size=world_size)


def with_overrides(text: str, *, source: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The YAML ``text`` of a params file with ``KEY=VALUE`` settings (dotted keys it has, YAML values)
    applied, unvalidated."""
    raw = parse_yaml(text, source)
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    for override in overrides:
        dotted, sep, value = override.partition("=")
        if not sep or OmegaConf.select(raw, dotted, default=_ABSENT) is _ABSENT:
            raise ConfigError(f"{source}: override {override!r}: expected KEY=VALUE for a key the file has")
        OmegaConf.update(raw, dotted, yaml.safe_load(value) if value else None, merge=False)
    return raw


def params_from_dict(raw: dict, *, source: str = "params", world_size: int | None = None) -> Params:
    """Validate a plain dictionary of parameters (as :func:`load_params` does for a file)."""
    raw = dict(raw)
    dataset_raw = raw.pop("dataset", None)
    if not isinstance(dataset_raw, dict):
        raise ConfigError(f"{source}: dataset: expected a section with a 'name' ({' | '.join(DATASETS)})")
    name = dataset_raw.get("name")
    if name not in DATASETS:
        raise ConfigError(f"{source}: dataset.name: expected one of {', '.join(DATASETS)}, got {name!r}")

    params = typed(Params, raw, source, prefix="")
    try:
        params.dataset = typed(DATASETS[name], dataset_raw, source, prefix="dataset.")
    except ConfigError as err:  # another preset's whole section under this name: `-S dataset.name=coco`
        others = [n for n, preset in group_presets("dataset").items() if n != name and set(preset) == set(dataset_raw)]
        raise ConfigError(f"{err}{group_hint('dataset', name)}" if others else f"{err}{_profile_hint(err)}") from None
    check_values(params, source, world_size)
    return params


def _profile_hint(err: ConfigError) -> str:
    """For an unknown ``dataset.KEY`` that a profile of ``conf/profile/`` sets (``dvc exp run -S dataset=coco -S
    profile=ci``: the ci profile sets the synthetic set's ``dataset.train_size``): the profile and the datasets
    it is for; else ""."""
    found = re.search(r": dataset\.(\w+): unknown key", str(err))
    profiles = [(n, p["dataset"]) for n, p in group_presets("profile").items() if isinstance(p.get("dataset"), dict)]
    setting = [(n, keys) for n, keys in profiles if found and found[1] in keys]
    if not setting:
        return ""
    profile, keys = setting[0]
    fits = [n for n, preset in group_presets("dataset").items() if set(keys) <= set(preset)]
    return (f"; profile={profile} sets it (conf/profile/{profile}.yaml), a profile for "
            f"{' or '.join(f'dataset={n}' for n in fits) or 'no dataset of conf/dataset/'}")


def read_policy_file(p: Params, source: str = "params.yaml") -> Params:
    """``p`` with the genes of a search's result (``augment.policy_file`` ending in ``.json``) as
    ``augment.policy``, and the scale bounds it was searched with as ``augment.scale_splits``, where
    ``augment.name`` is sa_autoaug; the train stage reads it so (the search's own stages never do: they run
    before it exists). Where the search's confirm stage found a preset better than every genome (the flip, say),
    the file holds that preset's whole ``augment`` section instead of genes, and ``p`` gets it (validated as
    params are; ``policy_file`` still names the file)."""
    augment = p.augment
    if augment.name != "sa_autoaug" or not augment.policy_file.endswith(".json"):
        return p
    path = Path(augment.policy_file)
    try:
        found = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{source}: augment.policy_file: {path}: not readable JSON ({first_line(err)})") from None
    if found is None:
        raise ConfigError(f"{source}: augment.policy_file: {path}: not found; run the search "
                          "(make search, which publishes its result with python -m stages.publish_search) or "
                          "choose another augment preset")
    if isinstance(found, dict) and isinstance(found.get("augment"), dict):
        return _with_augment(p, {**found["augment"], "policy_file": augment.policy_file},
                             source=f"{source}: augment.policy_file: {path}")
    if not isinstance(found, dict) or not isinstance(found.get("policy"), list):
        raise ConfigError(f"{source}: augment.policy_file: {path}: expected a JSON object with a 'policy' gene list "
                          "or an 'augment' section")
    if found.get("n_subpolicies", augment.n_subpolicies) != augment.n_subpolicies:
        raise ConfigError(f"{source}: augment.policy_file: {path}: searched with {found['n_subpolicies']} "
                          f"sub-policies, augment.n_subpolicies is {augment.n_subpolicies}")
    try:
        decode_policy(found["policy"], augment.n_subpolicies)
    except ConfigError as err:
        raise ConfigError(f"{source}: augment.policy_file: {path}: {err}") from None
    splits = found.get("scale_splits", augment.scale_splits)  # the bounds the policy was searched with
    if not (isinstance(splits, list) and len(splits) == 3 and all(isinstance(x, int) and x > 0 for x in splits)):
        raise ConfigError(f"{source}: augment.policy_file: {path}: scale_splits: expected three positive areas, "
                          f"got {splits!r}")
    return dataclasses.replace(p, augment=dataclasses.replace(augment, policy=list(found["policy"]),
                                                              scale_splits=splits))


def _with_augment(p: Params, augment: dict, *, source: str) -> Params:
    """``p`` with the ``augment`` section replaced, validated as a params file is."""
    raw = dataclasses.asdict(p)
    raw["augment"] = augment
    return params_from_dict(raw, source=source)


def to_flat_dict(params: Params | dict[str, Any]) -> dict[str, Any]:
    """Params, or their YAML tree, as dotted keys (``{"train": {"base_lr": 1}}`` -> ``{"train.base_lr": 1}``),
    as recorded in MLflow."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if dataclasses.is_dataclass(value):
            items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        elif isinstance(value, dict):
            items = list(value.items())
        else:
            flat[prefix[:-1]] = value
            return
        for key, item in items:
            walk(f"{prefix}{key}.", item)

    walk("", params)
    return flat


# Params that do not change the trained weights: they may differ between a run and its resumption.
NOT_IN_WEIGHTS = ("loader.num_workers", "train.log_period", "train.checkpoint_period", "train.keep_checkpoints")


def training_params(p: Params) -> dict[str, Any]:
    """The params that determine the trained weights (dotted keys): ``seed`` and the ``model``,
    ``augment``, ``loader`` and ``train`` sections, less :data:`NOT_IN_WEIGHTS`. The training data
    is identified separately (by the annotation cache)."""
    sections = ("seed", "model.", "augment.", "loader.", "train.")
    return {k: v for k, v in to_flat_dict(p).items() if k.startswith(sections) and k not in NOT_IN_WEIGHTS}

