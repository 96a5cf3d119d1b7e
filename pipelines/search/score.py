"""The search's score, "Pareto scale balance" (lower is better), with the original's exact terms.

``err`` is the standard deviation of the per-scale loss shares (the 4 bins of
:mod:`pipelines.scale_loss` divided by their total), with torch's default: unbiased, N - 1. For each
of AP_small, AP_medium and AP_large below the baseline's, ``err`` is multiplied by baseline / AP.
Then ``err += (9 - mean of the probability genes) * 0.01`` (:func:`~pipelines.search.genome.probability_genes`:
the zoom and box-level op probabilities, not the ratio genes), so that probabilities do not collapse
to 0. Two cases the original leaves undefined: an AP of -1 (COCO's "no object of this size in the
split") multiplies nothing, and an AP of 0 counts as :data:`MIN_AP`, so the score stays finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .genome import probability_genes

MIN_AP = 1e-3


def scale_balance(bins: Sequence[float]) -> float:
    """The spread of the loss shares: std (N - 1) of bins / sum(bins)."""
    values = torch.tensor([float(b) for b in bins], dtype=torch.float64)
    if not values.sum() > 0:
        raise ValueError(f"the scale bins hold no loss ({[float(b) for b in bins]}): no positive location was trained")
    return float((values / values.sum()).std())


def pareto_scale_balance(bins: Sequence[float], aps: Sequence[float], baseline_aps: Sequence[float],
                         genome: Sequence[int], n_subpolicies: int) -> float:
    """The score of a candidate: its fine-tune's scale bins, its (AP_small, AP_medium, AP_large) on the
    held-out split, the baseline's on the same split, and its genome."""
    err = scale_balance(bins)
    for ap, base in zip(aps, baseline_aps):
        if ap >= 0 and base >= 0 and ap < base:
            err *= base / max(ap, MIN_AP)
    probabilities = [genome[i] for i in probability_genes(n_subpolicies)]
    return err + (9 - sum(probabilities) / len(probabilities)) * 0.01
