"""End to end: ``dvc repro`` of all four stages on a tiny configuration in a copy of the repository, an
evaluate-only ``dvc exp run``, and the MLflow runs and lineage they leave."""

import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.fresh_clone import copy_tree

from .conftest import REPO, dvc_stages

pytestmark = pytest.mark.slow

TINY = [
    "dataset.train_size=16", "dataset.val_size=6", "dataset.min_side=128", "dataset.max_side=192",
    "model.min_size_train=[128]", "model.max_size_train=192", "model.min_size_test=128", "model.max_size_test=192",
    "train.max_iter=4", "train.ims_per_batch=4", "train.log_period=1", "train.warmup_iters=1",
    "evaluate.ims_per_batch=2", "evaluate.tta=false", "loader.num_workers=0",
]  # train.checkpoint_period stays 250: a run shorter than the checkpoint period must work
# End-to-end tests about something other than DDP train and evaluate in one process: each process imports
# torch, torchvision and MLflow (about 7 s of CPU), and the suite is CPU-bound on 2 cores.
TINY_ONE_PROCESS = [*TINY, "train.nproc=1"]


def _copy_repo(dest: Path) -> None:
    """The files git would commit (tracked and untracked, not ignored), in a fresh git repository, less the
    committed run's ``dvc.lock`` and ``metrics/``."""
    copy_tree(REPO, dest, leave_out=("dvc.lock", "metrics"))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _repro(repo: Path, *args: str) -> set[str]:
    """Run ``dvc repro``; return the stages that ran."""
    done = subprocess.run(["dvc", "repro", *args], cwd=repo, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return set(re.findall(r"Running stage '([\w/.:]+)'", done.stdout))


def _set_param(repo: Path, section: str, key: str, value) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params[section][key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("pipeline")
    _copy_repo(repo)
    composed = subprocess.run([sys.executable, "-m", "pipelines.compose", *TINY], cwd=repo, env=_env(),
                              capture_output=True, text=True)
    assert composed.returncode == 0, composed.stderr
    return repo


def _runs(repo: Path, stage: str | None = None):
    """The MLflow client and the runs of experiment ``detection`` (of one ``pipeline.stage``, if given)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("detection")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return client, [r for r in runs if stage is None or r.data.tags.get("pipeline.stage") == stage]


def _dvc_json(repo: Path, *args: str):
    done = subprocess.run(["dvc", *args, "--json"], cwd=repo, env=_env(), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _lineage(repo: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.lineage", name], cwd=repo, env=_env(), capture_output=True,
                          text=True, timeout=120)


COCO_FIGURES = ["AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl"]
INTERVALS = [f"{name}_{side}" for name in COCO_FIGURES[:6] for side in ("low", "high")]  # evaluate.bootstrap
PER_IOU = [f"AP_iou{t}" for t in range(50, 100, 5)]


def test_repro_runs_five_stages_and_records_a_training_and_an_evaluation_run(repo):
    assert _repro(repo) == {"prepare", "cache", "train", "evaluate", "export"}
    # the policy search (search/pipeline.yaml) is a pipeline of its own, which DVC sees only once `make search`
    # links it: the default repro never starts it, and DVC's commands over every pipeline find nothing missing
    assert not (repo / "search" / "outputs").exists() and not (repo / "search" / "data").exists()
    assert _repro(repo, "--dry") == set() and _dvc_json(repo, "status") == {}
    checkout = subprocess.run(["dvc", "checkout"], cwd=repo, env=_env(), capture_output=True, text=True)
    assert checkout.returncode == 0 and "ERROR" not in checkout.stderr, checkout.stderr  # `dvc pull`: test_team

    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    # headline figures only: as wide whatever the number of classes
    assert list(metrics) == [*COCO_FIGURES, *INTERVALS, *PER_IOU]
    assert 0.0 <= metrics["AP"] <= 1.0
    for key in ("AP", "AP50", "AP75", "APs", "APm", "APl"):
        assert metrics[key] is None or 0.0 <= metrics[key] <= 1.0  # None: no ground truth of that size
        if metrics[key] is None:
            assert metrics[f"{key}_low"] is None and metrics[f"{key}_high"] is None
        else:
            assert metrics[f"{key}_low"] <= metrics[key] <= metrics[f"{key}_high"]
    assert abs(sum(metrics[key] for key in PER_IOU) / len(PER_IOU) - metrics["AP"]) <= 1e-9
    per_category = json.loads((repo / "metrics" / "per_category.json").read_text())
    assert {row["category"] for row in per_category} <= {"circle", "rectangle", "triangle", "star", "cross"}
    assert all(set(row) == {"category", "AP"} and 0.0 <= row["AP"] <= 1.0 for row in per_category)
    assert (repo / "metrics" / "pr_curve.json").is_file()
    log = (repo / "metrics" / "train_log.csv").read_text().splitlines()
    assert log[0].startswith("iteration,loss,") and len(log) == 5

    shown = _dvc_json(repo, "metrics", "show")[""]["data"]
    assert shown["metrics/eval.json"]["data"] == {k: v for k, v in metrics.items() if v is not None}
    run_ids = shown["metrics/run.json"]["data"]  # the MLflow runs, listed by dvc metrics show and dvc exp show
    plots = _dvc_json(repo, "plots", "show")["data"]
    chart = plots["Per-category AP (val)"][0]["content"]
    assert chart["mark"]["type"] == "bar" and len(chart["data"]["values"]) == len(per_category)
    assert "metrics/per_category.json" not in plots  # no second, default chart of the same file
    counts = {row["item"]: row["count"] for row in plots["Dataset counts"][0]["content"]["data"]["values"]}
    assert counts["train: images"] == 16 and counts["val: images"] == 6 and "train: boxes of circle" in counts
    assert set(shown) == {"metrics/eval.json", "metrics/run.json", "metrics/export.json"}  # however many classes
    export = shown["metrics/export.json"]["data"]  # the ONNX export's parity, measured in the stage
    assert export["match_rate"] >= 0.99 and export["max_abs_diff"] <= 1e-3 and export["detections"] > 0
    assert export["ap_tolerance"] >= 0.002  # on these 6 images of a 4-iteration model, one box is worth more
    for kind in ("", "_tta"):
        assert abs(export[f"ap_onnx{kind}"] - export[f"ap_torch{kind}"]) <= export["ap_tolerance"]
    card = json.loads((repo / "outputs" / "export" / "model.json").read_text())
    locked = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["train"]["outs"]
    assert card["weights_md5"] == next(o["md5"] for o in locked if o["path"] == "outputs/train/model_final.pth")

    client, runs = _runs(repo)
    (training,), (evaluation,) = _runs(repo, "train")[1], _runs(repo, "evaluate")[1]
    assert len(runs) == 2  # one training and one evaluation run, not one per process
    assert run_ids == {"mlflow_run_id": evaluation.info.run_id, "mlflow_training_run_id": training.info.run_id}
    assert export["mlflow_run_id"] == card["mlflow_run_id"] == training.info.run_id
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert training.data.params["train.base_lr"] == str(params["train"]["base_lr"])
    assert training.data.params["dataset.name"] == "synthetic"
    assert training.data.params["augment.name"] == "sa_autoaug"  # the default: the pipeline runs with it end to end
    assert not any(k.startswith("evaluate.") for k in training.data.params)  # evaluation runs hold those
    history = client.get_metric_history(training.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert {"train/lr", "train/classification"} <= set(training.data.metrics)
    assert not any(k.startswith("eval/") for k in training.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(training.info.run_id)}
    assert {"model", "params.yaml", "preview", "augment_policy.txt"} <= artifacts
    assert "checkpoints" not in artifacts  # tracking.log_checkpoints is off by default
    assert (repo / "outputs" / "train" / "augment_preview.png").stat().st_size > 0
    assert [a.path for a in client.list_artifacts(training.info.run_id, "model")] == ["model/model_final.pth"]

    # the precision and layout auto resolved to here: recorded in both runs and stored with the model
    import torch

    from pipelines.hardware import resolve

    resolved = resolve("auto", "auto", torch.device("cpu"))
    for run in (training, evaluation):
        assert run.data.params["compute.precision"] == resolved.precision
        assert run.data.params["compute.channels_last"] == str(resolved.channels_last)
    stored = torch.load(repo / "outputs" / "train" / "model_final.pth", weights_only=True)
    assert (stored["precision"], stored["channels_last"]) == (resolved.precision, resolved.channels_last)

    assert {"train.base_lr", "evaluate.tta", "dataset.name"} <= set(evaluation.data.params)
    assert evaluation.data.metrics["eval/AP"] == pytest.approx(metrics["AP"])
    for key in ("AP_low", "AP_high", "AP_iou50", "AP_iou95"):
        assert evaluation.data.metrics[f"eval/{key}"] == pytest.approx(metrics[key])
    assert {f"eval/AP_{row['category']}" for row in per_category} <= set(evaluation.data.metrics)
    assert {"eval", "params.yaml"} <= {a.path for a in client.list_artifacts(evaluation.info.run_id)}
    tags = evaluation.data.tags
    assert tags["training_run_id"] == training.info.run_id
    assert tags["params.sha256"] == hashlib.sha256((repo / "params.yaml").read_bytes()).hexdigest()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    model = next(o for o in lock["train"]["outs"] if o["path"] == "outputs/train/model_final.pth")
    assert tags["dvc.lock/train/outputs/train/model_final.pth"] == model["md5"]
    cache_meta = json.loads((repo / "data" / "cache" / "val" / "meta.json").read_text())
    arrays = json.dumps(cache_meta["arrays"], sort_keys=True).encode()
    assert tags["data.cache.val"] == hashlib.sha256(arrays).hexdigest()
    for run in (training, evaluation):
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.source.git.commit"] and run.data.tags["data.cache.train"]
    # readable names: no DVC experiment here, so the params changed against conf/'s defaults, own section first
    assert evaluation.info.run_name.startswith("evaluate.ims_per_batch=2, ")
    assert training.info.run_name.endswith(" (train)") and "evaluate." not in training.info.run_name


@pytest.mark.parametrize("model, key", [("outputs/export/model.onnx", "ap_onnx"),
                                        ("outputs/train/model_final.pth", "ap_torch")])
def test_predict_on_the_val_split_gives_the_ap_the_export_measured(repo, monkeypatch, restore_logging, model, key):
    """Each backend's AP on the val images, through predict as a user runs it (one image at a time, fp32),
    is the figure the export stage recorded for it."""
    import stages.predict
    from pipelines import cli

    import torch

    monkeypatch.chdir(repo)
    out = repo / "outputs" / f"predict-{key}"
    threads = torch.get_num_threads()  # predict sets torch's threads for the backend it loads
    cli.run(stages.predict.main, ["data/prepared/images/val", "--model", model, "--out", str(out),
                                  "--coco-gt", "data/prepared/val.json", "--precision", "fp32"])  # exit 0
    summary = json.loads((out / "summary.json").read_text())
    export = json.loads((repo / "metrics" / "export.json").read_text())
    assert summary["metrics"]["AP"] == pytest.approx(export[key], abs=1e-6)  # (the COCO scorers may differ in
    # the last bits: predict scores a .pth with evaluate.backend, the export with pycocotools)
    shutil.rmtree(out)
    torch.set_num_threads(threads)


def test_an_export_that_misses_parity_stops_in_one_line_and_replaces_nothing(repo, monkeypatch, capsys,
                                                                               restore_logging):
    """(The exporter and the measurement are stood in for: what is tested is what the stage does with
    figures that miss, on the pipeline's real inputs.)"""
    import stages.export
    from pipelines import cli
    from pipelines.inference import onnx_export, parity

    exported = repo / "outputs" / "export"
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    metrics_before = (repo / "metrics" / "export.json").read_bytes()
    monkeypatch.setattr(onnx_export, "export", lambda detector, path, **_: [
        shutil.copy(exported / name, path.parent / name) for name in ("model.onnx", "model.json")])
    monkeypatch.setattr(parity, "measure", lambda *a, **k: parity.Parity(2e-3, 0.5, 10, 0.5, 0.4, 0.6, 0.6))
    monkeypatch.chdir(repo)
    with pytest.raises(SystemExit) as stopped:
        cli.run(stages.export.main, ["--cache", "data/cache", "--prepared", "data/prepared", "--model",
                                     "outputs/train/model_final.pth", "--train-run", "outputs/train/run.json",
                                     "--out", "outputs/export", "--metrics", "metrics/export.json"])
    assert stopped.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line == ("error: outputs/train/model_final.pth: the ONNX export misses parity: max_abs_diff 0.002 (at "
                    "most 0.001); match_rate 0.5000 (at least 0.99); ap_onnx 0.4 against ap_torch 0.5 (within "
                    "0.002); nothing written to outputs/export")
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before
    assert (repo / "metrics" / "export.json").read_bytes() == metrics_before
    assert not [p.name for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_what_a_run_writes_is_what_dvc_yaml_declares(repo):
    """Every file the pipeline wrote is a declared output of a stage (or inside one), or one of the
    deliberate exceptions: the resume state and the lock in ``outputs/train/checkpoints/`` (the train
    stage's working folder), the MLflow store, and DVC's own files."""
    declared = {out for stage in dvc_stages(repo).values() for out in stage["outs"]}
    assert "outputs/eval/run.json" in declared and "metrics/train_log.csv" in declared  # ${paths.*} resolved
    tracked = set(subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True)
                  .stdout.splitlines())
    deliberate = (".git/", ".dvc/", "dvc_plots/", "mlartifacts/", "outputs/train/checkpoints/")
    undeclared = []
    for path in sorted(p for p in repo.rglob("*") if p.is_file()):
        name = path.relative_to(repo).as_posix()
        if (name in tracked or name.startswith(deliberate) or "__pycache__" in name or path.name == ".gitignore"
                or name == "dvc.lock" or name.startswith("mlflow.db")):
            continue
        if not any(name == out or name.startswith(out.rstrip("/") + "/") for out in declared):
            undeclared.append(name)
    assert undeclared == []


def test_second_repro_does_nothing(repo):
    assert _repro(repo) == set()
    assert len(_runs(repo)[1]) == 2


def test_an_evaluate_only_experiment_gets_a_run_of_its_own_linked_both_ways(repo):
    """``dvc exp run -S evaluate.tta=true`` after the default run (the issue's case) re-runs evaluate only."""
    client, (baseline,) = _runs(repo, "evaluate")
    (training,) = _runs(repo, "train")[1]
    before = baseline.data.metrics
    overrides = [a for o in TINY for a in ("-S", o)]
    done = subprocess.run(["dvc", "exp", "run", "-n", "tta", *overrides, "-S", "evaluate.tta=true"], cwd=repo,
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert set(re.findall(r"Running stage '(\w+)'", done.stdout)) == {"evaluate"}

    client, runs = _runs(repo, "evaluate")
    assert len(runs) == 2 and len(_runs(repo, "train")[1]) == 1
    tta = next(r for r in runs if r.info.run_id != baseline.info.run_id)
    assert (baseline.data.params["evaluate.tta"], tta.data.params["evaluate.tta"]) == ("False", "True")
    for run in runs:  # each configuration: its own params, one eval/AP value, the same training run
        assert len(client.get_metric_history(run.info.run_id, "eval/AP")) == 1
        assert run.data.tags["training_run_id"] == training.info.run_id
    assert client.get_run(baseline.info.run_id).data.metrics == before  # the baseline's run is untouched
    assert tta.info.run_name == "tta" and tta.data.tags["dvc.exp_name"] == "tta" and tta.data.tags["dvc.baseline_rev"]

    # experiment -> runs: the run ids are in a DVC-tracked metrics file that dvc exp show lists
    ids = {"mlflow_run_id": tta.info.run_id, "mlflow_training_run_id": training.info.run_id}
    assert json.loads((repo / "metrics" / "run.json").read_text()) == ids
    shown = json.dumps(_dvc_json(repo, "exp", "show"))
    assert tta.info.run_id in shown and training.info.run_id in shown
    by_name = _lineage(repo, "tta")
    assert by_name.returncode == 0, by_name.stderr
    for run in (tta, training):
        assert f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}" in by_name.stdout

    # run -> experiment: how to restore it, and the params hash to check it by
    by_run = _lineage(repo, tta.info.run_id)
    assert by_run.returncode == 0, by_run.stderr
    assert "dvc exp apply tta" in by_run.stdout
    assert hashlib.sha256((repo / "params.yaml").read_bytes()).hexdigest() in by_run.stdout
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert head in by_run.stdout

    unknown = _lineage(repo, "no-such-experiment")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.strip().splitlines() == [
        "error: no-such-experiment: not an MLflow run id, DVC experiment or git revision of this repository"]
    _set_param(repo, "evaluate", "tta", False)  # back to the baseline's params for the tests below


def test_same_params_and_code_give_the_same_model_bit_for_bit(repo):
    import torch

    first = torch.load(repo / "outputs" / "train" / "model_final.pth", weights_only=True)["model"]
    done = subprocess.run(["dvc", "repro", "--force", "--single-item", "train"], cwd=repo, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    second = torch.load(repo / "outputs" / "train" / "model_final.pth", weights_only=True)["model"]
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # two gloo processes, bf16, same result
    assert len(_runs(repo, "train")[1]) == 2


def test_switching_the_augmentation_preset_and_the_learning_rate_reruns_train_and_evaluate_only(repo):
    from pipelines.compose import compose_params

    augment = yaml.safe_load(compose_params(repo, ["augment=flip"]))["augment"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["augment"] = augment
    params["train"]["base_lr"] = 0.0005
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert _repro(repo) == {"train", "evaluate", "export"}
    client, runs = _runs(repo, "train")
    latest = max(runs, key=lambda r: r.info.start_time)
    assert latest.data.params["augment.name"] == "flip"
    artifacts = {a.path for a in client.list_artifacts(latest.info.run_id)}
    assert "preview" in artifacts and "augment_policy.txt" not in artifacts
    evaluation = max(_runs(repo, "evaluate")[1], key=lambda r: r.info.start_time)
    assert evaluation.data.tags["training_run_id"] == latest.info.run_id and "eval/AP" in evaluation.data.metrics


OUTPUTS = ("data/prepared", "data/cache", "outputs/train/model_final.pth", "outputs/train/run.json",
           "outputs/train/augment_preview.png", "outputs/eval/detections.json", "metrics/dataset.json",
           "metrics/train_log.csv", "metrics/eval.json", "metrics/per_category.json", "metrics/pr_curve.json",
           "metrics/run.json")


def _snapshot(repo: Path) -> dict[str, bytes]:
    files = {}
    for name in OUTPUTS:
        path = repo / name
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                files[str(file.relative_to(repo))] = file.read_bytes()
    return files


@pytest.mark.parametrize(("section", "key", "value", "message"), [
    ("train", "ims_per_batch", 7, "train.ims_per_batch: expected a multiple of the number of processes"),
    ("dataset", "max_objects", 0, "dataset.max_objects: expected >= dataset.min_objects"),
    ("train", "base_lr", 1e30, "(not finite); training stopped"),
])
def test_a_failing_stage_keeps_every_earlier_output(repo, section, key, value, message):
    before = _snapshot(repo)
    assert len(before) > 20
    params = (repo / "params.yaml").read_text()
    _set_param(repo, section, key, value)
    try:
        done = subprocess.run(["dvc", "repro"], cwd=repo, env=_env(), capture_output=True, text=True, timeout=900)
    finally:
        (repo / "params.yaml").write_text(params)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in done.stderr
    assert _snapshot(repo) == before  # nothing removed, nothing half-written
    assert _repro(repo) == set()  # and the pipeline is still up to date


def _descendants(pid: int) -> list[int]:
    """``pid``'s descendants now (threads and processes that end while they are read are passed over)."""
    children = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    return children + [d for c in children for d in _descendants(c)]


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _runs_module(pid: int, module: str) -> bool:
    """Whether ``pid`` is a Python process running ``-m module``, directly or as a launched process
    (``-m pipelines.lifetime --die-with PID module``); not a shell that starts one (dash, Debian's
    ``/bin/sh``, which DVC runs commands with when ``SHELL`` is unset, stays in between)."""
    argv = _argv(pid)
    if "-m" not in argv:
        return False
    ran = argv[argv.index("-m") + 1:]
    if ran[:2] == ["pipelines.lifetime", "--die-with"]:
        ran = ran[3:]
    return ran[:1] == [module]


def _training_processes(pid: int) -> list[int]:
    """The training processes among ``pid``'s descendants: the launcher's children, not their loader workers
    (forked, with the same command line)."""
    def parent(child: int) -> int:
        return int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])

    found = []
    for child in _descendants(pid):
        with contextlib.suppress(OSError):
            if _runs_module(child, "stages.train") and _runs_module(parent(child), "pipelines.launch"):
                found.append(child)
    return found


@contextlib.contextmanager
def _killed_on_failure(dvc: subprocess.Popen):
    """Kill the ``dvc`` this test started (and so its stage) if the test fails while it runs: a ``dvc repro``
    left running would hold the repository's lock for the tests after."""
    try:
        yield
    except BaseException:
        dvc.kill()
        dvc.wait()
        raise


def _signal_training(repo: Path, *, at: int) -> tuple[subprocess.CompletedProcess, int]:
    """Start ``dvc repro train``; once the training log has a row for iteration ``at`` or later, SIGKILL one
    of the training processes the test started (found by pid among its descendants). Returns the finished
    ``dvc repro`` and the iteration the log had reached."""
    log = repo / "outputs" / "train" / "checkpoints" / "train_log.csv"
    dvc = subprocess.Popen(["dvc", "repro", "train"], cwd=repo, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    stale = log.stat().st_mtime_ns if log.is_file() else None  # a log this run has not written yet
    deadline, reached = time.monotonic() + 600, 0
    with _killed_on_failure(dvc):
        while time.monotonic() < deadline and dvc.poll() is None:
            fresh = log.is_file() and log.stat().st_mtime_ns != stale
            rows = log.read_text().splitlines()[1:] if fresh else []
            reached = int(rows[-1].split(",")[0]) if rows else 0
            if reached >= at and (targets := _training_processes(dvc.pid)):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"training did not reach iteration {at}: {dvc.communicate()[1][-2000:]}")
        os.kill(random.Random(at).choice(targets), signal.SIGKILL)
        stdout, stderr = dvc.communicate(timeout=600)
    return subprocess.CompletedProcess(dvc.args, dvc.returncode, stdout, stderr), reached


def _weights(repo: Path) -> bytes:
    return (repo / "outputs" / "train" / "model_final.pth").read_bytes()


def test_killed_or_stopped_training_resumes_to_the_same_weights_bit_for_bit(repo):
    """A worker killed: one line, the earlier model kept; the next run resumes. Ctrl-C (SIGINT to the process
    group, as a terminal sends it: to dvc, the launcher, both processes and their loader workers): one line,
    a checkpoint at the stop, the MLflow run KILLED; the next run resumes from that checkpoint. With
    launch.max_restarts, a worker killed costs nothing: the group restarts, resumes, and the stage succeeds.
    The final model is the uninterrupted run's, bit for bit. (Each run is ``dvc repro train``: the test
    evaluates nothing, and the test after it re-runs evaluate.)"""
    _set_param(repo, "train", "max_iter", 12)
    _set_param(repo, "train", "checkpoint_period", 2)
    _set_param(repo, "loader", "num_workers", 1)  # a loader worker in each process, which Ctrl-C also reaches
    assert _repro(repo, "train") == {"train"}
    uninterrupted = hashlib.sha256(_weights(repo)).hexdigest()
    client, runs = _runs(repo, "train")
    count = len(runs)

    _set_param(repo, "train", "log_period", 2)  # a new run (other params): it starts from iteration 0
    killed, killed_at = _signal_training(repo, at=random.Random().randint(3, 4))  # after checkpoint 2
    assert killed.returncode != 0
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "was killed by SIGKILL" in errors[0], killed.stderr[-3000:]
    assert "ChildFailedError" not in killed.stderr
    assert hashlib.sha256(_weights(repo)).hexdigest() == uninterrupted  # the earlier model is still there

    dvc, reached = _start_training(repo, "train", at=killed_at + 2, start_new_session=True)  # its own group
    os.killpg(dvc.pid, signal.SIGINT)
    _, stderr = dvc.communicate(timeout=120)
    assert dvc.returncode != 0 and stderr.count("resuming from") == 1
    lines = stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert [lines[i] for i in errors] == ["error: stopped by SIGINT"], stderr[-3000:]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    assert lines[errors[0] + 1].startswith("ERROR: failed to reproduce 'train'")  # then DVC's own line
    stop_checkpoint = max((repo / "outputs" / "train" / "checkpoints").glob("model_*.pth"))
    stopped_at = int(stop_checkpoint.stem.split("_")[1])
    assert stopped_at >= reached  # the stop's own checkpoint, at or after the iteration the log had reached
    assert max(_runs(repo, "train")[1], key=lambda r: r.info.start_time).info.status == "KILLED"

    _set_param(repo, "launch", "max_restarts", 1)
    _set_param(repo, "tracking", "log_checkpoints", True)  # not in the fingerprint: the run resumes
    resumed, _ = _signal_training(repo, at=stopped_at + 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("resuming from") == 2 and "error:" not in resumed.stderr
    assert f"resuming from {stop_checkpoint.relative_to(repo)} (iteration {stopped_at})" in resumed.stderr
    assert hashlib.sha256(_weights(repo)).hexdigest() == uninterrupted
    print(f"killed at {killed_at}, stopped at {stopped_at}; sha256 {uninterrupted}")

    client, runs = _runs(repo, "train")
    assert len(runs) == count + 1  # the killed, stopped, resumed and restarted run is one MLflow run
    latest = max(runs, key=lambda r: r.info.start_time)
    assert latest.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(latest.info.run_id, "train/loss")]
    assert sorted(steps) == [2, 4, 6, 8, 10, 12]  # no step logged twice
    logged = [a.path for a in client.list_artifacts(latest.info.run_id, "checkpoints")]
    assert logged == ["checkpoints/model_0000008.pth", "checkpoints/model_0000010.pth"]  # train.keep_checkpoints
    assert not list((repo / "outputs" / "train" / "checkpoints").glob("model_*.pth"))  # finished: removed
    assert all(r.info.status in ("FINISHED", "FAILED", "KILLED") for r in _runs(repo)[1])
    _set_param(repo, "launch", "max_restarts", 0)
    assert _dvc_json(repo, "status", "train") == {}  # the launch section is not the stage's dependency


def _start_training(repo: Path, *targets: str, at: int, env: dict | None = None,
                    **popen) -> tuple[subprocess.Popen, int]:
    """Start ``dvc repro`` (of ``targets`` and what they need, if given); return it once the training log of
    this run has a row for iteration ``at`` or later (and that iteration)."""
    log = repo / "outputs" / "train" / "checkpoints" / "train_log.csv"
    stale = log.stat().st_mtime_ns if log.is_file() else None
    dvc = subprocess.Popen(["dvc", "repro", *targets], cwd=repo, env=env or _env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and dvc.poll() is None:
        fresh = log.is_file() and log.stat().st_mtime_ns != stale
        rows = log.read_text().splitlines()[1:] if fresh else []
        if rows and (reached := int(rows[-1].split(",")[0])) >= at:
            return dvc, reached
        time.sleep(0.05)
    pytest.fail(f"training did not reach iteration {at}: {dvc.communicate()[1][-2000:]}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_alive, pids))


def _state(repo: Path) -> dict[str, object]:
    """What a failed run must not change: the train stage's outputs (bytes) and its working folder
    (names, sizes, times), and any temporary file of an atomic write."""
    outputs = [repo / "outputs" / "train" / name for name in ("model_final.pth", "run.json", "augment_preview.png")]
    outputs.append(repo / "metrics" / "train_log.csv")
    work = repo / "outputs" / "train" / "checkpoints"
    state = {str(p): p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() for p in outputs}
    state.update({str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in work.rglob("*") if p.is_file()})
    state["temporary"] = sorted(str(p) for folder in (work, work.parent, repo / "metrics")
                                for p in folder.glob(".*.*") if not p.name.startswith(".lock"))
    return state


def test_sigkill_of_the_launcher_or_of_dvc_leaves_nothing_running_and_the_next_run_resumes(repo, tmp_path):
    """What the OOM killer does, to the launcher (2 gloo processes, fp32) and then to ``dvc`` itself:
    every process of the stage is gone within seconds, nothing more is written, no temporary file or
    folder stays. Then the run file is lost as well: the next ``dvc repro`` still resumes from the
    checkpoints (same fingerprint), in a new MLflow run linked to the one it continues."""
    for section, key, value in (("model", "precision", "fp32"), ("train", "nproc", 2), ("train", "max_iter", 16),
                                ("train", "checkpoint_period", 2), ("train", "log_period", 1),
                                ("launch", "max_restarts", 0), ("tracking", "log_checkpoints", False),
                                ("loader", "num_workers", 0)):
        _set_param(repo, section, key, value)
    env = {**_env(), "TMPDIR": str(tmp_path)}
    for target, at in (("pipelines.launch", 5), ("dvc", 9)):
        dvc, reached = _start_training(repo, at=at, env=env)
        family = [pid for pid in _descendants(dvc.pid) if _runs_module(pid, "pipelines.launch")]
        family += [pid for pid in _descendants(dvc.pid) if _runs_module(pid, "stages.train")]
        assert len(family) == 3  # the launcher and its 2 processes
        for pid in family:  # held still while the state is read, so that "before" is the state at the kill
            os.kill(pid, signal.SIGSTOP)
        before = _state(repo)
        os.kill(family[0] if target == "pipelines.launch" else dvc.pid, signal.SIGKILL)
        for pid in family[1:] if target == "pipelines.launch" else family:
            os.kill(pid, signal.SIGCONT)
        _, stderr = dvc.communicate(timeout=60)
        assert dvc.returncode != 0
        assert _gone_within(family, 5), f"still running after {target} was killed: {list(filter(_alive, family))}"
        time.sleep(2)
        after = _state(repo)
        assert after["temporary"] == [] and after == before  # nothing written after the failure
        if target == "dvc":
            assert "resuming from" in stderr  # the kill of the launcher cost nothing but the iterations since
    assert len(list(tmp_path.glob("torchelastic_*"))) == 1  # the last killed launcher's log folder (each start
    # removes those of launchers that are gone)...

    run_file = repo / "outputs" / "train" / "checkpoints" / "run.json"
    killed_run = json.loads(run_file.read_text())["run_id"]
    run_file.unlink()
    done = subprocess.run(["dvc", "repro", "evaluate"], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(tmp_path.glob("torchelastic_*"))  # ...are removed by the next launch
    resumed_from = int(re.search(r"resuming from .* \(iteration (\d+)\)", done.stderr).group(1))
    assert resumed_from >= 8
    client, runs = _runs(repo, "train")
    latest = max(runs, key=lambda r: r.info.start_time)
    assert latest.info.run_id != killed_run and latest.data.tags["train.continues_run"] == killed_run
    assert len(latest.data.tags["train.fingerprint"]) == 64
    assert client.get_run(killed_run).info.status == "KILLED"
    assert not list(run_file.parent.glob("model_*.pth"))


def _launch(repo: Path, params: dict, module_args: list[str], *, cores: set[int], store: Path) -> subprocess.Popen:
    """``python -m pipelines.launch`` with ``params`` (written beside ``store``), pinned to ``cores``,
    recording into the MLflow store ``store``."""
    path = store.parent / f"params-{os.urandom(4).hex()}.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    return subprocess.Popen([sys.executable, "-m", "pipelines.launch", "--params", str(path), *module_args], cwd=repo,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))


def _finish(*processes: subprocess.Popen) -> None:
    for process in processes:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _readme_two_nodes() -> tuple[dict[str, str], list[tuple[int, list[str]]]]:
    """docs/distributed.md's "Two nodes on one machine" block: its compose overrides, and each launcher's core and
    arguments after ``python -m pipelines.launch``."""
    section = (REPO / "docs" / "distributed.md").read_text().split("**Two nodes on one machine**", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    overrides, launchers = {}, []
    for line in block.splitlines():
        words = shlex.split(line.rstrip(" &"))
        if words[:3] == ["python", "-m", "pipelines.compose"]:
            overrides.update(word.split("=", 1) for word in words[3:])
        elif words[:2] == ["taskset", "-c"] and words[3:6] == ["python", "-m", "pipelines.launch"]:
            launchers.append((int(words[2]), words[6:]))
    return overrides, launchers


def test_two_nodes_of_one_process_train_the_weights_of_one_node_of_two(repo, tmp_path):
    """docs/distributed.md's two launchers on 127.0.0.1, one gloo process each, each pinned to one core, as each of one
    node's two processes gets one of its two cores (here with the tiny params, a free port, other outputs)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    import torch

    overrides, launchers = _readme_two_nodes()
    assert overrides == {"launch.nodes": "2", "launch.rdzv_endpoint": "127.0.0.1:29400", "train.nproc": "1"}
    assert [core for core, _ in launchers] == [0, 1] and launchers[0][1] == launchers[1][1]
    cores = sorted(os.sched_getaffinity(0))[:2]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["train"]["nproc"] == 2 and _dvc_json(repo, "status", "train") == {}  # the model: one node of two
    for key, value in overrides.items():
        section, name = key.split(".")
        params[section][name] = yaml.safe_load(value)
    params["launch"]["rdzv_endpoint"] = f"127.0.0.1:{_free_port()}"
    # the train stage's command as dvc.yaml has it, but for launch.nodes
    assert launchers[0][1] == shlex.split(dvc_stages(repo)["train"]["cmd"])[3:]
    args = [arg.replace("outputs/train/", f"{tmp_path}/two/").replace("metrics/", f"{tmp_path}/two/")
            for arg in launchers[0][1]]
    _finish(*[_launch(repo, params, args, cores={cores[core]}, store=tmp_path / "mlflow.db") for core, _ in launchers])

    one, two = (torch.load(path, weights_only=True)["model"]
                for path in (repo / "outputs" / "train" / "model_final.pth", tmp_path / "two" / "model_final.pth"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert (tmp_path / "two" / "train_log.csv").is_file() and (tmp_path / "two" / "augment_preview.png").is_file()


def test_distributed_evaluation_gives_the_metrics_of_one_process(repo, tmp_path):
    """One image per process per batch (padding depends on the batch): 1 process scores as the
    pipeline's 2 did (``evaluate.ims_per_batch`` 2 in the tiny params)."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert (params["train"]["nproc"], params["evaluate"]["ims_per_batch"]) == (2, 2)
    assert _dvc_json(repo, "status", "evaluate") == {}  # the metrics are those of the model
    params["train"]["nproc"], params["evaluate"]["ims_per_batch"] = 1, 1
    out = tmp_path
    args = ["stages.evaluate", "--cache", "data/cache", "--prepared", "data/prepared", "--model",
            "outputs/train/model_final.pth", "--train-run", "outputs/train/run.json", "--run-file",
            str(out / "run.json"), "--metrics", str(out / "eval.json"), "--per-category",
            str(out / "per_category.json"), "--run-ids", str(out / "run_ids.json"), "--plots",
            str(out / "pr_curve.json"), "--detections", str(out / "detections.json")]
    _finish(_launch(repo, params, args, cores=set(os.sched_getaffinity(0)), store=tmp_path / "mlflow.db"))
    one, two = ([json.loads((folder / name).read_text()) for name in ("eval.json", "per_category.json")]
                for folder in (out, repo / "metrics"))
    assert one == two
    # the bootstrap's intervals too, to the byte: the scoring is deterministic
    assert "AP_low" in one[0] and (out / "eval.json").read_bytes() == (repo / "metrics" / "eval.json").read_bytes()
    assert one[0]["AP"] is not None


def test_an_unreachable_tracking_store_does_not_stop_training_or_evaluation(repo):
    """(With a new dataset seed, which re-runs every stage, and the tiny training again, in one process.)"""
    _set_param(repo, "dataset", "seed", 1)
    for section, key, value in (("train", "max_iter", 4), ("train", "checkpoint_period", 250), ("train", "nproc", 1)):
        _set_param(repo, section, key, value)
    env = {**_env(), "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}  # nothing listens on port 9
    done = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(re.findall(r"Running stage '(\w+)'", done.stdout)) == {"prepare", "cache", "train", "evaluate", "export"}
    assert json.loads((repo / "outputs" / "train" / "run.json").read_text())["run_id"] is None
    assert "MLflow store http://127.0.0.1:9 unreachable: this run is not tracked" in done.stderr
    assert json.loads((repo / "metrics" / "eval.json").read_text())["AP"] is not None
    assert json.loads((repo / "metrics" / "run.json").read_text()) == {"mlflow_run_id": None,
                                                                       "mlflow_training_run_id": None}
    assert "Traceback" not in done.stderr
