"""Every value of typed params in range: the names that select code, the numbers that numpy and torch
must hold, each section's own values (:mod:`pipelines.config.sections`), and the rules across sections.
The first problem raises :class:`~pipelines.errors.ConfigError`, one line naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError
from . import sections
from .presets import group_hint, model_presets
from .schema import CHOICES, INT64_MAX, INT64_MIN, Model, Params, SyntheticDataset
from .sections import Require
from .typed import show

# The fields that make a model preset's network what it is (parameter shapes and initial weights). The
# others (sizes, thresholds, precision, trainable stages) are settings a run may change under the same name.
ARCHITECTURE = ("backbone", "norm", "backbone_weights", "fpn_channels", "head_convs")

# Seeds go to torch.manual_seed (stages/train.py), which takes 64 bits, and to numpy's SeedSequence (any
# size); every other integer is held as int64 somewhere.
SEED_KEYS = ("seed", "dataset.seed")
SEED_MAX = 2**64 - 1
# Image sides in pixels: the synthetic set is saved as JPEG, whose sides stop at 65500 (libjpeg's
# JPEG_MAX_DIMENSION), and float32 box coordinates stay exact to 1/256 pixel below 2**16; resize targets
# share the bound.
PIXEL_SIZE_KEYS = ("dataset.min_side", "dataset.max_side", "model.min_size_train", "model.max_size_train",
                   "model.min_size_test", "model.max_size_test", "evaluate.tta_scales", "evaluate.tta_max_size")
MAX_SIDE = 65500


def check_values(p: Params, source: str, world_size: int | None) -> None:
    """Every value in range, section by section; the first problem raises ConfigError (one line)."""
    def require(ok: bool, key: str, expected: str, value: Any) -> None:
        if not ok:
            raise ConfigError(f"{source}: {key}: expected {expected}, got {show(value)}")

    _check_names(p, source)
    beyond_int64 = _check_numbers(p, require)
    try:
        _check_sections(p, source, world_size, require)
    except ConfigError:
        raise  # a field's own bound (train.max_iter: "at least 1 iteration") names what matters for it
    except Exception:  # a value beyond int64 that a check cannot compute with
        if not beyond_int64:
            raise
    if beyond_int64:
        key, value = beyond_int64[0]
        require(False, key, f"an integer {'at most 2**63-1' if value > 0 else 'at least -2**63'} (numpy and torch "
                "hold it as int64)", value)


def _check_sections(p: Params, source: str, world_size: int | None, require: Require) -> None:
    """Each section's own values, then the rules across sections."""
    require(p.seed >= 0, "seed", "an integer >= 0", p.seed)
    sections.check_dataset(p.dataset, require)
    if isinstance(p.dataset, SyntheticDataset):
        sections.check_synthetic(p.dataset, require)
    sections.check_model(p.model, require)
    sections.check_augment(p.augment, require, source)
    sections.check_loader(p.loader, require)
    _check_grouping(p, require)
    _check_bn_reestimate(p, require)
    sections.check_train(p.train, require)
    sections.check_evaluate(p.evaluate, require)
    sections.check_tracking(p.tracking, require)
    sections.check_launch(p.launch, require)
    _check_processes(p, source, world_size)
    sections.check_search(p.search, require)
    sections.check_search_space(p.search, p.augment, require)
    sections.check_confirm(p.confirm, p.search, require)


# --- names that select code ----------------------------------------------------------------------------------


def _check_names(p: Params, source: str) -> None:
    """Every name that selects code is one the code has (:data:`CHOICES`), and ``model.name`` is the model
    preset that the section is (:func:`_check_model_name`)."""
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(p, section), name)
        if value not in choices:
            raise ConfigError(f"{source}: {key}: expected one of {', '.join(choices)}, got {value!r}"
                              f"{group_hint(section, value)}")
    _check_model_name(p.model, source)


def _check_model_name(model: Model, source: str) -> None:
    """``model.name`` is a label (MLflow records it; no code reads it), so it must say what the section is:
    the name of a model preset, ``conf/model/<name>.yaml``, whose network the section builds. A section
    may change a preset's other settings (sizes, thresholds, precision, trainable stages) and even its
    network under the same name, but a name that labels another preset's network exactly is the slip
    ``-S model.name=fcos_r50`` for ``-S model=fcos_r50``: refused, with that hint. Without ``conf/model/``
    (the package outside its repository) the name is not checked."""
    presets = model_presets()
    if not presets:
        return
    if model.name not in presets:
        raise ConfigError(f"{source}: model.name: expected one of {', '.join(presets)} (a preset in conf/model/), "
                          f"got {model.name!r}{group_hint('model', model.name)}")
    mine = tuple(getattr(model, key) for key in ARCHITECTURE)
    if mine == _architecture(presets[model.name]):
        return
    same = [stem for stem, preset in presets.items() if _architecture(preset) == mine]
    if same:
        network = ", ".join(f"{key} {'null' if value is None else value}" for key, value in zip(ARCHITECTURE, mine))
        raise ConfigError(f"{source}: model.name: expected {same[0]!r} (the section builds the network of "
                          f"conf/model/{same[0]}.yaml: {network}), got {model.name!r}; "
                          f"did you mean `-S model={model.name}`?")


def _architecture(preset: dict) -> tuple:
    return tuple(preset.get(key) for key in ARCHITECTURE)


# --- numbers: what numpy and torch can hold --------------------------------------------------------------------


def _numbers(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(dotted key, number)`` for every int and float in ``value`` (a dataclass of params), list items
    as ``key[i]``; booleans are not numbers here."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _numbers(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{key}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield key, value


def _check_numbers(p: Params, require: Require) -> list[tuple[str, int]]:
    """Every number fits where it goes, whatever its field: floats are finite, seeds are 0..2**64-1, image
    sides 1..:data:`MAX_SIDE` pixels. Other integers must be int64: those beyond are returned, ``(key, value)``,
    for the caller to refuse after the field's own checks, so that the message names the bound that matters
    for the field (``train.max_iter: -10**20`` is "at least 1 iteration", as -5 is)."""
    beyond = []
    for key, value in _numbers(p, ""):
        field_key = key.split("[")[0]
        if isinstance(value, float):
            require(math.isfinite(value), key, "a finite number", value)
        elif field_key in SEED_KEYS:
            require(0 <= value <= SEED_MAX, key, "a seed from 0 to 2**64-1 (torch.manual_seed takes 64 bits)", value)
        elif field_key in PIXEL_SIZE_KEYS:
            require(1 <= value <= MAX_SIDE, key, f"a size from 1 to {MAX_SIDE} pixels", value)
        elif not INT64_MIN <= value <= INT64_MAX:
            beyond.append((key, value))
    return beyond


# --- across sections -------------------------------------------------------------------------------------------


def _check_bn_reestimate(p: Params, require: Require) -> None:
    """Re-estimating BatchNorm statistics needs BatchNorm layers that keep statistics."""
    if p.evaluate.bn_reestimate is None:
        return
    require(p.model.norm == "batchnorm", "evaluate.bn_reestimate", f"null with model.norm {p.model.norm} (only "
            "batchnorm layers keep statistics to re-estimate)", p.evaluate.bn_reestimate)


def _check_grouping(p: Params, require: Require) -> None:
    """Padded-shape grouping refines the orientation groups and needs one training size (with several, each
    image's size is drawn per iteration, after the batches are made)."""
    loader = p.loader
    if not loader.padded_shape_grouping:
        return
    require(loader.aspect_grouping, "loader.padded_shape_grouping", "false with loader.aspect_grouping false "
            "(padded-shape groups refine the orientation groups)", loader.padded_shape_grouping)
    require(len(p.model.min_size_train) == 1, "loader.padded_shape_grouping", "false with several "
            f"model.min_size_train ({list(p.model.min_size_train)}: the size is drawn per image and iteration, after "
            "batching)", loader.padded_shape_grouping)


def _check_processes(p: Params, source: str, world_size: int | None) -> None:
    """Both batch sizes divide among the processes: those that ``launch`` and ``train`` start, and
    ``world_size``, those actually running (when known)."""
    launch, train = p.launch, p.train
    processes = (launch.nodes * train.nproc, "launch.nodes x train.nproc") if launch.nodes > 1 \
        else (train.nproc, "train.nproc")
    for n, what in (processes, (world_size, "running processes")):
        if n is None:
            continue
        for key, batch in (("train.ims_per_batch", train.ims_per_batch),
                           ("evaluate.ims_per_batch", p.evaluate.ims_per_batch)):
            if batch < n or batch % n:
                raise ConfigError(
                    f"{source}: {key}: expected a multiple of the number of processes "
                    f"({what} = {n}), got {batch}"
                )
