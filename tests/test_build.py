"""The one edge from params to objects: each builder passes the params it is given, and only those."""

import dataclasses
from urllib.error import URLError

import pytest
import torch
import torchvision
import yaml
from torchvision.models._api import WeightsEnum

from pipelines import checkpoint
from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.build import train as build_train
from pipelines.compose import compose_params
from pipelines.config.load import load_params, params_from_dict, training_params
from pipelines.config.schema import Params
from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.dataset import DetectionDataset
from pipelines.data import transforms
from pipelines.data.transforms import Compose, RandomHorizontalFlip, ResizeShorterSide
from pipelines.errors import ConfigError
from pipelines.hardware import Compute
from pipelines.policy import decode_policy

from .conftest import REPO

CPU = torch.device("cpu")
FP32 = Compute("fp32", False, "chosen by the test")


@pytest.fixture(scope="module")
def params() -> Params:
    return load_params(REPO / "params.yaml")


def _with(p: Params, section: str, **values) -> Params:
    return dataclasses.replace(p, **{section: dataclasses.replace(getattr(p, section), **values)})


def test_sa_autoaug_preset_is_the_flip_then_the_policy_with_the_params_settings(params):
    augment = params.augment
    assert augment.name == "sa_autoaug"
    policy = build_data.policy(params)
    assert policy == decode_policy(augment.policy, augment.n_subpolicies)
    for augmentation in (build_data.augmentation(params), build_data.augmentation(params, policy)):
        flip, autoaug = augmentation.transforms
        assert isinstance(flip, RandomHorizontalFlip) and flip.prob == augment.hflip_prob
        assert isinstance(autoaug, ScaleAwareAutoAugment) and autoaug.policy == policy
        assert autoaug.scale_splits == tuple(augment.scale_splits) and autoaug.box_prob == augment.box_prob
        assert autoaug.max_iter == params.train.max_iter and autoaug.filler_cache_mb == augment.filler_cache_mb
        assert (autoaug.filler_pool, autoaug.filler_pool_iters) == (augment.filler_pool, augment.filler_pool_iters)
    assert (augment.filler_pool, augment.filler_pool_iters) == (512, 1000)


@pytest.mark.parametrize("preset", ["none", "flip", "sa_autoaug"])
def test_a_given_policy_without_ramp_is_the_searchs_augmentation_whatever_the_preset(params, preset):
    """The search's candidates: the flip, then Scale-aware AutoAugment with the candidate's policy at full
    strength from the first iteration, with the preset's settings."""
    p = _with(params, "augment", name=preset)
    genes = list(reversed(params.augment.policy))
    candidate = decode_policy(genes, p.augment.n_subpolicies)
    flip, autoaug = build_data.augmentation(p, candidate, ramp=False).transforms
    assert isinstance(flip, RandomHorizontalFlip) and flip.prob == p.augment.hflip_prob
    assert autoaug.policy == candidate and autoaug.max_iter == 0 and autoaug.ramp(0) == 1.0
    assert (autoaug.scale_splits, autoaug.box_prob, autoaug.filler_cache_mb) == (
        tuple(p.augment.scale_splits), p.augment.box_prob, p.augment.filler_cache_mb)


@pytest.mark.parametrize("preset", ["none", "flip"])
def test_other_presets(preset):
    p = params_from_dict(yaml.safe_load(compose_params(REPO, [f"augment={preset}"])))
    augmentation = build_data.augmentation(p)
    assert build_data.policy(p) is None
    if preset == "none":
        assert augmentation is None
    else:
        assert isinstance(augmentation, RandomHorizontalFlip) and augmentation.prob == p.augment.hflip_prob


def test_transforms_resize_to_the_train_or_test_sizes(params):
    model = params.model
    train = build_data.train_transforms(params, build_data.augmentation(params))
    assert isinstance(train, Compose) and len(train.transforms) == 2
    resize = train.transforms[0]
    assert isinstance(resize, ResizeShorterSide) and (resize.min_sizes, resize.max_size) == (model.min_size_train,
                                                                                              model.max_size_train)
    resized = build_data.train_transforms(params, None)
    assert len(resized.transforms) == 1 and resized.transforms[0].min_sizes == model.min_size_train
    test = build_data.test_transforms(params).transforms
    assert len(test) == 1 and (test[0].min_sizes, test[0].max_size) == ([model.min_size_test], model.max_size_test)


def test_test_time_augmentation_only_when_asked(params):
    assert build_data.test_time_augmentation(_with(params, "evaluate", tta=False)) is None
    tta = build_data.test_time_augmentation(_with(params, "evaluate", tta=True, tta_scales=[200, 300], tta_flip=False))
    assert tta == transforms.TestTimeAugmentation(scales=(200, 300), max_size=params.evaluate.tta_max_size, flip=False,
                                                  source=params.evaluate.tta_source)


def test_detector_follows_the_model_section(params):
    p = _with(params, "model", fpn_channels=64, head_convs=1, precision="fp32", channels_last=False, score_thresh=0.2,
              nms_thresh=0.5, detections_per_img=7, topk_candidates=50)
    model = build_model.detector(p, num_classes=3, compute=build_model.compute(p, CPU))
    assert model.backbone.out_channels == 64 and model.autocast_dtype is None and not model.channels_last
    assert len([m for m in model.head.classification_head.conv if isinstance(m, torch.nn.Conv2d)]) == 1
    assert model.head.classification_head.num_classes == 3
    assert (model.score_thresh, model.nms_thresh, model.detections_per_img, model.topk_candidates) == (0.2, 0.5, 7, 50)
    bf16 = build_model.detector(params, num_classes=3, compute=Compute("bf16", True, "chosen by the test"))
    assert bf16.autocast_dtype == torch.bfloat16 and bf16.channels_last
    assert (model.merge, model.vote_thresh) == ("nms", 0.8)  # torchvision's post-processing until evaluation says
    build_model.use_evaluate(model, _with(p, "evaluate", nms_thresh=None, merge="nms", vote_thresh=0.8))
    assert (model.nms_thresh, model.merge) == (0.5, "nms")  # evaluate.nms_thresh null: model.nms_thresh
    build_model.use_evaluate(model, _with(p, "evaluate", nms_thresh=0.3, merge="vote", vote_thresh=0.9))
    assert (model.nms_thresh, model.merge, model.vote_thresh) == (0.3, "vote", 0.9)


def test_compute_resolves_auto_from_the_hardware_and_keeps_explicit_values(params, monkeypatch):
    from pipelines import hardware

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    for native, expected in (("avx2_vnni_2", ("bf16", True)), (None, ("fp32", False))):
        monkeypatch.setattr(hardware, "native_bf16_cpu", lambda native=native: native)
        resolved = build_model.compute(_with(params, "model", precision="auto", channels_last="auto"), CPU)
        assert (resolved.precision, resolved.channels_last) == expected and resolved.warning is None
        assert resolved.reason.startswith("auto: ")
    explicit = build_model.compute(_with(params, "model", precision="bf16", channels_last=False), CPU)
    assert (explicit.precision, explicit.channels_last) == ("bf16", False)
    assert "bf16 is emulated here" in explicit.warning and "18x slower than fp32 on an AVX2 CPU" in explicit.warning


def test_loaders_split_the_global_batch_across_processes(params, tiny_cache):
    p = _with(_with(params, "train", ims_per_batch=4, max_iter=5), "loader", num_workers=0)
    p = _with(p, "evaluate", ims_per_batch=4)
    dataset = DetectionDataset(tiny_cache, transforms=build_data.train_transforms(p, None), seed=p.seed)
    batches = list(build_train.train_loader(p, dataset, rank=1, world_size=2, device=CPU, start_iter=2))
    assert len(batches) == 3 and all(len(b.indices) <= 2 for b in batches)
    shards = [list(build_data.test_loader(p, dataset, rank=r, world_size=2)) for r in range(2)]
    assert all(len(b.indices) <= 2 for shard in shards for b in shard)
    assert sorted(i for shard in shards for b in shard for i in b.indices) == list(range(len(dataset)))


def test_a_fine_tune_reads_its_whole_schedule_in_process_in_its_candidates_order(params, tiny_cache):
    p = _with(_with(params, "train", ims_per_batch=2, max_iter=4, stop_at=0.5), "loader", num_workers=2)
    dataset = DetectionDataset(tiny_cache, transforms=build_data.train_transforms(p, None), seed=p.seed)
    loader = build_train.fine_tune_loader(p, dataset, seed=7)
    assert loader.num_workers == 0 and not loader.pin_memory
    batches = [b.indices for b in loader]
    # train.max_iter, whatever train.stop_at says; a padded-shape group's last batch of an epoch may be partial
    assert len(batches) == 4 and all(1 <= len(b) <= 2 for b in batches)
    by_orientation = _with(p, "loader", padded_shape_grouping=False)
    assert all(len(b.indices) == 2 for b in build_train.fine_tune_loader(by_orientation, dataset, seed=7))
    assert [b.indices for b in build_train.fine_tune_loader(p, dataset, seed=7)] == batches
    assert [b.indices for b in build_train.fine_tune_loader(p, dataset, seed=8)] != batches


def test_the_preview_shows_the_augmented_datasets_images_resized_only_then_augmented(params, tiny_cache, tmp_path):
    p = _with(params, "model", min_size_train=[96], max_size_train=128)
    flip = RandomHorizontalFlip(1.0)
    augmented = DetectionDataset(tiny_cache, transforms=build_data.train_transforms(p, flip), seed=p.seed)
    path = build_data.preview(p, augmented, count=2, iteration=3, path=tmp_path / "preview.png")
    grid = torchvision.io.decode_png(torchvision.io.read_file(str(path)))
    assert grid.shape[0] == 3 and 2 * 96 <= grid.shape[1] <= 2 * 128 + 3 * 4


def test_optimizer_and_schedule_follow_the_train_section(params):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    p = _with(params, "train", optimizer="sgd", base_lr=0.5, momentum=0.8, weight_decay=0.01, norm_weight_decay=0.0,
              warmup_iters=10, warmup_factor=0.2)
    optimizer = build_train.optimizer(p, model)
    assert isinstance(optimizer, torch.optim.SGD)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert optimizer.param_groups[0]["momentum"] == 0.8
    build_train.scheduler(p, optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 0.2)  # the warm-up factor at iteration 0
    assert isinstance(build_train.optimizer(params, model), torch.optim.AdamW)


def _r18_file(tmp_path, state=None):
    path = tmp_path / "r18.pth"
    torch.save(torchvision.models.resnet18().state_dict() if state is None else state, path)
    return path


def _small(params, **values):
    return _with(params, "model", **{"backbone": "resnet18", "fpn_channels": 32, "head_convs": 1, **values})


def test_detector_loads_backbone_weights_from_a_file_and_freezes_the_stages(params, tmp_path):
    state = {k: v + 1 if v.is_floating_point() else v for k, v in torchvision.models.resnet18().state_dict().items()}
    path = _r18_file(tmp_path, state)
    p = _small(params, backbone_weights=str(path), norm="frozen_batchnorm", trainable_layers=3)
    body = build_model.detector(p, num_classes=3, compute=FP32).backbone.body
    assert all(torch.equal(v, state[k]) for k, v in body.state_dict().items())
    assert {n for n, x in body.named_parameters() if not x.requires_grad} == \
        {n for n, _ in body.named_parameters() if n.startswith(("conv1.", "layer1."))}
    # A trained model's state dict replaces the weights anyway: nothing needs to be read.
    assert not torch.equal(build_model.detector(p, num_classes=3, compute=FP32, pretrained=False).backbone.body.conv1.weight,
                           state["conv1.weight"])


@pytest.mark.parametrize("value", ["IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1", "DEFAULT"])
def test_detector_resolves_torchvision_weights_names(params, monkeypatch, value):
    state = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v
             for k, v in torchvision.models.resnet18().state_dict().items()}
    asked = []

    def get_state_dict(weights, *args, **kwargs):  # instead of the download
        asked.append(weights)
        return state

    monkeypatch.setattr(WeightsEnum, "get_state_dict", get_state_dict)
    body = build_model.detector(_small(params, backbone_weights=value), num_classes=3, compute=FP32).backbone.body
    assert asked == [torchvision.models.ResNet18_Weights.IMAGENET1K_V1]
    assert all(torch.equal(v, state[k]) for k, v in body.state_dict().items())


def _garbage(tmp_path):
    path = tmp_path / "garbage.pth"
    path.write_bytes(b"this is not a checkpoint\n" * 10)
    return path


def _no_state_dict(tmp_path):
    path = tmp_path / "list.pth"
    torch.save([1, 2, 3], path)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing.pth", "file not found; expected a state dict of torchvision.models.resnet18()"),
        (lambda tmp: tmp, "not a file; expected a state dict"),
        (_garbage, "garbage.pth': not a readable PyTorch file ("),
        (_no_state_dict, "holds no state dict (a list that does not map names to tensors); expected a state dict"),
        (lambda tmp: _r18_file(tmp, {"conv1.weight": torch.zeros(64, 3, 7, 7), "extra.weight": torch.zeros(1)}),
         ": does not match the resnet18 backbone: 99 missing keys (bn1.weight, bn1.bias, bn1.running_mean, ...); "
         "1 unexpected keys (extra.weight); expected a state dict of torchvision.models.resnet18()"),
        (lambda tmp: _r18_file(tmp, torchvision.models.resnet34().state_dict()),
         "80 unexpected keys (layer1.2.conv1.weight, layer1.2.bn1.weight, "),
        (lambda tmp: _r18_file(tmp, {**torchvision.models.resnet18().state_dict(),
                                     "conv1.weight": torch.zeros(8, 3, 7, 7)}),
         "1 shape mismatches (conv1.weight [8, 3, 7, 7] instead of [64, 3, 7, 7])"),
    ],
)
def test_bad_backbone_weights_files_stop_with_one_line(params, tmp_path, make, message):
    value = str(make(tmp_path))
    with pytest.raises(ConfigError) as err:
        build_model.detector(_small(params, backbone_weights=value), num_classes=3, compute=FP32)
    text = str(err.value)
    assert text.startswith(f"model.backbone_weights: {value!r}") and message in text and "\n" not in text


def test_unknown_weights_name_and_failed_download_stop_with_one_line(params, tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as err:
        build_model.detector(_small(params, backbone_weights="IMAGENET9K_V9"), num_classes=3, compute=FP32)
    assert str(err.value) == ("model.backbone_weights: 'IMAGENET9K_V9': no such weights for resnet18; expected one of "
                              "IMAGENET1K_V1, DEFAULT (or ResNet18_Weights.<name>), or a state-dict file")

    def offline(*args, **kwargs):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))  # an empty cache: it must download
    monkeypatch.setattr(torch.hub, "urlopen", offline)
    with pytest.raises(ConfigError) as err:
        build_model.detector(_small(params, backbone_weights="ResNet18_Weights.IMAGENET1K_V1"), num_classes=3, compute=FP32)
    text = str(err.value)
    assert text.startswith("model.backbone_weights: 'ResNet18_Weights.IMAGENET1K_V1': could not download "
                           "ResNet18_Weights.IMAGENET1K_V1 from https://download.pytorch.org/models/resnet18-")
    assert ("(URLError: <urlopen error [Errno -3] Temporary failure in name resolution>); "
            "expected internet access") in text
    assert str(tmp_path / "hub" / "checkpoints") in text and "\n" not in text
    assert not any((tmp_path / "hub").rglob("*.pth"))


def test_backbone_weights_file_content_is_in_the_resume_fingerprint(params, tmp_path):
    path = _r18_file(tmp_path)

    def fingerprint(p):
        return checkpoint.fingerprint(params=training_params(p), data="d")

    scratch = fingerprint(params)
    pretrained = _with(params, "model", backbone_weights=str(path))
    before = fingerprint(pretrained)
    assert before != scratch and before != fingerprint(_with(params, "model", backbone_weights="IMAGENET1K_V1"))
    torch.save({k: v + 1 for k, v in torchvision.models.resnet18().state_dict().items()}, path)
    assert fingerprint(pretrained) != before  # same path, other content: not resumed into


def test_one_process_trains_the_model_itself_and_sync_batchnorm_needs_a_gpu(params):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    assert build_train.data_parallel(params, model, device=torch.device("cpu"), world_size=1) is model
    synced = _with(params, "model", sync_batchnorm=True)
    with pytest.raises(ConfigError, match="model.sync_batchnorm: SyncBatchNorm runs on GPUs only; this run is on cpu"):
        build_train.data_parallel(synced, model, device=torch.device("cpu"), world_size=2)


def test_the_gradient_scaler_is_on_for_fp16_only(params):
    for precision, enabled in (("fp16", True), ("bf16", False), ("fp32", False)):
        assert build_train.grad_scaler(Compute(precision, False, "chosen by the test"), CPU).is_enabled() == enabled


def test_loop_settings_are_the_train_sections_keyword_arguments_of_the_loop(params):
    import inspect

    from pipelines.engine import train

    settings = build_train.loop_settings(params)
    assert set(settings) <= set(inspect.signature(train).parameters)
    assert settings == {"checkpoint_period": params.train.checkpoint_period,
                        "clip_grad_norm": params.train.clip_grad_norm}
    report = build_train.reporter(params, start_iter=3, device=torch.device("cpu"))
    assert (report.max_iter, report.ims_per_batch, report.log_period) == (
        params.train.max_iter, params.train.ims_per_batch, params.train.log_period)


def test_the_resolved_precision_and_layout_enter_the_resume_fingerprint(params):
    """A checkpoint trained in another precision is set aside as a changed model is, never resumed."""
    bf16, fp32 = Compute("bf16", True, "test"), Compute("fp32", True, "test")
    assert build_model.fingerprint(params, bf16, data="d") == build_model.fingerprint(params, Compute("bf16", True, "other"), data="d")
    assert build_model.fingerprint(params, bf16, data="d") != build_model.fingerprint(params, fp32, data="d")
    assert build_model.fingerprint(params, fp32, data="d") != build_model.fingerprint(params, Compute("fp32", False, "t"), data="d")
