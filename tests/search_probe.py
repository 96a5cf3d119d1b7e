"""A search with a made-up score, for the resume test: ``python -m tests.search_probe FOLDER [--delay S]``."""

import argparse
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


def scorer(delay: float):
    def score(genomes):
        for genome in genomes:
            time.sleep(delay)
            yield genome, {"score": made_up_score(genome)}
    return score


def kill_when_scored(process: subprocess.Popen, state: Path, count: int, *, rounds: int, timeout: float) -> None:
    """SIGKILL ``process`` (one the test started, by pid) once ``count`` candidates are scored in the
    search folder ``state``; check that it died mid-search."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list((state / "candidates").glob("*.json"))) < count:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert len(list((state / "candidates").glob("*.json"))) >= count
    finished = json.loads((state / "history.json").read_text()) if (state / "history.json").is_file() else []
    assert len(finished) < rounds  # killed before the search ended


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    best = Search(args.folder, SETTINGS).run(scorer(args.delay))
    print(best["key"], best["score"])


if __name__ == "__main__":
    main()
