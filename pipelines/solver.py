"""Optimizer and iteration-based learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config.schema import registry


def build_optimizer(model: nn.Module, *, name: str, base_lr: float, momentum: float = 0.9, weight_decay: float = 1e-4,
                    norm_weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW; normalisation weights, all biases and the box branch's per-level ``scales``
    get ``norm_weight_decay``.

    Both use torch's fused kernels (one kernel over all parameters: 4x faster than the per-tensor
    ``foreach`` ones for AdamW on the CPU, see ``docs/hardware.md``)."""
    decay, no_decay = [], []
    for module in model.modules():
        is_norm = isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm))
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            # the box branch's per-level scales (model.learn_scales) are gains, like a norm layer's weight
            (no_decay if is_norm or param_name in ("bias", "scales") else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": norm_weight_decay},
    ]
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](groups, lr=base_lr, momentum=momentum)


# train.optimizer and train.lr_schedule: the names config validation accepts are these keys (config.registry).
OPTIMIZERS = registry("train.optimizer", {
    "sgd": lambda groups, *, lr, momentum: torch.optim.SGD(groups, lr=lr, momentum=momentum, fused=True),
    "adamw": lambda groups, *, lr, momentum: torch.optim.AdamW(groups, lr=lr, fused=True),  # no momentum
})
LR_SCHEDULES = registry("train.lr_schedule", {  # the decay factor at an iteration, before warm-up
    "multistep": lambda iteration, *, max_iter, steps, gamma: gamma ** sum(iteration >= s for s in steps),
    "cosine": lambda iteration, *, max_iter, steps, gamma: 0.5 * (1 + math.cos(math.pi * min(iteration, max_iter)
                                                                               / max_iter)),
})


def lr_factor(iteration: int, *, schedule: str, max_iter: int, steps: list[int], gamma: float, warmup_iters: int,
              warmup_factor: float) -> float:
    """Learning-rate multiplier at ``iteration``: linear warm-up, then multi-step or cosine decay."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(LR_SCHEDULES)}")
    factor = LR_SCHEDULES[schedule](iteration, max_iter=max_iter, steps=steps, gamma=gamma)
    if iteration < warmup_iters:
        alpha = iteration / warmup_iters
        factor *= warmup_factor * (1 - alpha) + alpha
    return factor


def build_lr_scheduler(optimizer: torch.optim.Optimizer, **schedule) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepped once per iteration; ``schedule`` are :func:`lr_factor`'s keywords."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_factor(it, **schedule))
