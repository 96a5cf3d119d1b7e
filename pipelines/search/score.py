"""The search's score, "Pareto scale balance" (lower is better), with the original's terms and a weight on
its regulariser.

Three terms, kept apart (:func:`score_terms`): the **balance**, the standard deviation of the per-scale
loss shares (the 4 bins of :mod:`pipelines.scale_loss` divided by their total), with torch's default:
unbiased, N - 1; the **Pareto penalty**, the product of comparator / AP over AP_small, AP_medium and
AP_large below the comparator's (1 when none is); and the **regulariser**, ``(9 - mean of the probability
genes) * weight`` (:func:`~pipelines.search.genome.probability_genes`: the zoom and box-level op
probabilities, not the ratio genes), so that probabilities do not collapse to 0; the original's weight is
:data:`ORIGINAL_WEIGHT`. The score is balance x penalty + regulariser. Two cases the original leaves
undefined: an AP of -1 (COCO's "no object of this size in the split") multiplies nothing, and an AP of 0
counts as :data:`MIN_AP`, so the score stays finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .genome import probability_genes

MIN_AP = 1e-3
ORIGINAL_WEIGHT = 0.01  # the original's regulariser weight, set for COCO / RetinaNet loss spreads


def scale_balance(bins: Sequence[float]) -> float:
    """The spread of the loss shares: std (N - 1) of bins / sum(bins)."""
    values = torch.tensor([float(b) for b in bins], dtype=torch.float64)
    if not values.sum() > 0:
        raise ValueError(f"the scale bins hold no loss ({[float(b) for b in bins]}): no positive location was trained")
    return float((values / values.sum()).std())


def pareto_penalty(aps: Sequence[float], comparator_aps: Sequence[float]) -> float:
    """The product of comparator / AP over the scales whose AP is below the comparator's."""
    penalty = 1.0
    for ap, base in zip(aps, comparator_aps):
        if ap >= 0 and base >= 0 and ap < base:
            penalty *= base / max(ap, MIN_AP)
    return penalty


def regulariser(genome: Sequence[int], n_subpolicies: int, weight: float) -> float:
    probabilities = [genome[i] for i in probability_genes(n_subpolicies)]
    return (9 - sum(probabilities) / len(probabilities)) * weight


def score_terms(bins: Sequence[float], aps: Sequence[float], comparator_aps: Sequence[float],
                genome: Sequence[int], n_subpolicies: int, *, regulariser_weight: float) -> dict[str, float]:
    """A candidate's score and its three terms: its fine-tune's scale bins, its (AP_small, AP_medium,
    AP_large) on the held-out split, the comparator's on the same split, and its genome."""
    balance, penalty = scale_balance(bins), pareto_penalty(aps, comparator_aps)
    extra = regulariser(genome, n_subpolicies, regulariser_weight)
    return {"score": balance * penalty + extra, "balance": balance, "pareto_penalty": penalty, "regulariser": extra}


def pareto_scale_balance(bins: Sequence[float], aps: Sequence[float], baseline_aps: Sequence[float],
                         genome: Sequence[int], n_subpolicies: int, regulariser_weight: float = ORIGINAL_WEIGHT) -> float:
    """The score of :func:`score_terms` alone (by default with the original's weight)."""
    return score_terms(bins, aps, baseline_aps, genome, n_subpolicies, regulariser_weight=regulariser_weight)["score"]
