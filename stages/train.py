"""Stage train: FCOS with DDP, started by ``python -m pipelines.launch`` (torchrun's elastic launch).

Its first line says how the model computes (``model.precision`` and ``model.channels_last``, with
``auto`` resolved from the hardware) and why. Resumes exactly: a run that was killed or stopped
continues from the newest checkpoint with the same fingerprint (training params, resolved precision,
data and code), whatever the run file says, and gives the weights an uninterrupted run gives, in the
same MLflow run (a new one linked to it where the run file was lost). A finished run removes its
checkpoints, so running it again trains from iteration 0. Rank 0 holds a lock on the folder: a
second trainer on the same outputs is refused. ``<out>/checkpoints/`` is the working folder (checkpoints, and this attempt's
log, preview and ``run.json``); the outputs (final model, training log, preview, ``run.json``)
replace the previous ones only when training has finished; until then the previous ones stay.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch

from pipelines import build, checkpoint, cli, distributed
from pipelines.config import load_params, to_flat_dict
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.data.preview import augmentation_preview
from pipelines.engine import MetricLog, StopRequest, train
from pipelines.fileio import atomic_file, check_writable, remove_temporaries
from pipelines.lifetime import FolderLock
from pipelines.hardware import Compute
from pipelines.tracking.lineage import NOTE_TAG, default_params, run_name, stage_tags, training_note
from pipelines.tracking.run import read_run_file, stage_run, write_run_file
from pipelines.tracking.store import close_run
from pipelines.tracking.tracker import Tracker

log = logging.getLogger("train")
PREVIEW_SAMPLES = 6
RUN_ID_KEY = "mlflow_run_id"  # in every checkpoint: the MLflow run that wrote it
FINGERPRINT_TAG = "train.fingerprint"  # on every training run
CONTINUES_TAG = "train.continues_run"  # on a run that resumed another run's checkpoint (its run file was lost)


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args(__doc__, argv, cache="annotation cache folder (train split inside)",
                          out="folder for model_final.pth, checkpoints/, run.json",
                          train_log="training log (CSV) for dvc plots",
                          preview="PNG of samples before and after augmentation")
    stop = StopRequest().install()
    device = distributed.init_from_env()
    rank, world_size, main_process = distributed.get_rank(), distributed.get_world_size(), distributed.is_main_process()
    p = load_params(args.params, world_size=world_size)
    t = p.train
    compute = build.compute(p, device)
    if main_process:
        log.info("%s", compute.describe())
        if compute.warning:
            log.warning("%s", compute.warning)
    torch.manual_seed(p.seed)

    cache = AnnotationCache(args.cache / "train", verify=True)
    dataset = DetectionDataset(cache, transforms=build.train_transforms(p), seed=p.seed)
    model = build.detector(p, num_classes=len(cache.categories), compute=compute).to(device)
    optimizer = build.optimizer(p, model)
    scheduler = build.scheduler(p, optimizer)
    work = args.out / "checkpoints"  # persistent: checkpoints, and this run's log and preview until it ends
    if main_process:  # one trainer per folder; then nothing else writes the outputs' temporary files
        FolderLock(work, job=os.environ.get("TORCHELASTIC_RUN_ID", "")).acquire()
        remove_temporaries(args.out / "model_final.pth", args.out / "run.json", args.train_log, args.preview)
        model_bytes = sum(x.numel() * x.element_size() for x in model.state_dict().values())
        for folder, needed in ((work, 3 * model_bytes * (t.keep_checkpoints + 1)), (args.out, model_bytes),
                               (args.train_log.parent, 0), (args.preview.parent, 0)):
            check_writable(folder, needed_bytes=needed)
    fingerprint = build.fingerprint(p, compute, data=json.dumps(cache.meta["arrays"]))
    checkpointer = checkpoint.Checkpointer(work, keep=t.keep_checkpoints, fingerprint=fingerprint,
                                           extra={"categories": cache.categories})
    state_file = work / "run.json"  # this attempt's run id, fingerprint and status; outputs/train/run.json at the end
    previous = read_run_file(state_file) if main_process else {}
    scaler = build.grad_scaler(compute, device)
    start_iter, extras = checkpointer.resume(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    loader = build.train_loader(p, dataset, rank=rank, world_size=world_size, device=device, start_iter=start_iter)
    model = build.data_parallel(p, model, device=device, world_size=world_size)
    log.info("%d images, %d classes, %.1fM parameters, %d processes on %s, batch %d, iterations %d to %d",
             len(dataset), len(cache.categories), sum(x.numel() for x in model.parameters()) / 1e6,
             world_size, device.type, t.ims_per_batch, start_iter, t.max_iter)

    tracker, tracked_until = _tracker(p, compute, previous, fingerprint, resumed_run=extras.get(RUN_ID_KEY, ""),
                                      resumed=start_iter > 0, main_process=main_process,
                                      tags=stage_tags("train", params_file=args.params, cache=args.cache)
                                      if main_process else {})
    checkpointer.extra[RUN_ID_KEY] = tracker.run_id or ""
    preview, train_log = work / args.preview.name, work / args.train_log.name
    if start_iter == 0:
        train_log.unlink(missing_ok=True)
    with stage_run(tracker, state_file if main_process else None, experiment=p.tracking.experiment,
                   fingerprint=fingerprint):
        if main_process:
            if start_iter == 0:
                tracker.log_artifact(args.params)
                if (policy := build.policy(p)) is not None:
                    log.info("Scale-aware AutoAugment policy:\n%s", policy)
                    tracker.log_text(str(policy), "augment_policy.txt")
            plain = DetectionDataset(cache, transforms=build.train_transforms(p, augment=False), seed=p.seed)
            augmentation_preview(plain, dataset, count=PREVIEW_SAMPLES, iteration=t.max_iter, path=preview)
            if start_iter == 0:
                tracker.log_artifact(preview, "preview")
        train(model, loader, optimizer, scheduler, device=device, max_iter=t.max_iter, start_iter=start_iter,
              **build.loop_settings(p), checkpointer=checkpointer, scaler=scaler, tracker=tracker,
              tracked_until=tracked_until, metric_log=MetricLog(train_log, start_iter=start_iter), stop=stop)
        if main_process:
            final = args.out / "model_final.pth"
            checkpoint.save(final, model=checkpoint.unwrap(model).state_dict(), categories=cache.categories,
                            iteration=t.max_iter, precision=compute.precision, channels_last=compute.channels_last)
            for source, target in ((train_log, args.train_log), (preview, args.preview)):
                with atomic_file(target) as tmp:
                    shutil.copyfile(source, tmp)
            tracker.log_artifact(final, "model")
            tracker.log_artifact(args.train_log)
            if p.tracking.log_checkpoints:
                for _, path in checkpoint.checkpoints(work):
                    tracker.log_artifact(path, "checkpoints")
            write_run_file(args.out / "run.json", run_id=tracker.run_id, experiment=p.tracking.experiment,
                           fingerprint=fingerprint, status="finished")
            checkpointer.finish()  # the final model is the output: running the stage again starts from 0
    distributed.shutdown()


def _tracker(p, compute: Compute, previous: dict, fingerprint: str, *, resumed_run: str, resumed: bool,
             main_process: bool, tags: dict[str, str]) -> tuple[Tracker, int]:
    """The MLflow training run, and the last step it has.

    Resuming (``resumed``, from a checkpoint that ``resumed_run`` wrote), it continues the run that the
    run file of the start before (``previous``) names, where that file agrees: same run, same
    fingerprint, left RUNNING. Otherwise a new run with ``tags``, the fingerprint, every param but the
    ``evaluate`` section's (evaluation runs record those), the resolved ``compute`` and a readable name;
    a resumed one is linked to the run it continues (tag :data:`CONTINUES_TAG`). A run left RUNNING that
    is not continued is closed as KILLED.
    """
    if not main_process:
        return Tracker(), 0
    interrupted = previous.get("run_id") if previous.get("status") == "running" else None
    if (resumed and interrupted and previous.get("fingerprint") == fingerprint
            and resumed_run in ("", interrupted)):
        tracker = Tracker.resume(interrupted)
        return tracker, tracker.last_step("train/loss")
    for run_id in {interrupted, resumed_run} - {None, ""}:
        close_run(run_id, "KILLED")
    tags = {**tags, FINGERPRINT_TAG: fingerprint}
    if resumed:
        tags[CONTINUES_TAG] = resumed_run or "unknown (a checkpoint without a run id)"
    params = {k: v for k, v in to_flat_dict(p).items() if not k.startswith("evaluate.")}
    tracker = Tracker.start(experiment=p.tracking.experiment, params={**params, **compute.as_params()}, tags=tags,
                            run_name=run_name("train", params, default_params()))
    if tracker.run_id:
        tracker.set_tag(NOTE_TAG, training_note(tracker.run_id))
    return tracker, 0


if __name__ == "__main__":
    cli.run(main)
