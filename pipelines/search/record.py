"""What a search keeps beside its evolution state, and what it tells MLflow.

The state folder is reserved for one search: its fingerprint covers the evolution settings, the
params the fine-tunes run with, the baseline model's bytes (and so the precision it computes in) and
the data. A folder whose fingerprint differs is emptied with a warning before the search starts (its
scores would not hold). The baseline's held-out APs are kept there too, so a resumed search does not
evaluate it again. Each scored candidate becomes a child run of the search's MLflow run.
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
from ..fileio import write_json
from ..policy import decode_policy
from ..tracking.tracker import Tracker
from .evolution import Scorer, Search, Settings
from .proxy import Proxy, fine_tune_params

log = logging.getLogger("search")
SCALE_NAMES = ("small", "medium", "large", "very large")
PARENT_TAG = "mlflow.parentRunId"  # how MLflow's UI nests a run under another


@dataclass
class SearchRecord:
    folder: Path
    fingerprint: str
    settings: Settings
    experiment: str

    @property
    def run_file(self) -> Path:
        return self.folder / "run.json"

    @classmethod
    def open(cls, folder: Path, *, settings: Settings, proxy: Proxy, baseline_sha256: str) -> SearchRecord:
        p = proxy.params
        data = {split: json.loads((proxy.cache / split / "meta.json").read_text())["arrays"] for split in ("train", "val")}
        identity = {"settings": dataclasses.asdict(settings), "fine_tune": training_params(fine_tune_params(p)),
                    "threads": p.search.threads, "evaluate": {"size": p.model.min_size_test, "backend": p.evaluate.backend},
                    "baseline": baseline_sha256, "data": data}
        fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
        stamp = folder / "fingerprint.json"
        if folder.is_dir() and (not stamp.is_file() or json.loads(stamp.read_text()).get("fingerprint") != fingerprint):
            if any(folder.iterdir()):
                log.warning("%s: the search there had other settings, baseline or data; starting afresh", folder)
            for path in folder.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        write_json(stamp, {"fingerprint": fingerprint})
        return cls(folder, fingerprint, settings, p.tracking.experiment)

    def baseline_aps(self, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        path = self.folder / "baseline.json"
        if not path.is_file():
            write_json(path, evaluate())
        return json.loads(path.read_text())

    def tracked(self, score: Scorer, parent: Tracker) -> Scorer:
        """``score`` with a progress bar, each scored candidate recorded as a child run of ``parent``."""
        n = self.settings.n_subpolicies

        def run(genomes):
            for genome, result in tqdm(score(genomes), total=len(genomes), desc="candidates", unit="candidate"):
                child = Tracker.start(experiment=self.experiment, run_name=f"candidate {''.join(map(str, genome))}",
                                      params={"genome": "".join(map(str, genome))},
                                      tags={PARENT_TAG: parent.run_id} if parent.run_id else {})
                child.log_metrics({k: result[k] for k in ("score", "AP", "APs", "APm", "APl", "seconds")})
                child.log_metrics({f"loss_share/{name}": share for name, share in zip(SCALE_NAMES, _shares(result))})
                child.log_text(str(decode_policy(genome, n)), "policy.txt")
                child.finish()
                yield genome, {**result, "mlflow_run_id": child.run_id}
        return run

    def round_logger(self, parent: Tracker) -> Callable[[dict], None]:
        def on_round(entry: dict) -> None:
            log.info("round %d: best %.4f (%s), this round's best %.4f, median %.4f", entry["round"],
                     entry["best"]["score"], entry["best"]["key"], entry["round_best"], entry["median"])
            parent.log_metrics({"search/best_score": entry["best"]["score"], "search/round_best": entry["round_best"],
                                "search/median_score": entry["median"]}, step=entry["round"])
        return on_round

    def top_bins(self, search: Search, count: int) -> list[dict]:
        """The best ``count`` candidates' loss shares per scale, as rows for ``dvc plots``."""
        rows = []
        for rank, result in enumerate(search.ranked()[:count], start=1):
            label = f"{rank}. {result['key']} ({result['score']:.4f})"
            rows += [{"candidate": label, "scale": name, "share": share}
                     for name, share in zip(SCALE_NAMES, _shares(result))]
        return rows


def _shares(result: dict) -> list[float]:
    total = sum(result["bins"])
    return [b / total if total else 0.0 for b in result["bins"]]
