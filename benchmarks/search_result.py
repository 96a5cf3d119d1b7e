"""Benchmark table: the published policy search's result, read from ``benchmarks/records/search/`` (no runs).

What ``python -m stages.publish_search`` copied from a finished search, as one table: the confirm stage's arms
by held-out AP (each seed, the mean, and the means of APs, APm and APl; a searched candidate's score beside it),
the confirmed winner and its margin over the published policy, and how the search's own score ranked the
published genome against the search's best candidate (``search.json``).

    python -m benchmarks.search_result [--folder benchmarks/records/search] [--json]
    python -m benchmarks.record run search-result -- benchmarks.search_result
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipelines import cli
from pipelines.errors import ConfigError

FOLDER = Path("benchmarks/records/search")
SEARCH_KEYS = ("winner", "winner_score", "published_rank", "published_score", "margin")


def _read(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: not found (expected a published search: make search, or "
                          "python -m stages.publish_search after one)")
    figures = json.loads(path.read_text())
    if not figures:
        raise ConfigError(f"{path}: empty (expected a published search: make search)")
    return figures


def measure(folder: Path) -> dict:
    """The confirm table and the search's standing of the published genome, as published in ``folder``."""
    confirm, search = _read(folder / "confirm.json"), _read(folder / "search.json")
    return {"confirm": confirm, "search": {key: search.get(key) for key in SEARCH_KEYS},
            "candidates": search.get("candidates")}


def _ap(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def table(figures: dict) -> str:
    """The arms best first by mean held-out AP, then one line on the winner and one on the search's score."""
    confirm, search = figures["confirm"], figures["search"]
    seeds = confirm["seeds"]
    arms = sorted(confirm["arms"].items(), key=lambda item: -item[1]["AP"])
    lines = [f"| arm | {' | '.join(f'AP seed {s}' for s in seeds)} | mean AP | APs | APm | APl | search score |",
             "|---|" + "---|" * (len(seeds) + 5)]
    for name, arm in arms:
        score = "" if arm.get("score") is None else f"{arm['score']:.4f}"
        lines.append(f"| {name} | {' | '.join(_ap(arm[f'AP_s{s}']) for s in seeds)} | {_ap(arm['AP'])} | "
                     f"{_ap(arm.get('APs'))} | {_ap(arm.get('APm'))} | {_ap(arm.get('APl'))} | {score} |")
    margin = confirm.get("margin")
    lines += ["", f"Confirmed winner: {confirm['winner']} (held-out AP {confirm['winner_AP']:.3f}"
              + ("" if margin is None else f", {margin:+.3f} over the published policy") + ")."]
    if search["published_rank"] is not None:
        lines.append(f"By the search's score: its best candidate {search['winner_score']:.4f}, the published genome "
                     f"{search['published_score']:.4f}, ranked {search['published_rank']} (margin "
                     f"{search['margin']:+.4f}; lower is better).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=FOLDER, help="the published search's folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    figures = measure(args.folder)
    print(json.dumps(figures) if args.json else table(figures), flush=True)


if __name__ == "__main__":
    cli.run(main)
