"""``evaluate.bn_reestimate``: the BatchNorm statistics re-estimated at the test sizes on train images
(:mod:`pipelines.bn_stats`, called by the evaluate stage): they change towards the test inputs' statistics,
the same on every rerun, nothing else in the model changes; off (null), the model is left bit for bit as
it was and nothing is read; bad values are one line naming the parameter."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from .conftest import REPO, set_dotted
from pipelines import bn_stats
from pipelines.config.load import params_from_dict
from pipelines.data.dataset import DetectionDataset
from pipelines.data.transforms import TestTimeAugmentation as Views
from pipelines.data.transforms import build_transforms
from pipelines.errors import ConfigError
from pipelines.model import build_detector
from stages.evaluate import bn_reestimated

CPU = torch.device("cpu")


def _detector():
    torch.manual_seed(0)
    return build_detector(num_classes=5, backbone="resnet10", norm="batchnorm", fpn_channels=32, head_convs=1).eval()


def _params(**evaluate):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, value in evaluate.items():
        set_dotted(raw, f"evaluate.{key}", value)
    set_dotted(raw, "model.min_size_test", 128)
    set_dotted(raw, "model.max_size_test", 192)
    set_dotted(raw, "evaluate.tta_scales", [160])
    set_dotted(raw, "evaluate.tta_max_size", 224)
    return params_from_dict(raw, source="params.yaml")


def _statistics(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("running_mean", "running_var"))}


def test_the_statistics_change_the_same_way_on_every_rerun_and_nothing_else_does(tiny_cache):
    dataset = DetectionDataset(tiny_cache, transforms=build_transforms(min_sizes=[128], max_size=192), seed=0)
    tta = Views((160,), 224, True, "decoded")
    runs = []
    for _ in range(2):
        model = _detector()
        before = copy.deepcopy(model.state_dict())
        momenta = [layer.momentum for layer in bn_stats.batchnorm_layers(model)]
        batches = bn_stats.reestimate(model, dataset, images=6, seed=0, min_size=128, max_size=192, batch_size=4,
                                      size_divisibility=32, tta=tta, device=CPU)
        assert batches == 2 * 4  # 2 batches of 6 images, 4 views each (test size, flip, 160, its flip)
        assert not model.training and [layer.momentum for layer in bn_stats.batchnorm_layers(model)] == momenta
        after = model.state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and all(k.endswith(("running_mean", "running_var")) for k in changed)
        assert {k.rsplit(".", 1)[0] for k in changed} == {n for n, m in model.named_modules()
                                                          if isinstance(m, torch.nn.BatchNorm2d)}
        runs.append(_statistics(model))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])  # bit for bit
    other = _detector()
    bn_stats.reestimate(other, dataset, images=6, seed=1, min_size=128, max_size=192, batch_size=4,
                        size_divisibility=32, tta=tta, device=CPU)
    assert not torch.equal(_statistics(other)["backbone.body.bn1.running_mean"], runs[0]["backbone.body.bn1.running_mean"])


def test_the_statistics_are_those_of_the_test_size_inputs(tiny_cache):
    """The stem's BatchNorm sees conv1 of the images: with one image per batch and no padding, its new mean is
    the mean over the images of conv1's per-image channel means (a fresh model's is 0, its variance 1)."""
    dataset = DetectionDataset(tiny_cache, transforms=build_transforms(min_sizes=[128], max_size=192), seed=0)
    model = _detector()
    bn_stats.reestimate(model, dataset, images=5, seed=0, min_size=128, max_size=192, batch_size=1,
                        size_divisibility=1, tta=None, device=CPU)
    chosen = bn_stats.chosen_images(5, len(dataset), seed=0)
    with torch.no_grad():
        stem = [model.backbone.body.conv1(model._normalised(dataset[int(i)][0][None])) for i in chosen]
    means = torch.stack([x.mean((0, 2, 3)) for x in stem]).mean(0)
    variances = torch.stack([x.var((0, 2, 3)) for x in stem]).mean(0)
    torch.testing.assert_close(model.backbone.body.bn1.running_mean, means, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.backbone.body.bn1.running_var, variances, rtol=1e-4, atol=1e-5)
    assert (variances - 1).abs().min() > 0.5  # far from a fresh layer's 1: the test inputs' own statistics


def test_off_leaves_the_model_bit_for_bit_and_reads_nothing(tmp_path):
    model = _detector()
    before = copy.deepcopy(model.state_dict())
    bn_reestimated(_params(bn_reestimate=None), model, tmp_path / "no-such-cache", device=CPU)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_stage_re_estimates_on_the_train_split_of_the_cache(tiny_cache):
    model = _detector()
    before = _statistics(model)
    bn_reestimated(_params(bn_reestimate=4, ims_per_batch=2), model, tiny_cache.path.parent, device=CPU)
    assert not torch.equal(before["backbone.body.bn1.running_mean"], _statistics(model)["backbone.body.bn1.running_mean"])


def test_more_images_than_the_split_or_no_batchnorm_is_one_line(tiny_cache):
    dataset = DetectionDataset(tiny_cache, transforms=build_transforms(min_sizes=[128], max_size=192), seed=0)
    with pytest.raises(ConfigError, match=rf"^evaluate\.bn_reestimate: 99 train images asked for, the train split "
                                          rf"holds {len(dataset)}$"):
        bn_stats.reestimate(_detector(), dataset, images=99, seed=0, min_size=128, max_size=192, batch_size=4,
                            size_divisibility=32, tta=None, device=CPU)
    torch.manual_seed(0)
    grouped = build_detector(num_classes=5, backbone="resnet10", norm="groupnorm", fpn_channels=32, head_convs=1)
    with pytest.raises(ConfigError, match=r"^evaluate\.bn_reestimate: the model has no BatchNorm layer"):
        bn_stats.reestimate(grouped, dataset, images=2, seed=0, min_size=128, max_size=192, batch_size=4,
                            size_divisibility=32, tta=None, device=CPU)
