"""One confirm run (:mod:`pipelines.search.confirm`): an arm trained at a seed by the train stage itself,
``python -m pipelines.launch ... stages.train`` in processes of its own as ``dvc repro`` and the search's
baseline stage run it (``train.nproc`` processes, its checkpoints, resume and MLflow run), on the search-train
images; then scored on the held-out images in this process as the evaluate stage scores val (its test-time
augmentation and post-processing), never on val. The training run is a child of the search's MLflow run
(:data:`~pipelines.tracking.lineage.PARENT_RUN_ENV`) and gets the held-out figures when they are known.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from .. import launch, lifetime
from ..build import data as build_data
from ..build import model as build_model
from ..config.load import params_from_dict, training_params
from ..data.annotation_cache import AnnotationCache
from ..data.dataset import DetectionDataset
from ..errors import STOP_SIGNALS, Stopped, TrainingError
from ..evaluation import coco_evaluate, predict
from ..fileio import atomic_file, write_json
from ..tracking.lineage import PARENT_RUN_ENV
from ..tracking.run import read_run_file
from ..tracking.tracker import Tracker
from .confirm import METRICS, Arm, policy_file

ARM_TAG = "search.confirm_arm"  # on a confirm training run: its arm and seed


@dataclass(frozen=True)
class FullRun:
    """What every confirm run shares; ``run(arm, seed, work)`` is a :data:`~pipelines.search.confirm.Runner`."""

    raw: dict  # params.yaml as read: every run takes it, less the augment section, the seed and train.stop_at
    cache: Path  # the search's annotation caches: train (the search-train images), val (the held-out ones)
    heldout: Path  # the held-out images' ground truth (COCO JSON)
    train_module: str  # the train stage's module
    fraction: float  # train.stop_at of every run
    n_subpolicies: int
    parent_run_id: str | None = None  # the search's MLflow run

    def params(self, arm: Arm, seed: int, work: Path) -> dict:
        """The run's params: ``raw`` with the arm's augment section (a candidate's genes in ``work/policy.json``,
        read as ``augment=searched`` reads a policy file), ``seed`` and ``train.stop_at``."""
        raw = copy.deepcopy(self.raw)
        raw["augment"] = dict(arm.augment)
        if arm.key is not None:
            raw["augment"]["policy_file"] = str(work / "policy.json")
        raw["seed"] = seed
        raw["train"]["stop_at"] = self.fraction
        return raw

    def identity(self, arm: Arm, seed: int, work: Path) -> dict:
        """What the run's result depends on: the params that set its weights, the evaluation's, the arm's genes
        and bounds, the data (not the search's settings: a wider confirmation keeps the runs it has)."""
        raw = self.params(arm, seed, work)
        data = {split: json.loads((self.cache / split / "meta.json").read_text())["arrays"] for split in ("train", "val")}
        return {"train": training_params(params_from_dict(raw)), "evaluate": raw["evaluate"], "genes": arm.genes,
                "scale_splits": arm.scale_splits, "data": data}

    def __call__(self, arm: Arm, seed: int, work: Path) -> dict:
        work.mkdir(parents=True, exist_ok=True)
        raw = self.params(arm, seed, work)
        if arm.key is not None:
            write_json(work / "policy.json", policy_file(arm, self.n_subpolicies))
        params = work / "params.yaml"
        with atomic_file(params) as tmp:
            tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
        model, run = work / "model_final.pth", work / "run.json"
        start = time.perf_counter()
        if read_run_file(run).get("status") != "finished" or not model.is_file():
            self._train(arm, seed, work, params, model, run)
        trained = time.perf_counter()
        figures = heldout_figures(params_from_dict(raw, source=str(params)), model, self.cache, self.heldout)
        training_run_id = read_run_file(run).get("run_id")
        if training_run_id:
            tracker = Tracker.resume(training_run_id)
            tracker.set_tag(ARM_TAG, f"{arm.name}, seed {seed}")
            tracker.log_metrics({f"heldout/{k}": v for k, v in figures.items() if v is not None})
            tracker.finish()
        return {**figures, "training_run_id": training_run_id,
                "seconds": {"train": round(trained - start, 1), "score": round(time.perf_counter() - trained, 1)}}

    def _train(self, arm: Arm, seed: int, work: Path, params: Path, model: Path, run: Path) -> None:
        checkpoints = work / "checkpoints"
        command = [sys.executable, "-m", launch.__name__, "--params", str(params), "--run-file",
                   str(checkpoints / "run.json"), self.train_module, "--cache", str(self.cache), "--checkpoints",
                   str(checkpoints), "--model", str(model), "--run", str(run), "--train-log", str(work / "train_log.csv"),
                   "--preview", str(work / "augment_preview.png")]
        env = {**os.environ, **({PARENT_RUN_ENV: self.parent_run_id} if self.parent_run_id else {})}
        code = launch_process(command, env)
        if code - 128 in {int(s) for s in STOP_SIGNALS}:
            raise Stopped(f"stopped by {signal.Signals(code - 128).name}", signum=code - 128)
        if code:
            raise TrainingError(f"confirm run {arm.name}, seed {seed}: the train stage exited with code {code} (its "
                                f"error above); run the stage again to resume it from {checkpoints}")


def launch_process(command: list[str], env: dict[str, str]) -> int:
    """Run the launcher's ``command``; its exit code (its progress and its one-line errors go to stderr)."""
    return subprocess.run(command, env=env, preexec_fn=lifetime.parent_death_signal).returncode  # dies with us


def heldout_figures(p, model_file: Path, cache: Path, heldout: Path) -> dict[str, float | None]:
    """AP, APs, APm and APl of the model in ``model_file`` on the held-out split (``cache/val``, ground truth
    ``heldout``), with ``p.evaluate``'s test-time augmentation and post-processing; None where COCO has no
    object of that size."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    images = AnnotationCache(cache / "val", verify=False)
    model, _, _ = build_model.trained_detector(p, model_file, categories=images.categories, split=cache / "val",
                                               device=device)
    build_model.use_evaluate(model, p)
    dataset = DetectionDataset(images, transforms=build_data.test_transforms(p), seed=p.seed, skip_crowd=False)
    loader = build_data.test_loader(p, dataset, rank=0, world_size=1)
    detections = predict(model, loader, device=device, category_ids=images.category_ids,
                         tta=build_data.test_time_augmentation(p), size_divisibility=p.loader.size_divisibility,
                         progress=False)
    stats = coco_evaluate(heldout, detections, backend=p.evaluate.backend).stats
    return {name: float(stats[name]) if stats[name] is not None and stats[name] >= 0 else None for name in METRICS}
