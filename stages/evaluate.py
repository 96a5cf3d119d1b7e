"""Stage evaluate: COCO box metrics of the final model on the val split, in an MLflow run of its own.

The model computes in the precision and memory layout it was trained with (stored in the model
file), said in the stage's first line. Each process takes a shard of the val images; detections are gathered on rank 0, mapped back to
JSON category ids and original image coordinates, and scored with ``COCOeval`` of
``evaluate.backend`` (pycocotools or faster-coco-eval).

Every execution makes a new MLflow *evaluation run* (all params, the ``eval/*`` metrics, lineage
tags) tagged ``training_run_id`` with the training run that made the model; ``--run-file`` holds its
id while it is open (the launcher closes it if the processes die) and ``--run-ids`` records both ids
for ``dvc exp show``. Outputs: ``--metrics`` (the 12 COCO figures), ``--per-category`` (a list of
``{"category", "AP"}``), ``--plots`` (precision-recall), ``--detections``, ``--run-ids``.
"""

from __future__ import annotations

import logging

from pipelines import build, checkpoint, cli, distributed
from pipelines.config import load_params, to_flat_dict
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.errors import CheckpointError, first_line
from pipelines.evaluation import coco_evaluate, predict
from pipelines.fileio import write_json
from pipelines.hardware import Compute, resolve
from pipelines.tracking.lineage import (NOTE_TAG, TRAINING_RUN_TAG, default_params, evaluation_note, run_name,
                                        stage_tags)
from pipelines.tracking.run import close_stale_run, read_run_file, read_run_id, stage_run
from pipelines.tracking.tracker import Tracker

log = logging.getLogger("evaluate")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, cache="annotation cache folder (val split inside)",
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

    training_run_id = read_run_id(args.train_run) if main_process else None
    cache = AnnotationCache(args.cache / "val", verify=True)
    state = checkpoint.load(args.model)
    if state.get("categories") != cache.categories:
        raise CheckpointError(f"{args.model}: trained on other categories than {args.cache / 'val'}")
    compute = _compute(p, state, args.model, device)
    if main_process:
        log.info("%s", compute.describe())
        if compute.warning:
            log.warning("%s", compute.warning)
    # the trained weights replace the initial ones
    model = build.detector(p, num_classes=len(cache.categories), compute=compute, pretrained=False)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise CheckpointError(f"{args.model}: does not match params.yaml's model section ({first_line(err)})") from None
    model.to(device)

    tracker = _tracker(p, compute, args, training_run_id) if main_process else Tracker()
    with stage_run(tracker, args.run_file if main_process else None, experiment=p.tracking.experiment,
                   training_run_id=training_run_id):
        dataset = DetectionDataset(cache, transforms=build.test_transforms(p), seed=p.seed, skip_crowd=False)
        loader = build.test_loader(p, dataset, rank=rank, world_size=world_size)
        detections = predict(model, loader, device=device, category_ids=cache.category_ids,
                             tta=build.test_time_augmentation(p), size_divisibility=p.loader.size_divisibility,
                             progress=main_process)
        gathered = distributed.gather_objects(detections)
        if gathered is not None:
            _report(p, args, [d for part in gathered for d in part], tracker, training_run_id,
                    step=state.get("iteration", 0), images=len(cache))
    distributed.shutdown()


def _report(p, args, detections: list[dict], tracker: Tracker, training_run_id: str | None, *, step: int,
            images: int) -> None:
    """Score ``detections``, write the stage's outputs and record them in the evaluation run."""
    metrics = coco_evaluate(args.prepared / "val.json", detections, backend=p.evaluate.backend)
    log.info("COCO box metrics on %d val images:\n%s", images, metrics.summary)
    write_json(args.detections, detections, indent=None)
    write_json(args.metrics, metrics.stats)
    write_json(args.per_category, [{"category": name, "AP": ap} for name, ap in metrics.per_category.items()])
    write_json(args.plots, metrics.pr_curve)
    write_json(args.run_ids, {"mlflow_run_id": tracker.run_id, "mlflow_training_run_id": training_run_id})
    tracker.log_metrics({f"eval/{k}": v for k, v in metrics.stats.items() if v is not None}, step=step)
    tracker.log_metrics({f"eval/AP_{k}": v for k, v in metrics.per_category.items()}, step=step)
    for path in (args.metrics, args.per_category, args.plots):
        tracker.log_artifact(path, "eval")


def _compute(p, state: dict, model_file, device) -> Compute:
    """How the trained model computes: as it was trained (stored with it), or, for a model file that
    does not say, as ``params.yaml`` resolves on this machine."""
    if "precision" in state:
        return resolve(state["precision"], bool(state.get("channels_last")), device,
                       source=f"as the model was trained (stored in {model_file})")
    return build.compute(p, device)


def _tracker(p, compute: Compute, args, training_run_id: str | None) -> Tracker:
    """A new evaluation run (all params, lineage tags, linked to the training run), recorded in
    ``args.run_file``; a run that an earlier, killed evaluation left open there is closed as KILLED."""
    close_stale_run(read_run_file(args.run_file))
    params = to_flat_dict(p)
    tags = stage_tags("evaluate", params_file=args.params, cache=args.cache)
    if training_run_id:
        tags[TRAINING_RUN_TAG] = training_run_id
    tracker = Tracker.start(experiment=p.tracking.experiment, params={**params, **compute.as_params()},
                            tags=tags, run_name=run_name("evaluate", params, default_params(), first=("evaluate.",)))
    if tracker.run_id:
        tracker.set_tag(NOTE_TAG, evaluation_note(training_run_id, tracker.experiment_id))
        tracker.log_artifact(args.params)
    return tracker


if __name__ == "__main__":
    cli.run(main)
