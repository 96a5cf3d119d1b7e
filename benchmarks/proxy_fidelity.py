"""Benchmark: the search's proxy against full training, on the policies the confirm stage trained.

A finished search's confirm stage (``search/metrics/confirm.json``) has trained a handful of policies on the
full schedule and scored each by its held-out AP: the search's best candidates, the published policy, flip
and ``trivial_zoom``. This fine-tunes the same policies with the proxy (from the search's baseline, on its
train images, scored on the same held-out images) at ``--seeds`` seed indices, with two proxies:

- ``fair``: the search's settings as ``params.yaml`` has them (docs/search.md, "A fair score");
- ``original``: the score as first built: each policy its own random numbers, the un-fine-tuned baseline's
  APs as the comparator, the regulariser weight 0.01, no warmup, translate in pixels.

Per proxy it gives each policy's mean proxy AP and score, and the rank correlation (Spearman, ties averaged)
of the full schedule's AP with the proxy's AP and with the score (lower is better, so its ranking is
reversed). The score ranked here is balance x Pareto penalty: flip and ``trivial_zoom`` have no genes, so the
regulariser is left out for every policy (it is shown apart for the genomes). The published policy is
scored as the search scores it, as the published genome with the search's bounds.

    python -m benchmarks.proxy_fidelity [--seeds 3] [--json]
    python -m benchmarks.record run proxy-fidelity -- benchmarks.proxy_fidelity

Each fine-tune takes what one candidate of the search takes (``search.threads`` threads,
``search.candidates_at_once`` at once); 6 policies x 3 seeds x 2 proxies are 36 of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipelines import cli
from pipelines.build import data as build_data
from pipelines.config.load import load_params
from pipelines.config.schema import Params
from pipelines.errors import ConfigError
from pipelines.search.confirm import PUBLISHED_PRESET
from pipelines.search.pool import CandidatePool
from pipelines.search.proxy import SCALES, Proxy, baseline_aps, search_params
from pipelines.search.score import ORIGINAL_WEIGHT, pareto_penalty, regulariser, scale_balance
from pipelines.search.space import space

log = logging.getLogger("proxy_fidelity")
SEARCH = Path("search")
ORIGINAL = {"common_random_numbers": False, "pareto_comparator": "baseline", "regulariser_weight": ORIGINAL_WEIGHT,
            "proxy_warmup_fraction": 0.0, "translate_relative": False}  # the score as first built
FLIP = "flip"  # the null candidate's policy


def original_params(p: Params) -> Params:
    """``p`` with the search's score as first built (:data:`ORIGINAL`)."""
    return dataclasses.replace(p, search=dataclasses.replace(p.search, **ORIGINAL))


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of ``a`` and ``b`` (tied values share their mean rank); None where either
    is constant or there are fewer than 3 pairs."""
    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return None

    def ranks(values: list[float]) -> np.ndarray:
        x = np.asarray(values, dtype=np.float64)
        order = x.argsort(kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def policies(confirm: dict, ranked: list[dict], p: Params) -> dict[str, tuple]:
    """The confirm table's arms as proxy jobs' first parts: a genome, or (None, preset) for a preset; the
    published preset as the published genome, flip as the null candidate."""
    genes = space(p.search.space, p.augment.n_subpolicies)
    by_key = {c["key"]: tuple(c["genome"]) for c in ranked}
    found = {}
    for name, entry in confirm["arms"].items():
        if entry.get("key") is not None:
            if entry["key"] not in by_key:
                raise ConfigError(f"confirm.json: arm {name}'s candidate {entry['key']} is not in ranked.json "
                                  "(expected the same finished search)")
            found[name] = (by_key[entry["key"]], None)
        elif name == PUBLISHED_PRESET:
            found[name] = (genes.published(), None)
        elif name == FLIP:
            found[name] = (None, None)
        elif name in build_data.AUGMENTATIONS:
            found[name] = (None, name)
        else:
            log.warning("confirm arm %s: not an augment.name the proxy can fine-tune; left out", name)
    return found


def measure(p: Params, *, search: Path, seeds: int) -> dict:
    """Both proxies' figures for the arms of ``search``'s confirm table."""
    confirm = json.loads((search / "metrics" / "confirm.json").read_text() or "{}")
    if not confirm.get("arms"):
        raise ConfigError(f"{search / 'metrics' / 'confirm.json'}: no confirm table (expected a finished search: "
                          "make search)")
    ranked = json.loads((search / "outputs" / "ranked.json").read_text())
    arms = policies(confirm, ranked, p)
    figures = {"seeds": seeds, "confirm_seeds": confirm["seeds"], "proxies": {}}
    for name, params in (("fair", p), ("original", original_params(p))):
        proxy = Proxy(params, search / "outputs" / "baseline" / "model_final.pth", search / "data" / "cache",
                      search / "data" / "prepared" / "val.json")
        wanted = {(genome, i, preset) for genome, preset in arms.values() for i in range(seeds)}
        if params.search.pareto_comparator != "baseline":  # the comparator: the null candidate at each seed index
            wanted |= {(None, i, None) for i in range(seeds)}
        with CandidatePool(proxy) as pool:
            results = dict(tqdm(pool.fine_tunes(sorted(wanted, key=repr)), total=len(wanted),
                                desc=f"{name} proxy", unit="fine-tune"))
        if params.search.pareto_comparator == "baseline":
            base = baseline_aps(proxy)
            comparators = {i: base for i in range(seeds)}
        else:
            comparators = {i: results[(None, i, None)] for i in range(seeds)}
        genes = space(params.search.space, params.augment.n_subpolicies)
        rows = {}
        for arm, (genome, preset) in arms.items():
            runs = [results[(genome, i, preset)] for i in range(seeds)]
            scores = [scale_balance(r["bins"]) * pareto_penalty([r[k] for k in SCALES],
                                                                [comparators[i][k] for k in SCALES])
                      for i, r in enumerate(runs)]
            rows[arm] = {"full_AP": confirm["arms"][arm]["AP"], "proxy_AP": statistics.fmean(r["AP"] for r in runs),
                         "score": statistics.fmean(scores),
                         "score_sd": statistics.stdev(scores) if len(scores) > 1 else None,
                         "per_seed_AP": [r["AP"] for r in runs],
                         "per_seed_score": scores,
                         "regulariser": None if genome is None else regulariser(
                             genes.policy(genome), params.augment.n_subpolicies, params.search.regulariser_weight)}
        full = [r["full_AP"] for r in rows.values()]
        figures["proxies"][name] = {
            "settings": {k: getattr(params.search, k) for k in ORIGINAL}, "arms": rows,
            "spearman_AP": spearman(full, [r["proxy_AP"] for r in rows.values()]),
            "spearman_score": spearman(full, [-r["score"] for r in rows.values()]),
            "fine_tune_seconds": statistics.median(r["seconds"] for r in results.values())}
    return figures


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


def table(figures: dict) -> str:
    """The policies by full-schedule AP with each proxy's AP and score, then the rank correlations."""
    fair, original = figures["proxies"]["fair"], figures["proxies"]["original"]
    arms = sorted(fair["arms"], key=lambda a: -fair["arms"][a]["full_AP"])
    lines = [f"| policy | full schedule AP ({len(figures['confirm_seeds'])} seeds) | fair proxy: AP | score | "
             f"original proxy: AP | score |", "|---|---|---|---|---|---|"]
    for arm in arms:
        f, o = fair["arms"][arm], original["arms"][arm]
        lines.append(f"| {arm} | {f['full_AP']:.3f} | {f['proxy_AP']:.3f} | {f['score']:.4f} | {o['proxy_AP']:.3f} | "
                     f"{o['score']:.4f} |")
    lines.append(f"| Spearman with the full schedule's AP: by proxy AP | | {_signed(fair['spearman_AP'])} | | "
                 f"{_signed(original['spearman_AP'])} | |")
    lines.append(f"| Spearman with the full schedule's AP: by score (lower first) | | | {_signed(fair['spearman_score'])} "
                 f"| | {_signed(original['spearman_score'])} |")
    return "\n".join(lines) + (f"\n\nProxy figures: means over {figures['seeds']} seed indices; score = balance x "
                               "Pareto penalty (the regulariser left out: flip and trivial_zoom have no genes).")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--search", type=Path, default=SEARCH, help="the search's folder (a finished search)")
    parser.add_argument("--seeds", type=int, default=3, help="seed indices per policy and proxy (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if not 1 <= args.seeds <= 16:
        raise ConfigError(f"--seeds {args.seeds}: expected 1 to 16")
    figures = measure(search_params(load_params(args.params)), search=args.search, seeds=args.seeds)
    print(json.dumps(figures) if args.json else table(figures), flush=True)


if __name__ == "__main__":
    cli.run(main)
