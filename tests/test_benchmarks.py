"""Smoke tests of the benchmark code at tiny sizes (no timing is asserted)."""

import inspect
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from benchmarks import annotations as annotations_benchmark
from benchmarks import evaluation as evaluation_benchmark
from benchmarks import loader as loader_benchmark
from benchmarks import sa_autoaug as sa_autoaug_benchmark
from benchmarks.coco_scale import COCO_CATEGORY_IDS, make_coco_scale, write_coco_scale
from pipelines.build import data as build_data

from .conftest import COCO_REAL, REPO, require


def test_generator_is_deterministic_and_shaped_like_coco(tmp_path):
    kwargs = dict(num_images=500, num_boxes=3700, empty_fraction=0.01, crowd_fraction=0.02)
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    summary = write_coco_scale(a, seed=1, **kwargs)
    write_coco_scale(b, seed=1, **kwargs)
    write_coco_scale(c, seed=2, **kwargs)
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()
    assert summary["images"] == 500 and summary["annotations"] == 3700 and summary["crowd"] > 0

    coco = json.loads(a.read_text())
    assert [cat["id"] for cat in coco["categories"]] == list(COCO_CATEGORY_IDS)
    assert len(COCO_CATEGORY_IDS) == 80 and {12, 26, 29, 30, 45, 66, 68, 69, 71, 83}.isdisjoint(COCO_CATEGORY_IDS)
    images = {im["id"]: im for im in coco["images"]}
    assert len(images) == 500 and [im["id"] for im in coco["images"]] != sorted(images)  # unsorted, as in COCO
    with_boxes = {ann["image_id"] for ann in coco["annotations"]}
    assert len(images) - len(with_boxes) == 5
    assert len({ann["id"] for ann in coco["annotations"]}) == 3700
    for ann in coco["annotations"]:
        im = images[ann["image_id"]]
        x, y, w, h = ann["bbox"]
        assert 0 <= x and 0 <= y and w > 0 and h > 0 and x + w <= im["width"] + 0.01 and y + h <= im["height"] + 0.01
        if ann["iscrowd"]:
            assert ann["segmentation"]["size"] == [im["height"], im["width"]]
            assert sum(ann["segmentation"]["counts"]) == im["height"] * im["width"]
        else:
            assert len(ann["segmentation"]) == 1 and len(ann["segmentation"][0]) == 8
            assert ann["category_id"] in COCO_CATEGORY_IDS and ann["area"] > 0


def test_generator_defaults_are_coco_train2017s_counts():
    defaults = inspect.signature(make_coco_scale).parameters
    assert defaults["num_images"].default == 118_287 and defaults["num_boxes"].default == 860_001
    assert round(defaults["empty_fraction"].default * 118_287) == 1021


def test_annotations_benchmark_reports_every_figure(tmp_path, capsys):
    source = tmp_path / "instances.json"
    write_coco_scale(source, seed=0, num_images=300, num_boxes=2000)
    annotations_benchmark.main(["--annotations", str(source), "--repeats", "1", "--cache-repeats", "1",
                                "--accesses", "50", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert figures["dataset"]["images"] == 300 and figures["dataset"]["boxes"] == 2000
    for kind in ("coco", "cache", "build", "json", "orjson"):
        assert figures[kind]["seconds"] > 0 and figures[kind]["peak_rss_mb"] > 0
    assert figures["coco"]["access_us"] > 0 and figures["cache"]["access_us"] > 0
    assert set(figures["targets_met"]) == {"open_speedup", "memory_fraction", "access_us", "build_vs_json_load"}
    assert "| pycocotools `COCO(path)` |" in annotations_benchmark.table(figures)


def test_evaluation_benchmark_times_both_backends_and_checks_their_figures(capsys):
    evaluation_benchmark.main(["--quick", "--json"])
    figures = json.loads(capsys.readouterr().out)
    quick = evaluation_benchmark.QUICK
    assert figures["dataset"]["images"] == quick["images"] and figures["dataset"]["detections"] == quick["detections"]
    assert figures["dataset"]["crowd"] > 0
    assert set(figures["backends"]) == {"pycocotools", "faster_coco_eval"}
    for measured in figures["backends"].values():
        assert measured["seconds"] > 0 and measured["peak_rss_mb"] >= measured["base_rss_mb"] > 0
        assert len(measured["runs"]) == quick["repeats"]
    assert figures["backends"]["pycocotools"]["time_ratio"] == 1.0
    assert figures["figures"]["agree"] and 0 < figures["figures"]["reference"]["AP"] < 1
    text = evaluation_benchmark.table(figures)
    assert "| `pycocotools` |" in text and "| `faster_coco_eval` |" in text and "agree: yes" in text


def test_evaluation_benchmark_detections_are_spread_evenly_and_grouped_by_image():
    coco = make_coco_scale(seed=0, num_images=40, num_boxes=300)
    detections = evaluation_benchmark.make_detections(coco, num_detections=1003, seed=1)
    assert len(detections) == 1003
    counts = np.unique([d["image_id"] for d in detections], return_counts=True)[1]
    assert len(counts) == 40 and set(counts.tolist()) == {25, 26}
    order = {im["id"]: row for row, im in enumerate(coco["images"])}
    rows = [order[d["image_id"]] for d in detections]
    assert rows == sorted(rows)
    assert {d["category_id"] for d in detections} <= set(COCO_CATEGORY_IDS)
    assert all(d["bbox"][2] > 0 and d["bbox"][3] > 0 and 0 <= d["score"] <= 1 for d in detections)
    assert detections == evaluation_benchmark.make_detections(coco, num_detections=1003, seed=1)


def test_loader_benchmark_reports_every_figure(tmp_path, capsys):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"].update(min_size_train=[96], max_size_train=128)  # tiny, so the smoke test is quick
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    loader_benchmark.main(["--params", str(path), "--images", "8", "--workers", "0", "1", "--batches", "2",
                           "--warmup", "1", "--repeats", "1", "--train-steps", "1", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert figures["config"]["augment"] == params["augment"]["name"]
    assert figures["training"]["images_per_s"] > 0 and figures["training"]["batch"] == 4
    assert set(figures["loader"]) == {"0", "1"} and all(v["images_per_s"] > 0 for v in figures["loader"].values())
    assert figures["decoders"]["max_abs_pixel_difference"] == 0
    assert figures["decoders"]["faster"] in loader_benchmark.DECODERS
    assert "| loader, 1 worker (default) |" in loader_benchmark.table(figures)


def test_decoders_agree_with_the_dataset(tiny_cache, coco_real):
    from pipelines.data.dataset import DetectionDataset
    from pipelines.data.transforms import build_transforms

    dataset = DetectionDataset(tiny_cache, transforms=build_transforms(min_sizes=[320], max_size=416))
    path = str(tiny_cache.image_path(0))
    image, _ = dataset.load(0)
    for decode in loader_benchmark.DECODERS.values():
        decoded = decode(path)
        assert decoded.dtype == torch.uint8 and decoded.shape == image.shape
        assert torch.equal(decoded, image)  # same libjpeg-turbo output here

    _, images = coco_real
    for file in sorted(images.glob("*.jpg")):  # one is greyscale: both give 3 channels
        shapes = {tuple(decode(str(file)).shape) for decode in loader_benchmark.DECODERS.values()}
        assert len(shapes) == 1 and next(iter(shapes))[0] == 3


@pytest.mark.parametrize("name", ["flip", "none"])
def test_loader_benchmark_swaps_the_augment_preset(name):
    p = loader_benchmark.load_benchmark_params(REPO / "params.yaml", augment=name)
    assert p.augment.name == name
    # as the benchmark and the train stage build them
    transforms = build_data.train_transforms(p, build_data.augmentation(p))
    image = torch.zeros(3, 64, 80, dtype=torch.uint8)
    target = {"boxes": torch.tensor([[1.0, 2.0, 30.0, 40.0]]), "labels": torch.tensor([1])}
    from pipelines.data.transforms import SampleContext

    out, out_target = transforms(image, target, SampleContext(rng=np.random.default_rng(0)))
    assert min(out.shape[-2:]) == p.model.min_size_train[0] and len(out_target["boxes"]) == 1


def test_train_step_benchmark_quick_run_reports_every_variant_and_goal(capsys):
    from benchmarks import train_step as train_step_benchmark

    train_step_benchmark.main(["--quick", "--json"])
    figures = json.loads(capsys.readouterr().out)
    quick = train_step_benchmark.QUICK
    c = figures["config"]
    assert c["processes"] == 2 and c["batch_per_process"] == 4 and c["iters"] == quick["iters"]
    assert c["repeats"] == quick["repeats"] and len(c["load_average_before"]) == 3
    start, first, last = c["window"]
    assert first - start == quick["warmup"] and last - first == quick["iters"]
    assert first < c["checkpoint_period"] < last  # the stage's checkpoint is in the timed window
    variants = figures["variants"]
    assert list(variants) == list(train_step_benchmark.DEFAULT_VARIANTS)
    for name, v in variants.items():
        assert v["images_per_s"] > 0 and v["best_images_per_s"] > 0 and len(v["runs"]) == quick["repeats"]
        assert all(len(run["step_s"]) == quick["iters"] for run in v["runs"])
    assert variants["bare_1x1"]["baseline"] is None and "ratio" not in variants["bare_1x1"]
    assert variants["bare_1x1"]["other_process_waiting"]["wall_s"] > 0
    assert variants["bare_2x1"]["baseline"] == "bare_1x1" and variants["bare_2x1"]["ratio"] > 0
    stage = variants["stage"]
    assert stage["baseline"] == "bare_2x1" and stage["ratio"] > 0 and stage["workers"] == 1
    assert stage["log_calls"] >= 1 and stage["checkpoint_s"] > 0 and 0 < stage["tracking_fraction"] < 1
    assert set(figures["goals"]) == {"stage_vs_bare", "scaling", "tracking_overhead"}
    assert figures["goals"]["stage_vs_bare"]["value"] == stage["ratio"]
    assert figures["goals"]["scaling"]["best"] == variants["bare_2x1"]["best_ratio"]
    text = train_step_benchmark.table(figures)
    assert text.count("\n| `") == 3 and "| `stage`: train stage" in text and "load average" in text
    assert "(a) stage / bare 2x1" in text and "(b) bare 2x1 / bare 1x1" in text and "(c) MLflow" in text


def test_train_step_benchmark_diagnostics_pin_threads_and_train_without_all_reduce(capsys):
    """The variants docs/benchmarks.md's second table comes from: each process's threads pinned to a core of
    its own, and two processes training alone (an iteration counted as the slower process's)."""
    from benchmarks import train_step as train_step_benchmark

    train_step_benchmark.main(["--quick", "--json", "--only", "bare_1x1", "ddp_pinned", "no_allreduce_2x1"])
    variants = json.loads(capsys.readouterr().out)["variants"]
    assert variants["ddp_pinned"]["baseline"] == "bare_2x1" and "ratio" not in variants["ddp_pinned"]  # not run
    alone = variants["no_allreduce_2x1"]
    assert alone["baseline"] == "bare_1x1" and alone["ratio"] > 0
    for run in alone["runs"]:
        ranks = run["rank_step_s"]
        assert len(ranks) == 2 and run["step_s"] == [max(a, b) for a, b in zip(*ranks)]
    cores = sorted(os.sched_getaffinity(0))
    assert all(run["cores"] == cores[:1] for run in variants["ddp_pinned"]["runs"])  # rank 0 on the first core
    assert all(run["cores"] == cores for name in ("bare_1x1", "no_allreduce_2x1") for run in variants[name]["runs"])


def test_train_step_benchmark_window_holds_a_checkpoint_and_whole_log_periods():
    from benchmarks import train_step as train_step_benchmark

    p = loader_benchmark.load_benchmark_params(REPO / "params.yaml")
    start, first, last = train_step_benchmark.window(p, warmup=5, iters=60)
    assert first - start == 5 and last - first == 60
    assert first < p.train.checkpoint_period < last and first % p.train.log_period == 0


def _sa_autoaug_figures(capsys, *args):
    sa_autoaug_benchmark.main(["--quick", "--json", *args])
    return json.loads(capsys.readouterr().out)


def test_sa_autoaug_benchmark_times_the_full_call_on_every_input_and_each_op(capsys, coco_real, one_thread):
    from pipelines.policy import COLOR_OPS, GEO_OPS

    assert sa_autoaug_benchmark.COCO_REAL == COCO_REAL  # it finds the shared data where the tests do
    figures = _sa_autoaug_figures(capsys)
    b = sa_autoaug_benchmark
    assert list(figures["full_call_ms"]) == [b.SYNTHETIC, b.PHOTOS, b.DECODED, b.NO_POOL] and figures["skipped"] is None
    assert set(figures["ops_ms"]) == {"zoom_in", "zoom_out", *COLOR_OPS, *GEO_OPS}
    for s in [*figures["full_call_ms"].values(), *figures["ops_ms"].values()]:
        assert 0 < s["median"] <= s["max"] and s["mean"] > 0
    assert all(s["n"] == b.QUICK["calls"] for s in figures["full_call_ms"].values())
    assert figures["threads"] == 1 and figures["inputs"][b.PHOTOS]["images"] == 32
    assert set(figures["meets_goal"]) == {b.SYNTHETIC, b.PHOTOS, b.DECODED}  # no goal without the pool
    assert set(figures["goal_mean_ms"]) == set(figures["full_call_ms"])
    # The COCO-scale case runs as the default configuration trains: its pool, 8 images over 2 x 1 workers.
    assert figures["training"] == {"filler_pool": 512, "filler_pool_iters": 1000, "filler_cache_mb": 512,
                                   "samples_per_worker_iteration": 4}
    assert not any("ratio" in key for key in figures)  # absolute times only: no baseline is run
    assert "COCO photos, fillers decoded" in b.table(figures)


def test_sa_autoaug_benchmark_skips_the_coco_cases_without_the_shared_data(capsys, tmp_path, one_thread):
    figures = _sa_autoaug_figures(capsys, "--coco-real", str(tmp_path / "absent"))
    assert list(figures["full_call_ms"]) == [sa_autoaug_benchmark.SYNTHETIC]
    assert str(tmp_path / "absent") in figures["skipped"]
    assert figures["skipped"] in sa_autoaug_benchmark.table(figures)


def _tiny_params(tmp_path) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"].update(min_size_train=[96], max_size_train=128, min_size_test=96, max_size_test=128,
                           fpn_channels=32)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def test_precision_benchmark_times_each_variant_against_fp32_in_fresh_processes(tmp_path, capsys):
    from benchmarks import precision as precision_benchmark
    from pipelines import hardware

    precision_benchmark.main(["--params", str(_tiny_params(tmp_path)), "--images", "8", "--classes", "native",
                              "--steps", "1", "--repeats", "1", "--json"])
    figures = json.loads(capsys.readouterr().out)
    native = figures["classes"]["native"]
    assert list(native["variants"]) == ["fp32/contiguous", "fp32/channels_last", "bf16/contiguous",
                                        "bf16/channels_last"]
    assert native["variants"]["fp32/contiguous"]["ratio"] == 1.0
    assert all(len(v["runs_step_s"]) == 1 and v["step_s"] > 0 for v in native["variants"].values())
    auto = hardware.resolve("auto", "auto", torch.device("cpu"))
    assert native["auto"] == f"{auto.precision}/{'channels_last' if auto.channels_last else 'contiguous'}"
    assert native["variants"]["bf16/contiguous"]["emulated"] == (auto.precision != "bf16")
    assert "| fp32/contiguous |" in precision_benchmark.table(figures)


@pytest.mark.slow
def test_sizing_benchmark_runs_a_candidate_through_the_stages(capsys):
    from benchmarks import sizing

    tiny = ("dataset.train_size=8 dataset.val_size=4 dataset.min_side=128 dataset.max_side=160 "
            "model.min_size_train=[128] model.max_size_train=160 model.min_size_test=128 model.max_size_test=160 "
            "train.max_iter=2 train.ims_per_batch=4 train.log_period=1 train.warmup_iters=1 loader.num_workers=0 "
            "evaluate.ims_per_batch=2 train.nproc=1")  # one process: the stages' start-up is most of the CPU here
    sizing.main(["--candidate", tiny, "--json"])
    (found,) = json.loads(capsys.readouterr().out)["candidates"]
    assert found["images"] == 8 and found["train_s"] > 0 and found["evaluate_s"] > 0
    assert 0 <= found["metrics"]["AP"] <= 1 and found["precision"] in ("bf16", "fp32")


def test_fresh_clone_benchmark_runs_the_makefiles_test_command_and_counts_what_pytest_says(tmp_path):
    """The suite is timed with the command ``make test`` runs; its counts and exit code come from pytest's
    last line, so a failing suite is recorded as failing, not as a time."""
    from benchmarks import fresh_clone

    assert fresh_clone.make_test_command(REPO / "Makefile") == "pytest -n 2 --dist loadfile -rs --durations=25"
    assert "bash .ci/run" not in fresh_clone.make_test_command(REPO / "Makefile")  # the recipe, not CI's steps
    failing = "python -c \"print('== 2 failed, 5 passed, 1 skipped in 3.0s =='); raise SystemExit(1)\""
    found = fresh_clone._timed_tests(tmp_path, failing, dict(os.environ), tmp_path / "tests.log")
    assert found["exit_code"] == 1 and found["counts"] == {"failed": 2, "passed": 5, "skipped": 1}
    assert (tmp_path / "tests.log").read_text().startswith("== 2 failed")


def test_fresh_clone_benchmark_refuses_a_workdir_that_holds_files(tmp_path):
    from benchmarks import fresh_clone

    (tmp_path / "kept.txt").write_text("a user's file")
    with pytest.raises(fresh_clone.FreshCloneError, match=r"--workdir .*: expected an empty or new folder"):
        fresh_clone.main(["--workdir", str(tmp_path), "--no-tests"])
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_predict_benchmark_quick_run_times_every_case_side_by_side(capsys, one_thread):
    """Two real photos, every case once (PyTorch fp32 and auto, ONNX Runtime torch-free and behind predict's
    runner) with a random-weight model of 80 COCO categories exported on the way; the table reads the figures."""
    from benchmarks import predict as predict_benchmark

    require(COCO_REAL)
    predict_benchmark.main(["--quick", "--random", "--threads", "1", "--json"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(figures["cases"]) == set(predict_benchmark.CASES)
    assert figures["settings"]["photos"] == 2 and figures["settings"]["threads"] == 1
    assert figures["model"]["weights"] == "random" and figures["model"]["categories"] == 80
    assert figures["model"]["export_seconds"] > 0
    assert set(figures["steps_ms"]) == set(predict_benchmark.STEP_CASES) == {"torch_fp32", "torch_auto", "onnx"}
    for steps in figures["steps_ms"].values():
        assert set(steps) == set(predict_benchmark.STEPS) and min(steps.values()) > 0
    for case in figures["cases"].values():
        assert case["images_per_second"] > 0 and len(case["seconds"]) == 1
    assert figures["cases"]["torch_fp32"]["vs_baseline"] == 1
    assert figures["cases"]["torch_auto"]["precision"] == figures["settings"]["auto_precision"]
    # the same network and post-processing: ONNX Runtime keeps as many detections as PyTorch fp32
    found = {name: case["detections_per_image"] for name, case in figures["cases"].items()}
    assert found["onnx_runner"] == found["torch_fp32"]
    table = predict_benchmark.table(figures)
    assert "| `onnx`: ONNX Runtime, torch-free" in table and "random weights" in table and "goal >= 2x" in table
    assert "| `onnx`: PIL, PIL resize, ONNX Runtime, numpy |" in table


def test_predict_benchmark_without_the_photos_says_so_in_one_line(tmp_path):
    from benchmarks import predict as predict_benchmark
    from pipelines.errors import ConfigError

    with pytest.raises(ConfigError, match=r"images: folder not found; the benchmark times predict on the real photos"):
        predict_benchmark.main(["--photos", str(tmp_path), "--random"])
