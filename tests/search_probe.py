"""A search with a made-up score, for the resume tests: ``python -m tests.search_probe FOLDER [--delay S]
[--rescore]`` (``--rescore``: a noisy score, the best rescored at more seeds)."""

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from pipelines.search.evolution import Search, Settings

SETTINGS = Settings(rounds=4, population=8, kept=3, mutations=3, crossovers=3, random=2, mutation_prob=0.1, seed=5,
                    n_subpolicies=5)


def made_up_score(genome) -> float:
    """Deterministic, with a minimum at genes all 4 (any function of the genome serves)."""
    return sum((g - 4) ** 2 for g in genome) / 100 + (genome[0] * 7 + genome[5]) % 3 / 1000


RESCORED = dataclasses.replace(SETTINGS, rescore_top_k=2, rescore_seeds=2)


def noisy_score(genome, seed_index: int) -> float:
    """:func:`made_up_score` plus noise of (genome, seed index), large enough to reorder the best."""
    noise = int.from_bytes(hashlib.sha256(f"{list(genome)}:{seed_index}".encode()).digest()[:4], "little") / 2**32
    return made_up_score(genome) + noise - 0.5


def scorer(delay: float, *, noisy: bool = False):
    def score(genomes):
        for genome in genomes:
            time.sleep(delay)
            yield genome, {"score": noisy_score(genome, 0) if noisy else made_up_score(genome)}
    return score


def rescorer(delay: float):
    def rescore(jobs):
        for genome, seed_index in jobs:
            time.sleep(delay)
            yield genome, seed_index, {"score": noisy_score(genome, seed_index)}
    return rescore


def kill_when_scored(process: subprocess.Popen, state: Path, count: int, *, rounds: int, timeout: float,
                     files: str = "candidates") -> None:
    """SIGKILL ``process`` (one the test started, by pid) once ``count`` candidates are scored (JSON files in
    ``files``: ``rescores`` counts rescorings) in the search folder ``state``; check that it died mid-search."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list((state / files).glob("*.json"))) < count:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert len(list((state / files).glob("*.json"))) >= count
    finished = json.loads((state / "history.json").read_text()) if (state / "history.json").is_file() else []
    assert len(finished) < rounds  # killed before the search ended


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--rescore", action="store_true")
    args = parser.parse_args(argv)
    if args.rescore:
        best = Search(args.folder, RESCORED).run(scorer(args.delay, noisy=True), rescore=rescorer(args.delay))
    else:
        best = Search(args.folder, SETTINGS).run(scorer(args.delay))
    print(best["key"], best["score"])


if __name__ == "__main__":
    main()
