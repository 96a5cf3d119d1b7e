"""Stage train: FCOS with DDP, started by ``python -m pipelines.launch`` (torchrun's elastic launch).

Its first line says how the model computes and why. A run that was killed or stopped resumes from the
newest checkpoint with the same fingerprint (training params, resolved precision, data and code) to the
weights an uninterrupted run gives, in the same MLflow run. ``--checkpoints`` is the working folder,
locked by rank 0; the outputs replace the previous ones only when training has finished.
"""

from __future__ import annotations

import json
import logging

import torch

from pipelines import checkpoint, cli, distributed
from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.build import train as build_train
from pipelines.config.load import load_params, read_policy_file, to_flat_dict
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.engine import StopRequest, train
from pipelines.tracking import store
from pipelines.tracking.run import open_run

log = logging.getLogger("train")
PREVIEW_SAMPLES = 6
RUN_ID_KEY = "mlflow_run_id"  # in every checkpoint: the MLflow run that wrote it


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, overrides=True, output_folders=("checkpoints",),
                          output_files=("run_file", "model", "run", "train_log", "preview"),
                          cache="annotation cache folder (train split inside)",
                          checkpoints="working folder: checkpoints, the lock, this run's outputs until it ends",
                          run_file="this stage's MLflow run while it is open (for the launcher)",
                          model="the final model", run="the training run's MLflow id (JSON)",
                          train_log="training log (CSV) for dvc plots", preview="PNG of samples before and after augmentation")
    stop = StopRequest().install()
    device = distributed.init_from_env()
    rank, world_size, main_process = distributed.get_rank(), distributed.get_world_size(), distributed.is_main_process()
    p = read_policy_file(load_params(args.params, world_size=world_size, overrides=args.set), args.params)
    compute = build_model.compute(p, device)
    if main_process:
        compute.announce(log)
    torch.manual_seed(p.seed)

    cache = AnnotationCache(args.cache / "train", verify=True)
    policy = build_data.policy(p)  # decoded once: the augmentation applies it, the run logs it
    dataset = DetectionDataset(cache, transforms=build_data.train_transforms(p, build_data.augmentation(p, policy)),
                               seed=p.seed)
    model = build_model.detector(p, num_classes=len(cache.categories), compute=compute).to(device)
    optimizer = build_train.optimizer(p, model)
    scheduler = build_train.scheduler(p, optimizer)
    fingerprint = build_model.fingerprint(p, compute, data=json.dumps(cache.meta["arrays"]))
    checkpointer = checkpoint.Checkpointer(args.checkpoints, keep=p.train.keep_checkpoints, fingerprint=fingerprint,
                                           extra={"categories": cache.categories})
    if main_process:
        checkpointer.claim(model, args.model, others=[args.run, args.train_log, args.preview])
    scaler = build_train.grad_scaler(compute, device)
    start_iter, extras = checkpointer.resume(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    loader = build_train.train_loader(p, dataset, rank=rank, world_size=world_size, device=device,
                                      start_iter=start_iter)
    model = build_train.data_parallel(p, model, device=device, world_size=world_size)
    log.info("%d images, %d classes, %.1fM parameters, %d processes on %s, batch %d, iterations %d to %d",
             len(dataset), len(cache.categories), sum(x.numel() for x in model.parameters()) / 1e6,
             world_size, device.type, p.train.ims_per_batch, start_iter, build_train.last_iteration(p))

    run = open_run("train", args.run_file, experiment=p.tracking.experiment, params=to_flat_dict(p),
                   compute=compute.as_params(), fingerprint=fingerprint, params_file=args.params, cache=args.cache,
                   resumed_from=extras.get(RUN_ID_KEY, "") if start_iter else None, output=args.run,
                   artifacts=_artifacts(args, checkpoints=p.tracking.log_checkpoints))
    checkpointer.extra[RUN_ID_KEY] = run.tracker.run_id or ""
    preview, train_log = args.checkpoints / args.preview.name, args.checkpoints / args.train_log.name
    with run as tracker:
        if main_process:
            if start_iter == 0 and policy is not None:
                log.info("Scale-aware AutoAugment policy:\n%s", policy)
                tracker.log_text(str(policy), "augment_policy.txt")
            build_data.preview(p, dataset, count=PREVIEW_SAMPLES, iteration=p.train.max_iter, path=preview)
            if start_iter == 0:
                tracker.log_artifact(preview, "preview")
        report = build_train.reporter(p, start_iter=start_iter, device=device, log_file=train_log, tracker=tracker,
                                      tracked_until=run.tracked_until)
        train(model, loader, optimizer, scheduler, device=device, max_iter=build_train.last_iteration(p),
              start_iter=start_iter, **build_train.loop_settings(p), checkpointer=checkpointer, scaler=scaler,
              report=report, stop=stop)
        if main_process:
            checkpoint.save(args.model, model=checkpoint.unwrap(model).state_dict(), categories=cache.categories,
                            iteration=build_train.last_iteration(p), **compute.stored())
            checkpointer.promote({train_log: args.train_log, preview: args.preview})
    checkpointer.finish()  # the final model is the output: running the stage again starts from 0
    distributed.shutdown()


def _artifacts(args, *, checkpoints: bool):
    """The training run's artifacts, listed once it has ended: the model, the log and, if asked, the checkpoints."""
    yield from [(args.model, "model"), (args.train_log, None)]
    yield from ((path, "checkpoints") for _, path in (checkpoint.checkpoints(args.checkpoints) if checkpoints else []))


if __name__ == "__main__":
    cli.run(main, announce=store.announce)
