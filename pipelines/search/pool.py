"""Candidates fine-tuned side by side: ``search.candidates_at_once`` long-lived processes (started once,
each with ``search.threads`` threads), so the start-up of torch and the data is paid once per slot,
not once per candidate. The processes die with the search's process however it ends."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import torch

from .. import lifetime
from .genome import Genome
from .proxy import Proxy, fine_tune
from .score import pareto_scale_balance

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


def _fine_tune(genome: Genome) -> dict:
    return fine_tune(_proxy, genome)


class CandidatePool:
    """``with CandidatePool(proxy, baseline) as pool: search.run(pool.score)``."""

    def __init__(self, proxy: Proxy, baseline: dict[str, float]):
        search = proxy.params.search
        self.proxy, self.baseline = proxy, baseline
        context = multiprocessing.get_context("spawn")
        self.executor = ProcessPoolExecutor(max_workers=search.candidates_at_once, mp_context=context,
                                            initializer=_start,
                                            initargs=(proxy, search.threads, os.getpid(), context.Value("i", 0)))

    def __enter__(self) -> CandidatePool:
        return self

    def __exit__(self, *exc) -> None:
        self.executor.shutdown(wait=exc[0] is None, cancel_futures=True)

    def score(self, genomes: list[Genome]) -> Iterator[tuple[Genome, dict]]:
        """Fine-tune ``genomes`` (as many at once as there are slots); yield each with its result and
        score as it finishes."""
        a = self.proxy.params.augment
        pending = {self.executor.submit(_fine_tune, g): g for g in genomes}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                genome = pending.pop(future)
                result = future.result()
                aps = [result[k] for k in ("APs", "APm", "APl")]
                base = [self.baseline[k] for k in ("APs", "APm", "APl")]
                score = pareto_scale_balance(result["bins"], aps, base, genome, a.n_subpolicies)
                yield genome, {"score": score, **result}
