"""The search's params and result file as the stages read them: the scale bounds it searches with (and the
warning when a bin is empty), the policy file that ``augment=searched`` trains with, and the
TrivialAugment-style preset it is compared with."""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
import yaml

from pipelines.build import data as build_data
from pipelines.compose import compose_params
from pipelines.config.load import params_from_dict, read_policy_file
from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.transforms import Compose, RandomHorizontalFlip, SampleContext
from pipelines.errors import ConfigError
from pipelines.policy import COLOR_OPS, GEO_OPS, PUBLISHED_POLICY, trivial_policy
from pipelines.search.proxy import bin_shares, scale_splits, search_params

from .conftest import REPO, set_dotted


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(compose_params(REPO, []))


def _params(raw: dict, **dotted):
    tree = json.loads(json.dumps(raw))
    for key, value in dotted.items():
        set_dotted(tree, key.replace("__", "."), value)
    return params_from_dict(tree, source="params.yaml")


@pytest.mark.parametrize("splits, min_sizes, expected", [
    (None, [256], [2048, 10240, 51200]),  # the original's: augment.scale_splits
    ("auto", [800], [2048, 10240, 51200]),  # COCO's training size: the original's bounds
    ("auto", [256, 288], [210, 1049, 5243]),  # x (256 / 800)^2, from the smallest training size
    ([100, 200, 300], [256], [100, 200, 300]),
])
def test_the_search_bounds_are_the_originals_scaled_or_given(raw, splits, min_sizes, expected):
    p = _params(raw, search__scale_splits=splits, model__min_size_train=min_sizes, model__max_size_train=1333,
                loader__padded_shape_grouping=len(min_sizes) == 1)  # several sizes: batches by orientation only
    assert scale_splits(p) == expected
    searched = search_params(p)
    assert searched.augment.scale_splits == expected and searched.search == p.search and searched.model == p.model


@pytest.mark.parametrize("value", ["coco", [300, 200, 100], [0, 1, 2], [1, 2], [1.5, 2, 3], [True, 2, 3]])
def test_bad_search_bounds_are_one_line_errors(raw, value):
    with pytest.raises(ConfigError, match=r"^params.yaml: search.scale_splits: expected null, auto or three "
                                          r"increasing positive areas, got .+$"):
        _params(raw, search__scale_splits=value)


def test_bin_shares_count_boxes_by_their_area_on_the_resized_image(tmp_path):
    # A 200x100 image resized to shorter side 50 (scale 0.5): areas 4 x 0.25 = 1, 40x40 -> 400, 100x100 -> 2500;
    # a 400x400 image at shorter side 50 (scale 1/8): 400x400 -> 2500. The crowd box is not counted.
    coco = {"images": [{"id": 1, "file_name": "a.jpg", "width": 200, "height": 100},
                       {"id": 2, "file_name": "b.jpg", "width": 400, "height": 400}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 2, 2], "area": 4, "iscrowd": 0},
                            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [0, 0, 40, 40], "area": 1600, "iscrowd": 0},
                            {"id": 3, "image_id": 1, "category_id": 1, "bbox": [0, 0, 100, 100], "area": 1e4, "iscrowd": 0},
                            {"id": 4, "image_id": 2, "category_id": 1, "bbox": [0, 0, 400, 400], "area": 1.6e5, "iscrowd": 0},
                            {"id": 5, "image_id": 2, "category_id": 1, "bbox": [0, 0, 8, 8], "area": 64, "iscrowd": 1}],
            "categories": [{"id": 1, "name": "thing"}]}
    build_cache(coco, tmp_path / "train", image_root=str(tmp_path), source_sha256="0" * 64, drop_empty=True)
    cache = AnnotationCache(tmp_path / "train")
    assert bin_shares(cache, min_size=50, max_size=1000, splits=[10, 400, 2000]) == [0.25, 0.0, 0.25, 0.5]
    assert bin_shares(cache, min_size=50, max_size=1000, splits=[10, 401, 5000]) == [0.25, 0.25, 0.5, 0.0]


def _searched(raw: dict, tmp_path, result) -> object:
    path = tmp_path / "policy.json"
    if result is not None:
        path.write_text(result if isinstance(result, str) else json.dumps(result))
    return _params(raw, augment=yaml.safe_load(compose_params(REPO, ["augment=searched"]))["augment"],
                   augment__policy_file=str(path))


def test_a_search_result_gives_the_training_its_genes_and_its_bounds(raw, tmp_path):
    genes = list(PUBLISHED_POLICY[::-1])
    p = read_policy_file(_searched(raw, tmp_path, {"policy": genes, "n_subpolicies": 5, "scale_splits": [210, 1049, 5243]}))
    assert p.augment.policy == genes and p.augment.scale_splits == [210, 1049, 5243]
    assert build_data.policy(p) is not None
    older = read_policy_file(_searched(raw, tmp_path, {"policy": genes, "n_subpolicies": 5}))  # written before the bounds
    assert older.augment.scale_splits == [2048, 10240, 51200]


@pytest.mark.parametrize("result, message", [
    (None, r"not found; run the search \(make search, which publishes its result with python -m "
           r"stages.publish_search\) or choose another augment preset"),
    ("{not json", r"not readable JSON \(Expecting property name .*\)"),
    ({"genes": []}, "expected a JSON object with a 'policy' gene list or an 'augment' section"),
    ({"policy": list(PUBLISHED_POLICY), "n_subpolicies": 4}, "searched with 4 sub-policies, augment.n_subpolicies is 5"),
    ({"policy": [10] * 40}, r"augment.policy\[0\]: expected an integer 0..9, got 10"),
    ({"policy": list(PUBLISHED_POLICY), "scale_splits": [1, 2]}, r"scale_splits: expected three positive areas, got \[1, 2\]"),
])
def test_a_bad_search_result_is_a_one_line_error_naming_the_file(raw, tmp_path, result, message):
    with pytest.raises(ConfigError, match=rf"^params.yaml: augment.policy_file: {re.escape(str(tmp_path))}/policy.json: .*{message}$"):
        read_policy_file(_searched(raw, tmp_path, result), "params.yaml")


def test_the_trivial_policy_draws_one_op_and_one_level_uniformly():
    policy = trivial_policy()
    assert policy.zoom_out.prob == policy.zoom_in.prob == 0
    assert policy.area_ratios == policy.prob_ratios == (1, 1, 1)
    ops = [(s.color.name, s.color.level) if s.color.prob else (s.geometric.name, s.geometric.level)
           for s in policy.subpolicies]
    assert all(sorted((s.color.prob, s.geometric.prob)) == [0.0, 1.0] for s in policy.subpolicies)  # one op, always
    assert sorted(ops) == sorted((name, level) for name in COLOR_OPS + GEO_OPS for level in range(10))  # each once


def test_the_trivial_preset_is_the_flip_then_one_op_without_ramp_or_zoom(raw):
    p = _params(raw, augment=yaml.safe_load(compose_params(REPO, ["augment=trivial"]))["augment"])
    flip, trivial = build_data.augmentation(p).transforms
    assert isinstance(flip, RandomHorizontalFlip) and isinstance(trivial, ScaleAwareAutoAugment)
    assert trivial.policy == trivial_policy() and trivial.ramp(0) == 1.0  # full strength from the first iteration
    assert build_data.policy(p) is None  # not a searched policy: nothing to log as one
    # with its one (medium) box always selected, almost every draw changes the pixels or the box
    image = torch.from_numpy(np.random.default_rng(0).integers(0, 255, (3, 64, 64), dtype=np.uint8))
    target = {"boxes": torch.tensor([[8.0, 8.0, 56.0, 56.0]]), "labels": torch.tensor([1])}
    medium = dataclasses.replace(trivial_policy(), area_ratios=(0, 1, 0), prob_ratios=(0, 1, 0))
    always = ScaleAwareAutoAugment(medium, box_prob=1.0, max_iter=0)
    changed = 0
    for i in range(40):
        out, t = always(image, target, SampleContext(rng=np.random.default_rng(i)))
        changed += not torch.equal(out, image) or not torch.equal(t["boxes"], target["boxes"])
    assert changed >= 30  # a few (op, level) pairs are the identity: level 0 of a geometric op, for one
    with pytest.raises(ConfigError, match=r"^params.yaml: augment.box_prob: missing value \(required by "
                                          r"augment.name=trivial\)"):
        _params(raw, augment={"name": "trivial", "hflip_prob": 0.5, "policy_file": "pipelines/policy.py",
                              "scale_splits": [2048, 10240, 51200]})
    assert isinstance(build_data.augmentation(p), Compose)
