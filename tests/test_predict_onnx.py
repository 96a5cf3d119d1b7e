"""stages.predict with an exported ``.onnx``: the same detections as with the ``.pth`` it was exported from
(same label, IoU >= 0.99, score within 1e-3, at least 99 % matched; test-time augmentation off and on),
``summary.json`` naming the ONNX backend, and an ONNX file without its model card refused in one line."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from PIL import Image

from pipelines.inference import card as model_card
from pipelines.inference import onnx_export, torch_backend
from pipelines.inference.onnx_backend import is_onnx

from .conftest import scene as _scene
from .conftest import set_dotted
from .test_onnx_export import _spread
from .test_predict import CATEGORIES, _params_tree, _run, one_thread_each  # noqa: F401 (an autouse fixture)

IMAGES = [(64, 96), (96, 64), (64, 80)]  # height, width
# evaluation's post-processing levers on: levers.yaml has them, export/levers.onnx's card too
LEVERS = {"evaluate.nms_thresh": 0.5, "evaluate.merge": "vote", "evaluate.vote_thresh": 0.7,
          "evaluate.tta_source": "decoded"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder with params.yaml (the model's, tiny test sizes), the model saved as train saves it (head
    weights spread so that scores differ), its ONNX export with the card, one without the card, and images."""
    root = tmp_path_factory.mktemp("predict_onnx")
    tree = _params_tree()
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(tree))
    from pipelines import checkpoint
    from pipelines.build import model as build_model
    from pipelines.config.load import params_from_dict
    from pipelines.hardware import resolve

    p = params_from_dict(tree)
    torch.manual_seed(0)
    model = build_model.detector(p, num_classes=len(CATEGORIES), compute=resolve("fp32", False, torch.device("cpu")),
                                 pretrained=False)
    _spread(model)
    pth = root / "model_final.pth"
    checkpoint.save(pth, model=model.state_dict(), categories=CATEGORIES, iteration=8, precision="fp32",
                    channels_last=False)
    backend, _ = torch_backend.load(pth, device=torch.device("cpu"), precision="fp32", params_file=params)
    onnx_file = root / "export" / "model.onnx"
    onnx_file.parent.mkdir()
    onnx_export.export(backend.detector, onnx_file, categories=CATEGORIES, min_size_test=p.model.min_size_test,
                       max_size_test=p.model.max_size_test, size_divisibility=p.loader.size_divisibility,
                       max_image_pixels=p.dataset.max_image_pixels)
    bare = onnx.load(str(onnx_file))
    del bare.metadata_props[:]
    onnx.save(bare, str(root / "bare.onnx"))
    levers = copy.deepcopy(tree)
    for key, value in LEVERS.items():
        set_dotted(levers, key, value)
    (root / "levers.yaml").write_text(yaml.safe_dump(levers))
    voting = onnx.load(str(onnx_file))  # the card as the export writes it with those params (no second export)
    for prop in voting.metadata_props:
        if prop.key == model_card.METADATA_KEY:
            card = model_card.ModelCard.from_json(prop.value, source="export")
            prop.value = dataclasses.replace(card, nms_thresh=0.5, merge="vote", vote_thresh=0.7).to_json()
    onnx.save(voting, str(root / "export" / "levers.onnx"))
    for k, (height, width) in enumerate(IMAGES):
        path = root / "images" / ("a" if k % 2 else "b") / f"img{k}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_scene(height, width, seed=k)).save(path)
    return root


@pytest.fixture
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    return workspace


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of each box of ``a`` [N, 4] with each of ``b`` [M, 4] (xywh, as COCO results hold them); boxes
    of no area (clipped at the image's edge, which an untrained model predicts) count as the same box where
    their corners agree within 0.01 pixel."""
    ax2, ay2, bx2, by2 = a[:, 0] + a[:, 2], a[:, 1] + a[:, 3], b[:, 0] + b[:, 2], b[:, 1] + b[:, 3]
    w = np.clip(np.minimum(ax2[:, None], bx2[None]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    h = np.clip(np.minimum(ay2[:, None], by2[None]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = w * h
    union = (a[:, 2] * a[:, 3])[:, None] + (b[:, 2] * b[:, 3])[None] - inter
    same = np.abs(a[:, None] - b[None]).max(-1) <= 0.01
    return np.where(union > 0, inter / np.maximum(union, 1e-9), same.astype(float))


def match(reference: list[dict], other: list[dict]) -> tuple[float, float, int]:
    """``(match rate, largest score difference of the matches, detections)``: each detection of
    ``reference`` matched greedily, best score first, to an unused one of ``other`` on the same image with
    the same category, IoU >= 0.99 and score within 1e-3; the rate is over the larger of the two counts."""
    matched, worst = 0, 0.0
    for image_id in {d["image_id"] for d in reference + other}:
        ref = sorted((d for d in reference if d["image_id"] == image_id), key=lambda d: -d["score"])
        oth = [d for d in other if d["image_id"] == image_id]
        if not ref or not oth:
            continue
        ious = _iou(np.array([d["bbox"] for d in ref], float), np.array([d["bbox"] for d in oth], float))
        used = np.zeros(len(oth), bool)
        for i, d in enumerate(ref):
            for j in np.argsort(-ious[i]):
                e = oth[j]
                if (not used[j] and e["category_id"] == d["category_id"] and ious[i, j] >= 0.99
                        and abs(e["score"] - d["score"]) <= 1e-3):
                    used[j] = True
                    matched += 1
                    worst = max(worst, abs(e["score"] - d["score"]))
                    break
    total = max(len(reference), len(other))
    return (matched / total if total else 1.0), worst, total


def _predict(args: list[str], capsys) -> tuple[list[dict], dict]:
    code, err = _run(args, capsys)
    assert code == 0, err
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "predictions.json").read_text()), json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("tta, levers", [(False, False), (True, False), (True, True)], ids=["plain", "tta", "levers"])
def test_onnx_predicts_as_the_pth_it_was_exported_from(in_workspace, capsys, tta, levers):
    """Also with evaluation's post-processing levers on (``LEVERS``: NMS IoU, box voting, views from the
    decoded image): the .pth takes them from the params, the .onnx from its card (and the views' source
    from the params)."""
    params, exported = ("levers.yaml", "export/levers.onnx") if levers else ("params.yaml", "export/model.onnx")
    extra = ["--params", params, "--batch", "1", "--vis-thresh", "0.9"] + (["--tta"] if tta else [])
    torch_found, torch_summary = _predict(["images", "--model", "model_final.pth", "--out", f"torch{tta}{levers}",
                                           "--precision", "fp32", *extra], capsys)
    onnx_found, summary = _predict(["images", "--model", exported, "--out", f"onnx{tta}{levers}", *extra], capsys)
    merging = ("vote", 0.5) if levers else (_params_tree()["evaluate"]["merge"], 0.6)  # the repository's default
    assert (summary["merge"], summary["nms_thresh"]) == (torch_summary["merge"], torch_summary["nms_thresh"]) == merging
    rate, worst, total = match(torch_found, onnx_found)
    print(f"tta={tta}: {total} detections, match rate {rate:.4f}, max score difference {worst:.2e}")
    assert total >= 10 and rate >= 0.99 and worst <= 1e-3
    assert torch_summary["backend"] == "torch"
    assert (summary["backend"], summary["precision"], summary["images"], summary["tta"]) == ("onnx", "fp32", 3, tta)
    assert summary["score_thresh"] == pytest.approx(torch_summary["score_thresh"])
    drawn = sorted(p.name for p in (in_workspace / f"onnx{tta}{levers}").rglob("*.png"))
    assert drawn == ["img0.png", "img1.png", "img2.png"]


def test_onnx_score_overrides_the_card(in_workspace, capsys):
    found, summary = _predict(["images", "--model", "export/model.onnx", "--out", "scored", "--score", "0.3"], capsys)
    assert summary["score_thresh"] == 0.3 and all(d["score"] > 0.3 for d in found)


@pytest.mark.parametrize("args,expected", [
    (["--model", "bare.onnx"], "error: bare.onnx: an ONNX file without a model card"),
    (["--model", "gone.onnx"], "error: gone.onnx: ONNX file not found"),
    (["--model", "export/model.onnx", "--tta"], "error: --tta with an .onnx model: give --params FILE"),
    (["--model", "export/model.onnx", "--device", "cuda"], "error: --device cuda: an .onnx model runs on the CPU"),
], ids=["no-card", "missing", "tta-without-params", "device"])
def test_an_unusable_onnx_stops_with_one_line_and_writes_nothing(in_workspace, capsys, args, expected):
    code, err = _run(["images", "--out", "refused", *args], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(expected), err
    assert not (in_workspace / "refused").exists()


def test_the_model_kind_is_chosen_by_suffix():
    assert is_onnx(Path("a/model.onnx")) and is_onnx(Path("M.ONNX")) and not is_onnx(Path("model_final.pth"))
