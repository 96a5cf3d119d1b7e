"""Stage train: FCOS from scratch with DDP, launched by ``torchrun`` (gloo on CPU, NCCL on GPU).

Writes the final model, periodic checkpoints, a training log for ``dvc plots`` and the MLflow run
id that the evaluate stage adds its metrics to.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from pipelines import build, checkpoint, cli, distributed
from pipelines.config import load_params, to_flat_dict
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.data.preview import augmentation_preview
from pipelines.engine import MetricLog, train
from pipelines.tracking import Tracker, write_run_file

log = logging.getLogger("train")
PREVIEW_SAMPLES = 6


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, cache="annotation cache folder (train split inside)",
                          out="folder for model_final.pth, checkpoints/, run.json",
                          train_log="training log (CSV) for dvc plots",
                          preview="PNG of samples before and after augmentation")

    device = distributed.init_from_env()
    rank, world_size, main_process = distributed.get_rank(), distributed.get_world_size(), distributed.is_main_process()
    p = load_params(args.params, world_size=world_size)
    t = p.train
    torch.manual_seed(p.seed)

    cache = AnnotationCache(args.cache / "train")
    dataset = DetectionDataset(cache, transforms=build.train_transforms(p), seed=p.seed)
    loader = build.train_loader(p, dataset, rank=rank, world_size=world_size, device=device)
    model = build.detector(p, num_classes=len(cache.categories)).to(device)
    optimizer = build.optimizer(p, model)
    scheduler = build.scheduler(p, optimizer)
    if world_size > 1:
        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    log.info("%d images, %d classes, %.1fM parameters, %d processes on %s, batch %d",
             len(dataset), len(cache.categories), sum(x.numel() for x in model.parameters()) / 1e6,
             world_size, device.type, t.ims_per_batch)

    tracker = Tracker.start(experiment=p.tracking.experiment, params=to_flat_dict(p), main_process=main_process)
    tracker.log_artifact(args.params)
    if main_process:
        if (policy := build.policy(p)) is not None:
            log.info("Scale-aware AutoAugment policy:\n%s", policy)
            tracker.log_text(str(policy), "augment_policy.txt")
        plain = DetectionDataset(cache, transforms=build.train_transforms(p, augment=False), seed=p.seed)
        augmentation_preview(plain, dataset, count=PREVIEW_SAMPLES, iteration=t.max_iter, path=args.preview)
        tracker.log_artifact(args.preview, "preview")
    try:
        train(model, loader, optimizer, scheduler, device=device, max_iter=t.max_iter, ims_per_batch=t.ims_per_batch,
              log_period=t.log_period, checkpoint_period=t.checkpoint_period, checkpoint_dir=args.out / "checkpoints",
              clip_grad_norm=t.clip_grad_norm, tracker=tracker, metric_log=MetricLog(args.train_log))
    except BaseException:
        tracker.finish("FAILED")
        raise
    if main_process:
        final = args.out / "model_final.pth"
        checkpoint.save(final, model=checkpoint.unwrap(model).state_dict(), categories=cache.categories,
                        iteration=t.max_iter)
        tracker.log_artifact(final, "model")
        tracker.log_artifact(args.train_log)
        write_run_file(args.out / "run.json", run_id=tracker.run_id, experiment=p.tracking.experiment)
        tracker.finish()
    distributed.shutdown()


if __name__ == "__main__":
    cli.run(main)
