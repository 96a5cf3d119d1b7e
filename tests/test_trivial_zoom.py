"""``augment=trivial_zoom``, the bar without any search: TrivialAugment's one uniform box-level op after a
uniform zoom (out, in or none; a uniform level), drawn from the sample's seeded generator; it leaves every
other preset's draws as they were, trains through the train stage as a confirm arm, and is an arm of the
policy comparison (with the published policy at the auto bounds)."""

import collections
import functools
import hashlib
import json
import re
import sys

import numpy as np
import pytest
import torch
import yaml

from benchmarks import policies
from pipelines.build import data as build_data
from pipelines.compose import compose_params
from pipelines.config.load import params_from_dict, read_policy_file
from pipelines.data.autoaug import augment as autoaug
from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.autoaug.zoom import ZOOM_IN_RATIOS, ZOOM_OUT_RATIOS
from pipelines.data.transforms import RandomHorizontalFlip, SampleContext
from pipelines.errors import ConfigError
from pipelines.policy import PUBLISHED_POLICY, ZoomOp, trivial_policy, trivial_zoom_policy
from stages import confirm as confirm_stage

from .confirm_probe import train_in_this_process
from .conftest import REPO
from .test_search_confirm import _with, search_data, tiny  # noqa: F401 (fixtures)


@functools.lru_cache(maxsize=None)
def _composed(name: str) -> str:
    return compose_params(REPO, [f"augment={name}"])


def _preset(name: str) -> dict:
    """params.yaml as ``augment=<name>`` composes it (a fresh copy)."""
    return yaml.safe_load(_composed(name))


def _sample(i: int):
    """A stored sample: a 48x64 image with a small, a medium and a large box (also zoom_out's fillers)."""
    image = torch.from_numpy(np.random.default_rng(100 + i).integers(0, 255, (3, 48, 64), dtype=np.uint8))
    boxes = torch.tensor([[2.0, 3.0, 9.0, 8.0], [10.0, 5.0, 40.0, 30.0], [1.0, 1.0, 62.0, 46.0]]) + i
    return image, {"boxes": boxes, "labels": torch.tensor([1, 2, 3])}


def _draws(transform, max_iter: int, n: int, seed: int = 7):
    """The transform's output on ``n`` samples as the dataset calls it: (pixels, boxes, labels, the generator's
    state after the call) per sample."""
    out = []
    for k in range(n):
        iteration = (k * 37) % max_iter
        image, target = _sample(k % 4)
        ctx = SampleContext(rng=np.random.default_rng((seed, iteration, k)), iteration=iteration, fetch=_sample,
                            num_samples=4, seed=seed)
        pixels, t = transform(image, target, ctx)
        out.append((pixels, t["boxes"], t["labels"], ctx.rng.bit_generator.state["state"]["state"]))
    return out


def test_the_policy_is_the_trivial_one_after_a_zoom_out_in_or_none_at_a_uniform_level():
    policy = trivial_zoom_policy()
    assert policy.subpolicies == trivial_policy().subpolicies and policy.area_ratios == policy.prob_ratios == (1, 1, 1)
    assert policy.zoom_out == policy.zoom_in == ZoomOp(1 / 3, None)
    assert "zoom_out: p=0.33 level=uniform 0..9" in str(policy) and "zoom_in:  p=0.33 level=uniform 0..9" in str(policy)


def test_the_preset_draws_the_zoom_and_its_level_uniformly_from_the_samples_generator(monkeypatch):
    p = params_from_dict(_preset("trivial_zoom"))
    flip, transform = build_data.augmentation(p).transforms
    assert isinstance(flip, RandomHorizontalFlip) and isinstance(transform, ScaleAwareAutoAugment)
    assert transform.policy == trivial_zoom_policy() and transform.ramp(0) == 1.0  # no ramp, as trivial
    assert (transform.filler_pool, transform.filler_pool_iters) == (p.augment.filler_pool, p.augment.filler_pool_iters)
    assert build_data.policy(p) is None  # no genes to log
    zooms = collections.Counter()
    real_in, real_out = autoaug.zoom_in, autoaug.zoom_out

    def zoom_in(*args, ratio, **kwargs):
        zooms["in", ZOOM_IN_RATIOS.index(ratio)] += 1
        return real_in(*args, ratio=ratio, **kwargs)

    def zoom_out(*args, ratio, fillers, **kwargs):
        assert len(fillers) == 3  # drawn from the split, as sa_autoaug's
        zooms["out", ZOOM_OUT_RATIOS.index(ratio)] += 1
        return real_out(*args, ratio=ratio, fillers=fillers, **kwargs)

    monkeypatch.setattr(autoaug, "zoom_in", zoom_in)
    monkeypatch.setattr(autoaug, "zoom_out", zoom_out)
    n = 600
    first = _draws(build_data.augmentation(p), p.train.max_iter, n)
    for kind in ("in", "out"):
        fired = sum(zooms[kind, level] for level in range(10))
        assert 160 <= fired <= 240  # one third of 600 (sd 11.5)
        assert all(5 <= zooms[kind, level] <= 40 for level in range(10))  # each level about a tenth of them
    again = _draws(build_data.augmentation(p), p.train.max_iter, 100)  # reproducible: a fresh transform, same draws
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[3] == b[3] for a, b in zip(first, again))
    other = _draws(build_data.augmentation(p), p.train.max_iter, 20, seed=8)
    assert sum(not torch.equal(a[0], b[0]) for a, b in zip(first, other)) >= 15  # another seed, other draws


# What the other presets drew before trivial_zoom existed (at commit 6b23f2a): the generator's state after each of
# 120 samples and the boxes and labels that came out, hashed. The pixels were checked equal too, but are left out
# here: the color ops' float exp may round differently on another CPU.
BEFORE = {"sa_autoaug": "51065502f2672377", "trivial": "d1e8885917a9918a", "flip": "1116b9d27960380b"}


@pytest.mark.parametrize("preset", sorted(BEFORE))
def test_every_other_preset_draws_as_before(preset):
    p = params_from_dict(_preset(preset))
    digest = hashlib.sha256()
    for _, boxes, labels, state in _draws(build_data.augmentation(p), p.train.max_iter, 120):
        digest.update(json.dumps([state, boxes.tolist(), labels.tolist()]).encode())
    assert digest.hexdigest()[:16] == BEFORE[preset]


@pytest.mark.parametrize("key, value, message", [
    ("filler_pool", KeyError, "augment.filler_pool: missing value (required by augment.name=trivial_zoom)"),
    ("filler_pool_iters", 0, "augment.filler_pool_iters: expected a number of iterations >= 1, got 0"),
    ("box_prob", 2, "augment.box_prob: expected a probability in [0, 1], got 2"),
])
def test_bad_trivial_zoom_settings_are_one_line_errors(key, value, message):
    raw = _preset("trivial_zoom")
    if value is KeyError:
        del raw["augment"][key]
    else:
        raw["augment"][key] = value
    with pytest.raises(ConfigError, match="^params.yaml: " + re.escape(message)):
        params_from_dict(raw, source="params.yaml")


def test_the_confirm_stage_trains_the_trivial_zoom_arm_with_its_preset(search_data, tiny, tmp_path,  # noqa: F811
                                                                          monkeypatch, restore_logging):
    """The default ``confirm.arms`` names trivial_zoom: the arm is no longer skipped, the train stage trains it
    with the preset (``python -m pipelines.launch ... stages.train``, run here in this process), and as the
    only arm it wins, so the policy file holds the preset, which ``augment=searched`` then trains."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    commands = []

    train_in_this_process(monkeypatch, commands)
    assert "trivial_zoom" in yaml.safe_load((REPO / "params.yaml").read_text())["confirm"]["arms"]
    raw = _with(tiny, confirm__top_k=0, confirm__seeds=1, confirm__arms=["trivial_zoom"], model__precision="fp32",
                train__max_iter=1, train__warmup_iters=0)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    (tmp_path / "ranked.json").write_text("[]")
    out = {name: tmp_path / name for name in ("confirm", "policy.json", "metrics.json")}
    confirm_stage.main(["--params", str(params), "--cache", str(search_data / "cache"), "--prepared",
                        str(search_data / "prepared"), "--ranked", str(tmp_path / "ranked.json"), "--search-run",
                        str(tmp_path / "no_run.json"), "--out", str(out["confirm"]), "--policy",
                        str(out["policy.json"]), "--metrics", str(out["metrics.json"])])
    assert len(commands) == 1 and commands[0][:3] == [sys.executable, "-m", "pipelines.launch"]
    trained = yaml.safe_load((out["confirm"] / "trivial_zoom-s0" / "params.yaml").read_text())
    assert trained["augment"] == _preset("trivial_zoom")["augment"]
    assert (out["confirm"] / "trivial_zoom-s0" / "model_final.pth").is_file()
    figures = json.loads(out["metrics.json"].read_text())
    assert figures["winner"] == "trivial_zoom" and set(figures["arms"]) == {"trivial_zoom"}
    policy = json.loads(out["policy.json"].read_text())
    assert policy["arm"] == "trivial_zoom" and policy["augment"] == trained["augment"]
    searched = _with(tiny, augment={**_preset("searched")["augment"], "policy_file": str(out["policy.json"])})
    assert read_policy_file(params_from_dict(searched)).augment.name == "trivial_zoom"


def test_the_policy_comparison_takes_trivial_zoom_and_the_published_policy_at_the_auto_bounds(tmp_path, monkeypatch):
    """``python -m benchmarks.policies --augment trivial_zoom sa_autoaug-auto``: what each arm trains (the
    trainings are not run), kept under its name; run again, nothing is trained."""
    trained = []

    def train_and_evaluate(raw, **_):
        trained.append(raw)
        return {"metrics": {k: 0.5 for k in policies.METRICS}, "seconds": {"train": 1.0, "evaluate": 1.0}}

    monkeypatch.setattr(policies, "train_and_evaluate", train_and_evaluate)
    argv = ["--augment", "trivial_zoom", "sa_autoaug-auto", "--seeds", "3", "--runs", str(tmp_path), "--json"]
    policies.main(argv)
    zoom, auto = trained
    assert zoom["augment"] == _preset("trivial_zoom")["augment"] and zoom["seed"] == 3
    assert auto["augment"]["name"] == "sa_autoaug" and auto["augment"]["policy"] == list(PUBLISHED_POLICY)
    assert auto["augment"]["scale_splits"] == [210, 1049, 5243]  # (2048, 10240, 51200) x (256 / 800)^2
    records = {r["name"]: r for r in policies.kept(tmp_path)}
    assert records["sa_autoaug-auto"]["preset"] == "sa_autoaug"
    assert records["sa_autoaug-auto"]["scale_splits"] == [210, 1049, 5243]
    assert records["trivial_zoom"]["scale_splits"] == [2048, 10240, 51200]
    policies.main(argv)
    assert len(trained) == 2  # kept: not run again
