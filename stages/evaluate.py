"""Stage evaluate: COCO box metrics of the final model on the val split, added to the MLflow run.

Each process takes a shard of the val images; detections are gathered on rank 0, mapped back to
JSON category ids and original image coordinates, and scored with pycocotools' ``COCOeval``.
"""

from __future__ import annotations

import logging

from pipelines import build, checkpoint, cli, distributed
from pipelines.config import load_params
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.errors import CheckpointError
from pipelines.evaluation import coco_evaluate, predict
from pipelines.fileio import write_json
from pipelines.tracking import Tracker, read_run_id

log = logging.getLogger("evaluate")


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, cache="annotation cache folder (val split inside)",
                          prepared="prepared dataset (val.json is the ground truth)",
                          model="model_final.pth of the train stage", run_file="run.json of the train stage",
                          metrics="COCO metrics (JSON) for dvc metrics",
                          plots="precision-recall curve (JSON) for dvc plots",
                          detections="detections in COCO results format")

    device = distributed.init_from_env()
    rank, world_size = distributed.get_rank(), distributed.get_world_size()
    p = load_params(args.params, world_size=world_size)

    run_id = read_run_id(args.run_file) if distributed.is_main_process() else None
    cache = AnnotationCache(args.cache / "val", verify=True)
    state = checkpoint.load(args.model)
    if state.get("categories") != cache.categories:
        raise CheckpointError(f"{args.model}: trained on other categories than {args.cache / 'val'}")
    model = build.detector(p, num_classes=len(cache.categories))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise CheckpointError(f"{args.model}: does not match params.yaml's model section ({str(err).splitlines()[0]})") from None
    model.to(device)

    dataset = DetectionDataset(cache, transforms=build.test_transforms(p), seed=p.seed, skip_crowd=False)
    loader = build.test_loader(p, dataset, rank=rank, world_size=world_size)
    detections = predict(model, loader, device=device, category_ids=cache.category_ids,
                         tta=build.test_time_augmentation(p), size_divisibility=p.loader.size_divisibility,
                         progress=distributed.is_main_process())
    gathered = distributed.gather_objects(detections)
    if gathered is not None:
        detections = [d for part in gathered for d in part]
        metrics = coco_evaluate(str(args.prepared / "val.json"), detections)
        log.info("COCO box metrics on %d val images:\n%s", len(cache), metrics.summary)
        write_json(args.detections, detections, indent=None)
        write_json(args.metrics, {**metrics.stats, "per_category": metrics.per_category})
        write_json(args.plots, metrics.pr_curve)
        tracker = Tracker.resume(run_id)
        tracker.log_metrics({f"eval/{k}": v for k, v in metrics.stats.items() if v is not None},
                            step=state.get("iteration", 0))
        tracker.log_metrics({f"eval/AP_{k}": v for k, v in metrics.per_category.items()}, step=state.get("iteration", 0))
        for path in (args.metrics, args.plots):
            tracker.log_artifact(path, "eval")
        tracker.finish()
    distributed.shutdown()


if __name__ == "__main__":
    cli.run(main)
