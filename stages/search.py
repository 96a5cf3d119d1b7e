"""Stage search (search/dvc.yaml): Scale-aware AutoAugment's policy search on this dataset.

Every candidate fine-tunes the baseline (trained with the flip only, up to ``search.baseline_fraction``
of its schedule, on the train images less the held-out ones) and is scored on the held-out images by
the original's "Pareto scale balance" against the null candidate's APs there (the flip-only fine-tune;
or the baseline's own, ``search.pareto_comparator``); the best are rescored at more seeds (``pipelines.search``).
A candidate's genes are the policy's or, with ``search.space: scale``, the scale genes and a strength over the
published box-level ops (``pipelines.search.space``); the policy file holds the genes they decode to.
``--out`` keeps the state: every scored candidate and finished round, so a search stopped or killed at
any moment continues where it was, to the result an uninterrupted one gives. What it writes:
the best policy by the score (``--policy``), its metrics, every candidate best first (``--ranked``, what the
confirm stage trains the best of), the search curve and the best candidates' scale bins for ``dvc plots``.
In MLflow: one parent run, one child run per candidate.
"""

from __future__ import annotations

import logging
import os

from pipelines import cli, lifetime
from pipelines.build import data as build_data
from pipelines.config.load import load_params, to_flat_dict
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.fileio import file_sha256, write_json
from pipelines.policy import decode_policy
from pipelines.search.evolution import Search, Settings
from pipelines.search.pool import CandidatePool, Scoring
from pipelines.search.proxy import (
    Proxy,
    baseline_aps,
    bin_shares,
    fine_tune_params,
    search_params,
)
from pipelines.search.record import SearchRecord, search_policy
from pipelines.search.space import space
from pipelines.tracking import store
from pipelines.tracking.run import open_run

log = logging.getLogger("search")
TOP = 5  # candidates whose scale bins are plotted
EMPTY_BIN = 0.01  # a bin with a smaller share of the train boxes gets a warning


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, output_folders=("out",),
                          output_files=("policy", "ranked", "metrics", "curve", "bins"),
                          cache="the search's annotation caches (train, val: held out)",
                          prepared="the search's prepared dataset (val.json: the held-out ground truth)",
                          baseline="the baseline model the candidates fine-tune", out="the search's state folder",
                          policy="the best policy by the score (JSON)",
                          ranked="every scored candidate, best first (JSON)",
                          metrics="the best candidate's figures (JSON)",
                          curve="best and median score per round (JSON) for dvc plots",
                          bins="the best candidates' loss shares per scale (JSON) for dvc plots")
    if os.environ.get("DVC_STAGE"):  # started by DVC: it dies with dvc (and its candidate processes with it)
        lifetime.die_with(lifetime.owner_beyond_shells())
    p = search_params(load_params(args.params))
    augment = p.augment
    genes = space(p.search.space, augment.n_subpolicies)
    settings = Settings(rounds=p.search.rounds, population=p.search.population, kept=p.search.kept,
                        mutations=p.search.mutations, crossovers=p.search.crossovers, random=p.search.random,
                        mutation_prob=p.search.mutation_prob, seed=p.search.seed, n_subpolicies=augment.n_subpolicies,
                        include=(genes.published(),) if p.search.include_published else (),
                        rescore_top_k=p.search.rescore_top_k, rescore_seeds=p.search.rescore_seeds,
                        space=p.search.space)
    proxy = Proxy(p, args.baseline, args.cache, args.prepared / "val.json")
    shares = bin_shares(AnnotationCache(args.cache / "train"), min_size=min(p.model.min_size_train),
                        max_size=p.model.max_size_train, splits=augment.scale_splits)
    log.info("scale bins (area bounds %s): %s of the train boxes", augment.scale_splits,
             ", ".join(f"{x:.1%}" for x in shares))
    if min(shares) < EMPTY_BIN:
        log.warning("a scale bin holds almost none of the train boxes at the training size: the score's balance is "
                    "out of reach and it favours enlarging objects; search.scale_splits: auto scales the bounds to "
                    "model.min_size_train (docs/search.md)")
    record = SearchRecord.open(args.out, settings=settings, proxy=proxy, baseline_sha256=file_sha256(args.baseline))
    baseline = record.baseline_aps(lambda: baseline_aps(proxy))
    log.info("baseline on %d held-out images: AP %.3f, APs %.3f, APm %.3f, APl %.3f",
             len(AnnotationCache(args.cache / "val")), *(baseline[k] for k in ("AP", "APs", "APm", "APl")))
    with open_run("search", record.run_file, experiment=p.tracking.experiment, params=to_flat_dict(p),
                  fingerprint=record.fingerprint, params_file=args.params,
                  resumed_from="") as tracker:  # the state folder: progress that does not name its run
        tracker.log_metrics({f"baseline/{k}": v for k, v in baseline.items()})
        search = Search(args.out, settings)
        with CandidatePool(proxy) as pool:
            comparators = record.comparators(pool, baseline, tracker)
            scoring = Scoring(pool, comparators, regulariser_weight=p.search.regulariser_weight, space=genes)
            best = search.run(record.tracked(scoring.score, tracker), rescore=record.tracked_rescore(scoring.rescore),
                              on_round=record.round_logger(search, tracker))
        best_policy = decode_policy(genes.policy(best["genome"]), augment.n_subpolicies)
        write_json(args.policy, search_policy(best, settings, scale_splits=augment.scale_splits,
                                              translate_relative=p.search.translate_relative))
        ranked = search.ranked()
        write_json(args.metrics, record.metrics(best, baseline, comparators, ranked))
        write_json(args.ranked, ranked)
        write_json(args.curve, [{"round": e["round"], "best": e["best"]["score"], "round_best": e["round_best"],
                                 "median": e["median"]} for e in search.history])
        write_json(args.bins, record.top_bins(search, TOP))
        tracker.log_artifact(args.policy)
        tracker.log_text(genes.describe(best["genome"]), "best_policy.txt")
        tuned = fine_tune_params(p)  # as the candidates were fine-tuned
        augmentation = build_data.augmentation(tuned, best_policy, ramp=False)
        augmented = DetectionDataset(AnnotationCache(args.cache / "train", verify=False),
                                     transforms=build_data.train_transforms(tuned, augmentation), seed=p.seed)
        preview = build_data.preview(p, augmented, count=6, iteration=0, path=args.out / "best_preview.png")
        tracker.log_artifact(preview, "preview")
    log.info("best policy (score %.4f, AP %.3f on the held-out images):\n%s", best["score"], best["AP"],
             genes.describe(best["genome"]))


if __name__ == "__main__":
    cli.run(main, announce=store.announce)
