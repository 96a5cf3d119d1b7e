"""A policy's genome and the evolution's three ways of making one: at random, by mutation, by crossover.

A genome is the flat gene list of :mod:`pipelines.policy` (40 integers 0..9 for 5 sub-policies). Two
genomes that decode to the same policy are the same candidate: an op gene is taken modulo its op list
(7 colour ops, 6 geometric ops), so :func:`canonical` writes each op gene as that remainder and
:func:`key` names the candidate by its canonical genes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..policy import COLOR_OPS, GEO_OPS, MAX_GENE, policy_length

Genome = tuple[int, ...]


def op_genes(n_subpolicies: int) -> dict[int, int]:
    """Position of each op gene -> the length of its op list."""
    found = {}
    for i in range(n_subpolicies):
        found[4 + 6 * i] = len(COLOR_OPS)
        found[7 + 6 * i] = len(GEO_OPS)
    return found


def probability_genes(n_subpolicies: int) -> list[int]:
    """The genes that set an op's probability: 0 and 2 (zoom out, zoom in) and 5 + 3j for each of the
    2 * ``n_subpolicies`` box-level ops. The search's anti-collapse term reads these, not the ratio genes."""
    return [0, 2, *(5 + 3 * j for j in range(2 * n_subpolicies))]


def canonical(genome: Sequence[int], n_subpolicies: int) -> Genome:
    ops = op_genes(n_subpolicies)
    return tuple(int(g) % ops[i] if i in ops else int(g) for i, g in enumerate(genome))


def key(genome: Sequence[int], n_subpolicies: int) -> str:
    """The candidate's name: its canonical genes as one string of digits."""
    return "".join(str(g) for g in canonical(genome, n_subpolicies))


def random_genome(rng: np.random.Generator, n_subpolicies: int) -> Genome:
    return tuple(int(g) for g in rng.integers(0, MAX_GENE + 1, size=policy_length(n_subpolicies)))


def mutate(genome: Sequence[int], rng: np.random.Generator, probability: float) -> Genome:
    """Each gene redrawn (0..9) with ``probability``."""
    redraw = rng.random(len(genome)) < probability
    fresh = rng.integers(0, MAX_GENE + 1, size=len(genome))
    return tuple(int(f) if r else int(g) for g, f, r in zip(genome, fresh, redraw))


def crossover(a: Sequence[int], b: Sequence[int], rng: np.random.Generator) -> Genome:
    """Uniform crossover: each gene from ``a`` or ``b`` with equal chance."""
    take_a = rng.random(len(a)) < 0.5
    return tuple(int(x) if t else int(y) for x, y, t in zip(a, b, take_a))
