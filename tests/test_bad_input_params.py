"""Bad params as a table: each broken name or number in params.yaml, each broken YAML text and each bad
``python -m pipelines.compose`` call stops with one exact line and exit code 2 (split from test_bad_input.py,
which holds the broken datasets)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from pipelines import cli
from pipelines.build import data as build_data
from pipelines.config.load import load_params

from .conftest import REPO, set_dotted


pytestmark = pytest.mark.usefixtures("restore_logging")


# --- names and numbers in params ------------------------------------------------------------------------------
# params.yaml as a stage reads it (`python -m pipelines.config`, in-process through cli.run): each broken value
# stops with one exact line and exit code 2. `{params}` is the file's path.


def _with(changes: dict) -> Callable[[dict], None]:
    """Set dotted keys of the params dict (KeyError as a value deletes the key)."""
    def change(params: dict) -> None:
        for dotted, value in changes.items():
            set_dotted(params, dotted, value)
    return change


MODELS = "fcos_r50, fcos_r50_pretrained, fcos_small, fcos_tiny"
TINY_NETWORK = "backbone resnet10, norm batchnorm, backbone_weights null, fpn_channels 64, head_convs 2"
INT64 = "an integer at most 2**63-1 (numpy and torch hold it as int64)"  # below -2**63: the field's own bound
SEED = "a seed from 0 to 2**64-1 (torch.manual_seed takes 64 bits)"

NAMES_AND_NUMBERS = [
    # names that select code, checked against the registries; a config group's option gets the hint
    pytest.param(_with({"model.name": "resnet9000"}),
                 f"{{params}}: model.name: expected one of {MODELS} (a preset in conf/model/), got 'resnet9000'",
                 id="model-name-unknown"),
    pytest.param(_with({"model.name": "fcos_r50"}),
                 f"{{params}}: model.name: expected 'fcos_tiny' (the section builds the network of "
                 f"conf/model/fcos_tiny.yaml: {TINY_NETWORK}), got 'fcos_r50'; did you mean `-S model=fcos_r50`?",
                 id="model-name-for-model-group"),
    pytest.param(_with({"model.name": "fcos_tiny", "model.backbone": "resnet18", "model.fpn_channels": 128}),
                 "{params}: model.name: expected 'fcos_small' (the section builds the network of "
                 "conf/model/fcos_small.yaml: backbone resnet18, norm batchnorm, backbone_weights null, fpn_channels "
                 "128, head_convs 2), got 'fcos_tiny'; did you mean `-S model=fcos_tiny`?",
                 id="model-name-of-another-network"),
    pytest.param(_with({"evaluate.backend": "coco"}),  # an option of another section's group: no hint
                 "{params}: evaluate.backend: expected one of pycocotools, faster_coco_eval, got 'coco'",
                 id="eval-backend-unknown"),
    pytest.param(_with({"model.backbone": "resnet9000"}),
                 "{params}: model.backbone: expected one of resnet10, resnet18, resnet34, resnet50, resnet101, "
                 "got 'resnet9000'", id="backbone-unknown"),
    pytest.param(_with({"model.backbone": "fcos_r50"}),
                 "{params}: model.backbone: expected one of resnet10, resnet18, resnet34, resnet50, resnet101, "
                 "got 'fcos_r50'; did you mean `-S model=fcos_r50`?", id="backbone-for-model-group"),
    pytest.param(_with({"model.norm": "layernorm"}),
                 "{params}: model.norm: expected one of batchnorm, groupnorm, frozen_batchnorm, got 'layernorm'",
                 id="norm-unknown"),
    pytest.param(_with({"augment.name": "autoaug"}),
                 "{params}: augment.name: expected one of none, flip, sa_autoaug, trivial, trivial_zoom, got 'autoaug'", id="augment-unknown"),
    pytest.param(_with({"augment": {"name": "sa_autoaug", "hflip_prob": 0.5, "policy_file": "pipelines/policy.py"}}),
                 "{params}: augment.policy: missing value (required by augment.name=sa_autoaug); did you mean "
                 "`-S augment=sa_autoaug`?", id="augment-name-for-augment-group"),
    pytest.param(_with({"train.optimizer": "fcos_1x"}),
                 "{params}: train.optimizer: expected one of sgd, adamw, got 'fcos_1x'; did you mean "
                 "`-S solver=fcos_1x`?", id="optimizer-for-solver-group"),
    pytest.param(_with({"train.lr_schedule": "linear"}),
                 "{params}: train.lr_schedule: expected one of multistep, cosine, got 'linear'", id="schedule-unknown"),
    pytest.param(_with({"dataset.name": "coco"}),
                 "{params}: dataset.seed: unknown key (expected one of: {coco_keys}); did you mean `-S dataset=coco`?",
                 id="dataset-name-for-dataset-group"),
    # seeds: torch.manual_seed takes 64 bits
    pytest.param(_with({"seed": 2**64}), f"{{params}}: seed: expected {SEED}, got 18446744073709551616",
                 id="seed-2**64"),
    pytest.param(_with({"seed": -1}), f"{{params}}: seed: expected {SEED}, got -1", id="seed-negative"),
    pytest.param(_with({"dataset.seed": 2**64}), f"{{params}}: dataset.seed: expected {SEED}, got 18446744073709551616",
                 id="dataset-seed-2**64"),
    # floats: finite wherever they are
    pytest.param(_with({"train.base_lr": float("inf")}), "{params}: train.base_lr: expected a finite number, got inf",
                 id="base-lr-inf"),
    pytest.param(_with({"train.base_lr": float("nan")}), "{params}: train.base_lr: expected a finite number, got nan",
                 id="base-lr-nan"),
    pytest.param(_with({"train.base_lr": 10**400}),
                 "{params}: train.base_lr: expected a finite number, got an integer of 401 digits", id="base-lr-huge"),
    pytest.param(_with({"train.weight_decay": float("inf")}),
                 "{params}: train.weight_decay: expected a finite number, got inf", id="weight-decay-inf"),
    pytest.param(_with({"train.momentum": float("nan")}), "{params}: train.momentum: expected a finite number, got nan",
                 id="momentum-nan"),
    pytest.param(_with({"train.clip_grad_norm": float("inf")}),
                 "{params}: train.clip_grad_norm: expected a finite number, got inf", id="clip-grad-norm-inf"),
    pytest.param(_with({"augment.filler_cache_mb": float("inf")}),
                 "{params}: augment.filler_cache_mb: expected a finite number, got inf", id="filler-cache-inf"),
    pytest.param(_with({"model.score_thresh": float("-inf")}),
                 "{params}: model.score_thresh: expected a finite number, got -inf", id="score-thresh-inf"),
    # integers: int64, sizes in pixels
    pytest.param(_with({"train.max_iter": 2**63}), f"{{params}}: train.max_iter: expected {INT64}, got {2**63}",
                 id="max-iter-2**63"),
    pytest.param(_with({"train.ims_per_batch": 2**64}),
                 f"{{params}}: train.ims_per_batch: expected {INT64}, got {2**64}", id="batch-2**64"),
    pytest.param(_with({"train.steps": [10, 10**40]}),
                 "{params}: train.steps: expected strictly increasing iterations between 0 and train.max_iter (800), "
                 f"got [10, {10**40}]", id="step-huge"),
    pytest.param(_with({"model.topk_candidates": 10**40}),
                 f"{{params}}: model.topk_candidates: expected {INT64}, got an integer of 41 digits", id="topk-huge"),
    pytest.param(_with({"loader.num_workers": -(2**63) - 1}),
                 f"{{params}}: loader.num_workers: expected an integer >= 0, got {-(2**63) - 1}",
                 id="workers-below-int64"),
    pytest.param(_with({"model.min_size_test": 0}),
                 "{params}: model.min_size_test: expected a size from 1 to 65500 pixels, got 0", id="size-zero"),
    pytest.param(_with({"model.min_size_train": [256, -1]}),
                 "{params}: model.min_size_train[1]: expected a size from 1 to 65500 pixels, got -1", id="size-negative"),
    pytest.param(_with({"evaluate.tta_max_size": 65501}),
                 "{params}: evaluate.tta_max_size: expected a size from 1 to 65500 pixels, got 65501", id="size-huge"),
    pytest.param(_with({"evaluate.bootstrap": -1}), "{params}: evaluate.bootstrap: expected a number of image "
                 "resamples from 0 (no intervals) to 100000, got -1", id="bootstrap-negative"),
    pytest.param(_with({"dataset.max_side": 100000}),
                 "{params}: dataset.max_side: expected a size from 1 to 65500 pixels, got 100000",
                 id="synthetic-side-beyond-jpeg"),
    # the search's fair score (tests/test_search_score.py)
    pytest.param(_with({"search.pareto_comparator": "original"}), "{params}: search.pareto_comparator: expected one "
                 "of null_candidate, baseline, got 'original'", id="search-comparator-unknown"),
    pytest.param(_with({"search.space": "box"}), "{params}: search.space: expected one of full, scale, got 'box'",
                 id="search-space-unknown"),
    pytest.param(_with({"search.space": "scale", "augment.n_subpolicies": 3, "augment.policy": [0] * 28}),
                 "{params}: search.space: expected full with augment.n_subpolicies 3 (scale keeps the published "
                 "policy's 5 sub-policies), got 'scale'", id="search-space-scale-subpolicies"),
    pytest.param(_with({"search.proxy_warmup_fraction": 1.0}), "{params}: search.proxy_warmup_fraction: expected a "
                 "fraction of search.fine_tune_iters in [0, 1) (0: no warmup), got 1.0", id="search-warmup-all"),
    pytest.param(_with({"search.rescore_seeds": 0}), "{params}: search.rescore_seeds: expected at least 1 seed to "
                 "rescore the best search.rescore_top_k (3) with, got 0", id="search-rescore-no-seeds"),
    pytest.param(_with({"augment.translate_relative": KeyError}), "{params}: augment.translate_relative: missing "
                 "value (required by augment.name=sa_autoaug); did you mean `-S augment=sa_autoaug`?",
                 id="translate-relative-missing"),
]


def _validate_params(path: Path, capsys) -> tuple[int, str]:
    """``python -m pipelines.config --params path`` in-process: (exit code, stderr)."""
    from pipelines.config.__main__ import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.run(main, ["--params", str(path)])
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("change, expected", NAMES_AND_NUMBERS)
def test_bad_names_and_numbers_stop_in_one_line(tmp_path, capsys, base_params, change, expected):
    import dataclasses

    from pipelines.config.schema import CocoDataset

    params = copy.deepcopy(base_params)
    change(params)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    code, stderr = _validate_params(path, capsys)
    coco_keys = ", ".join(f.name for f in dataclasses.fields(CocoDataset))
    assert (code, stderr.splitlines()) == (2, ["error: " + expected.format(params=path, coco_keys=coco_keys)])


@pytest.mark.parametrize("changes", [{"seed": 2**64 - 1, "dataset.seed": 2**64 - 1},
                                     {"model.backbone": "resnet18"},  # a preset's network changed, not another's
                                     {"train.base_lr": 1e-300, "model.max_size_test": 65500}])
def test_names_and_numbers_at_their_bounds_pass(tmp_path, base_params, changes):
    params = copy.deepcopy(base_params)
    _with(changes)(params)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    load_params(path)


def test_every_name_validation_accepts_is_one_the_code_selects():
    from pipelines import evaluation, hardware, model, scale_loss, solver
    from pipelines.config.presets import model_presets
    from pipelines.config.schema import CHOICES
    from pipelines.data import transforms
    from pipelines.inference import card, postprocess, tta
    from pipelines.search import record, space

    registries = {"model.backbone": model.BACKBONES, "model.norm": model.NORM_LAYERS,
                  "model.precision": hardware.PRECISIONS, "augment.name": build_data.AUGMENTATIONS,
                  "train.optimizer": solver.OPTIMIZERS, "train.lr_schedule": solver.LR_SCHEDULES,
                  "evaluate.backend": evaluation.BACKENDS, "model.cls_loss": scale_loss.CLS_LOSSES,
                  "model.assigner": model.ASSIGNERS,
                  "evaluate.merge": model.MERGES, "evaluate.tta_source": transforms.TTA_SOURCES,
                  "search.pareto_comparator": record.COMPARATORS, "search.space": space.SPACES}
    assert {key: tuple(names) for key, names in registries.items()} == CHOICES
    assert postprocess.MERGES == card.MERGES == model.MERGES  # the numpy twin's and the model card's
    assert tta.SOURCES == transforms.TTA_SOURCES
    presets = model_presets()
    assert list(presets) == sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    assert all(preset["name"] == stem for stem, preset in presets.items())  # each preset's label is its own name


# YAML: the error keeps its line and column; aliases that expand without bound are refused at once
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{x}: &{x} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, x in zip("abcdefgh", "bcdefghi"))

BAD_YAML = [
    pytest.param("seed: 0\ntrain:\n  base_lr: [0.1\n",
                 "{params}:4:1: not valid YAML: expected ',' or ']', but got '<stream end>' (while parsing a flow "
                 "sequence at 3:12)", id="yaml-unclosed"),
    pytest.param("seed: 0\ntrain:\n  base_lr: 0.1\n   max_iter: 3\n",
                 "{params}:4:12: not valid YAML: mapping values are not allowed here", id="yaml-indent"),
    pytest.param("seed: 0\nseed: 1\n",
                 "{params}:2:1: not valid YAML: found duplicate key seed (while constructing a mapping at 1:1)",
                 id="yaml-duplicate-key"),
    pytest.param(BOMB, "{params}:6:4: YAML aliases expand this to more than 100000 values; expected a file of at "
                 "most 100000 values", id="yaml-alias-bomb"),  # line 6: f, 9**6 values
    pytest.param("a: &a [1, *a]\n", "{params}:1:4: an alias inside the value it refers to (expands without end); "
                 "expected values written out", id="yaml-recursive-alias"),
    pytest.param("seed: 0\n" + "#" * (1 << 20) + "\n",
                 f"{{params}}: {(1 << 20) + 9} bytes; expected a YAML file of at most {1 << 20} bytes", id="yaml-huge"),
]


@pytest.mark.parametrize("text, expected", BAD_YAML)
def test_bad_yaml_stops_in_one_line_with_line_and_column(tmp_path, capsys, text, expected):

    path = tmp_path / "params.yaml"
    path.write_text(text)
    start = time.perf_counter()
    code, stderr = _validate_params(path, capsys)
    assert (code, stderr.splitlines()) == (2, ["error: " + expected.format(params=path)])
    assert time.perf_counter() - start < 5  # a billion laughs is refused, not expanded


def test_an_alias_bomb_in_conf_stops_compose_before_hydra_expands_it(tmp_path):

    from pipelines.compose import compose_params
    from pipelines.errors import ConfigError

    shutil.copytree(REPO / "conf", tmp_path / "conf")
    (tmp_path / "conf" / "model" / "bomb.yaml").write_text(BOMB)
    with pytest.raises(ConfigError) as err:
        compose_params(tmp_path, ["model=bomb"])
    assert str(err.value) == ("conf/model/bomb.yaml:6:4: YAML aliases expand this to more than 100000 values; "
                              "expected a file of at most 100000 values")


# python -m pipelines.compose: one line, exit code 2, and the output file untouched
@pytest.mark.parametrize("overrides, expected", [
    (["bogus=1"], "error: conf/: override 'bogus=1': no such key or config group in conf/"),
    (["model=fcos_r5"], "error: conf/: In 'config': Could not find 'model/fcos_r5'; Available options in 'model': "
                        "fcos_r50, fcos_r50_pretrained, fcos_small, fcos_tiny"),
    (["train.steps=[1,"], "error: conf/: override 'train.steps=[1,': no viable alternative at input '[1,'"),
    (["model.name=fcos_r50"], f"error: {{out}} (composed from conf/): model.name: expected 'fcos_tiny' (the section "
                              f"builds the network of conf/model/fcos_tiny.yaml: {TINY_NETWORK}), got 'fcos_r50'; did "
                              "you mean `-S model=fcos_r50`?"),
    (["train.base_lr=inf"], "error: {out} (composed from conf/): train.base_lr: expected a finite number, got inf"),
], ids=["unknown-key", "unknown-option", "malformed-override", "model-name-slip", "base-lr-inf"])
def test_compose_errors_are_one_line_and_write_nothing(tmp_path, overrides, expected):
    out = tmp_path / "params.yaml"
    out.write_text("previous: params\n")
    done = subprocess.run([sys.executable, "-m", "pipelines.compose", *overrides, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stderr.splitlines()) == (2, [expected.format(out=out)])
    assert out.read_text() == "previous: params\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # no temporary file left


@pytest.mark.parametrize("setting, expected", [
    ("evaluate.nope=1", "error: {out}: override 'evaluate.nope=1': expected KEY=VALUE for a key the file has"),
    ("train.base_lr=-1", "error: {out}: train.base_lr: expected a learning rate > 0, got -1.0"),
], ids=["unknown-key", "bad-value"])
def test_compose_edit_changes_one_key_of_the_current_file_or_nothing(tmp_path, setting, expected):
    out = tmp_path / "params.yaml"
    out.write_text((REPO / "params.yaml").read_text())
    command = [sys.executable, "-m", "pipelines.compose", "--edit", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([*command, setting], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stderr.splitlines()) == (2, [expected.format(out=out)])
    assert out.read_text() == (REPO / "params.yaml").read_text()
    done = subprocess.run([*command, "evaluate.tta=false"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    before, after = (REPO / "params.yaml").read_text().splitlines(), out.read_text().splitlines()
    assert [(a, b) for a, b in zip(before, after) if a != b] == [("  tta: true", "  tta: false")] and len(before) == len(after)
