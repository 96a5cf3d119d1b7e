"""Typed schemas for ``params.yaml`` and the one loader that validates it.

``conf/`` is composed by Hydra (through DVC) into ``params.yaml``; stages read only ``params.yaml``
through :func:`load_params`, which checks it against these OmegaConf structured configs and then
checks values. Every problem stops the stage with one line naming the key and what was expected.
The schemas carry no defaults of their own: ``conf/`` is the single source of values.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import re
import sys
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from . import cli
from .errors import ConfigError, first_line
from .policy import decode_policy


@dataclass
class DatasetFiles:
    """What every dataset config has: its name, the four paths that the prepare stage's DVC deps name
    (relative to the repository root, or absolute), and the pixel limit."""

    name: str = MISSING
    train_images: str = MISSING
    train_annotations: str = MISSING
    val_images: str = MISSING
    val_annotations: str = MISSING
    # The most pixels an image may have (width x height, x frames for an animated GIF), read from its
    # header before it is decoded; 2**28, 256 megapixels (16384 x 16384): above phone cameras and most
    # aerial tiles. A default, unlike the other fields, so that a dataset config written before it existed
    # still loads (conf/dataset/*.yaml states it too).
    max_image_pixels: int = 2**28


@dataclass
class SyntheticDataset(DatasetFiles):
    """The built-in shapes dataset, generated from a seed (see :mod:`pipelines.data.synthetic`); its four
    paths stand for the data by naming what makes it, the generator itself (pipelines/data/synthetic.py)."""

    seed: int = MISSING
    train_size: int = MISSING
    val_size: int = MISSING
    num_classes: int = MISSING
    min_side: int = MISSING
    max_side: int = MISSING
    min_objects: int = MISSING
    max_objects: int = MISSING


@dataclass
class CocoDataset(DatasetFiles):
    """A user's COCO-format dataset on disk: an image folder and an annotation JSON per split."""


DATASETS: dict[str, type] = {"synthetic": SyntheticDataset, "coco": CocoDataset}


@dataclass
class Model:
    # The model preset the section is, conf/model/<name>.yaml: a label (MLflow records it) that validation
    # holds to the section's network (see _check_model_name)
    name: str = MISSING
    backbone: str = MISSING  # resnet18 | resnet34 | resnet50 | resnet101
    norm: str = MISSING  # batchnorm | groupnorm | frozen_batchnorm (the last only with backbone_weights)
    # null: from scratch; a torchvision weights name (IMAGENET1K_V1, ResNet50_Weights.IMAGENET1K_V1),
    # downloaded once into torch's hub cache; or a local file holding a state dict of the ResNet
    backbone_weights: Optional[str] = MISSING
    trainable_layers: int = MISSING  # ResNet stages trained, from the top (torchvision's meaning): 0..5
    fpn_channels: int = MISSING
    head_convs: int = MISSING
    min_size_train: list[int] = MISSING  # shorter side; one value is drawn per image
    max_size_train: int = MISSING
    min_size_test: int = MISSING
    max_size_test: int = MISSING
    # auto | bf16 | fp16 | fp32: autocast of backbone and head (fp16 with a gradient scaler); auto: bf16
    # where the CPU or GPU has it natively, fp32 elsewhere (pipelines/hardware.py)
    precision: str = MISSING
    channels_last: Any = MISSING  # auto | true | false; auto: on except for fp32 on AVX2 CPUs
    sync_batchnorm: bool = MISSING  # BatchNorm statistics over all processes (SyncBatchNorm; GPUs only)
    score_thresh: float = MISSING
    nms_thresh: float = MISSING
    detections_per_img: int = MISSING
    topk_candidates: int = MISSING


@dataclass
class Augment:
    name: str = MISSING  # none | flip | sa_autoaug | trivial
    hflip_prob: float = MISSING
    # Scale-aware AutoAugment (required by name=sa_autoaug; scale_splits and box_prob also by trivial)
    policy: Optional[list[int]] = None  # the flat gene list, 4 + 6 * n_subpolicies + 6 integers 0..9
    n_subpolicies: Optional[int] = None
    scale_splits: Optional[list[int]] = None  # box areas (pixels, resized image) between small/medium/large
    box_prob: Optional[float] = None
    filler_cache_mb: Optional[float] = None  # zoom_out filler images kept per loader process
    filler_pool: Optional[int] = None  # zoom_out draws fillers among this many images of the split (0: all)
    filler_pool_iters: Optional[int] = None  # iterations between changes of the filler pool
    # Where the policy comes from: pipelines/policy.py (the module of the published policy: the genes are
    # those above), or a policy search's JSON result, whose genes replace ``policy`` when params are read
    policy_file: str = MISSING


@dataclass
class Loader:
    num_workers: int = MISSING
    aspect_grouping: bool = MISSING
    size_divisibility: int = MISSING


@dataclass
class Train:
    nproc: int = MISSING
    ims_per_batch: int = MISSING  # global batch, split evenly across processes
    max_iter: int = MISSING
    stop_at: float = MISSING  # training ends after this fraction of max_iter, on max_iter's schedule (1: all of it)
    optimizer: str = MISSING  # sgd | adamw
    base_lr: float = MISSING
    momentum: float = MISSING
    weight_decay: float = MISSING
    norm_weight_decay: float = MISSING  # weight decay of normalisation weights and biases
    lr_schedule: str = MISSING  # multistep | cosine
    steps: list[int] = MISSING
    gamma: float = MISSING
    warmup_iters: int = MISSING
    warmup_factor: float = MISSING
    clip_grad_norm: float = MISSING  # 0 turns clipping off
    log_period: int = MISSING
    checkpoint_period: int = MISSING
    keep_checkpoints: int = MISSING  # newest checkpoints kept in outputs/train/checkpoints


@dataclass
class Evaluate:
    ims_per_batch: int = MISSING
    tta: bool = MISSING  # test-time augmentation: extra scales and horizontal flip, merged by class-wise NMS
    tta_scales: list[int] = MISSING  # shorter sides of the extra scales
    tta_max_size: int = MISSING
    tta_flip: bool = MISSING  # also flip each scale
    backend: str = MISSING  # pycocotools | faster_coco_eval: the COCOeval that scores the detections


@dataclass
class Tracking:
    experiment: str = MISSING
    log_checkpoints: bool = MISSING  # also store every checkpoint in MLflow (the final model always is)


@dataclass
class Search:
    """Scale-aware AutoAugment's policy search (search/dvc.yaml; the default pipeline never runs it)."""

    population: int = MISSING  # genomes scored in round 0
    rounds: int = MISSING
    kept: int = MISSING  # best genomes ever scored, parents of the next round
    mutations: int = MISSING  # per round after the first: mutants of the kept genomes...
    crossovers: int = MISSING  # ...uniform crossovers of two of them...
    random: int = MISSING  # ...and new random genomes
    mutation_prob: float = MISSING  # each gene of a mutant redrawn with this probability
    include_published: bool = MISSING  # round 0 scores the published policy first
    fine_tune_iters: int = MISSING  # the proxy: iterations of fine-tuning per candidate...
    fine_tune_lr: float = MISSING  # ...at this constant learning rate, batch train.ims_per_batch
    heldout_fraction: float = MISSING  # of the train images, held out of the baseline and fine-tunes to score on
    baseline_fraction: float = MISSING  # the proxy starts from the baseline at this fraction of train.max_iter
    candidates_at_once: int = MISSING  # fine-tunes running side by side, one process each
    threads: int = MISSING  # per candidate process
    seed: int = MISSING  # the held-out split, the rounds' genomes and each fine-tune's randomness
    # The area bounds of the score's bins and of the policy's scale buckets: null, augment.scale_splits (the
    # original's, COCO's at 800 pixels); auto, those scaled to min(model.min_size_train); or three areas
    scale_splits: Any = None


@dataclass
class Launch:
    """Where the processes run, read by ``pipelines.launch`` only: no stage depends on it and it is not in
    the resume fingerprint, so changing it re-runs nothing. ``nodes: 1`` is torchrun's ``--standalone``."""

    nodes: int = MISSING  # machines, each running train.nproc processes
    rdzv_endpoint: str = MISSING  # HOST:PORT of the c10d rendezvous (on one of the nodes) when nodes > 1
    rdzv_id: str = MISSING  # the job's id: the same on every node, another for another job
    max_restarts: int = MISSING  # restarts of the whole group after a failure; each resumes from a checkpoint


@dataclass
class Params:
    seed: int = MISSING
    model: Model = field(default_factory=Model)
    augment: Augment = field(default_factory=Augment)
    loader: Loader = field(default_factory=Loader)
    train: Train = field(default_factory=Train)
    evaluate: Evaluate = field(default_factory=Evaluate)
    tracking: Tracking = field(default_factory=Tracking)
    launch: Launch = field(default_factory=Launch)
    search: Search = field(default_factory=Search)
    dataset: Any = None  # SyntheticDataset | CocoDataset, chosen by dataset.name


# Names that select code. Validation checks against these tuples; the modules that select build their
# registries (dicts of what each name runs) keyed by exactly these names through :func:`registry`, so the
# two cannot drift apart. They live here because this module may not import those (they import torch).
BACKBONES = ("resnet10", "resnet18", "resnet34", "resnet50", "resnet101")  # pipelines.model.BACKBONES
NORMS = ("batchnorm", "groupnorm", "frozen_batchnorm")  # pipelines.model.NORM_LAYERS
PRECISIONS = ("auto", "bf16", "fp16", "fp32")  # pipelines.hardware.PRECISIONS
AUGMENTATIONS = ("none", "flip", "sa_autoaug", "trivial")  # pipelines.build.AUGMENTATIONS
OPTIMIZERS = ("sgd", "adamw")  # pipelines.solver.OPTIMIZERS
LR_SCHEDULES = ("multistep", "cosine")  # pipelines.solver.LR_SCHEDULES
EVAL_BACKENDS = ("pycocotools", "faster_coco_eval")  # pipelines.evaluation.BACKENDS

CHOICES = {
    "model.backbone": BACKBONES,
    "model.norm": NORMS,
    "model.precision": PRECISIONS,
    "augment.name": AUGMENTATIONS,
    "train.optimizer": OPTIMIZERS,
    "train.lr_schedule": LR_SCHEDULES,
    "evaluate.backend": EVAL_BACKENDS,
}

_ABSENT = object()
_Registry = TypeVar("_Registry", bound=Mapping)


def registry(key: str, entries: _Registry) -> _Registry:
    """``entries`` (name -> what the name selects) unchanged, once its names are checked to be
    ``CHOICES[key]``, in order: the one list that validation accepts. A mismatch is a bug in the code,
    raised when the selecting module is imported."""
    if tuple(entries) != CHOICES[key]:
        raise AssertionError(f"registry of {key}: {tuple(entries)} differs from config.CHOICES: {CHOICES[key]}")
    return entries


# conf/, composed by Hydra: its group options give the "did you mean `-S model=fcos_r50`?" hints, and
# conf/model/ holds the model presets that model.name names.
CONF = Path(__file__).resolve().parents[1] / "conf"
# Config groups by the params section they fill (conf/solver/ is packaged into ``train``).
GROUP_OF_SECTION = {"dataset": "dataset", "model": "model", "augment": "augment", "train": "solver"}
# The fields that make a model preset's network what it is (parameter shapes and initial weights). The
# others (sizes, thresholds, precision, trainable stages) are settings a run may change under the same name.
ARCHITECTURE = ("backbone", "norm", "backbone_weights", "fpn_channels", "head_convs")

# Where numbers cross into numpy and torch. Seeds go to torch.manual_seed (stages/train.py), which takes
# 64 bits, and to numpy's SeedSequence (any size); every other integer is held as int64 somewhere.
SEED_KEYS = ("seed", "dataset.seed")
SEED_MAX = 2**64 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Image sides in pixels: the synthetic set is saved as JPEG, whose sides stop at 65500 (libjpeg's
# JPEG_MAX_DIMENSION), and float32 box coordinates stay exact to 1/256 pixel below 2**16; resize targets
# share the bound.
PIXEL_SIZE_KEYS = ("dataset.min_side", "dataset.max_side", "model.min_size_train", "model.max_size_train",
                   "model.min_size_test", "model.max_size_test", "evaluate.tta_scales", "evaluate.tta_max_size")
MAX_SIDE = 65500

# A params file is a few kB (conf/ composes to about 3 kB); YAML aliases may not expand it beyond this
# many values (a "billion laughs" document is a few hundred bytes that expand to 10**9).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000


_WEIGHTS_NAME = re.compile(r"(?:(\w+_Weights)\.)?([A-Z][A-Z0-9_]*)")


def weights_name(value: str) -> tuple[str | None, str] | None:
    """``(enum, member)`` when ``model.backbone_weights`` names torchvision weights (``IMAGENET1K_V1``:
    ``(None, "IMAGENET1K_V1")``; ``ResNet50_Weights.IMAGENET1K_V1``), ``None`` when it is a file path
    (anything else; ``./IMAGENET1K_V1`` is a file)."""
    match = _WEIGHTS_NAME.fullmatch(value)
    return (match.group(1), match.group(2)) if match else None


def weights_enum(backbone: str) -> str:
    """The name of torchvision's weights enum of a ResNet backbone: ``resnet50`` -> ``ResNet50_Weights``."""
    return f"ResNet{backbone.removeprefix('resnet')}_Weights"


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


def params_from_dict(raw: dict, *, source: str = "params", world_size: int | None = None) -> Params:
    """Validate a plain dictionary of parameters (as :func:`load_params` does for a file)."""
    raw = dict(raw)
    dataset_raw = raw.pop("dataset", None)
    if not isinstance(dataset_raw, dict):
        raise ConfigError(f"{source}: dataset: expected a section with a 'name' ({' | '.join(DATASETS)})")
    name = dataset_raw.get("name")
    if name not in DATASETS:
        raise ConfigError(f"{source}: dataset.name: expected one of {', '.join(DATASETS)}, got {name!r}")

    params = _typed(Params, raw, source, prefix="")
    try:
        params.dataset = _typed(DATASETS[name], dataset_raw, source, prefix="dataset.")
    except ConfigError as err:  # another preset's whole section under this name: `-S dataset.name=coco`
        others = [n for n, preset in group_presets("dataset").items() if n != name and set(preset) == set(dataset_raw)]
        raise ConfigError(f"{err}{_group_hint('dataset', name)}" if others else str(err)) from None
    _check_values(params, source, world_size)
    return params


def read_policy_file(p: Params, source: str = "params.yaml") -> Params:
    """``p`` with the genes of a search's result (``augment.policy_file`` ending in ``.json``) as
    ``augment.policy``, and the scale bounds it was searched with as ``augment.scale_splits``, where
    ``augment.name`` is sa_autoaug; the train stage reads it so (the search's own stages never do: they run
    before it exists)."""
    a = p.augment
    if a.name != "sa_autoaug" or not a.policy_file.endswith(".json"):
        return p
    path = Path(a.policy_file)
    try:
        found = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{source}: augment.policy_file: {path}: not readable JSON ({first_line(err)})") from None
    if found is None:
        raise ConfigError(f"{source}: augment.policy_file: {path}: not found; run the search "
                          "(make search) or choose another augment preset")
    if not isinstance(found, dict) or not isinstance(found.get("policy"), list):
        raise ConfigError(f"{source}: augment.policy_file: {path}: expected a JSON object with a 'policy' gene list")
    if found.get("n_subpolicies", a.n_subpolicies) != a.n_subpolicies:
        raise ConfigError(f"{source}: augment.policy_file: {path}: searched with {found['n_subpolicies']} "
                          f"sub-policies, augment.n_subpolicies is {a.n_subpolicies}")
    try:
        decode_policy(found["policy"], a.n_subpolicies)
    except ConfigError as err:
        raise ConfigError(f"{source}: augment.policy_file: {path}: {err}") from None
    splits = found.get("scale_splits", a.scale_splits)  # the bounds the policy was searched with
    if not (isinstance(splits, list) and len(splits) == 3 and all(isinstance(x, int) and x > 0 for x in splits)):
        raise ConfigError(f"{source}: augment.policy_file: {path}: scale_splits: expected three positive areas, "
                          f"got {splits!r}")
    return dataclasses.replace(p, augment=dataclasses.replace(a, policy=list(found["policy"]), scale_splits=splits))


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


def _typed(schema: type, raw: dict, source: str, prefix: str) -> Any:
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
        raise ConfigError(f"{source}: {key}: expected a finite number, got {_show(value)}") from None
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


def _show(value: Any) -> str:
    """``repr(value)``, with an integer of more than 30 digits given by its size (one readable line)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _check_values(p: Params, source: str, world_size: int | None) -> None:
    """Every value in range, section by section; the first problem raises ConfigError (one line)."""
    def require(ok: bool, key: str, expected: str, value: Any) -> None:
        if not ok:
            raise ConfigError(f"{source}: {key}: expected {expected}, got {_show(value)}")

    _check_names(p, source)
    _check_numbers(p, require)
    require(p.seed >= 0, "seed", "an integer >= 0", p.seed)
    if isinstance(p.dataset, SyntheticDataset):
        _check_synthetic(p.dataset, require)
    _check_model(p.model, require)
    _check_augment(p.augment, require, source)
    require(p.loader.num_workers >= 0, "loader.num_workers", "an integer >= 0", p.loader.num_workers)
    require(p.loader.size_divisibility >= 1, "loader.size_divisibility", "an integer >= 1", p.loader.size_divisibility)
    _check_train(p, require)
    _check_evaluate(p, require)
    _check_launch(p, require, source, world_size)
    _check_search(p.search, require)


# --- names that select code ----------------------------------------------------------------------------------


def _check_names(p: Params, source: str) -> None:
    """Every name that selects code is one the code has (:data:`CHOICES`), and ``model.name`` is the model
    preset that the section is (:func:`_check_model_name`)."""
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(p, section), name)
        if value not in choices:
            raise ConfigError(f"{source}: {key}: expected one of {', '.join(choices)}, got {value!r}"
                              f"{_group_hint(section, value)}")
    _check_model_name(p.model, source)


def _check_model_name(m: Model, source: str) -> None:
    """``model.name`` is a label (MLflow records it; no code reads it), so it must say what the section is:
    the name of a model preset, ``conf/model/<name>.yaml``, whose network the section builds. A section
    may change a preset's other settings (sizes, thresholds, precision, trainable stages) and even its
    network under the same name, but a name that labels another preset's network exactly is the slip
    ``-S model.name=fcos_r50`` for ``-S model=fcos_r50``: refused, with that hint. Without ``conf/model/``
    (the package outside its repository) the name is not checked."""
    presets = model_presets()
    if not presets:
        return
    if m.name not in presets:
        raise ConfigError(f"{source}: model.name: expected one of {', '.join(presets)} (a preset in conf/model/), "
                          f"got {m.name!r}{_group_hint('model', m.name)}")
    mine = tuple(getattr(m, key) for key in ARCHITECTURE)
    if mine == _architecture(presets[m.name]):
        return
    same = [stem for stem, preset in presets.items() if _architecture(preset) == mine]
    if same:
        network = ", ".join(f"{key} {'null' if value is None else value}" for key, value in zip(ARCHITECTURE, mine))
        raise ConfigError(f"{source}: model.name: expected {same[0]!r} (the section builds the network of "
                          f"conf/model/{same[0]}.yaml: {network}), got {m.name!r}; did you mean `-S model={m.name}`?")


def _architecture(preset: dict) -> tuple:
    return tuple(preset.get(key) for key in ARCHITECTURE)


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


def _group_hint(section: str, value: Any) -> str:
    """``; did you mean `-S <group>=<value>`?`` when ``value`` names an option of the config group that fills
    ``section`` (``conf/<group>/<value>.yaml``), else ``""``."""
    group = GROUP_OF_SECTION.get(section)
    if group is None or not isinstance(value, str) or not re.fullmatch(r"\w[\w.-]*", value):
        return ""
    return f"; did you mean `-S {group}={value}`?" if (CONF / group / f"{value}.yaml").is_file() else ""


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


def _check_numbers(p: Params, require) -> None:
    """Every number fits where it goes, whatever its field: floats are finite, seeds are 0..2**64-1,
    other integers int64, image sides 1..:data:`MAX_SIDE` pixels."""
    for key, value in _numbers(p, ""):
        field_key = key.split("[")[0]
        if isinstance(value, float):
            require(math.isfinite(value), key, "a finite number", value)
        elif field_key in SEED_KEYS:
            require(0 <= value <= SEED_MAX, key, "a seed from 0 to 2**64-1 (torch.manual_seed takes 64 bits)", value)
        else:
            require(INT64_MIN <= value <= INT64_MAX, key, "an integer from -2**63 to 2**63-1 (numpy and torch hold "
                    "it as int64)", value)
            if field_key in PIXEL_SIZE_KEYS:
                require(1 <= value <= MAX_SIDE, key, f"a size from 1 to {MAX_SIDE} pixels", value)


# --- values, section by section ----------------------------------------------------------------------------------


def _check_synthetic(d: SyntheticDataset, require) -> None:
    require(d.seed >= 0, "dataset.seed", "an integer >= 0", d.seed)
    require(d.train_size >= 1, "dataset.train_size", "at least 1 image", d.train_size)
    require(d.val_size >= 1, "dataset.val_size", "at least 1 image", d.val_size)
    require(1 <= d.num_classes <= 6, "dataset.num_classes", "1 to 6 shape classes", d.num_classes)
    require(d.min_side >= 64, "dataset.min_side", "at least 64 pixels", d.min_side)
    require(d.max_side >= d.min_side, "dataset.max_side", f">= dataset.min_side ({d.min_side})", d.max_side)
    require(d.min_objects >= 1, "dataset.min_objects", "at least 1", d.min_objects)
    require(d.max_objects >= d.min_objects, "dataset.max_objects", f">= dataset.min_objects ({d.min_objects})",
            d.max_objects)


def _check_model(m: Model, require) -> None:
    require(isinstance(m.channels_last, bool) or m.channels_last == "auto", "model.channels_last",
            "auto, true or false", m.channels_last)
    require(m.fpn_channels > 0 and m.fpn_channels % 32 == 0, "model.fpn_channels",
            "a positive multiple of 32 (the head's GroupNorm has 32 groups)", m.fpn_channels)
    require(m.head_convs >= 1, "model.head_convs", "at least 1", m.head_convs)
    require(len(m.min_size_train) > 0 and all(s > 0 for s in m.min_size_train), "model.min_size_train",
            "a non-empty list of positive sizes", m.min_size_train)
    require(m.max_size_train >= max(m.min_size_train), "model.max_size_train",
            f">= the largest model.min_size_train ({max(m.min_size_train)})", m.max_size_train)
    require(m.min_size_test > 0, "model.min_size_test", "a positive size", m.min_size_test)
    require(m.max_size_test >= m.min_size_test, "model.max_size_test", f">= model.min_size_test ({m.min_size_test})",
            m.max_size_test)
    require(0 <= m.score_thresh < 1, "model.score_thresh", "a value in [0, 1)", m.score_thresh)
    require(0 < m.nms_thresh <= 1, "model.nms_thresh", "a value in (0, 1]", m.nms_thresh)
    require(m.detections_per_img >= 1, "model.detections_per_img", "at least 1", m.detections_per_img)
    require(m.topk_candidates >= 1, "model.topk_candidates", "at least 1", m.topk_candidates)
    require(0 <= m.trainable_layers <= 5, "model.trainable_layers",
            "0 to 5 (ResNet stages trained, from the top; 5: all)", m.trainable_layers)
    w = m.backbone_weights
    if w is None:
        require(m.norm != "frozen_batchnorm", "model.norm", "batchnorm or groupnorm when model.backbone_weights is "
                "null (frozen_batchnorm from scratch keeps mean 0, variance 1: no normalisation)", m.norm)
        require(m.trainable_layers == 5, "model.trainable_layers", "5 when model.backbone_weights is null "
                "(frozen stages would keep their random weights)", m.trainable_layers)
    else:
        require(w != "" and w == w.strip(), "model.backbone_weights",
                "null, a torchvision weights name or the path of a state-dict file", w)
        name = weights_name(w)
        if name is not None:
            require(m.backbone != "resnet10", "model.backbone_weights", "null or a state-dict file with model.backbone "
                    "resnet10 (torchvision publishes no ResNet-10 weights)", w)
            enum = weights_enum(m.backbone)
            require(name[0] in (None, enum), "model.backbone_weights",
                    f"weights of model.backbone ({m.backbone}): {enum}.{name[1]} or {name[1]}", w)
            require(m.norm != "groupnorm", "model.norm", f"batchnorm or frozen_batchnorm with torchvision weights "
                    f"(model.backbone_weights = {w!r} holds BatchNorm layers)", m.norm)
    require(not m.sync_batchnorm or m.norm == "batchnorm", "model.sync_batchnorm",
            f"false with model.norm {m.norm!r} (only trainable BatchNorm synchronises)", m.sync_batchnorm)


def _check_augment(a: Augment, require, source: str) -> None:
    require(0 <= a.hflip_prob <= 1, "augment.hflip_prob", "a probability in [0, 1]", a.hflip_prob)
    if a.name not in ("sa_autoaug", "trivial"):
        return
    from_file = a.policy is None and a.policy_file.endswith(".json")  # read by the train stage
    needed = ("scale_splits", "box_prob") if a.name == "trivial" else (
        *(() if from_file else ("policy",)), "n_subpolicies", "scale_splits", "box_prob", "filler_cache_mb",
        "filler_pool", "filler_pool_iters")
    for key in needed:
        if getattr(a, key) is None:
            raise ConfigError(f"{source}: augment.{key}: missing value (required by augment.name={a.name})"
                              f"{_group_hint('augment', a.name)}")
    require(len(a.scale_splits) == 3 and list(a.scale_splits) == sorted(set(a.scale_splits)) and a.scale_splits[0] > 0,
            "augment.scale_splits", "three increasing positive areas", a.scale_splits)
    require(0 <= a.box_prob <= 1, "augment.box_prob", "a probability in [0, 1]", a.box_prob)
    if a.name == "trivial":
        return
    require(a.filler_cache_mb >= 0, "augment.filler_cache_mb", "a size in MB >= 0", a.filler_cache_mb)
    require(a.filler_pool >= 0, "augment.filler_pool", "a number of images >= 0 (0: the whole split)", a.filler_pool)
    require(a.filler_pool_iters >= 1, "augment.filler_pool_iters", "a number of iterations >= 1", a.filler_pool_iters)
    if from_file:
        return
    try:
        decode_policy(a.policy, a.n_subpolicies)  # the one check of the genes; errors name their position
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _check_train(p: Params, require) -> None:
    t = p.train
    require(t.nproc >= 1, "train.nproc", "at least 1 process", t.nproc)
    require(t.max_iter >= 1, "train.max_iter", "at least 1 iteration", t.max_iter)
    require(0 < t.stop_at <= 1, "train.stop_at", "a fraction of train.max_iter in (0, 1]", t.stop_at)
    require(t.base_lr > 0, "train.base_lr", "a learning rate > 0", t.base_lr)
    require(0 <= t.momentum < 1, "train.momentum", "a value in [0, 1)", t.momentum)
    require(t.weight_decay >= 0, "train.weight_decay", "a value >= 0", t.weight_decay)
    require(t.norm_weight_decay >= 0, "train.norm_weight_decay", "a value >= 0", t.norm_weight_decay)
    require(list(t.steps) == sorted(set(t.steps)) and all(0 < s < t.max_iter for s in t.steps), "train.steps",
            f"strictly increasing iterations between 0 and train.max_iter ({t.max_iter})", t.steps)
    require(0 < t.gamma <= 1, "train.gamma", "a factor in (0, 1]", t.gamma)
    require(0 <= t.warmup_iters < t.max_iter, "train.warmup_iters", f"a value in [0, train.max_iter ({t.max_iter}))",
            t.warmup_iters)
    require(0 < t.warmup_factor <= 1, "train.warmup_factor", "a factor in (0, 1]", t.warmup_factor)
    require(t.clip_grad_norm >= 0, "train.clip_grad_norm", "a value >= 0 (0 turns clipping off)", t.clip_grad_norm)
    require(t.log_period >= 1, "train.log_period", "at least 1 iteration", t.log_period)
    require(t.checkpoint_period >= 1, "train.checkpoint_period", "at least 1 iteration", t.checkpoint_period)
    require(t.keep_checkpoints >= 1, "train.keep_checkpoints", "at least 1", t.keep_checkpoints)


def _check_evaluate(p: Params, require) -> None:
    e = p.evaluate
    require(e.ims_per_batch >= 1, "evaluate.ims_per_batch", "at least 1 image", e.ims_per_batch)
    require(all(s > 0 for s in e.tta_scales), "evaluate.tta_scales", "positive sizes", e.tta_scales)
    require(e.tta_max_size >= max(e.tta_scales, default=0), "evaluate.tta_max_size",
            f">= the largest evaluate.tta_scales ({max(e.tta_scales, default=0)})", e.tta_max_size)
    require(bool(p.tracking.experiment.strip()), "tracking.experiment", "a non-empty experiment name",
            p.tracking.experiment)


def _check_launch(p: Params, require, source: str, world_size: int | None) -> None:
    launch, t = p.launch, p.train
    require(launch.nodes >= 1, "launch.nodes", "at least 1 node", launch.nodes)
    require(launch.max_restarts >= 0, "launch.max_restarts", "an integer >= 0", launch.max_restarts)
    if launch.nodes > 1:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "launch.rdzv_endpoint",
                "HOST:PORT of the rendezvous (a port in 1..65535) when launch.nodes > 1", launch.rdzv_endpoint)
        require(bool(launch.rdzv_id.strip()), "launch.rdzv_id", "a non-empty job id", launch.rdzv_id)
    processes = (launch.nodes * t.nproc, "launch.nodes x train.nproc") if launch.nodes > 1 else (t.nproc, "train.nproc")
    for n, what in (processes, (world_size, "running processes")):
        if n is None:
            continue
        for key, batch in (("train.ims_per_batch", t.ims_per_batch), ("evaluate.ims_per_batch", p.evaluate.ims_per_batch)):
            if batch < n or batch % n:
                raise ConfigError(
                    f"{source}: {key}: expected a multiple of the number of processes "
                    f"({what} = {n}), got {batch}"
                )


def _check_search(s: Search, require) -> None:
    for key in ("population", "rounds", "kept", "fine_tune_iters", "candidates_at_once", "threads"):
        require(getattr(s, key) >= 1, f"search.{key}", "at least 1", getattr(s, key))
    for key in ("mutations", "crossovers", "random", "seed"):
        require(getattr(s, key) >= 0, f"search.{key}", "an integer >= 0", getattr(s, key))
    require(s.rounds == 1 or s.mutations + s.crossovers + s.random >= 1, "search.mutations",
            "at least one genome per round after the first (mutations + crossovers + random)", s.mutations)
    require(0 <= s.mutation_prob <= 1, "search.mutation_prob", "a probability in [0, 1]", s.mutation_prob)
    require(s.fine_tune_lr > 0, "search.fine_tune_lr", "a learning rate > 0", s.fine_tune_lr)
    require(0 < s.heldout_fraction < 1, "search.heldout_fraction", "a fraction in (0, 1)", s.heldout_fraction)
    require(0 < s.baseline_fraction <= 1, "search.baseline_fraction", "a fraction in (0, 1]", s.baseline_fraction)
    splits = s.scale_splits
    require(splits is None or splits == "auto" or (
        isinstance(splits, (list, tuple)) and len(splits) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) for x in splits)
        and list(splits) == sorted(set(splits)) and splits[0] > 0),
        "search.scale_splits", "null, auto or three increasing positive areas", splits)


def main(argv: list[str] | None = None) -> None:
    """``python -m pipelines.config``: validate ``params.yaml`` before ``torchrun`` starts processes."""
    load_params(cli.parse_args("Validate params.yaml; one line per problem, exit code 2.", argv).params)


if __name__ == "__main__":
    cli.run(main)
