"""What a search keeps beside its evolution state, and what it tells MLflow.

The state folder is reserved for one search: its fingerprint covers the evolution settings (the genome
space, ``search.space``, among them), the params the fine-tunes run with, the baseline model's bytes (and so
the precision it computes in) and the data. A folder whose fingerprint differs is emptied with a warning before the search starts (its
scores would not hold). The baseline's held-out APs and the null candidate's fine-tunes (``null/<seed
index>.json``: what the Pareto penalty compares with) are kept there too, so a resumed search does not
compute them again. Each scored candidate, and each fine-tune of the null candidate, becomes a child run of
the search's MLflow run; a candidate's rescoring is added to its run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..config.load import training_params
from ..config.schema import registry
from ..fileio import write_json
from ..tracking.tracker import Tracker
from .evolution import Rescorer, Scorer, Search, Settings
from .pool import CandidatePool
from .proxy import SCALES, Proxy, fine_tune_params
from .score import scale_balance

log = logging.getLogger("search")
SCALE_NAMES = ("small", "medium", "large", "very large")
PARENT_TAG = "mlflow.parentRunId"  # how MLflow's UI nests a run under another
TERMS = ("score", "balance", "pareto_penalty", "regulariser")


@dataclass
class SearchRecord:
    folder: Path
    fingerprint: str
    settings: Settings
    experiment: str
    comparator: str  # search.pareto_comparator

    @property
    def run_file(self) -> Path:
        return self.folder / "run.json"

    @classmethod
    def open(cls, folder: Path, *, settings: Settings, proxy: Proxy, baseline_sha256: str) -> SearchRecord:
        p = proxy.params
        data = {split: json.loads((proxy.cache / split / "meta.json").read_text())["arrays"] for split in ("train", "val")}
        genes = dataclasses.asdict(settings)
        if settings.space == "full":  # as before search.space: a state folder begun before it is kept
            del genes["space"]
        identity = {"settings": genes, "fine_tune": training_params(fine_tune_params(p)),
                    "threads": p.search.threads, "evaluate": {"size": p.model.min_size_test, "backend": p.evaluate.backend},
                    "baseline": baseline_sha256, "data": data,
                    "score": {k: getattr(p.search, k) for k in ("common_random_numbers", "pareto_comparator",
                                                                 "regulariser_weight")}}
        fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
        stamp = folder / "fingerprint.json"
        if folder.is_dir() and (not stamp.is_file() or json.loads(stamp.read_text()).get("fingerprint") != fingerprint):
            if any(folder.iterdir()):
                log.warning("%s: the search there had other settings, baseline or data; starting afresh", folder)
            for path in folder.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        write_json(stamp, {"fingerprint": fingerprint})
        return cls(folder, fingerprint, settings, p.tracking.experiment, p.search.pareto_comparator)

    def baseline_aps(self, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        path = self.folder / "baseline.json"
        if not path.is_file():
            write_json(path, evaluate())
        return json.loads(path.read_text())

    def comparators(self, pool: CandidatePool, baseline: dict[str, float], parent: Tracker) -> dict[int, dict]:
        """What each seed index's fine-tunes are compared with (``search.pareto_comparator``), by seed index:
        0, and 1 .. ``rescore_seeds`` where the search rescores."""
        s = self.settings
        seeds = range(1 + (s.rescore_seeds if s.rescore_top_k else 0))
        return COMPARATORS[self.comparator](self, pool=pool, baseline=baseline, parent=parent, seeds=seeds)

    def _null_candidate(self, *, pool: CandidatePool, parent: Tracker, seeds: range, **_) -> dict[int, dict]:
        """The null candidate (the flip-only fine-tune) at each of ``seeds``, fine-tuned where not kept yet."""
        folder = self.folder / "null"
        folder.mkdir(exist_ok=True)
        todo = [(None, i) for i in seeds if not (folder / f"{i}.json").is_file()]
        for (_, i), result in tqdm(pool.fine_tunes(todo), total=len(todo), desc="null candidate", unit="fine-tune"):
            child = self._child(parent, f"null candidate (flip only), seed {i}", {"genome": "null", "seed_index": i})
            child.log_metrics({k: result[k] for k in ("AP", *SCALES, "seconds")})
            child.log_metrics({"balance": scale_balance(result["bins"])})
            child.finish()
            write_json(folder / f"{i}.json", {**result, "balance": scale_balance(result["bins"]), "seed_index": i,
                                              "mlflow_run_id": child.run_id})
        found = {i: json.loads((folder / f"{i}.json").read_text()) for i in seeds}
        log.info("null candidate (flip only) on the held-out images: %s", "; ".join(
            f"seed {i}: AP {r['AP']:.3f}, APs {r['APs']:.3f}, APm {r['APm']:.3f}, APl {r['APl']:.3f}"
            for i, r in found.items()))
        return found

    def _child(self, parent: Tracker, name: str, params: dict) -> Tracker:
        """A child run of ``parent``; none (a no-op tracker) where the parent has no run."""
        if not parent.active:
            return Tracker()
        return Tracker.start(experiment=self.experiment, run_name=name, params=params,
                             tags={PARENT_TAG: parent.run_id})

    def tracked(self, score: Scorer, parent: Tracker) -> Scorer:
        """``score`` with a progress bar, each scored candidate recorded as a child run of ``parent``: its score
        and the score's three terms, APs, loss shares, seconds and policy."""
        genes = self.settings.genome_space

        def run(genomes):
            for genome, result in tqdm(score(genomes), total=len(genomes), desc="candidates", unit="candidate"):
                child = self._child(parent, f"candidate {genes.key(genome)}", {"genome": genes.key(genome)})
                child.log_metrics({k: result[k] for k in (*TERMS, "AP", *SCALES, "seconds")})
                child.log_metrics({"seed_score": result["score"]})
                child.log_metrics({f"loss_share/{name}": share for name, share in zip(SCALE_NAMES, _shares(result))})
                child.log_text(genes.describe(genome), "policy.txt")
                child.finish()
                yield genome, {**result, "mlflow_run_id": child.run_id}
        return run

    @staticmethod
    def tracked_rescore(rescore: Rescorer) -> Rescorer:
        """``rescore`` with a progress bar."""
        def run(jobs):
            yield from tqdm(rescore(jobs), total=len(jobs), desc="rescoring", unit="fine-tune", leave=False)
        return run

    def round_logger(self, search: Search, parent: Tracker) -> Callable[[dict], None]:
        """Logs each finished round, and adds each candidate rescored in it to its child run: per seed index
        (the step), its score, terms and APs; its ``score`` becomes the mean over the seeds (at the last step)."""
        def on_round(entry: dict) -> None:
            log.info("round %d: best %.4f (%s), this round's best %.4f, median %.4f; rescored %d", entry["round"],
                     entry["best"]["score"], entry["best"]["key"], entry["round_best"], entry["median"],
                     len(entry["rescored"]))
            parent.log_metrics({"search/best_score": entry["best"]["score"], "search/round_best": entry["round_best"],
                                "search/median_score": entry["median"]}, step=entry["round"])
            for k in entry["rescored"]:
                result = json.loads((search.candidates / f"{k}.json").read_text())
                if not result.get("mlflow_run_id"):
                    continue
                child = Tracker.resume(result["mlflow_run_id"])
                for step, extra in enumerate(result["rescores"], start=1):
                    child.log_metrics({"seed_score": extra["score"], **{t: extra[t] for t in TERMS[1:]},
                                       **{m: extra[m] for m in ("AP", *SCALES)}}, step=step)
                child.log_metrics({"score": result["score"]}, step=len(result["seed_scores"]) - 1)
                child.finish()
        return on_round

    def metrics(self, best: dict, baseline: dict[str, float], comparators: dict[int, dict],
                ranked: list[dict]) -> dict:
        """The search's metrics: the best candidate's score and its terms and held-out APs, each the mean over
        its seeds, beside the baseline's and the comparator's (seed index 0) APs; then how the winner stands
        against the published genome among ``ranked`` (every scored candidate, best first: :func:`standing`)."""
        seeds = [best, *best.get("rescores", [])]
        genes = self.settings.genome_space
        return {**{k: sum(r[k] for r in seeds) / len(seeds) for k in (*TERMS[1:], "AP", *SCALES)},
                "score": best["score"], "seeds": len(seeds),
                **{f"baseline_{k}": baseline[k] for k in ("AP", *SCALES)},
                **{f"comparator_{k}": comparators[0][k] for k in ("AP", *SCALES)},
                "candidates": len(list(self.folder.glob("candidates/*.json"))),
                **standing(ranked, genes.key(genes.canonical(genes.published())))}

    def top_bins(self, search: Search, count: int) -> list[dict]:
        """The best ``count`` candidates' loss shares per scale, as rows for ``dvc plots``."""
        rows = []
        for rank, result in enumerate(search.ranked()[:count], start=1):
            label = f"{rank}. {result['key']} ({result['score']:.4f})"
            rows += [{"candidate": label, "scale": name, "share": share}
                     for name, share in zip(SCALE_NAMES, _shares(result))]
        return rows


def standing(ranked: list[dict], published_key: str) -> dict:
    """The winner (``ranked[0]``: the best by the score, lower is better) against the published genome (its key
    ``published_key``): ``winner``, ``winner_score``, ``published_rank`` (1 is the best of ``ranked``),
    ``published_score`` and ``margin``, the winner's score minus the published one's (0 where the published
    genome won; below 0 where the winner scored better). The published genome is scored in round 0 with
    ``search.include_published``; where it was not scored, its three figures are null."""
    keys = [r["key"] for r in ranked]
    winner = ranked[0]
    if published_key not in keys:
        return {"winner": winner["key"], "winner_score": winner["score"], "published_rank": None,
                "published_score": None, "margin": None}
    rank = keys.index(published_key) + 1
    published = ranked[rank - 1]
    return {"winner": winner["key"], "winner_score": winner["score"], "published_rank": rank,
            "published_score": published["score"], "margin": winner["score"] - published["score"]}


def search_policy(best: dict, settings: Settings, *, scale_splits: list[int], translate_relative: bool) -> dict:
    """The policy file of the search's ``best`` candidate (what ``augment=searched`` reads): the policy's genes its
    genome decodes to in ``settings.space``, with the bounds it was searched with; a ``scale`` genome's own genes
    and strength recorded beside them."""
    genes = settings.genome_space
    return {"policy": list(genes.policy(best["genome"])), "n_subpolicies": settings.n_subpolicies,
            "scale_splits": scale_splits, "key": best["key"], **genes.record(best["genome"]),
            "translate_relative": translate_relative,  # recorded; training keeps its own
            "score": best["score"], "policy_text": genes.describe(best["genome"])}


def _baseline(record: SearchRecord, *, baseline: dict[str, float], seeds: range, **_) -> dict[int, dict]:
    """The un-fine-tuned baseline's APs, for every seed index."""
    return {i: baseline for i in seeds}


# search.pareto_comparator: the names config validation accepts are these keys (config.registry)
COMPARATORS = registry("search.pareto_comparator", {"null_candidate": SearchRecord._null_candidate,
                                                    "baseline": _baseline})


def _shares(result: dict) -> list[float]:
    total = sum(result["bins"])
    return [b / total if total else 0.0 for b in result["bins"]]
