"""stages.predict: a random-weight tiny detector saved as train saves it, run on nested images, a video and
bad inputs; its outputs, its errors, and its detections against evaluation's."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from pycocotools.coco import COCO

from pipelines import checkpoint, cli
from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.config.load import load_params, params_from_dict
from pipelines.data.annotation_cache import AnnotationCache, build_cache, file_sha256
from pipelines.data.dataset import DetectionDataset
from pipelines.data.loader import make_test_loader
from pipelines.data.synthetic import generate_split
from pipelines.evaluation import predict as evaluation_predict
from pipelines.hardware import resolve
from pipelines.inference import sources, torch_backend
from pipelines.inference.backend import category_ids
from pipelines.inference.ground_truth import GroundTruth
from pipelines.inference.trained_params import trained_params
from stages import predict as stage

from .conftest import REPO, set_dotted
from .test_bad_input import make_fifo, png_header_bomb, save_image

SIZE = (96, 64)  # width, height of the test images
FRAMES, FPS = 6, 10


@pytest.fixture(autouse=True)
def one_thread_each(monkeypatch):
    """One torch thread, in the stage too (it takes PIPELINES_THREADS): tiny tensors gain nothing from a second
    thread, and a second one waits whenever the cores are busy."""
    monkeypatch.setenv("PIPELINES_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _params_tree() -> dict:
    tree = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, value in {"model.min_size_test": 64, "model.max_size_test": 96, "model.score_thresh": 0.05,
                       "model.precision": "fp32", "model.channels_last": False, "evaluate.tta_scales": [80],
                       "evaluate.tta_max_size": 128, "evaluate.backend": "pycocotools",
                       "dataset.num_classes": 3}.items():
        set_dotted(tree, key, value)
    return tree


def _save_model(path: Path, tree: dict, categories: list[dict], *, precision: str = "fp32") -> None:
    params = params_from_dict(tree)
    torch.manual_seed(0)
    model = build_model.detector(params, num_classes=len(categories),
                                 compute=resolve("fp32", False, torch.device("cpu")), pretrained=False)
    checkpoint.save(path, model=model.state_dict(), categories=categories, iteration=8, precision=precision,
                    channels_last=False)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _write_video(path: Path, frames: int = FRAMES, fps: int = FPS) -> None:
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = SIZE[0], SIZE[1], "yuv420p"
        rng = np.random.default_rng(1)
        for _ in range(frames):
            pixels = rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


def _read_video(path: Path) -> tuple[int, Fraction]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return sum(1 for _ in container.decode(stream)), Fraction(stream.average_rate)


CATEGORIES = [{"id": 1, "name": "circle"}, {"id": 3, "name": "square"}, {"id": 7, "name": "triangle"}]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A repository-like folder: params.yaml, a dvc.lock whose train entry records the model's params (its
    model section differs from params.yaml's: fpn_channels), the model, good images in nested folders with
    colliding names, a video, and the bad inputs."""
    root = tmp_path_factory.mktemp("predict")
    tree = _params_tree()
    trained = json.loads(json.dumps(tree))
    (root / "params.yaml").write_text(yaml.safe_dump({**tree, "model": {**tree["model"], "fpn_channels": 32}}))
    model = root / "outputs" / "train" / "model_final.pth"
    model.parent.mkdir(parents=True)
    _save_model(model, trained, CATEGORIES)
    lock = {"schema": "2.0", "stages": {"train": {
        "cmd": "python -m pipelines.launch stages.train",
        "params": {"params.yaml": {"model": trained["model"], "loader": trained["loader"], "seed": 0,
                                   "tracking.experiment": "detection"}},
        "outs": [{"path": "outputs/train/model_final.pth", "hash": "md5", "md5": _md5(model),
                  "size": model.stat().st_size}]}}}
    (root / "dvc.lock").write_text(yaml.safe_dump(lock))
    (root / "trained.yaml").write_text(yaml.safe_dump(trained))

    good = root / "good"
    save_image(good / "a" / "img.jpg", SIZE, seed=1)
    save_image(good / "b" / "img.jpg", SIZE, seed=2)
    save_image(good / "b" / "deep" / "c.png", SIZE, seed=3)
    exif = Image.Exif()
    exif[0x0112] = 6
    save_image(good / "b" / "turned.jpg", SIZE, seed=4, exif=exif.tobytes())
    _write_video(good / "clip.mp4")

    bad = root / "bad"
    save_image(bad / "truncated.jpg", SIZE, seed=5)
    (bad / "truncated.jpg").write_bytes((bad / "truncated.jpg").read_bytes()[:-40])
    (bad / "text.jpg").write_text("not an image\n")
    (bad / "empty.jpg").write_bytes(b"")
    (bad / "folder.jpg").mkdir()
    png_header_bomb(bad / "huge.png", 30000, 30000)
    (bad / "broken.mp4").write_text("not a video\n")
    return root


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """``stages.predict`` in this process: (exit code, stderr)."""
    code = 0
    try:
        cli.run(stage.main, argv)
    except SystemExit as exit_:
        code = exit_.code or 0
    return code, capsys.readouterr().err


@pytest.fixture
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    return workspace


BAD = ["bad/truncated.jpg", "bad/text.jpg", "bad/empty.jpg", "bad/folder.jpg", "bad/pipe.jpg", "bad/huge.png",
       "bad/broken.mp4"]


def _bad_inputs(root: Path) -> Path:
    """The list file naming the bad inputs (the FIFO made afresh: a watchdog unblocks a reader)."""
    make_fifo(root / "bad" / "pipe.jpg")
    listing = root / "bad.txt"
    listing.write_text("# the bad inputs\n" + "\n".join(BAD) + "\n")
    return listing


def test_predict_on_folders_a_video_and_bad_inputs(in_workspace, capsys):
    root = in_workspace
    out = root / "out"
    (out / "stale").mkdir(parents=True)  # a previous run's folder: replaced once the new one is complete
    code, err = _run(["good", str(_bad_inputs(root).name), "--model", "outputs/train/model_final.pth",
                      "--out", "out", "--score", "0.0", "--batch", "2"], capsys)
    assert code == 0, err
    skipped_lines = [line for line in err.splitlines() if "WARNING: skipped" in line]
    assert len(skipped_lines) == len(BAD), err
    for name, reason in [("truncated.jpg", "truncated"), ("text.jpg", "unreadable image"), ("empty.jpg", "empty file"),
                         ("folder.jpg", "a folder"), ("pipe.jpg", "a FIFO"), ("huge.png", "30000x30000 pixels"),
                         ("broken.mp4", "unreadable video (Invalid data found when processing input)")]:
        assert sum(name in line and reason in line for line in skipped_lines) == 1, (name, err)
    assert sum("EXIF orientation 6" in line for line in err.splitlines()) == 1
    assert "not an output" not in err and "md5 differs" not in err  # dvc.lock records this model

    assert not (out / "stale").exists() and not (out / "bad").exists()  # nothing of the skipped inputs
    for relative in ("good/a/img.jpg", "good/b/img.jpg", "good/b/deep/c.png", "good/b/turned.jpg"):
        with Image.open(out / relative) as image:
            assert image.size == SIZE
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "torch" and summary["precision"] in ("fp32", "bf16")
    assert summary["model_params"] == "dvc.lock's train entry" and summary["iteration"] == 8
    assert summary["score_thresh"] == 0.0 and summary["vis_thresh"] == 0.3
    assert (summary["images"], summary["videos"], summary["frames"]) == (4, 1, FRAMES)
    assert sorted(Path(s["file"]).name for s in summary["skipped"]) == sorted(Path(b).name for b in BAD)
    assert all(s["reason"] for s in summary["skipped"]) and summary["ms_per_image"] > 0

    assert _read_video(out / "good" / "clip.mp4") == (FRAMES, Fraction(FPS))
    coco = COCO(str(out / "coco.json"))
    results = coco.loadRes(str(out / "predictions.json"))
    images = coco.dataset["images"]
    assert [i["id"] for i in images] == list(range(1, 5 + FRAMES))
    assert {i["file_name"] for i in images} == {"good/a/img.jpg", "good/b/img.jpg", "good/b/deep/c.png",
                                               "good/b/turned.jpg", "good/clip.mp4"}
    assert sorted(i["frame_index"] for i in images if "frame_index" in i) == list(range(FRAMES))
    predictions = json.loads((out / "predictions.json").read_text())
    assert {d["category_id"] for d in predictions} <= {c["id"] for c in CATEGORIES}
    assert {d["frame_index"] for d in predictions if "frame_index" in d} == set(range(FRAMES))
    assert all(set(d) <= {"image_id", "category_id", "bbox", "score", "frame_index"} for d in predictions)
    assert len(results.getAnnIds()) == len(predictions) == summary["detections"] > 0
    for d in predictions:
        x, y, w, h = d["bbox"]
        assert 0 <= x and 0 <= y and x + w <= SIZE[0] + 1e-3 and y + h <= SIZE[1] + 1e-3


def test_strict_stops_at_the_first_bad_input_and_writes_nothing(in_workspace, capsys):
    root = in_workspace
    shutil.rmtree(root / "strict", ignore_errors=True)
    code, err = _run([str(_bad_inputs(root).name), "good", "--model", "outputs/train/model_final.pth",
                      "--out", "strict", "--strict"], capsys)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: bad/truncated.jpg: unreadable image (Image is incomplete or truncated)"], err
    assert not (root / "strict").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".strict")]


def test_video_stride_keeps_every_nth_frame(in_workspace, capsys):
    code, err = _run(["good/clip.mp4", "--model", "outputs/train/model_final.pth", "--out", "stride",
                      "--vid-stride", "4", "--score", "0.0"], capsys)
    assert code == 0, err
    assert _read_video(in_workspace / "stride" / "clip.mp4") == (2, Fraction(FPS, 4))
    predictions = json.loads((in_workspace / "stride" / "predictions.json").read_text())
    assert {d["frame_index"] for d in predictions} == {0, 4}


@pytest.mark.parametrize("args, expected", [
    (["--model", "missing.pth"], "error: missing.pth: checkpoint not found"),
    (["--model", "outputs/train/model_final.pth", "--params", "params.yaml"],
     "error: outputs/train/model_final.pth: does not match params.yaml's model section (Error(s) in loading"),
    (["--model", "outputs/train/model_final.pth", "--coco-gt", "other_gt.json"],
     "error: outputs/train/model_final.pth: trained on other categories than other_gt.json has"),
    (["--model", "outputs/train/model_final.pth", "--vis-thresh", "2"], "error: --vis-thresh: expected a score"),
    (["--model", "outputs/train/model_final.pth", "--device", "cuda:7"], "error: --device cuda:7: no such CUDA device"),
], ids=["missing-model", "other-model-params", "other-categories", "bad-threshold", "no-such-device"])
def test_a_model_that_does_not_fit_stops_with_one_line_and_writes_nothing(in_workspace, capsys, args, expected):
    (in_workspace / "other_gt.json").write_text(json.dumps(
        {"images": [], "annotations": [], "categories": [{"id": 1, "name": "circle"}, {"id": 2, "name": "dog"}]}))
    code, err = _run(["good/a/img.jpg", "--out", "refused", *args], capsys)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected), err
    assert not (in_workspace / "refused").exists()


def test_the_command_exits_2_with_one_line(workspace):
    """``python -m stages.predict`` as a user runs it (the process's own exit path)."""
    done = subprocess.run([sys.executable, "-m", "stages.predict", "good", "--model", "gone.pth", "--out", "cli"],
                          cwd=workspace, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: gone.pth: checkpoint not found"]
    assert not (workspace / "cli").exists()


def test_no_detections_gives_empty_results(in_workspace, capsys):
    code, err = _run(["good/a", "--model", "outputs/train/model_final.pth", "--out", "none", "--score", "1.0"], capsys)
    assert code == 0, err
    assert json.loads((in_workspace / "none" / "predictions.json").read_text()) == []
    assert json.loads((in_workspace / "none" / "summary.json").read_text())["detections"] == 0
    images = json.loads((in_workspace / "none" / "coco.json").read_text())["images"]
    assert [i["file_name"] for i in images] == ["img.jpg"]


def test_sources_keep_paths_relative_to_their_common_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a/img.jpg", "b/img.jpg", "b/sub/x.png", "b/notes.json"):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_bytes(b"")
    Path("list.txt").write_text("a/img.jpg\n\n# comment\nb/sub/x.png\n")

    def relative(*args: str) -> list[str]:
        return [i.relative for i in sources.expand(list(args))]

    assert relative("a/img.jpg", "b/img.jpg") == ["a/img.jpg", "b/img.jpg"]
    assert relative("b") == ["img.jpg", "sub/x.png"]
    assert relative("a", "b") == ["a/img.jpg", "b/img.jpg", "b/sub/x.png"]
    assert relative("b/**/*.png") == ["sub/x.png"]
    assert relative("list.txt") == ["a/img.jpg", "b/sub/x.png"]
    assert relative("a/img.jpg", "a/img.jpg") == ["img.jpg"]
    assert [i.relative for i in sources.expand(["b"], exclude="b/sub")] == ["img.jpg"]  # the output folder
    missing = sources.expand(["nothing/*.jpg", "gone.jpg"])
    assert [i.problem for i in missing] == ["no file matches this pattern", "file not found"]


def test_precision_auto_resolves_on_this_machine(workspace, tmp_path):
    model = tmp_path / "bf16.pth"
    _save_model(model, json.loads(json.dumps(_params_tree())), CATEGORIES, precision="bf16")
    params = workspace / "trained.yaml"
    cpu = torch.device("cpu")
    as_trained, _ = torch_backend.load(model, device=cpu, precision="as-trained", params_file=params)
    auto, _ = torch_backend.load(model, device=cpu, precision="auto", params_file=params, score_thresh=0.2)
    fp32, _ = torch_backend.load(model, device=cpu, precision="fp32", params_file=params)
    assert as_trained.precision == "bf16"
    assert auto.precision == resolve("auto", "auto", cpu).precision
    assert fp32.precision == "fp32" and auto.score_thresh == 0.2 and auto.categories == CATEGORIES


@pytest.fixture(scope="module")
def synthetic_split(tmp_path_factory):
    """Four synthetic images of the three categories, their COCO JSON and annotation cache."""
    root = tmp_path_factory.mktemp("synthetic")
    coco = generate_split(root / "images", split="val", size=4, seed=5, num_classes=3, min_side=64, max_side=96,
                          min_objects=1, max_objects=3)
    (root / "val.json").write_text(json.dumps(coco))
    build_cache(coco, root / "cache", image_root=str(root / "images"), source_sha256=file_sha256(root / "val.json"),
                drop_empty=False)
    return root, coco


@pytest.mark.parametrize("tta", [False, True], ids=["plain", "tta"])
def test_torch_backend_detects_as_evaluation_does(workspace, synthetic_split, tmp_path, monkeypatch, capsys, tta):
    root, coco = synthetic_split
    categories = [{"id": c["id"], "name": c["name"]} for c in coco["categories"]]
    tree = _params_tree()
    set_dotted(tree, "evaluate.tta", tta)
    model_file = tmp_path / "model.pth"
    _save_model(model_file, tree, categories)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tree))
    p = load_params(tmp_path / "params.yaml")

    cache = AnnotationCache(root / "cache")
    model, _, _ = build_model.trained_detector(p, model_file, categories=cache.categories, split=root / "cache",
                                               device=torch.device("cpu"))
    build_model.use_evaluate(model, p)  # evaluation's post-processing (box voting), as the evaluate stage sets it
    model.score_thresh = 0.0
    dataset = DetectionDataset(cache, transforms=build_data.test_transforms(p), seed=p.seed, skip_crowd=False)
    loader = make_test_loader(dataset, batch_size=1, aspect_grouping=False)
    with contextlib.redirect_stderr(io.StringIO()):
        expected = evaluation_predict(model, loader, device=torch.device("cpu"), category_ids=cache.category_ids,
                                      tta=build_data.test_time_augmentation(p), size_divisibility=32, progress=False)

    backend, _ = torch_backend.load(model_file, device=torch.device("cpu"), precision="as-trained",
                                    params_file=tmp_path / "params.yaml", score_thresh=0.0)
    with contextlib.redirect_stderr(io.StringIO()):  # evaluation's own loop runs unchanged on the backend
        through_backend = evaluation_predict(backend, loader, device=torch.device("cpu"),
                                             category_ids=category_ids(backend),
                                             tta=build_data.test_time_augmentation(p), size_divisibility=32,
                                             progress=False)
    assert through_backend == expected

    monkeypatch.chdir(tmp_path)
    code, err = _run([str(root / "images"), "--model", str(model_file), "--params", "params.yaml", "--out", "out",
                      "--score", "0.0", "--precision", "as-trained", "--coco-gt", str(root / "val.json"),
                      *(["--tta"] if tta else [])], capsys)
    assert code == 0, err
    assert "Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]" in err
    got = json.loads((tmp_path / "out" / "predictions.json").read_text())
    assert [d["image_id"] for d in got] == [d["image_id"] for d in expected]  # ids from the ground truth by file name
    assert len(got) == len(expected) > 0
    for ours, theirs in zip(got, expected):
        assert ours["category_id"] == theirs["category_id"]
        assert ours["score"] == pytest.approx(theirs["score"], abs=1e-6)
        assert ours["bbox"] == pytest.approx(theirs["bbox"], abs=1e-4)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["tta"] is tta and set(summary["metrics"]) >= {"AP", "AP50", "ARl"}


def test_ground_truth_ids_by_file_name(tmp_path):
    path = tmp_path / "gt.json"
    path.write_text(json.dumps({"images": [{"id": 5, "file_name": "val/0001.jpg"}, {"id": 9, "file_name": "0002.jpg"}],
                                "annotations": [], "categories": CATEGORIES}))
    gt = GroundTruth(path)
    gt.check_categories(CATEGORIES, "model.pth")
    assert [gt.image_id(name) for name in ("images/val/0001.jpg", "0002.jpg", "b/0002.jpg", "0001.jpg", "x.jpg")] \
        == [5, 9, None, None, None]
    assert gt.matched == {5, 9} and gt.max_id == 9


def test_dvc_lock_gives_the_params_and_says_when_it_does_not_record_the_file(workspace, tmp_path, caplog):
    model = workspace / "outputs" / "train" / "model_final.pth"
    lock = workspace / "dvc.lock"
    p, source = trained_params(model, lock=lock)
    assert source == f"{lock}'s train entry" and p.model.fpn_channels == 64  # params.yaml says 32
    assert not caplog.records
    copy = tmp_path / "copy.pth"
    shutil.copy(model, copy)
    trained_params(copy, lock=lock)
    assert "not an output of the train stage" in caplog.text
    changed = tmp_path / "dvc.lock"
    changed.write_text(lock.read_text().replace(_md5(model), "0" * 32))
    shutil.copy(workspace / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "outputs" / "train").mkdir(parents=True)
    shutil.copy(model, tmp_path / "outputs" / "train" / "model_final.pth")
    trained_params(tmp_path / "outputs" / "train" / "model_final.pth", lock=changed)
    assert "(md5 differs)" in caplog.text
