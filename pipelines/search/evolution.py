"""The original search's evolution, resumable from any moment.

Round 0 scores ``population`` genomes: the ``include``d ones first (the published policy, say), then
random ones. Every later round scores ``mutations`` mutants (each gene redrawn with
``mutation_prob``) and ``crossovers`` uniform crossovers of the ``kept`` best genomes ever scored,
and ``random`` new random genomes. Each round's genomes are drawn from a generator seeded by
(``seed``, round), so they depend only on the settings and the history before the round.

What is kept in ``folder``:

* ``candidates/<key>.json``: one scored candidate each (written atomically as soon as it is scored),
  named by its canonical genes (:func:`~pipelines.search.genome.key`). A candidate already scored is
  never scored again, in this round or a later one; the scorer's results must depend only on the
  genome and settings that ``folder`` is reserved for.
* ``history.json``: one entry per finished round (its candidates in order, their scores, the kept
  set after it, the best and the median score), written atomically when the round ends.

A search killed at any moment and started again in the same folder regenerates the unfinished
round, scores only what it had not scored, and ends with the history and best genome an
uninterrupted search gives.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..fileio import write_json
from .genome import Genome, canonical, crossover, key, mutate, random_genome


@dataclass(frozen=True)
class Settings:
    rounds: int
    population: int  # round 0
    kept: int
    mutations: int  # per later round, and so on
    crossovers: int
    random: int
    mutation_prob: float
    seed: int
    n_subpolicies: int
    include: tuple[Genome, ...] = ()  # genomes scored first in round 0


# Scores a batch of genomes; yields (genome, result) as each is scored, result holding at least "score".
Scorer = Callable[[list[Genome]], Iterable[tuple[Genome, dict]]]


def round_genomes(s: Settings, round_index: int, kept: Sequence[Genome]) -> list[Genome]:
    """Round ``round_index``'s genomes (canonical, duplicates kept: a repeat is scored once)."""
    rng = np.random.default_rng([s.seed, round_index])
    n = s.n_subpolicies
    if round_index == 0:
        genomes = [*s.include[:s.population]]
        genomes += [random_genome(rng, n) for _ in range(s.population - len(genomes))]
    else:
        genomes = [mutate(kept[rng.integers(len(kept))], rng, s.mutation_prob) for _ in range(s.mutations)]
        for _ in range(s.crossovers):
            a, b = rng.choice(len(kept), size=2, replace=len(kept) < 2)
            genomes.append(crossover(kept[a], kept[b], rng))
        genomes += [random_genome(rng, n) for _ in range(s.random)]
    return [canonical(g, n) for g in genomes]


class Search:
    """A search's state in ``folder``: the scored candidates and the finished rounds."""

    def __init__(self, folder: str | Path, settings: Settings):
        self.folder, self.settings = Path(folder), settings
        self.candidates = self.folder / "candidates"
        self.candidates.mkdir(parents=True, exist_ok=True)
        history = self.folder / "history.json"
        self.history: list[dict] = json.loads(history.read_text()) if history.is_file() else []

    def scored(self, genome: Sequence[int]) -> dict | None:
        path = self.candidates / f"{key(genome, self.settings.n_subpolicies)}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def kept(self) -> list[Genome]:
        """The ``kept`` best genomes scored in the finished rounds (lowest score first; ties by key)."""
        return [tuple(r["genome"]) for r in self.ranked()[:self.settings.kept]]

    def best(self) -> dict | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def ranked(self) -> list[dict]:
        keys = {k for entry in self.history for k in entry["candidates"]}
        results = [json.loads((self.candidates / f"{k}.json").read_text()) for k in keys]
        return sorted(results, key=lambda r: (r["score"], r["key"]))

    def run(self, score: Scorer, *, on_round: Callable[[dict], None] | None = None) -> dict:
        """Run the rounds not finished yet; return the best candidate."""
        s = self.settings
        for index in range(len(self.history), s.rounds):
            genomes = round_genomes(s, index, self.kept())
            todo = list({key(g, s.n_subpolicies): g for g in genomes if self.scored(g) is None}.values())
            for genome, result in score(todo):
                write_json(self.candidates / f"{key(genome, s.n_subpolicies)}.json",
                           {**result, "genome": list(genome), "key": key(genome, s.n_subpolicies), "round": index})
            results = [self.scored(g) for g in genomes]
            missing = [key(g, s.n_subpolicies) for g, r in zip(genomes, results) if r is None]
            if missing:
                raise RuntimeError(f"round {index}: the scorer returned no result for {len(missing)} genome(s)")
            scores = [r["score"] for r in results]
            entry = {"round": index, "candidates": [r["key"] for r in results], "scores": scores,
                     "round_best": min(scores), "median": statistics.median(scores)}
            self.history.append(entry)
            best = self.best()
            entry.update(best={"key": best["key"], "score": best["score"]},
                         kept=[key(g, s.n_subpolicies) for g in self.kept()])
            write_json(self.folder / "history.json", self.history)
            if on_round is not None:
                on_round(entry)
        return self.best()
