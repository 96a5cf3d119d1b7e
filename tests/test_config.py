import copy
import subprocess
import sys

import pytest
import yaml

from pipelines.compose import compose_params
from pipelines.config import load_params, params_from_dict, to_flat_dict
from pipelines.errors import ConfigError

from .conftest import REPO


@pytest.fixture(scope="module")
def raw_params() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_params_yaml_is_the_composition_of_conf():
    assert (REPO / "params.yaml").read_text() == compose_params(REPO)


def test_model_group_override_composes_the_r50_setting():
    composed = yaml.safe_load(compose_params(REPO, ["model=fcos_r50", "solver=fcos_1x"]))
    assert composed["model"]["backbone"] == "resnet50"
    assert composed["model"]["min_size_train"] == [800] and composed["model"]["max_size_train"] == 1333
    assert composed["train"]["optimizer"] == "sgd" and composed["train"]["steps"] == [60000, 80000]
    params_from_dict(composed)  # the composition is valid


def test_loads_the_committed_params():
    p = load_params(REPO / "params.yaml")
    assert p.dataset.name == "synthetic"
    assert p.train.ims_per_batch % p.train.nproc == 0
    flat = to_flat_dict(p)
    assert flat["train.base_lr"] == p.train.base_lr
    assert flat["dataset.seed"] == p.dataset.seed
    assert flat["model.min_size_train"] == p.model.min_size_train


def _broken(raw: dict, dotted: str, value) -> dict:
    raw = copy.deepcopy(raw)
    *parents, leaf = dotted.split(".")
    node = raw
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[leaf]
    else:
        node[leaf] = value
    return raw


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.lr", 0.1, "train.lr: unknown key"),
        ("train.base_lr", -0.01, "train.base_lr: expected a learning rate > 0, got -0.01"),
        ("train.base_lr", "fast", "train.base_lr"),
        ("train.max_iter", 1.5, "train.max_iter"),
        ("train.ims_per_batch", 7, "train.ims_per_batch: expected a multiple of the number of processes (train.nproc = 2), got 7"),
        ("train.steps", [500, 100], "train.steps"),
        ("train.optimizer", "lamb", "train.optimizer: expected one of sgd, adamw, got 'lamb'"),
        ("model.fpn_channels", 100, "model.fpn_channels"),
        ("model.max_size_train", 100, "model.max_size_train"),
        ("augment.hflip_prob", 1.5, "augment.hflip_prob"),
        ("dataset.name", "imagenet", "dataset.name: expected one of synthetic, coco, got 'imagenet'"),
        ("dataset.train_size", KeyError, "dataset.train_size: missing value"),
        ("dataset.colour", "red", "dataset.colour: unknown key"),
        ("loader.num_workers", -1, "loader.num_workers"),
        ("evaluate.ims_per_batch", 3, "evaluate.ims_per_batch"),
        ("augment.scale_splits", [2048, 1024, 51200], "augment.scale_splits: expected three increasing positive areas"),
        ("augment.box_prob", 1.5, "augment.box_prob: expected a probability in [0, 1], got 1.5"),
        ("augment.filler_cache_mb", -1, "augment.filler_cache_mb: expected a size in MB >= 0, got -1"),
        ("augment.n_subpolicies", 0, "augment.n_subpolicies: expected a positive integer, got 0"),
        ("augment.policy", [10] + [0] * 39, "augment.policy[0]: expected an integer 0..9, got 10"),
        ("augment.policy", [0] * 39, "augment.policy: expected 40 genes for 5 sub-policies"),
    ],
)
def test_bad_values_stop_with_one_line_naming_the_key(raw_params, key, value, message):
    with pytest.raises(ConfigError) as err:
        params_from_dict(_broken(raw_params, key, value), source="params.yaml")
    text = str(err.value)
    assert message in text
    assert text.startswith("params.yaml: ")
    assert "\n" not in text


def test_batch_must_divide_across_running_processes(raw_params):
    raw = _broken(raw_params, "train.nproc", 1)
    raw["train"]["ims_per_batch"] = 6
    raw["evaluate"]["ims_per_batch"] = 6
    params_from_dict(raw)
    with pytest.raises(ConfigError, match="running processes = 4"):
        params_from_dict(raw, world_size=4)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "params.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_params(bad)


def test_sa_autoaug_preset_composes_and_requires_its_settings():
    composed = yaml.safe_load(compose_params(REPO, ["augment=sa_autoaug"]))
    assert composed["augment"]["name"] == "sa_autoaug" and len(composed["augment"]["policy"]) == 40
    assert params_from_dict(composed).augment.policy == composed["augment"]["policy"]
    del composed["augment"]["box_prob"]
    with pytest.raises(ConfigError, match="augment.box_prob: missing value"):
        params_from_dict(composed)



def test_loading_and_validating_params_imports_neither_torch_nor_torchvision():
    """``python -m pipelines.config`` runs before torchrun and in every stage: it must stay light."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipelines.config", "--params",
                           str(REPO / "params.yaml")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "pipelines.policy" in imported and "omegaconf" in imported  # the measurement works
    heavy = sorted(name for name in imported if name.split(".")[0] in ("torch", "torchvision"))
    assert not heavy, f"validating params imports {heavy[:5]}"


@pytest.mark.parametrize("overrides", [["solver=smoke"], ["profile=ci"], ["profile=ci", "augment.box_prob=0.5"],
                                       ["dataset=coco", "solver=smoke"]])
def test_smoke_solver_and_ci_profile_compose_valid_params(overrides):
    composed = yaml.safe_load(compose_params(REPO, overrides))
    p = params_from_dict(composed)
    assert p.train.warmup_iters < p.train.max_iter <= 20 and p.train.ims_per_batch == 4
    assert {"train_images", "train_annotations", "val_images", "val_annotations"} <= set(composed["dataset"])
    assert "source" not in composed["dataset"]
