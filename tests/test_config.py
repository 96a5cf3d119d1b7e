import copy
import subprocess
import sys

import pytest
import yaml

from pipelines.compose import compose_params
from pipelines.config.backbones import weights_name
from pipelines.config.load import load_params, params_from_dict, to_flat_dict, training_params
from pipelines.errors import ConfigError

from .conftest import REPO, set_dotted


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
    set_dotted(raw, dotted, value)
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
        ("evaluate.nms_thresh", 0, "evaluate.nms_thresh: expected null (model.nms_thresh) or a value in (0, 1], got 0"),
        ("evaluate.merge", "soft", "evaluate.merge: expected one of nms, vote, wbf, got 'soft'"),
        ("evaluate.bn_reestimate", 0, "evaluate.bn_reestimate: expected null (off) or a number of train images >= 1, "
                                      "got 0"),
        ("evaluate.bn_reestimate", 2.5, "evaluate.bn_reestimate"),
        ("evaluate.vote_thresh", 1.5, "evaluate.vote_thresh: expected a value in (0, 1], got 1.5"),
        ("augment.scale_splits", [2048, 1024, 51200], "augment.scale_splits: expected three increasing positive areas"),
        ("augment.box_prob", 1.5, "augment.box_prob: expected a probability in [0, 1], got 1.5"),
        ("augment.filler_cache_mb", -1, "augment.filler_cache_mb: expected a size in MB >= 0, got -1"),
        ("augment.filler_pool", -1, "augment.filler_pool: expected a number of images >= 0 (0: the whole split), got -1"),
        ("augment.filler_pool_iters", 0, "augment.filler_pool_iters: expected a number of iterations >= 1, got 0"),
        ("augment.n_subpolicies", 0, "augment.n_subpolicies: expected a positive integer, got 0"),
        ("augment.policy", [10] + [0] * 39, "augment.policy[0]: expected an integer 0..9, got 10"),
        ("augment.policy", [0] * 39, "augment.policy: expected 40 genes for 5 sub-policies"),
        ("model.precision", "fp8", "model.precision: expected one of auto, bf16, fp16, fp32, got 'fp8'"),
        ("model.channels_last", "yes", "model.channels_last: expected auto, true or false, got 'yes'"),
        ("model.cls_loss", "dfl", "model.cls_loss: expected one of focal, qfl, got 'dfl'"),
        ("model.assigner", "paa", "model.assigner: expected one of fcos, atss, got 'paa'"),
        ("augment.off_tail", 1.0, "augment.off_tail: expected a fraction of train.max_iter in [0, 1), got 1.0"),
        ("loader.padded_shape_grouping", "maybe", "loader.padded_shape_grouping: expected true or false, got 'maybe'"),
        ("launch.nodes", 0, "launch.nodes: expected at least 1 node, got 0"),
        ("launch.max_restarts", -1, "launch.max_restarts: expected an integer >= 0, got -1"),
        ("launch.port", 1, "launch.port: unknown key (expected one of: nodes, rdzv_endpoint, rdzv_id, max_restarts)"),
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


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model.trainable_layers": 6}, "model.trainable_layers: expected 0 to 5 (ResNet stages trained, from the top; "
                                        "5: all), got 6"),
        ({"model.trainable_layers": -1}, "model.trainable_layers: expected 0 to 5"),
        ({"model.trainable_layers": 3}, "model.trainable_layers: expected 5 when model.backbone_weights is null "
                                        "(frozen stages would keep their random weights), got 3"),
        ({"model.norm": "frozen_batchnorm"}, "model.norm: expected batchnorm or groupnorm when model.backbone_weights "
                                             "is null (frozen_batchnorm from scratch keeps mean 0, variance 1: no "
                                             "normalisation), got 'frozen_batchnorm'"),
        ({"model.backbone_weights": ""}, "model.backbone_weights: expected null, a torchvision weights name or the "
                                         "path of a state-dict file, got ''"),
        ({"model.backbone_weights": "w.pth "}, "model.backbone_weights: expected null, a torchvision weights name"),
        ({"model.backbone": "resnet18", "model.backbone_weights": "ResNet50_Weights.IMAGENET1K_V1"},
         "model.backbone_weights: expected weights of model.backbone (resnet18): ResNet18_Weights.IMAGENET1K_V1 or "
         "IMAGENET1K_V1, got 'ResNet50_Weights.IMAGENET1K_V1'"),
        ({"model.backbone": "resnet10", "model.backbone_weights": "IMAGENET1K_V1"},
         "model.backbone_weights: expected null or a state-dict file with model.backbone resnet10 (torchvision "
         "publishes no ResNet-10 weights), got 'IMAGENET1K_V1'"),
        ({"model.backbone": "resnet18", "model.backbone_weights": "IMAGENET1K_V1", "model.norm": "groupnorm"},
         "model.norm: expected batchnorm or frozen_batchnorm with torchvision weights (model.backbone_weights = "
         "'IMAGENET1K_V1' holds BatchNorm layers), got 'groupnorm'"),
        ({"model.backbone_weights": KeyError}, "model.backbone_weights: missing value"),
        ({"model.trainable_layers": KeyError}, "model.trainable_layers: missing value"),
    ],
)
def test_bad_backbone_settings_stop_with_one_line(raw_params, changes, message):
    raw = raw_params
    for key, value in changes.items():
        raw = _broken(raw, key, value)
    with pytest.raises(ConfigError) as err:
        params_from_dict(raw, source="params.yaml")
    assert str(err.value).startswith(f"params.yaml: {message}") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "changes",
    [
        # frozen BatchNorm and frozen stages with pretrained weights, named or from a file (read when building)
        {"model.backbone": "resnet18", "model.backbone_weights": "IMAGENET1K_V1", "model.norm": "frozen_batchnorm",
         "model.trainable_layers": 0},
        {"model.backbone": "resnet18", "model.backbone_weights": "ResNet18_Weights.DEFAULT", "model.trainable_layers": 5},
        {"model.backbone_weights": "weights/r18.pth", "model.norm": "groupnorm", "model.trainable_layers": 3},
        {"model.backbone_weights": "./IMAGENET1K_V1"},
    ],
)
def test_backbone_settings_that_validate(raw_params, changes):
    raw = raw_params
    for key, value in changes.items():
        raw = _broken(raw, key, value)
    params_from_dict(raw)


def test_weights_names_and_paths():
    assert weights_name("IMAGENET1K_V1") == (None, "IMAGENET1K_V1")
    assert weights_name("ResNet50_Weights.IMAGENET1K_V2") == ("ResNet50_Weights", "IMAGENET1K_V2")
    assert weights_name("DEFAULT") == (None, "DEFAULT")
    for path in ("r50.pth", "./IMAGENET1K_V1", "/data/weights/ResNet50_Weights.IMAGENET1K_V1.pth", "imagenet1k_v1"):
        assert weights_name(path) is None


def test_pretrained_r50_preset_is_the_published_setting():
    composed = yaml.safe_load(compose_params(REPO, ["model=fcos_r50_pretrained", "solver=fcos_1x"]))
    m = params_from_dict(composed).model
    assert (m.backbone, m.norm, m.trainable_layers) == ("resnet50", "frozen_batchnorm", 3)
    assert m.backbone_weights == "ResNet50_Weights.IMAGENET1K_V1"
    assert (m.fpn_channels, m.head_convs, m.min_size_train, m.max_size_train) == (256, 4, [800], 1333)
    default = load_params(REPO / "params.yaml").model
    assert (default.backbone_weights, default.trainable_layers) == (None, 5)


def test_backbone_weights_change_the_training_params():
    a = params_from_dict(yaml.safe_load(compose_params(REPO, ["model=fcos_small"])))
    b = params_from_dict(yaml.safe_load(compose_params(REPO, ["model=fcos_small", "model.backbone_weights=IMAGENET1K_V1"])))
    diff = {k for k, v in training_params(a).items() if training_params(b)[k] != v}
    assert diff == {"model.backbone_weights"}


def test_launch_section_for_several_nodes(raw_params):
    raw = copy.deepcopy(raw_params)
    raw["launch"].update(nodes=2, rdzv_endpoint="node0.example:29400")
    p = params_from_dict(raw)
    assert (p.launch.nodes, p.launch.rdzv_endpoint) == (2, "node0.example:29400")
    assert not any(key.startswith("launch.") for key in training_params(p))  # not in the resume fingerprint
    for endpoint in ("node0.example", "node0.example:0", ":29400"):
        raw["launch"]["rdzv_endpoint"] = endpoint
        with pytest.raises(ConfigError, match="launch.rdzv_endpoint: expected HOST:PORT"):
            params_from_dict(raw)
    raw["launch"]["rdzv_endpoint"] = "node0.example:29400"
    raw["train"]["ims_per_batch"] = 6  # 2 nodes x 2 processes
    with pytest.raises(ConfigError, match=r"train.ims_per_batch: expected a multiple of the number of processes "
                                          r"\(launch.nodes x train.nproc = 4\), got 6"):
        params_from_dict(raw)


def test_sync_batchnorm_needs_trainable_batchnorm(raw_params):
    raw = _broken(raw_params, "model.sync_batchnorm", True)
    assert params_from_dict(raw).model.sync_batchnorm
    raw["model"]["norm"] = "groupnorm"
    with pytest.raises(ConfigError, match="model.sync_batchnorm: expected false with model.norm 'groupnorm'"):
        params_from_dict(raw)


def test_bn_reestimate_needs_batchnorm_layers(raw_params):
    """Re-estimating BatchNorm statistics with a norm that keeps none is refused in one line naming the key."""
    raw = _broken(_broken(raw_params, "model.norm", "groupnorm"), "evaluate.bn_reestimate", 16)
    with pytest.raises(ConfigError, match=r"^params\.yaml: evaluate\.bn_reestimate: expected null with model\.norm "
                                          r"groupnorm \(only batchnorm layers keep statistics to re-estimate\), got 16$"):
        params_from_dict(raw, source="params.yaml")
    params_from_dict(_broken(raw_params, "evaluate.bn_reestimate", 16), source="params.yaml")  # batchnorm: fine
