"""COCO's AP figures under an image-level bootstrap, from per-image matches extracted once (no torch).

COCO's box AP depends on the images only through per-image matches: for each (category, area range,
image), the detections' scores, whether each is a true positive at each IoU threshold, whether it is
ignored (matched to a crowd region, or unmatched and outside the area range), and the number of ground
truth boxes that are not ignored. :func:`extract_matches` reads them once from a pycocotools
``COCOeval`` after ``evaluate()`` and keeps them as flat numpy arrays, the detections of each
(category, area range) already in the order ``COCOeval.accumulate`` sorts them (score descending, a
stable sort over image order). A bootstrap resample draws the images with replacement; an image drawn
``w`` times counts ``w`` times, which is only a weighted cumulative sum over that fixed order.
:func:`figures` then applies ``accumulate``'s arithmetic exactly (precision ``tp / (tp + fp +
np.spacing(1))``, its precision envelope, the 101-point recall interpolation; a category without
ground truth in the resample is left out, as ``COCOeval`` leaves it out) and ``summarize``'s means.
With every weight 1 the figures are ``COCOeval``'s, bit for bit in practice.

An image drawn twice counts as two copies of it: the same figures as ``COCOeval`` on a dataset where
the image really appears twice, except where a tied score would order the copies differently among
other images' detections.

* :func:`bootstrap`: percentile intervals of every figure in :data:`FIGURES`.
* :func:`resampled_figures`: the figures of each resample for several models evaluated on the same
  images, with the same image draws for every model, for paired comparisons (for example the mean over
  seeds of a difference in AP: take the difference per resample, then its percentiles).

The interval covers the noise of drawing the evaluation images only; it says nothing about the noise
between training runs (seeds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

AREAS = ("all", "small", "medium", "large")  # COCOeval's area ranges for boxes, in its order
SUMMARY_FIGURES = ("AP", "AP50", "AP75", "APs", "APm", "APl")  # COCOeval's first six stats
IOU_FIGURES = tuple(f"AP_iou{t}" for t in range(50, 100, 5))  # AP at each IoU threshold, area all
FIGURES = SUMMARY_FIGURES + IOU_FIGURES


def iou_figure_name(threshold: float) -> str:
    """``AP_iou50`` for IoU threshold 0.5, ..., ``AP_iou95`` for 0.95."""
    return f"AP_iou{round(float(threshold) * 100)}"


@dataclass(frozen=True)
class Matches:
    """One model's per-image matches on one set of images (see the module's docstring), as index arrays.

    The detections of all (category, area range) groups are concatenated, group ``g = k * 4 + a``
    (category index ``k`` in sorted category id order, area range ``a`` of :data:`AREAS`) at
    ``starts[g]:starts[g + 1]``, each group sorted as ``COCOeval.accumulate`` sorts it. Detections that
    change no figure for any weights are left out: those ignored at every IoU threshold, and those after
    the group's last true positive (at any threshold). A figure needs the precision and recall at the
    true positives only (see :func:`precision`); at each, the weighted counts down its group are
    differences of cumulative sums over three lists: every detection, the true positives (per
    threshold) and the ignored detections (per threshold)."""

    image_ids: np.ndarray  # [I] the evaluated image ids, ascending (COCOeval's order)
    category_ids: np.ndarray  # [K]
    iou_thresholds: np.ndarray  # [T]
    recall_thresholds: np.ndarray  # [R]
    starts: np.ndarray  # [K * A + 1] where each group's detections start
    image: np.ndarray  # [N] each detection's image index (into image_ids)
    ground_truth: np.ndarray  # [K * A, I] boxes that are not ignored, per group and image
    # the true positives, threshold by threshold, each in detection order: [P] each
    positive_image: np.ndarray  # its image index
    positive_segment: np.ndarray  # threshold * groups + group (ascending)
    positive_group: np.ndarray  # its group
    positive_first: np.ndarray  # the index (in this list) of the first true positive of its threshold and group
    seen: np.ndarray  # [2, P] detections of its group up to it: indices into the cumulative sum over all
    ignored_image: np.ndarray  # [Q] image index of each detection ignored at a threshold (threshold by threshold)
    ignored: np.ndarray  # [2, P] ignored detections of its threshold and group before it: indices likewise

    @property
    def images(self) -> int:
        return len(self.image_ids)


def extract_matches(evaluator) -> Matches:
    """The per-image matches of a pycocotools ``COCOeval`` (box or mask) after ``evaluate()``, with
    COCO's default parameters (10 IoU thresholds 0.50:0.95, 101 recall thresholds, maxDets ending at
    100, the four area ranges). Raises ``ValueError`` on other parameters or before ``evaluate()``."""
    p = evaluator.params
    if not isinstance(getattr(evaluator, "evalImgs", None), list):
        raise ValueError("extract_matches: the evaluator has no per-image results; call evaluate() first")
    if (list(p.areaRngLbl) != list(AREAS) or p.maxDets[-1] != 100 or not p.useCats
            or [iou_figure_name(t) for t in p.iouThrs] != list(IOU_FIGURES)):
        raise ValueError("extract_matches: expected COCOeval's default box parameters "
                         "(areas all/small/medium/large, maxDets up to 100, IoU 0.50:0.95 by 0.05)")
    images, categories, areas = len(p.imgIds), len(p.catIds), len(p.areaRng)
    thresholds = len(p.iouThrs)
    if len(evaluator.evalImgs) != images * categories * areas:
        raise ValueError("extract_matches: evaluate() has not run with the evaluator's current parameters")
    groups = categories * areas
    ground_truth = np.zeros((groups, images), dtype=np.int64)
    parts = [_group(evaluator.evalImgs[g * images:(g + 1) * images], thresholds, ground_truth[g])
             for g in range(groups)]  # evalImgs: [k][a][i], as evaluate() lists them
    starts_a = np.concatenate([[0], np.cumsum([len(image) for image, _, _ in parts])]).astype(np.int64)
    image_all = np.concatenate([image for image, _, _ in parts])
    tp = np.concatenate([tp for _, tp, _ in parts], axis=1)
    neutral = ~(tp | np.concatenate([fp for _, _, fp in parts], axis=1))
    n = len(image_all)
    group = np.repeat(np.arange(groups), np.diff(starts_a))
    threshold, position = np.nonzero(tp)  # threshold by threshold, in detection order (so group by group)
    positive_group = group[position]
    segment = threshold * groups + positive_group
    group_start = starts_a[positive_group]
    ignored_threshold, ignored_position = np.nonzero(neutral)
    ignored_key = ignored_threshold * n + ignored_position  # ascending
    return Matches(
        image_ids=np.asarray(p.imgIds, dtype=np.int64),
        category_ids=np.asarray(p.catIds, dtype=np.int64),
        iou_thresholds=np.asarray(p.iouThrs, dtype=np.float64),
        recall_thresholds=np.asarray(p.recThrs, dtype=np.float64),
        starts=starts_a,
        image=image_all,
        ground_truth=ground_truth,
        positive_image=image_all[position],
        positive_segment=segment,
        positive_group=positive_group,
        positive_first=np.searchsorted(segment, segment, side="left"),
        seen=np.stack([group_start, position + 1]),
        ignored_image=image_all[ignored_position],
        ignored=np.stack([np.searchsorted(ignored_key, threshold * n + group_start),
                          np.searchsorted(ignored_key, threshold * n + position)]),
    )


def _group(entries: list, thresholds: int, ground_truth: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One (category, area range)'s detections from its ``evalImgs`` entries (one per image, None where
    the image has neither ground truth nor detections) in accumulate's order, less those that change no
    figure: ``(image index [D], true positive [T, D], false positive [T, D])``. Fills ``ground_truth``
    (per image) with the count of boxes that are not ignored."""
    scores, image, matched, ignored = [np.zeros(0)], [np.zeros(0, dtype=np.int64)], [], []
    for i, e in enumerate(entries):
        if e is None:
            continue
        ground_truth[i] = np.count_nonzero(np.asarray(e["gtIgnore"]) == 0)
        n = len(e["dtScores"][:100])
        scores.append(np.asarray(e["dtScores"][:100], dtype=np.float64))
        image.append(np.full(n, i, dtype=np.int64))
        matched.append(np.asarray(e["dtMatches"])[:, :100].reshape(thresholds, n))
        ignored.append(np.asarray(e["dtIgnore"])[:, :100].reshape(thresholds, n))
    order = np.argsort(-np.concatenate(scores), kind="mergesort")  # accumulate's sort
    matched_g = np.concatenate([np.zeros((thresholds, 0)), *matched], axis=1)[:, order]
    ignored_g = np.concatenate([np.zeros((thresholds, 0)), *ignored], axis=1)[:, order].astype(bool)
    tp = np.logical_and(matched_g, ~ignored_g)
    fp = np.logical_and(np.logical_not(matched_g), ~ignored_g)
    # Ignored detections and those after the group's last true positive change no figure: their recall
    # is that of an earlier detection, their precision no higher (see precision()).
    keep = (tp | fp).any(axis=0)
    positive = np.flatnonzero(tp.any(axis=0))
    keep[positive[-1] + 1 if len(positive) else 0:] = False
    return np.concatenate(image)[order][keep], tp[:, keep], fp[:, keep]


def precision(matches: Matches, weights: np.ndarray | None = None) -> np.ndarray:
    """``COCOeval.accumulate``'s precision ``[T, R, K, A]`` at maxDets 100 with image ``weights`` (one
    non-negative integer per image: how many times it counts; all 1 when None); -1 where a category has
    no ground truth that is not ignored in an area range."""
    m = matches
    t_count, r_count = len(m.iou_thresholds), len(m.recall_thresholds)
    groups = len(m.starts) - 1
    w = np.ones(m.images, dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64)
    npig = m.ground_truth @ w  # [groups]
    wf = w.astype(np.float64)  # counts as floats, as accumulate has them: whole-number sums, exact

    def cumulative(images: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(wf[images])])

    every, positive, ignored = cumulative(m.image), cumulative(m.positive_image), cumulative(m.ignored_image)
    # At each true positive, the weighted counts down its group (up to it, itself included) at its
    # threshold, as accumulate's cumulative sums have them there.
    tp = positive[1:] - positive[m.positive_first]
    fp = (every[m.seen[1]] - every[m.seen[0]]) - (ignored[m.ignored[1]] - ignored[m.ignored[0]]) - tp
    rc = tp / np.maximum(npig, 1)[m.positive_group]  # a group with npig 0 is set to -1 below
    pr = tp / (fp + tp + np.spacing(1))
    # accumulate takes, at recall threshold r, the precision envelope (the maximum of the precision from
    # there on) at the first detection whose recall reaches r: that is the largest precision among the
    # detections whose recall reaches r, or 0 where none does. That maximum is at a true positive: a
    # detection that is not one has the recall of the last true positive before it (which reaches r
    # too) and no higher precision, or no true positive before it and precision 0. So are the
    # detections extract_matches leaves out. A true positive enters the maxima of the thresholds below
    # ``reached``: the largest precision per (threshold, group, reached), then the maximum over reached > r.
    reached = np.searchsorted(m.recall_thresholds, rc, side="right")  # in 0..R
    bins = np.zeros((r_count + 1, t_count * groups))
    key = m.positive_segment * (r_count + 1) + reached  # ascending: recall grows down each group
    if key.size:
        first = np.flatnonzero(np.diff(key, prepend=-1))  # where each run of one key starts
        bins[reached[first], m.positive_segment[first]] = np.maximum.reduceat(pr, first)
    for r in range(r_count - 1, -1, -1):  # row by row: numpy's accumulate along axis 0 goes column by column
        np.maximum(bins[r], bins[r + 1], out=bins[r])
    q = bins[1:].reshape(r_count, t_count, groups)  # q[r]: the maximum over reached > r
    q[:, :, npig == 0] = -1
    areas = len(AREAS)
    return q.reshape(r_count, t_count, groups // areas, areas).transpose(1, 0, 2, 3)


def summary(precision_array: np.ndarray, iou_thresholds: np.ndarray) -> np.ndarray:
    """The figures of :data:`FIGURES` from a precision array ``[T, R, K, A]``, as ``COCOeval.summarize``
    computes its first six stats (the mean over the entries that are not -1, in the same order); NaN
    where every entry is -1 (``COCOeval``'s -1)."""
    out = np.full(len(FIGURES), np.nan)
    t50, t75 = (np.flatnonzero(iou_thresholds == t) for t in (0.5, 0.75))
    for a in range(len(AREAS)):
        # a category's entries are all -1 (no ground truth here) or all >= 0: the entries that are not -1
        # are those of the categories with ground truth, in summarize's order (threshold, recall, category)
        counted = precision_array[0, 0, :, a] > -1
        if not counted.any():
            continue
        s = np.ascontiguousarray(precision_array[:, :, counted, a])  # [T, R, categories counted]
        if a:
            out[SUMMARY_FIGURES.index(("APs", "APm", "APl")[a - 1])] = s.ravel().mean()
            continue
        out[0], out[1], out[2] = s.ravel().mean(), s[t50].ravel().mean(), s[t75].ravel().mean()
        for t in range(len(iou_thresholds)):
            out[len(SUMMARY_FIGURES) + t] = s[t].ravel().mean()
    return out


def figures(matches: Matches, weights: np.ndarray | None = None) -> np.ndarray:
    """The figures of :data:`FIGURES` (in that order) with image ``weights`` (all 1 when None: the
    figures of ``COCOeval`` on these images); NaN where ``COCOeval`` reports -1."""
    return summary(precision(matches, weights), matches.iou_thresholds)


def resampled_figures(models: Sequence[Matches], resamples: int, seed: int, *,
                      progress: bool = False) -> np.ndarray:
    """The figures of each bootstrap resample, ``[resamples, len(models), len(FIGURES)]`` (NaN where a
    figure is undefined in a resample, e.g. no large objects drawn).

    Every model gets the same draws: resample ``b`` draws ``images`` image indices uniformly with
    replacement from ``numpy.random.default_rng(seed)`` (``integers(0, images, images)``, one call per
    resample in order), so the same seed gives the same bits, and differences between models are paired.
    The models must have been evaluated on the same image ids (``ValueError`` otherwise)."""
    if resamples < 1:
        raise ValueError(f"resamples: expected at least 1, got {resamples}")
    if not models:
        raise ValueError("resampled_figures: expected at least one model's matches")
    images = models[0].image_ids
    for m in models[1:]:
        if not np.array_equal(m.image_ids, images):
            raise ValueError("resampled_figures: the models were evaluated on different images")
    rng = np.random.default_rng(seed)
    out = np.empty((resamples, len(models), len(FIGURES)))
    count = len(images)
    for b in tqdm(range(resamples), desc="bootstrap", unit="resample", disable=not progress, leave=False):
        weights = np.bincount(rng.integers(0, count, count), minlength=count) if count else np.zeros(0, np.int64)
        for j, m in enumerate(models):
            out[b, j] = figures(m, weights)
    return out


def intervals(point: np.ndarray, resampled: np.ndarray, level: float = 0.95) -> dict[str, tuple | None]:
    """Percentile intervals ``{figure: (low, high)}`` (numpy's ``quantile``, linear interpolation) of one
    model's figures from its resampled figures ``[resamples, len(FIGURES)]``; None where the figure (``point``, with every weight 1) is undefined.
    Resamples where a defined figure is undefined (its ground truth not drawn) are left out."""
    if not 0 < level < 1:
        raise ValueError(f"level: expected a value in (0, 1), got {level}")
    tail = (1 - level) / 2
    out = {}
    for j, name in enumerate(FIGURES):
        values = resampled[:, j][~np.isnan(resampled[:, j])]
        if np.isnan(point[j]) or not len(values):
            out[name] = None
        else:
            low, high = np.quantile(values, [tail, 1 - tail])
            out[name] = (float(low), float(high))
    return out


def bootstrap(matches: Matches, resamples: int, seed: int, level: float = 0.95, *,
              progress: bool = False) -> dict[str, tuple[float, float] | None]:
    """Percentile intervals at ``level`` of every figure of :data:`FIGURES` over ``resamples`` image
    resamples drawn from ``seed`` (as :func:`resampled_figures` draws them): ``{figure: (low, high)}``,
    None where the figure is undefined on the evaluated images."""
    resampled = resampled_figures([matches], resamples, seed, progress=progress)[:, 0, :]
    return intervals(figures(matches), resampled, level)
