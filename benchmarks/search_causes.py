"""Benchmark: why a search chose what it chose, read from a finished search's state (no fine-tune runs).

From every scored candidate a search keeps (``search/outputs/state/candidates/*.json``, with its score's
three terms and its held-out APs) and its null candidate (``null/0.json``), for round 0 and for the whole
search:

- how often the Pareto penalty fired (above 1);
- the regulariser's spread against the rest of the score's (standard deviations over the candidates' first
  scores), and whether the winner still wins without it;
- the published genome's rank, with and without the regulariser;
- how well the score's ranking agrees with the candidates' own held-out AP (Spearman) and where the
  candidate of the best held-out AP ranked;
- how many candidates beat the null candidate's held-out AP;
- for the rescored candidates, the spread of a score over its seeds (the noise a single score carries).

    python -m benchmarks.search_causes [--state search/outputs/state] [--json]
    python -m benchmarks.record run search-causes -- benchmarks.search_causes
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pipelines import cli
from pipelines.config.load import load_params
from pipelines.errors import ConfigError
from pipelines.search.space import space

from .proxy_fidelity import spearman

STATE = Path("search/outputs/state")


def _rank(candidates: list[dict], key: str, by) -> int | None:
    """``key``'s rank (1: the best, lowest ``by``; ties by key as the search breaks them) among ``candidates``."""
    order = [c["key"] for c in sorted(candidates, key=lambda c: (by(c), c["key"]))]
    return order.index(key) + 1 if key in order else None


def _first(c: dict) -> float:
    return c["seed_scores"][0]


def causes(candidates: list[dict], published_key: str, null_AP: float | None) -> dict:
    """The figures above for ``candidates`` (candidate files)."""
    rest = [_first(c) - c["regulariser"] for c in candidates]
    regularisers = [c["regulariser"] for c in candidates]
    winner = min(candidates, key=lambda c: (c["score"], c["key"]))
    bare = min(candidates, key=lambda c: (c["score"] - c["regulariser"], c["key"]))
    best_ap = max(candidates, key=lambda c: (c["AP"], c["key"]))
    spreads = [statistics.stdev(c["seed_scores"]) for c in candidates if len(c["seed_scores"]) > 1]
    two = len(candidates) > 1
    return {
        "candidates": len(candidates),
        "penalty_fired": sum(c["pareto_penalty"] > 1 for c in candidates),
        "regulariser_sd": statistics.stdev(regularisers) if two else None,
        "rest_sd": statistics.stdev(rest) if two else None,
        "winner": winner["key"], "winner_without_regulariser": bare["key"],
        "winner_wins_without_regulariser": winner["key"] == bare["key"],
        "published_rank": _rank(candidates, published_key, lambda c: c["score"]),
        "published_rank_without_regulariser": _rank(candidates, published_key, lambda c: c["score"] - c["regulariser"]),
        "spearman_score_AP": spearman([-s for s in (c["score"] for c in candidates)], [c["AP"] for c in candidates]),
        "best_AP": best_ap["AP"], "best_AP_rank": _rank(candidates, best_ap["key"], lambda c: c["score"]),
        "null_AP": null_AP, "beat_null": None if null_AP is None else sum(c["AP"] > null_AP for c in candidates),
        "rescored": len(spreads), "score_sd_over_seeds": statistics.median(spreads) if spreads else None,
    }


def measure(state: Path, published_key: str) -> dict:
    files = sorted((state / "candidates").glob("*.json"))
    if not files:
        raise ConfigError(f"{state / 'candidates'}: no scored candidate (expected a finished search: make search)")
    candidates = [json.loads(f.read_text()) for f in files]
    null = state / "null" / "0.json"
    null_AP = json.loads(null.read_text())["AP"] if null.is_file() else None
    round0 = [c for c in candidates if c["round"] == 0]
    return {"rounds": 1 + max(c["round"] for c in candidates), "published_key": published_key,
            "round0": causes(round0, published_key, null_AP), "all": causes(candidates, published_key, null_AP)}


def _value(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def table(figures: dict) -> str:
    r0, whole = figures["round0"], figures["all"]
    rows = [("candidates", "candidates"), ("Pareto penalty fired (above 1)", "penalty_fired"),
            ("SD of the regulariser", "regulariser_sd"), ("SD of the rest of the score", "rest_sd"),
            ("the winner still wins without the regulariser", "winner_wins_without_regulariser"),
            ("published genome's rank by the score", "published_rank"),
            ("... without the regulariser", "published_rank_without_regulariser"),
            ("Spearman of the score's ranking with held-out AP", "spearman_score_AP"),
            ("best held-out AP", "best_AP"), ("its rank by the score", "best_AP_rank"),
            ("null candidate's held-out AP", "null_AP"), ("candidates above it", "beat_null"),
            ("rescored candidates", "rescored"), ("median SD of a score over its seeds", "score_sd_over_seeds")]
    lines = [f"| what | round 0 | the whole search ({figures['rounds']} rounds) |", "|---|---|---|"]
    lines += [f"| {label} | {_value(r0[key])} | {_value(whole[key])} |" for label, key in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--state", type=Path, default=STATE, help="the search's state folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    p = load_params(args.params)
    genes = space(p.search.space, p.augment.n_subpolicies)
    figures = measure(args.state, genes.key(genes.canonical(genes.published())))
    print(json.dumps(figures) if args.json else table(figures), flush=True)


if __name__ == "__main__":
    cli.run(main)
