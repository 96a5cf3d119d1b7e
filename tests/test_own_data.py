"""Your own COCO-format data: the command of docs/data.md, as written, on real photos in a copy of the repository.

``../shared/data/coco-real-33`` has one split: it serves as both train and val. The four paths are
absolute and outside the repository copy, as a user's data would be.
"""

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import COCO_REAL, REPO, require
from .test_pipeline import _copy_repo, _env

pytestmark = pytest.mark.slow

# Not in the documented command, only to keep this test near a minute on 2 cores (twice that without them): smaller
# input sizes, no loader workers, 8 of the smoke solver's 20 iterations and one process. Data, paths and stages as written.
FAST = ["-S", "model.min_size_train=[160]", "-S", "model.max_size_train=224", "-S", "model.min_size_test=160",
        "-S", "model.max_size_test=224", "-S", "loader.num_workers=0", "-S", "train.max_iter=8",
        "-S", "train.nproc=1"]
PATH_KEYS = ("dataset.train_images", "dataset.train_annotations", "dataset.val_images", "dataset.val_annotations")


def documented_command() -> list[str]:
    """The first ``bash`` block of docs/data.md's "Your own COCO-format data" section, as arguments."""
    section = (REPO / "docs" / "data.md").read_text().split("## Your own COCO-format data", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def _with_paths(command: list[str], paths: dict[str, Path]) -> list[str]:
    """``command`` with the value of each ``-S dataset.<path key>=...`` replaced; every key must be there."""
    out, seen = [], set()
    for arg in command:
        key = arg.split("=", 1)[0]
        if key in paths:
            arg, seen = f"{key}={paths[key]}", seen | {key}
        out.append(arg)
    assert seen == set(paths), f"docs/data.md's command sets {sorted(seen)}, expected {sorted(paths)}"
    return out


def _dvc(repo: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run(["dvc", *args], cwd=repo, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_documented_command_trains_on_data_outside_the_repository_and_watches_its_four_paths(tmp_path):
    shared = require(COCO_REAL)
    data = tmp_path / "my data"  # outside the repository, with a space in its path
    shutil.copytree(shared / "images", data / "images")
    shutil.copy(shared / "annotations" / "instances.json", data / "instances.json")
    repo = tmp_path / "repo"
    repo.mkdir()
    _copy_repo(repo)

    command = documented_command()
    assert command[:3] == ["dvc", "exp", "run"] and "dataset=coco" in command and "solver=smoke" in command
    assert not any(arg.startswith("dataset.source") for arg in command)
    paths = dict(zip(PATH_KEYS, (data / "images", data / "instances.json", data / "images", data / "instances.json")))
    done = _dvc(repo, *_with_paths(command, paths)[1:], *FAST)
    assert "Running stage 'prepare'" in done.stdout and "Running stage 'evaluate'" in done.stdout

    counts = {r["item"]: r["count"] for r in json.loads((repo / "metrics" / "dataset.json").read_text())}
    assert counts["train: images"] == counts["val: images"] == 33
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["dataset"] == {"name": "coco", **{k.split(".")[1]: str(v) for k, v in paths.items()},
                                 "max_image_pixels": 2**28, "max_damaged_images": 0}
    assert params["train"]["ims_per_batch"] == 4 and params["train"]["warmup_iters"] == 5  # the smoke solver
    assert json.loads((repo / "metrics" / "eval.json").read_text())["AP"] is not None
    categories = {r["item"] for r in json.loads((repo / "metrics" / "dataset.json").read_text())
                  if r["item"].startswith("train: boxes of ")}
    header = _dvc(repo, "metrics", "show").stdout.splitlines()[0].split()
    from pipelines.ap_bootstrap import IOU_FIGURES, SUMMARY_FIGURES

    # the 12 COCO figures, the 95% intervals of six of them and the AP per IoU threshold, as DVC sorts them
    coco = sorted(["AP", "AP50", "AP75", "APl", "APm", "APs", "AR1", "AR10", "AR100", "ARl", "ARm", "ARs",
                   *(f"{k}_{end}" for k in SUMMARY_FIGURES for end in ("low", "high")), *IOU_FIGURES])
    export = ["ap_onnx", "ap_onnx_tta", "ap_tolerance", "ap_torch", "ap_torch_tta", "detections", "match_rate",
              "max_abs_diff"]
    assert len(categories) > 10  # and not one column per class: the 12 COCO figures, the export's and the run ids
    assert header == ["Path", *coco, *export, "mlflow_run_id", "mlflow_training_run_id", "val_fingerprint"]
    assert "prepare" not in _dvc(repo, "status", "dvc.yaml").stdout

    # A file added under the image folder re-runs prepare; so does another path for one of the four keys.
    shutil.copy(data / "images" / sorted(p.name for p in (data / "images").iterdir())[0], data / "images" / "new.jpg")
    status = _dvc(repo, "status", "prepare").stdout
    assert "prepare:" in status and "modified:" in status and str(data / "images") in status
    (data / "images" / "new.jpg").unlink()
    assert "prepare" not in _dvc(repo, "status", "dvc.yaml").stdout
    shutil.copy(data / "instances.json", data / "val.json")
    params["dataset"]["val_annotations"] = str(data / "val.json")
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = _dvc(repo, "status", "prepare").stdout
    assert "prepare:" in status and str(data / "val.json") in status
