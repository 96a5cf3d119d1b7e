"""Stage evaluate: COCO box metrics of the final model on the val split, in an MLflow run of its own.

The model computes as it was trained (stored in the model file; said in the first line). Each process
takes a shard of the val images; rank 0 gathers the detections, maps them back to JSON category ids and
image coordinates and scores them with ``evaluate.backend``'s ``COCOeval``, AP's intervals from
``evaluate.bootstrap`` image resamples drawn from ``seed``. Every execution is a new
MLflow *evaluation run* tagged ``training_run_id``; ``--run-file`` holds its id while it is open (the
launcher closes it if the processes die) and ``--run-ids`` records both ids for ``dvc exp show``.
With ``evaluate.bn_reestimate``, the model's BatchNorm statistics are first re-estimated at the test sizes
on that many images of the train split in ``--cache`` (:mod:`pipelines.bn_stats`; evaluation only).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipelines import bn_stats, cli, distributed
from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.config.load import load_params, to_flat_dict
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.evaluation import coco_evaluate, predict
from pipelines.fileio import write_json
from pipelines.tracking import store
from pipelines.tracking.run import open_run, read_run_id
from pipelines.tracking.tracker import Tracker

log = logging.getLogger("evaluate")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, output_files=("run_file", "metrics", "per_category", "run_ids", "plots",
                                                          "detections"),
                          cache="annotation cache folder (val split inside; train too with evaluate.bn_reestimate)",
                          prepared="prepared dataset (val.json is the ground truth)",
                          model="model_final.pth of the train stage", train_run="run.json of the train stage",
                          run_file="this stage's MLflow run while it is open (for the launcher)",
                          metrics="COCO summary metrics (JSON) for dvc metrics",
                          per_category="per-category AP (JSON list) for dvc plots",
                          run_ids="MLflow evaluation and training run ids (JSON) for dvc metrics and dvc exp show",
                          plots="precision-recall curve (JSON) for dvc plots",
                          detections="detections in COCO results format")
    device = distributed.init_from_env()
    rank, world_size, main_process = distributed.get_rank(), distributed.get_world_size(), distributed.is_main_process()
    p = load_params(args.params, world_size=world_size)
    training_run_id = read_run_id(args.train_run)
    cache = AnnotationCache(args.cache / "val", verify=True)
    model, compute, iteration = build_model.trained_detector(p, args.model, categories=cache.categories,
                                                             split=args.cache / "val", device=device)
    build_model.use_evaluate(model, p)
    if main_process:
        compute.announce(log)
    bn_reestimated(p, model, args.cache, device=device)
    outputs = [(path, "eval") for path in (args.metrics, args.per_category, args.plots)]  # logged as the run ends
    with open_run("evaluate", args.run_file, experiment=p.tracking.experiment, params=to_flat_dict(p),
                  compute=compute.as_params(), training_run_id=training_run_id, params_file=args.params,
                  cache=args.cache, artifacts=outputs) as tracker:
        dataset = DetectionDataset(cache, transforms=build_data.test_transforms(p), seed=p.seed, skip_crowd=False)
        loader = build_data.test_loader(p, dataset, rank=rank, world_size=world_size)
        detections = predict(model, loader, device=device, category_ids=cache.category_ids,
                             tta=build_data.test_time_augmentation(p), size_divisibility=p.loader.size_divisibility,
                             progress=main_process)
        gathered = distributed.gather_objects(detections)
        if gathered is not None:
            _report(p, args, [d for part in gathered for d in part], tracker, training_run_id, step=iteration,
                    images=len(cache))
    distributed.shutdown()


def bn_reestimated(p, model, cache: Path, *, device) -> None:
    """With ``evaluate.bn_reestimate`` N, ``model``'s BatchNorm statistics re-estimated at the test sizes on N
    images of the train split in ``cache`` (:func:`pipelines.bn_stats.reestimate`); off (null), nothing is
    read and the model is left as it is."""
    if p.evaluate.bn_reestimate is None:
        return
    train = DetectionDataset(AnnotationCache(cache / "train", verify=True), transforms=build_data.test_transforms(p),
                             seed=p.seed, skip_crowd=False)
    bn_stats.reestimate(model, train, images=p.evaluate.bn_reestimate, seed=p.seed, min_size=p.model.min_size_test,
                        max_size=p.model.max_size_test, batch_size=p.evaluate.ims_per_batch,
                        size_divisibility=p.loader.size_divisibility, tta=build_data.test_time_augmentation(p),
                        device=device)


def _report(p, args, detections: list[dict], tracker: Tracker, training_run_id: str | None, *, step: int,
            images: int) -> None:
    """Score ``detections``, write the stage's outputs and log the metrics to the evaluation run (which
    logs the output files when it ends)."""
    metrics = coco_evaluate(args.prepared / "val.json", detections, backend=p.evaluate.backend,
                            bootstrap=p.evaluate.bootstrap, seed=p.seed, progress=True)
    log.info("COCO box metrics on %d val images:\n%s", images, metrics.summary)
    if metrics.intervals.get("AP") is not None:
        low, high = metrics.intervals["AP"]
        log.info("AP %.3f (95%% interval %.3f-%.3f, %d image resamples)", metrics.stats["AP"], low, high,
                 metrics.resamples)
    figures = metrics.figures()
    write_json(args.detections, detections, indent=None)
    write_json(args.metrics, figures)
    write_json(args.per_category, [{"category": name, "AP": ap} for name, ap in metrics.per_category.items()])
    write_json(args.plots, metrics.pr_curve)
    write_json(args.run_ids, {"mlflow_run_id": tracker.run_id, "mlflow_training_run_id": training_run_id})
    tracker.log_metrics({f"eval/{k}": v for k, v in figures.items() if v is not None}, step=step)
    tracker.log_metrics({f"eval/AP_{k}": v for k, v in metrics.per_category.items()}, step=step)


if __name__ == "__main__":
    cli.run(main, announce=store.announce)
