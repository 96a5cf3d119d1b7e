"""The Scale-aware AutoAugment transform: zoom, then one sub-policy's color and geometric ops.

Per image, every random choice from ``ctx.rng`` (so the same ``(seed, iteration, index)`` gives the
same output in any worker or rank):

1. Zoom: one uniform draw ``u``; ``u < p_out``: zoom_out, else ``u < p_out + p_in``: zoom_in. The
   two probabilities are exactly the configured ones (the original draws zoom_in first and then
   zoom_out against ``p_in + p_out`` with a second draw, so its zoom_out fires about 41% of the
   time with the published policy, not 30%). Zoom probabilities do not ramp. A zoom without a level
   (``augment=trivial_zoom``'s) then draws its level uniformly 0..9, before anything else it draws.
2. One sub-policy, uniformly.
3. Its color op, then its geometric op: each fires with probability
   ``p * min(iteration / max_iter, 1)`` where ``iteration`` is the true global iteration
   (``ctx.iteration``, from the sampler; the original estimates it from a per-worker counter that
   restarts on resume); when it fires, boxes are selected by scale (:mod:`.selection`).

zoom_out's three fillers are drawn from a pool of ``filler_pool`` samples of the split, which changes
every ``filler_pool_iters`` iterations (:func:`filler_pool`: the same pool for every sample of those
iterations, in any worker or rank), and loaded through ``ctx.fetch`` via a per-process LRU cache of at
most ``filler_cache_mb`` MB of decoded pixels. Decoding a filler costs about as much as the whole
augmentation of a sample, and at COCO scale a filler drawn from the whole split is almost never
cached; drawn from the pool, each worker decodes a pool's images about once. (The original draws
from a pool too: the last 1000 full images each worker loaded, about 10 GB, which depends on the
worker.) The cache holds exactly what ``ctx.fetch`` returns, which zoom_out only reads, so the output
never depends on what is cached.

The input pixels may be stored interleaved (``[H, W, 3]`` in memory, as decoded and resized images
are) or plane by plane; the output values do not depend on it. An output that an op changed is
planar: the zoom ops write planes, and the box-level ops, about twice as fast on planes, convert an
interleaved input once before they run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from ...policy import MAX_GENE, Policy, ZoomOp
from ..transforms import SampleContext
from ._cache import SampleCache
from .color import color_op_on_boxes
from .geometric import geometric_op
from .selection import select_boxes
from ._pixels import planar
from .zoom import zoom_in, zoom_in_ratio, zoom_out, zoom_out_ratio

N_FILLERS = 3


@functools.lru_cache(maxsize=4)
def filler_pool(seed: int, block: int, num_samples: int, size: int) -> np.ndarray:
    """The indices zoom_out draws fillers from in block ``block`` of ``filler_pool_iters`` iterations:
    ``size`` distinct indices of ``num_samples`` chosen by ``(seed, block)``, or all of them when
    ``size`` is 0 or at least ``num_samples``. Cached and shared: read-only."""
    if size == 0 or size >= num_samples:
        pool = np.arange(num_samples)
    else:
        pool = np.sort(np.random.default_rng((seed, block, 0xF111E5)).choice(num_samples, size=size, replace=False))
    pool.flags.writeable = False
    return pool


def _level(zoom: ZoomOp, rng: np.random.Generator) -> int:
    """The zoom's level: its own, or one drawn uniformly 0..9 from ``rng`` where it has none (a draw that only
    such a policy, ``augment=trivial_zoom``'s, makes)."""
    return zoom.level if zoom.level is not None else int(rng.integers(MAX_GENE + 1))


class ScaleAwareAutoAugment:
    """Scale-aware AutoAugment of one training sample (a transform of :mod:`pipelines.data.transforms`).

    Args:
        policy: the decoded policy (:func:`pipelines.policy.decode_policy`).
        scale_splits: box areas (pixels, on the resized image) separating small / medium / large.
        box_prob: the base probability of selecting a box.
        max_iter: iteration at which box-level ops reach their full probability.
        filler_cache_mb: bound of the per-process cache of zoom_out filler images (0: no cache).
        filler_pool: how many of the split's samples zoom_out draws its fillers from (0: all of them).
        filler_pool_iters: iterations after which the filler pool changes.
        off_from: the iteration from which the transform does nothing (the strong-augmentation-off tail of
            ``augment.off_tail``); ``None``: never off.
        translate_relative: translate's pixels scaled by the image's shorter side over 800 (the original's
            image size) rather than the same pixels at any size.

    Call with ``(image uint8 [3, H, W], target, ctx)`` after resize and flip, before normalisation;
    returns a new ``(image, target)`` of the same size (the inputs are never modified in place).
    The arguments are trusted: :mod:`pipelines.config` validates them where they enter, as params.
    """

    def __init__(self, policy: Policy, *, scale_splits: Sequence[int] = (2048, 10240, 51200), box_prob: float = 0.3,
                 max_iter: int, filler_cache_mb: float = 64.0, filler_pool: int = 0, filler_pool_iters: int = 1,
                 off_from: int | None = None, translate_relative: bool = False):
        self.policy = policy
        self.scale_splits = tuple(scale_splits)
        self.box_prob = float(box_prob)
        self.max_iter = int(max_iter)
        self.filler_cache_mb = float(filler_cache_mb)
        self.filler_pool = int(filler_pool)
        self.filler_pool_iters = int(filler_pool_iters)
        self.off_from = None if off_from is None else int(off_from)
        self.translate_relative = bool(translate_relative)
        self._fillers = SampleCache(int(self.filler_cache_mb * 2**20))

    def ramp(self, iteration: int) -> float:
        """The factor on box-level probabilities at ``iteration``: ``min(iteration / max_iter, 1)``; 1 with
        ``max_iter`` 0 (no ramp: the search's fine-tunes run the ops at full strength, as the original's do)."""
        return min(max(iteration, 0) / self.max_iter, 1.0) if self.max_iter > 0 else 1.0

    def __call__(self, image: torch.Tensor, target: dict, ctx: SampleContext) -> tuple[torch.Tensor, dict]:
        if self.off_from is not None and ctx.iteration >= self.off_from:
            return image, target  # the tail: the resize and flip before it only (a function of the iteration)
        rng = ctx.rng
        image, target = self._zoom(image, target, ctx)
        sub = self.policy.subpolicies[int(rng.integers(len(self.policy.subpolicies)))]
        ramp = self.ramp(ctx.iteration)
        boxes = target["boxes"]
        if rng.random() < sub.color.prob * ramp:
            selected = select_boxes(boxes, ratios=self.policy.area_ratios, box_prob=self.box_prob,
                                    scale_splits=self.scale_splits, rng=rng)
            if selected.any():
                image = color_op_on_boxes(sub.color.name, planar(image), boxes[torch.from_numpy(selected)],
                                          level=sub.color.level, area_ratios=self.policy.area_ratios,
                                          scale_splits=self.scale_splits)
        if rng.random() < sub.geometric.prob * ramp:
            selected = select_boxes(boxes, ratios=self.policy.prob_ratios, box_prob=self.box_prob,
                                    scale_splits=self.scale_splits, rng=rng)
            image, target = geometric_op(sub.geometric.name, planar(image) if selected.any() else image, target,
                                         level=sub.geometric.level, selected=selected, rng=rng,
                                         translate_relative=self.translate_relative)
        return image, target

    def _zoom(self, image: torch.Tensor, target: dict, ctx: SampleContext) -> tuple[torch.Tensor, dict]:
        p_out, p_in = self.policy.zoom_out.prob, self.policy.zoom_in.prob
        u = ctx.rng.random()
        if u < p_out:
            return zoom_out(image, target, ratio=zoom_out_ratio(_level(self.policy.zoom_out, ctx.rng)),
                            fillers=self._draw_fillers(ctx))
        if u < p_out + p_in:
            return zoom_in(image, target, ratio=zoom_in_ratio(_level(self.policy.zoom_in, ctx.rng)), rng=ctx.rng)
        return image, target

    def _draw_fillers(self, ctx: SampleContext) -> list[tuple[torch.Tensor, dict]]:
        if ctx.fetch is None or ctx.num_samples < 1:
            return []
        pool = filler_pool(ctx.seed, ctx.iteration // self.filler_pool_iters, ctx.num_samples, self.filler_pool)
        picks = ctx.rng.choice(len(pool), size=N_FILLERS, replace=len(pool) < N_FILLERS)
        return [self._fillers.get(int(pool[k]), ctx.fetch) for k in picks]

    def __repr__(self) -> str:
        policy = str(self.policy).replace("\n", "\n    ")
        return (f"ScaleAwareAutoAugment(scale_splits={list(self.scale_splits)}, box_prob={self.box_prob}, "
                f"max_iter={self.max_iter}, filler_cache_mb={self.filler_cache_mb}, "
                f"filler_pool={self.filler_pool}, filler_pool_iters={self.filler_pool_iters}"
                f"{'' if self.off_from is None else f', off_from={self.off_from}'}"
                f"{', translate_relative=True' if self.translate_relative else ''},\n    {policy})")
