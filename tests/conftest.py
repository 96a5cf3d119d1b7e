"""Shared fixtures: tiny synthetic datasets made by the code, and the shared real data when present."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SHARED_DATA", REPO.parent / "shared" / "data"))
COCO_REAL = SHARED_DATA / "coco-real-33"
KNOWN_ANSWER = SHARED_DATA / "cocoeval-known-answer"

# pytest-xdist's workers run tests at once, and each test's stages would take the whole CPU budget in
# threads: share it between the workers instead, as a user does for a `dvc queue start -j 2` sweep
# (docs/hardware.md). Beside a busy core, a tiny training run took 0.7 of its CPU time with 1 thread
# against 2 (ci profile, 2 cores).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "PIPELINES_THREADS" not in os.environ:
    from pipelines.hardware import threads_per_process

    os.environ["PIPELINES_THREADS"] = str(threads_per_process(_WORKERS))  # the budget's share: it is not set yet


def set_dotted(tree: dict, dotted: str, value) -> None:
    """Set the key ``dotted`` (``train.base_lr``) of a params tree in place; ``KeyError`` as the value
    deletes it."""
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[leaf]
    else:
        node[leaf] = value


def dvc_stages(repo: Path) -> dict[str, dict]:
    """The stages of ``dvc.yaml`` and of the search's ``search/pipeline.yaml`` (named as DVC names them once
    ``make search`` has linked it as ``search/dvc.yaml``: ``search/dvc.yaml:baseline``), as DVC resolves them
    (``vars``, params): per stage its ``cmd``, its file ``deps`` and its ``outs`` (metrics and plots
    included), paths as written."""
    from dvc.dependency.param import ParamsDependency
    from dvc.dvcfile import ProjectFile
    from dvc.repo import Repo

    def described(stage) -> dict:
        return {"cmd": stage.cmd, "deps": [d.def_path for d in stage.deps if not isinstance(d, ParamsDependency)],
                "outs": [o.def_path for o in stage.outs]}

    with Repo(str(repo)) as dvc:
        stages = {name: described(stage) for name, stage in ProjectFile(dvc, os.path.join(repo, "dvc.yaml")).stages.items()}
        search = ProjectFile(dvc, os.path.join(repo, "search", "pipeline.yaml"), verify=False)  # not a DVC file name
        return stages | {f"search/dvc.yaml:{name}": described(stage) for name, stage in search.stages.items()}


def train_outputs(folder: str | Path) -> list[str]:
    """The train stage's output options for a folder laid out as dvc.yaml lays out ``outputs/train``
    (the training log and preview are passed on their own)."""
    folder = Path(folder)
    return ["--checkpoints", str(folder / "checkpoints"), "--run-file", str(folder / "checkpoints" / "run.json"),
            "--model", str(folder / "model_final.pth"), "--run", str(folder / "run.json")]


def require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared data not found at {path}")
    return path


@pytest.fixture(scope="module")
def base_params() -> dict:
    """params.yaml as a dict, for tests that change a copy of it."""
    return yaml.safe_load((REPO / "params.yaml").read_text())


@pytest.fixture
def restore_logging():
    """``cli.run`` points the root logger at the captured stderr; put the handlers back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture
def one_thread():
    """Pin torch to one thread, as in data-loader workers; on a shared 2-core machine a second
    intra-op thread only adds waits for tiny tensors."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def coco_real() -> tuple[Path, Path]:
    """``(annotations, image folder)`` of the 33 real COCO images."""
    root = require(COCO_REAL)
    return root / "annotations" / "instances.json", root / "images"


@pytest.fixture(scope="session")
def known_answer() -> Path:
    return require(KNOWN_ANSWER)


@pytest.fixture(scope="session")
def tiny_synthetic(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A 12-image synthetic split: ``(annotations path, image folder, coco dict)``."""
    from pipelines.data.synthetic import generate_split

    root = tmp_path_factory.mktemp("synthetic")
    coco = generate_split(root / "images", split="train", size=12, seed=3, num_classes=5, min_side=256,
                          max_side=416, min_objects=2, max_objects=8)
    path = root / "train.json"
    path.write_text(json.dumps(coco))
    return path, root / "images", coco


@pytest.fixture(scope="session")
def tiny_cache(tiny_synthetic, tmp_path_factory):
    """An :class:`AnnotationCache` of the tiny synthetic split (training: empty images dropped)."""
    from pipelines.data.annotation_cache import AnnotationCache, build_cache, file_sha256

    path, images, coco = tiny_synthetic
    out = tmp_path_factory.mktemp("cache") / "train"
    build_cache(coco, out, image_root=str(images), source_sha256=file_sha256(path), drop_empty=True)
    return AnnotationCache(out)


def scene(height: int, width: int, seed: int):
    """An ``uint8 [H, W, 3]`` image of a few filled shapes on a gradient (what the ONNX tests detect on)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    image = Image.fromarray(np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 90)], 2).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(5):
        x0, y0 = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
        box = (x0, y0, x0 + int(rng.integers(20, width // 2)), y0 + int(rng.integers(20, height // 2)))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    return np.asarray(image)


def spy_on_head_loss(model) -> dict:
    """Record what ``model``'s head loss is called with (``outputs``, ``anchors``, ``matched``) in the returned
    dict, each time, while computing it as before."""
    seen = {}
    compute_loss = model.head.compute_loss

    def spy(targets, head_outputs, anchors, matched_idxs):
        seen.update(outputs=head_outputs, anchors=anchors, matched=matched_idxs)
        return compute_loss(targets, head_outputs, anchors, matched_idxs)

    model.head.compute_loss = spy
    return seen
