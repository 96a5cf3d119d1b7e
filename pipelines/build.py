"""The one edge from validated params to objects (detectron2's ``from_config`` idea, without a registry).

Each function takes the :class:`~pipelines.config.Params` that :func:`~pipelines.config.load_params`
validated and calls the core with explicit keyword arguments; nothing else in the project maps
params to arguments. Stages and benchmarks build through here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import fingerprint as checkpoint_fingerprint
from .checkpoint import load as load_checkpoint
from .config.load import training_params
from .config.schema import Params, registry
from .data.autoaug.augment import ScaleAwareAutoAugment
from .data.loader import make_test_loader, make_train_loader
from .data.transforms import Compose, RandomHorizontalFlip, TestTimeAugmentation, build_transforms
from .engine import MetricLog, Reporter
from .errors import CheckpointError, ConfigError, first_line
from .hardware import Compute, resolve
from .model import Detector, build_detector
from .policy import Policy, decode_policy, trivial_policy
from .solver import build_lr_scheduler, build_optimizer
from .tracking.tracker import Tracker


def compute(p: Params, device: torch.device) -> Compute:
    """How the model computes on ``device``: ``model.precision`` and ``model.channels_last`` with
    ``auto`` resolved from the hardware (:func:`pipelines.hardware.resolve`)."""
    return resolve(p.model.precision, p.model.channels_last, device)


def detector(p: Params, *, num_classes: int, compute: Compute, pretrained: bool = True) -> Detector:
    """The detector of ``p.model`` computing as ``compute`` says (seed torch's generator first): random
    weights, then, with ``pretrained``, the ResNet's from ``model.backbone_weights`` (pass ``False`` when
    a trained model's state dict will replace them anyway); ``model.trainable_layers`` sets which stages train.

    Raises:
        ConfigError: ``model.backbone_weights`` cannot be read, downloaded or loaded (one line).
    """
    m = p.model
    try:
        return build_detector(num_classes=num_classes, backbone=m.backbone, norm=m.norm, fpn_channels=m.fpn_channels,
                              backbone_weights=m.backbone_weights if pretrained else None,
                              trainable_layers=m.trainable_layers, head_convs=m.head_convs,
                              precision=compute.precision, channels_last=compute.channels_last,
                              score_thresh=m.score_thresh, nms_thresh=m.nms_thresh,
                              detections_per_img=m.detections_per_img, topk_candidates=m.topk_candidates)
    except ConfigError as err:
        raise ConfigError(f"model.backbone_weights: {err}") from None


def trained_detector(p: Params, model_file: Path, *, categories: list[dict], split: Path,
                     device: torch.device) -> tuple[Detector, Compute, int]:
    """The model in ``model_file`` (a train stage's ``model_final.pth``) as ``p.model`` builds it, on
    ``device``, computing in the precision and layout it was trained with (stored with it; for a file that
    does not say, as ``params.yaml`` resolves here); and the iteration it was trained to.

    Raises:
        CheckpointError: the file cannot be read, was trained on other ``categories`` than those of the
            annotation cache ``split``, or does not match ``p.model``.
    """
    state = load_checkpoint(model_file)
    if state.get("categories") != categories:
        raise CheckpointError(f"{model_file}: trained on other categories than {split}")
    how = (resolve(state["precision"], bool(state.get("channels_last")), device,
                   source=f"as the model was trained (stored in {model_file})")
           if "precision" in state else compute(p, device))
    model = detector(p, num_classes=len(categories), compute=how, pretrained=False)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise CheckpointError(f"{model_file}: does not match params.yaml's model section ({first_line(err)})") from None
    return model.to(device), how, int(state.get("iteration", 0))


def fingerprint(p: Params, compute: Compute, *, data: str) -> str:
    """The resume fingerprint of a training run (:func:`pipelines.checkpoint.fingerprint`): the params that
    change the weights, the resolved precision and layout, ``data`` (the training data's hash) and the code."""
    return checkpoint_fingerprint(params={**training_params(p), **compute.as_params()}, data=data)


def policy(p: Params) -> Policy | None:
    """The decoded Scale-aware AutoAugment policy of ``p.augment``, or ``None`` for other presets."""
    a = p.augment
    return decode_policy(a.policy, a.n_subpolicies) if a.name == "sa_autoaug" else None


def augmentation(p: Params):
    """The training augmentation preset ``p.augment.name`` as one transform, or ``None``.

    ``none``: nothing; ``flip``: horizontal flip with ``hflip_prob``; ``sa_autoaug``: the flip, then
    Scale-aware AutoAugment ramped over ``train.max_iter`` iterations; ``trivial``: the flip, then one
    box-level op of the same set at a uniform level, always (:func:`pipelines.policy.trivial_policy`).
    """
    return AUGMENTATIONS[p.augment.name](p)


def _flip(p: Params) -> RandomHorizontalFlip:
    return RandomHorizontalFlip(p.augment.hflip_prob)


def _sa_autoaug(p: Params) -> Compose:
    a = p.augment
    autoaug = ScaleAwareAutoAugment(policy(p), scale_splits=a.scale_splits, box_prob=a.box_prob,
                                    max_iter=p.train.max_iter, filler_cache_mb=a.filler_cache_mb,
                                    filler_pool=a.filler_pool, filler_pool_iters=a.filler_pool_iters)
    return Compose([_flip(p), autoaug])


def _trivial(p: Params) -> Compose:
    a = p.augment  # no ramp (max_iter 0): TrivialAugment applies its op at once, at full strength
    return Compose([_flip(p), ScaleAwareAutoAugment(trivial_policy(), scale_splits=a.scale_splits,
                                                    box_prob=a.box_prob, max_iter=0, filler_cache_mb=0)])


# augment.name: the names config validation accepts are these keys (config.registry).
AUGMENTATIONS = registry("augment.name", {"none": lambda p: None, "flip": _flip, "sa_autoaug": _sa_autoaug,
                                          "trivial": _trivial})


def train_transforms(p: Params, *, augment: bool = True) -> Compose:
    """Resize to the training sizes, then (with ``augment``) the augmentation preset."""
    return build_transforms(min_sizes=p.model.min_size_train, max_size=p.model.max_size_train,
                            augment=augmentation(p) if augment else None)


def test_transforms(p: Params) -> Compose:
    """Resize to the test size."""
    return build_transforms(min_sizes=[p.model.min_size_test], max_size=p.model.max_size_test)


def test_time_augmentation(p: Params) -> TestTimeAugmentation | None:
    """The extra test-time views of ``p.evaluate``, or ``None`` when ``evaluate.tta`` is off."""
    e = p.evaluate
    return TestTimeAugmentation(tuple(e.tta_scales), e.tta_max_size, e.tta_flip) if e.tta else None


def last_iteration(p: Params) -> int:
    """The iteration training ends at: ``train.stop_at`` of ``train.max_iter`` (the schedule's length)."""
    return max(1, round(p.train.stop_at * p.train.max_iter))


def train_loader(p: Params, dataset, *, rank: int, world_size: int, device: torch.device, start_iter: int = 0):
    """This rank's loader of :func:`last_iteration` - ``start_iter`` batches of ``train.ims_per_batch / world_size``."""
    return make_train_loader(dataset, batch_size=p.train.ims_per_batch // world_size, max_iter=last_iteration(p),
                             start_iter=start_iter, aspect_grouping=p.loader.aspect_grouping,
                             num_workers=p.loader.num_workers, size_divisibility=p.loader.size_divisibility,
                             seed=p.seed, rank=rank, world_size=world_size, pin_memory=device.type == "cuda")


def test_loader(p: Params, dataset, *, rank: int, world_size: int):
    """This rank's shard of the test set in batches of ``evaluate.ims_per_batch / world_size``."""
    return make_test_loader(dataset, batch_size=p.evaluate.ims_per_batch // world_size,
                            aspect_grouping=p.loader.aspect_grouping, num_workers=p.loader.num_workers,
                            size_divisibility=p.loader.size_divisibility, seed=p.seed, rank=rank,
                            world_size=world_size)


def optimizer(p: Params, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = p.train
    return build_optimizer(model, name=t.optimizer, base_lr=t.base_lr, momentum=t.momentum,
                           weight_decay=t.weight_decay, norm_weight_decay=t.norm_weight_decay)


def scheduler(p: Params, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    t = p.train
    return build_lr_scheduler(optimizer, schedule=t.lr_schedule, max_iter=t.max_iter, steps=list(t.steps),
                              gamma=t.gamma, warmup_iters=t.warmup_iters, warmup_factor=t.warmup_factor)


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
