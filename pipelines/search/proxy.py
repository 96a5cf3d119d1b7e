"""The proxy task that scores a candidate: fine-tune the baseline with the candidate's policy at full
strength for ``search.fine_tune_iters`` iterations at ``search.fine_tune_lr`` (after a linear warmup over
``search.proxy_warmup_fraction`` of them), adding the loss into scale bins (:mod:`pipelines.scale_loss`),
then detect on the held-out split. The null candidate is the same fine-tune with the flip only.

A fine-tune is seeded from ``search.seed`` and a seed index (0 for a candidate's first fine-tune, 1, 2, ...
for its rescoring): with ``search.common_random_numbers`` every candidate of one seed index draws the same
random numbers (data order and per-image draws), otherwise each its own (from its key). It runs in one
process with ``search.threads`` threads, so it gives the same result wherever the precision and those match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..build import data as build_data
from ..build import model as build_model
from ..build import train as build_train
from ..config.schema import Params
from ..data.annotation_cache import AnnotationCache
from ..data.dataset import DetectionDataset
from ..engine import train_step
from ..evaluation import coco_evaluate, predict
from ..policy import decode_policy
from .genome import Genome
from .space import space

SCALES = ("APs", "APm", "APl")


@dataclass(frozen=True)
class Proxy:
    """What every fine-tune of one search shares."""

    params: Params
    baseline: Path  # the baseline's model file: every fine-tune starts from it
    cache: Path  # the search's annotation caches: train, and val (the held-out images)
    heldout: Path  # the held-out images' ground truth (COCO JSON)
    device: torch.device = torch.device("cpu")


WARMUP_FACTOR = 1 / 3  # maskrcnn-benchmark's default SOLVER.WARMUP_FACTOR: the original's fine-tunes warm up from it
NULL = "null"  # the null candidate's name where a genome's key would be


def candidate_seed(seed: int, genome_key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{genome_key}".encode()).digest()[:4], "little")


def fine_tune_seed(p: Params, genome_key: str, seed_index: int = 0) -> int:
    """The seed of fine-tune ``seed_index`` of the candidate ``genome_key`` (:data:`NULL`: the null
    candidate): with ``search.common_random_numbers`` the same for every candidate of that seed index."""
    search = p.search
    if search.common_random_numbers:
        return candidate_seed(search.seed, f"common:{seed_index}")
    return candidate_seed(search.seed, genome_key if seed_index == 0 else f"{genome_key}:{seed_index}")


PUBLISHED_SPLITS = (2048, 10240, 51200)  # the original's bounds, pixel areas on COCO images resized to 800 pixels
PUBLISHED_SIZE = 800


def scale_splits(p: Params) -> list[int]:
    """The search's area bounds (``search.scale_splits``): ``augment.scale_splits`` where null, as the original;
    for ``auto`` the original's bounds scaled by the area ratio of ``min(model.min_size_train)`` to 800 pixels
    (on smaller images the original's upper bin stays empty and its balance cannot be reached)."""
    splits = p.search.scale_splits
    if splits is None:
        return list(p.augment.scale_splits)
    if splits == "auto":
        factor = (min(p.model.min_size_train) / PUBLISHED_SIZE) ** 2
        return [max(1, round(area * factor)) for area in PUBLISHED_SPLITS]
    return list(splits)


def bin_shares(cache: AnnotationCache, *, min_size: int, max_size: int, splits: list[int]) -> list[float]:
    """The share of ``cache``'s non-crowd boxes in each of the score's 4 bins (bounds ``splits``) on images
    resized to ``min_size`` (longer side at most ``max_size``), as the fine-tunes see them."""
    areas = []
    for index in range(len(cache)):
        boxes, _, crowd = cache.annotations(index)
        width, height = (float(v) for v in cache.sizes[index])
        scale = min(min_size / min(width, height), max_size / max(width, height))
        b = boxes[~crowd].astype(np.float64)
        areas.append((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) * scale**2)
    counts = np.bincount(np.searchsorted(splits, np.concatenate(areas) if areas else np.zeros(0), side="right"), minlength=4)
    return [float(c) / max(int(counts.sum()), 1) for c in counts]


def search_params(p: Params) -> Params:
    """``p`` as the search uses it: ``augment.scale_splits`` replaced by :func:`scale_splits`, for the fine-tunes'
    scale buckets, the score's bins and the policy it writes."""
    return dataclasses.replace(p, augment=dataclasses.replace(p.augment, scale_splits=scale_splits(p)))


def fine_tune_params(p: Params) -> Params:
    """``p`` with the fine-tune's schedule: ``search.fine_tune_iters`` at the constant ``search.fine_tune_lr``
    after a linear warmup from :data:`WARMUP_FACTOR` over ``search.proxy_warmup_fraction`` of them; and
    translate scaled with the image size as ``search.translate_relative`` says."""
    search = p.search
    warmup = round(search.proxy_warmup_fraction * search.fine_tune_iters)
    return dataclasses.replace(
        p, train=dataclasses.replace(p.train, max_iter=search.fine_tune_iters, stop_at=1.0, base_lr=search.fine_tune_lr,
                                     lr_schedule="multistep", steps=[], warmup_iters=warmup,
                                     warmup_factor=WARMUP_FACTOR),
        augment=dataclasses.replace(p.augment, translate_relative=search.translate_relative))


def _model(proxy: Proxy, split: str):
    cache = AnnotationCache(proxy.cache / split, verify=False)
    model, _, _ = build_model.trained_detector(proxy.params, proxy.baseline, categories=cache.categories,
                                               split=proxy.cache / split, device=proxy.device)
    return model, cache


def heldout_aps(proxy: Proxy, model) -> dict[str, float]:
    """AP, APs, APm and APl of ``model`` on the held-out split (no test-time augmentation), read in this
    process (a candidate's process starts no loader workers of its own)."""
    p = dataclasses.replace(proxy.params, loader=dataclasses.replace(proxy.params.loader, num_workers=0))
    cache = AnnotationCache(proxy.cache / "val", verify=False)
    dataset = DetectionDataset(cache, transforms=build_data.test_transforms(p), seed=p.seed, skip_crowd=False)
    loader = build_data.test_loader(p, dataset, rank=0, world_size=1)
    detections = predict(model, loader, device=proxy.device, category_ids=cache.category_ids,
                         size_divisibility=p.loader.size_divisibility, progress=False)
    stats = coco_evaluate(proxy.heldout, detections, backend=p.evaluate.backend).stats
    return {name: float(stats[name]) if stats[name] is not None else -1.0 for name in ("AP", *SCALES)}


def baseline_aps(proxy: Proxy) -> dict[str, float]:
    """The baseline model's own APs on the held-out split (what candidates are compared with under
    ``search.pareto_comparator: baseline``)."""
    model, _ = _model(proxy, "val")
    return heldout_aps(proxy, model)


def fine_tune(proxy: Proxy, genome: Genome | None, seed_index: int = 0, *, preset: str | None = None) -> dict:
    """Fine-tune the baseline with ``genome`` (genes of ``search.space``; ``None``: the null candidate, the flip
    only) at seed index ``seed_index``; return its scale bins, held-out APs and seconds. ``preset`` (with
    ``genome`` None): an ``augment.name`` instead, such as ``trivial_zoom``, fine-tuned the same way."""
    start = time.perf_counter()
    p = fine_tune_params(proxy.params)
    genes = space(p.search.space, p.augment.n_subpolicies)  # a genome of search.space
    name = genes.key(genome) if genome is not None else f"preset:{preset}" if preset else NULL
    seed = fine_tune_seed(p, name, seed_index)
    torch.manual_seed(seed)
    model, cache = _model(proxy, "train")
    model.train()
    model.head.measure_scales(p.augment.scale_splits)
    if genome is None:
        augmentation = build_data.augmentation(dataclasses.replace(p, augment=dataclasses.replace(p.augment,
                                                                                                  name=preset or "flip")))
    else:
        augmentation = build_data.augmentation(p, decode_policy(genes.policy(genome), p.augment.n_subpolicies),
                                               ramp=False)
    dataset = DetectionDataset(cache, transforms=build_data.train_transforms(p, augmentation), seed=seed)
    loader = build_train.fine_tune_loader(p, dataset, seed=seed)
    optimizer = build_train.optimizer(p, model)
    scheduler = build_train.scheduler(p, optimizer)
    for batch in loader:
        train_step(model, batch.to(proxy.device), optimizer, scheduler, p.train.clip_grad_norm)
    bins = [float(b) for b in model.head.take_scale_losses()]
    model.head.measure_scales(None)
    return {"bins": bins, **heldout_aps(proxy, model), "seconds": time.perf_counter() - start}
