"""The table of every lever compared with ``benchmarks.compare``, from the comparisons' own records.

Each comparison is kept as ``benchmarks/records/lever-NAME.json`` by

    python -m benchmarks.record run lever-NAME -- benchmarks.compare -S KEY=VALUE ... --seeds 0-2

and this gathers them, adopted or not, one row each: the candidate's overrides, how it was measured
(seeds, val images, class and precision), the mean ΔAP with its t-based 95% interval and the paired image
bootstrap's, ΔAP per seed and the verdict of the fixed rule (``benchmarks/compare.py``). Its own record,
``levers.json``, is what docs/results.md's table is written from:

    python -m benchmarks.record run levers -- benchmarks.levers
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .compare import WORST_SEED

RECORDS = Path(__file__).resolve().parent / "records"


def gather(records: Path = RECORDS) -> dict:
    """One row per ``lever-*.json`` record, in name order."""
    rows = []
    for path in sorted(records.glob("lever-*.json")):
        record = json.loads(path.read_text())
        f = record["figures"]
        rows.append({"record": path.stem, "name": f["name"], "candidate": f["candidate"], "baseline": f["baseline"],
                     "seeds": f["seeds"], "images": f["images"],
                     "measured": (f"held to {f['hold']}" if f["hold"] else record["machine"]["class"]) + f", {f['precision']}",
                     "mean_delta": f["mean_delta"], "ci95": f["ci95"], "bootstrap95": f["bootstrap95"],
                     "per_seed_delta": f["per_seed_delta"], "verdict": f["verdict"]})
    return {"levers": rows}


def screen(row: dict) -> str:
    """A screen (fewer than 5 seeds, or not held to AVX2) decides nothing: a lever survives it with a positive
    mean and no seed below the rule's worst (docs/results.md); a decision is the rule's verdict."""
    if len(row["seeds"]) >= 5 and row["measured"].startswith("held to avx2"):
        return f"decided: {row['verdict']}"
    survives = row["mean_delta"] > 0 and min(row["per_seed_delta"].values()) >= WORST_SEED
    return "screen: " + ("survives" if survives else "stops") + f" (rule at these seeds: {row['verdict']})"


def table(figures: dict) -> str:
    lines = ["| lever | measured on | seeds | val images | mean ΔAP | t 95% interval | image bootstrap 95% | "
             "ΔAP per seed | outcome |", "|---|---|---|---|---|---|---|---|---|"]
    for r in figures["levers"]:
        per_seed = ", ".join(f"{d:+.3f}" for d in r["per_seed_delta"].values())
        b = r["bootstrap95"]  # None where the arms were reused from records, which keep no per-image matches
        boot = "(arms reused from records)" if b is None else f"[{b[0]:+.4f}, {b[1]:+.4f}]"
        lines.append(f"| `{' '.join(r['candidate'])}` | {r['measured']} | {len(r['seeds'])} | "
                     "{}-{} | ".format(*r["images"]) + f"{r['mean_delta']:+.4f} | [{r['ci95'][0]:+.4f}, "
                     f"{r['ci95'][1]:+.4f}] | {boot} | {per_seed} | "
                     f"{screen(r)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    figures = gather()
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
