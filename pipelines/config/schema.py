"""The params schemas (OmegaConf structured configs), the names that select code, and the integer
bounds that numbers must fit.

Fields set to ``MISSING`` have no value of their own: ``conf/`` is the single source of values, and a
params file that leaves one out is refused. The ``None`` defaults are "not set": the augmentation
settings that only some ``augment.name`` choices read (validation requires them where they are read),
``search.scale_splits`` (null: ``augment.scale_splits``) and ``Params.dataset`` (typed by
``dataset.name`` when params are read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from omegaconf import MISSING

from . import backbones


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
    # header before it is decoded; conf/dataset/*.yaml: 2**28, 256 megapixels (16384 x 16384), above phone
    # cameras and most aerial tiles.
    max_image_pixels: int = MISSING
    # The most images of a split that the decoder may find damaged (libjpeg's "Corrupt JPEG data", its
    # pixels decoded through the damage) and still be kept, named in one warning; above it prepare
    # refuses the split. conf/dataset/*.yaml: 0.
    max_damaged_images: int = MISSING


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
    backbone: str = MISSING  # a name in pipelines.config.backbones.BACKBONES (resnet10 ... resnet101)
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
    # focal: FCOS's sigmoid focal loss and centerness, scores sqrt(sigmoid(cls) * sigmoid(centerness)); qfl: GFL's
    # quality focal loss (targets: the IoU of the predicted box at positives), no centerness, scores sigmoid(cls)
    cls_loss: str = MISSING
    # the official FCOS's loss details: GIoU weighted by the centerness target, normalised by its sum; the
    # positives' count (and that sum) averaged over the processes (all-reduced) rather than this process's
    centerness_weighted_giou: bool = MISSING
    sync_num_pos: bool = MISSING
    # which locations train on which box: fcos, torchvision's FCOS (centre sampling, scale range per level);
    # atss, ATSS's adaptive training sample selection (pipelines/assign.py)
    assigner: str = MISSING
    # the box branch (pipelines/box_head.py): a learnable scale per pyramid level on the regression output (the
    # official FCOS's Scale, initialised to 1); null or n (2..64): GFL's distribution, logits over the n + 1
    # distances 0..n strides per side, the expectation decoded, plus the distribution focal loss (weight 0.25)
    learn_scales: bool = MISSING
    dfl_bins: Optional[int] = MISSING


@dataclass
class Augment:
    name: str = MISSING  # none | flip | sa_autoaug | trivial | trivial_zoom
    hflip_prob: float = MISSING
    # the last off_tail of train.max_iter's iterations run the resize and flip only (required by sa_autoaug,
    # trivial and trivial_zoom; 0: no tail)
    off_tail: Optional[float] = None
    # Scale-aware AutoAugment (required by name=sa_autoaug; scale_splits and box_prob also by trivial, and they
    # and the filler_* keys by trivial_zoom)
    policy: Optional[list[int]] = None  # the flat gene list, 4 + 6 * n_subpolicies + 6 integers 0..9
    n_subpolicies: Optional[int] = None
    scale_splits: Optional[list[int]] = None  # box areas (pixels, resized image) between small/medium/large
    box_prob: Optional[float] = None
    filler_cache_mb: Optional[float] = None  # zoom_out filler images kept per loader process
    filler_pool: Optional[int] = None  # zoom_out draws fillers among this many images of the split (0: all)
    filler_pool_iters: Optional[int] = None  # iterations between changes of the filler pool
    # translate's offset scaled by the image's shorter side / 800 (the original's image size), rather than the
    # original's pixels at any size (required by sa_autoaug, trivial and trivial_zoom; false: the pixels)
    translate_relative: Optional[bool] = None
    # Where the policy comes from: pipelines/policy.py (the module of the published policy: the genes are
    # those above), or a policy search's JSON result, whose genes replace ``policy`` when params are read
    policy_file: str = MISSING


@dataclass
class Loader:
    num_workers: int = MISSING
    aspect_grouping: bool = MISSING  # batches of one orientation (landscape or portrait), train and test
    # training batches of one padded shape at the training resize (within an orientation): less padding;
    # needs aspect_grouping and one model.min_size_train
    padded_shape_grouping: bool = MISSING
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
    tta_source: str = MISSING  # resized | decoded: the extra scales resized from the test-size or the decoded image
    backend: str = MISSING  # pycocotools | faster_coco_eval: the COCOeval that scores the detections
    bootstrap: int = MISSING  # image resamples of the val split for the AP intervals; 0 turns them off
    # post-processing at test time (evaluate, export's card, predict): within a view and across the views
    nms_thresh: Optional[float] = MISSING  # class-wise NMS IoU; null: model.nms_thresh
    # nms | vote | wbf: kept boxes as they are, moved by box voting (Detectron's BBOX_VOTE), or weighted box fusion
    # (clusters of IoU > nms_thresh) instead of NMS
    merge: str = MISSING
    vote_thresh: float = MISSING  # merge vote: candidates of IoU >= this with a kept box vote on its coordinates
    # null: off; N: the BatchNorm statistics re-estimated on N train images at the test sizes before detecting
    # (evaluation only: the exported model keeps the trained statistics)
    bn_reestimate: Optional[int] = MISSING


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
    # The fair score (docs/search.md): every candidate fine-tunes with the same random numbers (true) or with its
    # own (false: seeded by its genes); the Pareto penalty compares with the null candidate (the flip-only
    # fine-tune) or with the un-fine-tuned baseline; the weight of (9 - mean probability gene) in the score
    common_random_numbers: bool = MISSING
    pareto_comparator: str = MISSING  # null_candidate | baseline
    regulariser_weight: float = MISSING
    # the proxy's augmentation as the original's: a linear learning-rate warmup over this fraction of the
    # fine-tune (0: none), translate scaled with the image size (augment.translate_relative)
    proxy_warmup_fraction: float = MISSING
    translate_relative: bool = MISSING
    # the best rescore_top_k candidates are fine-tuned at rescore_seeds more seeds before they become parents or
    # the result; their score is the mean over the seeds (0: no rescoring)
    rescore_top_k: int = MISSING
    rescore_seeds: int = MISSING
    # what a candidate's genes are (docs/search.md#a-smaller-scale-aware-space): full, the policy's whole gene list
    # (the original's); scale, the zoom and ratio genes and one strength over the published box-level ops
    space: str = MISSING


@dataclass
class Confirm:
    """The policy search's confirm stage (search/dvc.yaml): a section of its own, so that editing it re-runs the
    confirmation and not the evolution, whose stage depends on the whole ``search`` section."""

    top_k: int = MISSING  # the best candidates of the search by its score...
    arms: list[str] = MISSING  # ...and these augment presets (conf/augment/; a missing one skipped with a warning)
    seeds: int = MISSING  # trained at seeds seed, seed + 1, ... on the search-train images...
    fraction: float = MISSING  # ...up to this fraction of train.max_iter (on its schedule), scored by held-out AP


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
    confirm: Confirm = field(default_factory=Confirm)
    dataset: Any = None  # SyntheticDataset | CocoDataset, chosen by dataset.name


# Names that select code. Validation checks against these tuples; the modules that select build their
# registries (dicts of what each name runs) keyed by exactly these names through :func:`registry`, so the
# two cannot drift apart. They live here because this module may not import those (they import torch).
BACKBONES = tuple(backbones.BACKBONES)  # pipelines.model.BACKBONES
NORMS = ("batchnorm", "groupnorm", "frozen_batchnorm")  # pipelines.model.NORM_LAYERS
PRECISIONS = ("auto", "bf16", "fp16", "fp32")  # pipelines.hardware.PRECISIONS
AUGMENTATIONS = ("none", "flip", "sa_autoaug", "trivial", "trivial_zoom")  # pipelines.build.data.AUGMENTATIONS
OPTIMIZERS = ("sgd", "adamw")  # pipelines.solver.OPTIMIZERS
LR_SCHEDULES = ("multistep", "cosine")  # pipelines.solver.LR_SCHEDULES
EVAL_BACKENDS = ("pycocotools", "faster_coco_eval")  # pipelines.evaluation.BACKENDS
CLS_LOSSES = ("focal", "qfl")  # pipelines.scale_loss.CLS_LOSSES
TTA_SOURCES = ("resized", "decoded")  # pipelines.data.transforms.TTA_SOURCES and pipelines.inference.tta.SOURCES
MERGES = ("nms", "vote", "wbf")  # pipelines.model.MERGES and pipelines.inference.postprocess.MERGES
ASSIGNERS = ("fcos", "atss")  # pipelines.model.ASSIGNERS
PARETO_COMPARATORS = ("null_candidate", "baseline")  # pipelines.search.record.COMPARATORS
SEARCH_SPACES = ("full", "scale")  # pipelines.search.space.SPACES

CHOICES = {
    "model.backbone": BACKBONES,
    "model.norm": NORMS,
    "model.precision": PRECISIONS,
    "model.cls_loss": CLS_LOSSES,
    "model.assigner": ASSIGNERS,
    "augment.name": AUGMENTATIONS,
    "train.optimizer": OPTIMIZERS,
    "train.lr_schedule": LR_SCHEDULES,
    "evaluate.backend": EVAL_BACKENDS,
    "evaluate.merge": MERGES,
    "evaluate.tta_source": TTA_SOURCES,
    "search.pareto_comparator": PARETO_COMPARATORS,
    "search.space": SEARCH_SPACES,
}

_Registry = TypeVar("_Registry", bound=Mapping)


def registry(key: str, entries: _Registry) -> _Registry:
    """``entries`` (name -> what the name selects) unchanged, once its names are checked to be
    ``CHOICES[key]``, in order: the one list that validation accepts. A mismatch is a bug in the code,
    raised when the selecting module is imported."""
    if tuple(entries) != CHOICES[key]:
        raise AssertionError(f"registry of {key}: {tuple(entries)} differs from config.CHOICES: {CHOICES[key]}")
    return entries


# The range of int64, in which numpy and torch hold integers: every integer param but the seeds (checked
# by pipelines.config.validate) and the ids of a COCO dataset must fit it.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
