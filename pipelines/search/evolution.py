"""The original search's evolution, resumable from any moment.

Round 0 scores ``population`` genomes: the ``include``d ones first (the published policy, say), then
random ones. Every later round scores ``mutations`` mutants (each gene redrawn with
``mutation_prob``) and ``crossovers`` uniform crossovers of the ``kept`` best genomes ever scored,
and ``random`` new random genomes. Each round's genomes are drawn from a generator seeded by
(``seed``, round), so they depend only on the settings and the history before the round.

What is kept in ``folder``:

* ``candidates/<key>.json``: one scored candidate each (written atomically as soon as it is scored),
  named by its canonical genes in ``space`` (:mod:`pipelines.search.space`). A candidate already scored is
  never scored again, in this round or a later one; the scorer's results must depend only on the
  genome and settings that ``folder`` is reserved for.
* ``rescores/<key>-<seed>.json``: one more fine-tune of a candidate, at seed index 1, 2, ... (below).
* ``history.json``: one entry per finished round (its candidates in order, their scores, the kept
  set after it, the best and the median score, the candidates rescored in it), written atomically when
  the round ends.

With ``rescore_top_k``, each round ends by rescoring: while one of the ``rescore_top_k`` best candidates
scored so far has a single score, it is scored again at ``rescore_seeds`` more seed indices, and its
score becomes the mean over its seeds (``seed_scores`` keeps each, ``rescored_round`` the round). So a
candidate is rescored before it is among the best that become parents or the result. A round rescores
only its own new candidates: after it, its ``rescore_top_k`` best are rescored and their scores fixed, and
later candidates only add above, so a candidate not rescored in its round never reaches them again. A
round half rescored when killed therefore changes nothing that the next try's genomes are drawn from.

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
from .genome import Genome, crossover, mutate
from .space import Space, space


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
    rescore_top_k: int = 0  # the best this many are rescored ...
    rescore_seeds: int = 0  # ... at this many more seed indices
    space: str = "full"  # search.space: what the genes are (pipelines.search.space)

    @property
    def genome_space(self) -> Space:
        return space(self.space, self.n_subpolicies)


# Scores a batch of genomes; yields (genome, result) as each is scored, result holding at least "score".
Scorer = Callable[[list[Genome]], Iterable[tuple[Genome, dict]]]
# Scores a batch of (genome, seed index) again; yields (genome, seed index, result) as each is scored.
Rescorer = Callable[[list[tuple[Genome, int]]], Iterable[tuple[Genome, int, dict]]]


def round_genomes(s: Settings, round_index: int, kept: Sequence[Genome]) -> list[Genome]:
    """Round ``round_index``'s genomes (canonical, duplicates kept: a repeat is scored once)."""
    rng = np.random.default_rng([s.seed, round_index])
    genes = s.genome_space
    if round_index == 0:
        genomes = [*s.include[:s.population]]
        genomes += [genes.random(rng) for _ in range(s.population - len(genomes))]
    else:
        genomes = [mutate(kept[rng.integers(len(kept))], rng, s.mutation_prob) for _ in range(s.mutations)]
        for _ in range(s.crossovers):
            a, b = rng.choice(len(kept), size=2, replace=len(kept) < 2)
            genomes.append(crossover(kept[a], kept[b], rng))
        genomes += [genes.random(rng) for _ in range(s.random)]
    return [genes.canonical(g) for g in genomes]


class Search:
    """A search's state in ``folder``: the scored candidates and the finished rounds."""

    def __init__(self, folder: str | Path, settings: Settings):
        self.folder, self.settings = Path(folder), settings
        self.key = settings.genome_space.key
        self.candidates = self.folder / "candidates"
        self.rescores = self.folder / "rescores"
        self.candidates.mkdir(parents=True, exist_ok=True)
        history = self.folder / "history.json"
        self.history: list[dict] = json.loads(history.read_text()) if history.is_file() else []

    def scored(self, genome: Sequence[int]) -> dict | None:
        path = self.candidates / f"{self.key(genome)}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def kept(self) -> list[Genome]:
        """The ``kept`` best genomes scored in the finished rounds (lowest score first; ties by key)."""
        return [tuple(r["genome"]) for r in self.ranked()[:self.settings.kept]]

    def best(self) -> dict | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def ranked(self, also: Iterable[str] = ()) -> list[dict]:
        """The candidates of the finished rounds (and ``also``, keys of the round under way), best first."""
        keys = {k for entry in self.history for k in entry["candidates"]} | set(also)
        results = [json.loads((self.candidates / f"{k}.json").read_text()) for k in keys]
        return sorted(results, key=lambda r: (r["score"], r["key"]))

    def run(self, score: Scorer, *, rescore: Rescorer | None = None,
            on_round: Callable[[dict], None] | None = None) -> dict:
        """Run the rounds not finished yet, rescoring with ``rescore`` where ``rescore_top_k`` asks; return
        the best candidate."""
        s = self.settings
        for index in range(len(self.history), s.rounds):
            genomes = round_genomes(s, index, self.kept())
            todo = list({self.key(g): g for g in genomes if self.scored(g) is None}.values())
            for genome, result in score(todo):
                write_json(self.candidates / f"{self.key(genome)}.json",
                           {**result, "seed_scores": [result["score"]], "genome": list(genome),
                            "key": self.key(genome), "round": index})
            results = [self.scored(g) for g in genomes]
            missing = [self.key(g) for g, r in zip(genomes, results) if r is None]
            if missing:
                raise RuntimeError(f"round {index}: the scorer returned no result for {len(missing)} genome(s)")
            self._rescore_best(index, [r["key"] for r in results], rescore)
            rescored = [r["key"] for r in self.ranked([r["key"] for r in results])
                        if r.get("rescored_round") == index]  # best first (a resumed round rescores in part)
            results = [self.scored(g) for g in genomes]
            scores = [r["score"] for r in results]
            entry = {"round": index, "candidates": [r["key"] for r in results], "scores": scores,
                     "round_best": min(scores), "median": statistics.median(scores), "rescored": rescored}
            self.history.append(entry)
            best = self.best()
            entry.update(best={"key": best["key"], "score": best["score"]},
                         kept=[self.key(g) for g in self.kept()])
            write_json(self.folder / "history.json", self.history)
            if on_round is not None:
                on_round(entry)
        return self.best()

    def _rescore_best(self, index: int, current: list[str], rescore: Rescorer | None) -> None:
        """Rescore, one candidate at a time (its seeds side by side), the best of the ``rescore_top_k`` best (of
        the finished rounds and ``current``) not rescored yet, until there is none.
        One at a time, so that every state a kill can leave is one an uninterrupted search passes through."""
        s = self.settings
        if not s.rescore_top_k:
            return
        if rescore is None:
            raise ValueError("settings.rescore_top_k asks for rescoring but no rescorer was given")
        seeds = range(1, s.rescore_seeds + 1)
        while todo := [r for r in self.ranked(current)[:s.rescore_top_k] if "rescored_round" not in r]:
            r = todo[0]
            self.rescores.mkdir(exist_ok=True)
            jobs = [(tuple(r["genome"]), i) for i in seeds if not self._rescore_file(r["key"], i).is_file()]
            for genome, i, result in rescore(jobs):
                write_json(self._rescore_file(self.key(genome), i), result)
            if missing := [i for i in seeds if not self._rescore_file(r["key"], i).is_file()]:
                raise RuntimeError(f"round {index}: the rescorer returned no result for {r['key']} at seed(s) {missing}")
            extra = [json.loads(self._rescore_file(r["key"], i).read_text()) for i in seeds]
            seed_scores = [r["seed_scores"][0], *(x["score"] for x in extra)]
            write_json(self.candidates / f"{r['key']}.json",
                       {**r, "score": sum(seed_scores) / len(seed_scores), "seed_scores": seed_scores,
                        "rescores": extra, "rescored_round": index})

    def _rescore_file(self, genome_key: str, seed_index: int) -> Path:
        return self.rescores / f"{genome_key}-{seed_index}.json"
