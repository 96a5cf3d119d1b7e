"""The search's genome spaces (``search.space``): what a candidate's genes are and the policy they decode to.

* ``full``: the original's space, a policy's whole gene list (:mod:`pipelines.policy`, 40 genes for 5
  sub-policies); everything as :mod:`pipelines.search.genome` does it.
* ``scale``: the scale genes only, plus one global strength (the RandAugment lesson: fewer knobs, tuned on the
  target). 11 genes, each 0..9:

  ===========  ======================================================================================
  position     meaning
  ===========  ======================================================================================
  0, 1         zoom_out probability and level (the policy's genes 0, 1)
  2, 3         zoom_in probability and level (the policy's genes 2, 3)
  4, 5, 6      ``area`` ratios (small, medium, large; the policy's 4 + 6n .. 6 + 6n)
  7, 8, 9      ``prob`` ratios (small, medium, large; the policy's 7 + 6n .. 9 + 6n)
  10           strength ``s``: every box-level op's level x ``(s + 1) / 5`` (0.2 .. 2; 4 is x1), rounded
               (never a tie: a level x (s + 1) is a whole number, so a fifth of it never ends in .5) and
               clipped to the genes' 0..9
  ===========  ======================================================================================

  The box-level ops (their names, probabilities and sub-policies) are the published policy's
  (:data:`~pipelines.policy.PUBLISHED_POLICY`). A scale genome decodes to a whole gene list
  (:meth:`Space.policy`), so the augmentation, the policy file and ``augment=searched`` read it as they
  read any policy. Its key is ``s`` and its 11 digits: never a full space's key (40 digits). Distinct scale
  genomes decode to distinct policies (the ten strengths give ten level lists), so none is canonicalised.

Mutation and crossover (:mod:`pipelines.search.genome`) work gene by gene over 0..9, in either space.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..config.schema import registry
from ..errors import ConfigError
from ..policy import MAX_GENE, PUBLISHED_POLICY, decode_policy, policy_length
from . import genome as full
from .genome import Genome

PUBLISHED_SUBPOLICIES = (len(PUBLISHED_POLICY) - 10) // 6
STRENGTH_ONE = 4  # the strength gene of x1: the published levels


def level_genes(n_subpolicies: int) -> list[int]:
    """Positions of the box-level ops' level genes in a policy: 6 + 6i (colour) and 9 + 6i (geometric)."""
    return [g for i in range(n_subpolicies) for g in (6 + 6 * i, 9 + 6 * i)]


def strength(gene: int) -> float:
    """The multiplier on the box-level levels that a strength gene sets."""
    return (gene + 1) / 5


def scaled_level(level: int, gene: int) -> int:
    """``level`` x :func:`strength` of ``gene``, rounded half up in whole numbers and clipped to 0..9."""
    return min(MAX_GENE, (2 * level * (gene + 1) + 5) // 10)


@dataclass(frozen=True)
class Space:
    """A genome space over policies of ``n_subpolicies`` sub-policies (:class:`FullSpace`, :class:`ScaleSpace`)."""

    n_subpolicies: int
    name: ClassVar[str]
    length: ClassVar[int]

    def canonical(self, genome: Sequence[int]) -> Genome:
        """One genome per policy: the genes of any genome that decodes to the same policy."""
        raise NotImplementedError

    def key(self, genome: Sequence[int]) -> str:
        """The candidate's name, from its canonical genes."""
        raise NotImplementedError

    def random(self, rng: np.random.Generator) -> Genome:
        """A genome of genes drawn uniformly 0..9."""
        raise NotImplementedError

    def published(self) -> Genome:
        """The published policy's genome in this space."""
        raise NotImplementedError

    def policy(self, genome: Sequence[int]) -> Genome:
        """The policy's gene list that ``genome`` decodes to (:mod:`pipelines.policy`)."""
        raise NotImplementedError

    def describe(self, genome: Sequence[int]) -> str:
        """The decoded policy in words."""
        return str(decode_policy(self.policy(genome), self.n_subpolicies))

    def record(self, genome: Sequence[int]) -> dict:
        """What a policy file records of the genome beside the policy's genes."""
        return {}

    def _checked(self, genome: Sequence[int]) -> Genome:
        if len(genome) != self.length:
            raise ConfigError(f"search.space: {self.name} holds genomes of {self.length} genes, got one of "
                              f"{len(genome)} (a search in the other space? run the search again)")
        return tuple(int(g) for g in genome)


@dataclass(frozen=True)
class FullSpace(Space):
    """The original's space: a genome is the policy's gene list (:mod:`pipelines.search.genome`)."""

    name: ClassVar[str] = "full"

    @property
    def length(self) -> int:
        return policy_length(self.n_subpolicies)

    def canonical(self, genome: Sequence[int]) -> Genome:
        return full.canonical(genome, self.n_subpolicies)

    def key(self, genome: Sequence[int]) -> str:
        return full.key(genome, self.n_subpolicies)

    def random(self, rng: np.random.Generator) -> Genome:
        return full.random_genome(rng, self.n_subpolicies)

    def published(self) -> Genome:
        return PUBLISHED_POLICY

    def policy(self, genome: Sequence[int]) -> Genome:
        """``genome`` itself."""
        return self._checked(genome)


@dataclass(frozen=True)
class ScaleSpace(Space):
    """The scale genes and a strength over the published box-level ops (the module docstring)."""

    name: ClassVar[str] = "scale"
    length: ClassVar[int] = 11

    def __post_init__(self):
        if self.n_subpolicies != PUBLISHED_SUBPOLICIES:
            raise ConfigError(f"search.space: scale keeps the published policy's {PUBLISHED_SUBPOLICIES} "
                              f"sub-policies; augment.n_subpolicies is {self.n_subpolicies}")

    def canonical(self, genome: Sequence[int]) -> Genome:
        """``genome`` itself: distinct scale genomes decode to distinct policies."""
        return tuple(int(g) for g in genome)

    def key(self, genome: Sequence[int]) -> str:
        return "s" + "".join(str(g) for g in self.canonical(genome))

    def random(self, rng: np.random.Generator) -> Genome:
        return tuple(int(g) for g in rng.integers(0, MAX_GENE + 1, size=self.length))

    def published(self) -> Genome:
        """The published policy's scale genes and the strength of x1."""
        r = 4 + 6 * PUBLISHED_SUBPOLICIES
        return (*PUBLISHED_POLICY[:4], *PUBLISHED_POLICY[r:r + 6], STRENGTH_ONE)

    def policy(self, genome: Sequence[int]) -> Genome:
        g = self._checked(genome)
        genes = list(PUBLISHED_POLICY)
        genes[:4] = g[:4]
        r = 4 + 6 * self.n_subpolicies
        genes[r:r + 6] = g[4:10]
        for i in level_genes(self.n_subpolicies):
            genes[i] = scaled_level(genes[i], g[10])
        return tuple(genes)

    def describe(self, genome: Sequence[int]) -> str:
        return (f"{super().describe(genome)}\n  searched in the scale space: the published box-level ops, their "
                f"levels x{strength(self._checked(genome)[10]):.1f}")

    def record(self, genome: Sequence[int]) -> dict:
        """The scale genome and its strength (recorded; training reads the policy's genes)."""
        g = self._checked(genome)
        return {"space": self.name, "genome": list(g), "strength": strength(g[10])}


# search.space: the names config validation accepts are these keys (config.registry)
SPACES = registry("search.space", {"full": FullSpace, "scale": ScaleSpace})


def space(name: str, n_subpolicies: int) -> Space:
    """The space ``name`` (``search.space``) over policies of ``n_subpolicies`` sub-policies."""
    return SPACES[name](n_subpolicies)
