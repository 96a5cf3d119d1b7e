"""Training from params: the schedule's last iteration, the train loaders, optimizer, learning-rate
schedule, gradient scaler, the loop's settings and reporter, and the model as DDP runs it."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.schema import Params
from ..data.loader import make_train_loader
from ..data.samplers import padded_shape_groups
from ..engine import MetricLog, Reporter
from ..errors import ConfigError
from ..hardware import Compute
from ..solver import build_lr_scheduler, build_optimizer
from ..tracking.tracker import Tracker


def last_iteration(p: Params) -> int:
    """The iteration training ends at: ``train.stop_at`` of ``train.max_iter`` (the schedule's length)."""
    return max(1, round(p.train.stop_at * p.train.max_iter))


def batch_groups(p: Params, dataset):
    """The group of each training image when ``loader.padded_shape_grouping`` is on: its padded shape at the
    training resize (the one ``model.min_size_train``, which validation holds to one size), within its
    orientation (:func:`pipelines.data.samplers.padded_shape_groups`); ``None`` when off (the loader then
    groups by orientation as ``loader.aspect_grouping`` says)."""
    if not p.loader.padded_shape_grouping:
        return None
    return padded_shape_groups(dataset.cache.sizes, dataset.aspect_groups, min_size=p.model.min_size_train[0],
                               max_size=p.model.max_size_train, size_divisibility=p.loader.size_divisibility)


def train_loader(p: Params, dataset, *, rank: int, world_size: int, device: torch.device, start_iter: int = 0):
    """This rank's loader of :func:`last_iteration` - ``start_iter`` batches of ``train.ims_per_batch / world_size``."""
    return make_train_loader(dataset, batch_size=p.train.ims_per_batch // world_size, max_iter=last_iteration(p),
                             start_iter=start_iter, aspect_grouping=p.loader.aspect_grouping,
                             num_workers=p.loader.num_workers, size_divisibility=p.loader.size_divisibility,
                             seed=p.seed, rank=rank, world_size=world_size, pin_memory=device.type == "cuda",
                             group_ids=batch_groups(p, dataset))


def fine_tune_loader(p: Params, dataset, *, seed: int):
    """The search's fine-tune loader: ``train.max_iter`` batches of ``train.ims_per_batch`` read in this
    process (a candidate's process starts no loader workers of its own), in the order ``seed`` gives."""
    return make_train_loader(dataset, batch_size=p.train.ims_per_batch, max_iter=p.train.max_iter,
                             aspect_grouping=p.loader.aspect_grouping, num_workers=0,
                             size_divisibility=p.loader.size_divisibility, seed=seed, group_ids=batch_groups(p, dataset))


def optimizer(p: Params, model: torch.nn.Module) -> torch.optim.Optimizer:
    train = p.train
    return build_optimizer(model, name=train.optimizer, base_lr=train.base_lr, momentum=train.momentum,
                           weight_decay=train.weight_decay, norm_weight_decay=train.norm_weight_decay)


def scheduler(p: Params, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    train = p.train
    return build_lr_scheduler(optimizer, schedule=train.lr_schedule, max_iter=train.max_iter, steps=list(train.steps),
                              gamma=train.gamma, warmup_iters=train.warmup_iters, warmup_factor=train.warmup_factor)


def grad_scaler(compute: Compute, device: torch.device) -> torch.amp.GradScaler:
    """The gradient scaler fp16 autocast needs; disabled, a no-op, for other precisions."""
    return torch.amp.GradScaler(device.type, enabled=compute.precision == "fp16")


def loop_settings(p: Params) -> dict:
    """The keyword arguments of :func:`pipelines.engine.train` that params set (the caller adds the
    iteration range and what it runs with: loader, checkpointer, reporter, stop)."""
    return {"checkpoint_period": p.train.checkpoint_period, "clip_grad_norm": p.train.clip_grad_norm}


def reporter(p: Params, *, start_iter: int, device: torch.device, log_file: Path | None = None,
             tracker: Tracker | None = None, tracked_until: int = 0) -> Reporter:
    """What the loop reports, as ``train.log_period`` says: to the CSV ``log_file`` (continued from
    ``start_iter``), to ``tracker`` and to the progress bar (:class:`pipelines.engine.Reporter`)."""
    return Reporter(max_iter=last_iteration(p), start_iter=start_iter, ims_per_batch=p.train.ims_per_batch,
                    log_period=p.train.log_period, metric_log=MetricLog(log_file, start_iter=start_iter),
                    tracker=tracker, tracked_until=tracked_until, device=device)


def data_parallel(p: Params, model: torch.nn.Module, *, device: torch.device, world_size: int) -> torch.nn.Module:
    """``model`` as the training loop runs it: in one process as it is; in several, its BatchNorm layers
    made ``SyncBatchNorm`` if ``model.sync_batchnorm`` (GPUs only), then wrapped in DDP.

    Raises:
        ConfigError: ``model.sync_batchnorm`` on CPU.
    """
    if world_size == 1:
        return model
    if p.model.sync_batchnorm:
        if device.type != "cuda":
            raise ConfigError("model.sync_batchnorm: SyncBatchNorm runs on GPUs only; this run is on "
                              f"{device.type} (set it to false)")
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
