"""Confirm before output: the search's best candidates and fixed presets trained on the full schedule at a
few seeds, the best by held-out AP written as the search's policy.

An *arm* is one policy: a candidate of the search (``search-1`` is its best by the score, with the search's
scale bounds, trained as ``augment=searched`` trains a policy file) or an augment preset of
``conf/augment/`` (``sa_autoaug`` is the published policy). Every arm trains at the same seeds, so a seed's
initialisation and data order are the same for all (a paired comparison). The winner is the arm of the
highest mean AP over the seeds; a tie goes to the arm listed first: the presets in ``confirm.arms``'
order, then the candidates by rank, so a searched policy must beat the presets to be chosen.

What is kept in ``folder`` (``search/outputs/confirm``): ``<arm id>-s<seed>.json`` per finished run, written
atomically, with the fingerprint of what it trained on; a run is trained again only where no kept result has
that fingerprint. A stage killed at any moment and run again skips the kept runs, and the train stage
resumes an unfinished one from its newest checkpoint: it ends with the table an uninterrupted one gives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..errors import ConfigError
from ..fileio import write_json
from ..policy import decode_policy
from .space import Space

log = logging.getLogger("confirm")
PUBLISHED_PRESET = "sa_autoaug"
SEARCHED_PRESET = "searched"  # reads a policy file: how a candidate trains
METRICS = ("AP", "APs", "APm", "APl")


@dataclass(frozen=True)
class Arm:
    name: str  # search-<rank>, or the preset's name
    augment: dict  # the run's augment section (a preset of conf/augment/)
    genes: tuple[int, ...] | None = None  # a Scale-aware AutoAugment policy: a candidate's, or sa_autoaug's
    scale_splits: tuple[int, ...] | None = None  # the bounds it trains with
    key: str | None = None  # a candidate's name in the search
    score: float | None = None  # a candidate's search score

    @property
    def id(self) -> str:
        """Its name in the kept runs: the preset's, or ``g<key>`` (a candidate keeps its runs whatever its rank)."""
        return self.name if self.key is None else f"g{self.key}"


Compose = Callable[[str], "dict | None"]  # preset name -> its augment section, None where conf/augment/ lacks it


def arms(ranked: Sequence[dict], *, top_k: int, presets: Sequence[str], compose: Compose,
         scale_splits: Sequence[int], space: Space) -> list[Arm]:
    """The presets (in order; a missing one skipped with a warning), then the ``top_k`` best of ``ranked`` (the
    search's candidates, best first, each with ``genome``, ``key`` and ``score``), trained with ``scale_splits``:
    each with the policy's genes its genome decodes to in ``space`` (``search.space``)."""
    found = []
    for preset in presets:
        augment = compose(preset)
        if augment is None:
            log.warning("confirm.arms: conf/augment/%s.yaml does not exist: the %s arm is skipped", preset, preset)
            continue
        genes = augment.get("policy") if augment.get("name") == PUBLISHED_PRESET else None
        found.append(Arm(preset, augment, genes=tuple(genes) if genes else None,
                         scale_splits=tuple(augment["scale_splits"]) if genes else None))
    if top_k:
        searched = compose(SEARCHED_PRESET)
        if searched is None:
            raise ConfigError(f"conf/augment/{SEARCHED_PRESET}.yaml: not found; confirm.top_k > 0 trains the "
                              "candidates with it")
        for rank, candidate in enumerate(ranked[:top_k], start=1):
            genes = space.policy(candidate["genome"])
            decode_policy(genes, space.n_subpolicies)
            found.append(Arm(f"search-{rank}", searched, genes=genes,
                             scale_splits=tuple(scale_splits), key=candidate["key"], score=candidate["score"]))
    return found


def policy_file(arm: Arm, n_subpolicies: int) -> dict:
    """What ``augment=searched`` reads to train ``arm``: its genes and bounds, or a preset's ``augment`` section."""
    if arm.genes is None:
        return {"arm": arm.name, "augment": arm.augment}
    return {"arm": arm.name, "policy": list(arm.genes), "n_subpolicies": n_subpolicies,
            "scale_splits": list(arm.scale_splits), "key": arm.key, "score": arm.score,
            "policy_text": str(decode_policy(list(arm.genes), n_subpolicies))}


def fingerprint(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


# Trains ``arm`` at ``seed`` in the working folder given; returns its held-out figures (METRICS, more allowed).
Runner = Callable[[Arm, int, Path], dict]


def confirm(arms_: Sequence[Arm], seeds: Sequence[int], run: Runner, folder: Path, *,
            identity: Callable[[Arm, int, Path], dict]) -> list[dict]:
    """Every arm at every seed: its kept result where ``identity(arm, seed, work)`` (what the run trains on, as
    JSON) matches, else ``run(arm, seed, work)``, kept as soon as it returns; ``work`` is ``folder/<arm
    id>-s<seed>/``. One row per run."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    todo = [(arm, seed) for arm in arms_ for seed in seeds]
    for arm, seed in tqdm(todo, desc="confirm runs", unit="run"):
        path, work = folder / f"{arm.id}-s{seed}.json", folder / f"{arm.id}-s{seed}"
        stamp = fingerprint(identity(arm, seed, work))
        kept = json.loads(path.read_text()) if path.is_file() else None
        if kept is None or kept.get("fingerprint") != stamp:
            log.info("%s, seed %d: training and scoring on the held-out images", arm.name, seed)
            result = run(arm, seed, work)
            kept = {**result, "arm": arm.name, "seed": seed, "key": arm.key, "fingerprint": stamp}
            write_json(path, kept)
        rows.append({**kept, "arm": arm.name})  # a candidate's rank may have changed since it was kept
    return rows


def table(arms_: Sequence[Arm], seeds: Sequence[int], rows: Sequence[dict]) -> dict:
    """The confirm table (``search/metrics/confirm.json``): per arm its AP at each seed and their mean (and the
    mean of APs, APm, APl), the winner, and the margin over the published policy where it was trained."""
    by_arm = {arm.name: {row["seed"]: row for row in rows if row["arm"] == arm.name} for arm in arms_}
    summary = {}
    for arm in arms_:
        runs = [by_arm[arm.name][seed] for seed in seeds]
        entry = {f"AP_s{seed}": r["AP"] for seed, r in zip(seeds, runs)}
        for metric in METRICS:
            values = [r[metric] for r in runs if r.get(metric) is not None and r[metric] >= 0]
            entry[metric] = statistics.fmean(values) if values else None
        if arm.key is not None:
            entry.update(key=arm.key, score=arm.score)
        summary[arm.name] = entry
    winner = max(arms_, key=lambda a: (summary[a.name]["AP"], -arms_.index(a)))  # ties: the arm listed first
    figures = {"winner": winner.name, "winner_AP": summary[winner.name]["AP"], "seeds": list(seeds), "arms": summary}
    if PUBLISHED_PRESET in summary:
        figures["published_AP"] = summary[PUBLISHED_PRESET]["AP"]
        figures["margin"] = figures["winner_AP"] - figures["published_AP"]
    return figures


def verdict(figures: dict) -> str:
    """One line on the outcome, naming the case where the published policy won."""
    winner, ap = figures["winner"], figures["winner_AP"]
    if winner == PUBLISHED_PRESET:
        searched = [(name, e["AP"]) for name, e in figures["arms"].items() if e.get("key")]
        best = max(searched, key=lambda x: x[1], default=None)
        against = f"; the best searched policy, {best[0]}, {best[1]:.3f}" if best else ""
        return (f"the published policy won the confirmation (held-out AP {ap:.3f} over {len(figures['seeds'])} "
                f"seed(s){against}): the policy file holds the published policy")
    margin = f", {figures['margin']:+.3f} over the published policy" if "margin" in figures else ""
    return f"confirmed: {winner} (held-out AP {ap:.3f} over {len(figures['seeds'])} seed(s){margin}) is the policy file"
