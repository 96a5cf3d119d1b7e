import math

import pytest
import torch

from pipelines.solver import build_lr_scheduler, build_optimizer, lr_factor


def test_multistep_with_linear_warmup():
    kw = dict(schedule="multistep", max_iter=100, steps=[60, 80], gamma=0.1, warmup_iters=10, warmup_factor=0.1)
    assert lr_factor(0, **kw) == pytest.approx(0.1)
    assert lr_factor(5, **kw) == pytest.approx(0.55)
    assert lr_factor(10, **kw) == 1.0
    assert lr_factor(59, **kw) == 1.0
    assert lr_factor(60, **kw) == pytest.approx(0.1)
    assert lr_factor(80, **kw) == pytest.approx(0.01)


def test_cosine_decays_to_zero():
    kw = dict(schedule="cosine", max_iter=100, steps=[], gamma=0.1, warmup_iters=0, warmup_factor=1.0)
    assert lr_factor(0, **kw) == 1.0
    assert lr_factor(50, **kw) == pytest.approx(0.5)
    assert lr_factor(100, **kw) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(25, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_no_weight_decay_on_norms_and_biases_and_scheduler_steps():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 4, 1, bias=True))
    opt = build_optimizer(model, name="sgd", base_lr=0.1, weight_decay=1e-4, norm_weight_decay=0.0)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 1e-4 and len(decay["params"]) == 2  # the two conv weights
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 4  # 2 biases + BN weight and bias
    sched = build_lr_scheduler(opt, schedule="multistep", max_iter=10, steps=[5], gamma=0.5, warmup_iters=0,
                               warmup_factor=1.0)
    for _ in range(5):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert isinstance(build_optimizer(model, name="adamw", base_lr=1e-3), torch.optim.AdamW)
