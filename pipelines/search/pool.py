"""Candidates fine-tuned side by side: ``search.candidates_at_once`` long-lived processes (started once,
each with ``search.threads`` threads), so the start-up of torch and the data is paid once per slot,
not once per candidate. The processes die with the search's process however it ends. :class:`Scoring`
turns their results into scores."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import torch

from .. import lifetime
from .genome import Genome
from .proxy import SCALES, Proxy, fine_tune
from .score import score_terms
from .space import Space

_proxy: Proxy | None = None


def _start(proxy: Proxy, threads: int, owner: int, slots) -> None:
    """In each candidate process: die with the search, take ``threads`` threads and, where there are
    GPUs, a GPU of its own (slot k takes GPU k modulo their number)."""
    global _proxy
    lifetime.die_with(owner)
    torch.set_num_threads(threads)
    with slots.get_lock():
        slot, slots.value = slots.value, slots.value + 1
    if torch.cuda.is_available():
        proxy = dataclasses.replace(proxy, device=torch.device("cuda", slot % torch.cuda.device_count()))
    _proxy = proxy


def _fine_tune(genome: Genome | None, seed_index: int, preset: str | None = None) -> dict:
    return fine_tune(_proxy, genome, seed_index, preset=preset)


# A genome (None: the null candidate) and a seed index; a third item, an augment.name, fine-tunes that preset instead
Job = tuple[Genome | None, int] | tuple[Genome | None, int, str | None]


class CandidatePool:
    """``with CandidatePool(proxy) as pool: search.run(Scoring(pool, ...).score)``."""

    def __init__(self, proxy: Proxy):
        search = proxy.params.search
        self.proxy = proxy
        context = multiprocessing.get_context("spawn")
        self.executor = ProcessPoolExecutor(max_workers=search.candidates_at_once, mp_context=context,
                                            initializer=_start,
                                            initargs=(proxy, search.threads, os.getpid(), context.Value("i", 0)))

    def __enter__(self) -> CandidatePool:
        return self

    def __exit__(self, *exc) -> None:
        self.executor.shutdown(wait=exc[0] is None, cancel_futures=True)

    def fine_tunes(self, jobs: list[Job]) -> Iterator[tuple[Job, dict]]:
        """Fine-tune ``jobs`` (as many at once as there are slots); yield each with its result as it finishes."""
        pending = {self.executor.submit(_fine_tune, *job): job for job in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                yield job, future.result()


class Scoring:
    """The candidates' scores (:func:`~pipelines.search.score.score_terms`) from ``pool``'s fine-tunes, each
    compared with ``comparators[seed index]`` (APs by name: the null candidate's at that seed, or the baseline's);
    the regulariser reads the probability genes of the policy a genome of ``space`` decodes to."""

    def __init__(self, pool: CandidatePool, comparators: dict[int, dict[str, float]], *, regulariser_weight: float,
                 space: Space):
        self.pool, self.comparators = pool, comparators
        self.regulariser_weight, self.space = regulariser_weight, space

    def terms(self, genome: Genome, seed_index: int, result: dict) -> dict:
        """``result`` with the score and its three terms."""
        aps = [result[k] for k in SCALES]
        base = [self.comparators[seed_index][k] for k in SCALES]
        return {**score_terms(result["bins"], aps, base, self.space.policy(genome), self.space.n_subpolicies,
                              regulariser_weight=self.regulariser_weight), **result}

    def score(self, genomes: list[Genome]) -> Iterator[tuple[Genome, dict]]:
        """Each genome's first fine-tune (seed index 0), scored, as it finishes."""
        for (genome, _), result in self.pool.fine_tunes([(g, 0) for g in genomes]):
            yield genome, self.terms(genome, 0, result)

    def rescore(self, jobs: list[tuple[Genome, int]]) -> Iterator[tuple[Genome, int, dict]]:
        """More fine-tunes of genomes at the given seed indices, scored, as each finishes."""
        for (genome, seed_index), result in self.pool.fine_tunes(list(jobs)):
            yield genome, seed_index, self.terms(genome, seed_index, result)
