"""The machine report: what it says about this machine, what auto resolves to, and the prediction."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from pipelines import doctor, hardware
from pipelines.config.load import load_params

from .conftest import REPO
from .test_hardware import HOLD_AVX2


@pytest.fixture(scope="module")
def tiny_params(tmp_path_factory):
    """params.yaml with a tiny model and images, so the probe takes well under a second."""
    path = tmp_path_factory.mktemp("doctor") / "params.yaml"
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"].update(min_size_train=[96], max_size_train=128, min_size_test=96, max_size_test=128,
                           fpn_channels=32)
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def test_the_report_says_what_the_machine_offers_and_predicts_the_pipeline(tiny_params, monkeypatch):
    monkeypatch.delenv(hardware.THREADS_ENV, raising=False)
    r = doctor.report(load_params(tiny_params), params_file=str(tiny_params))
    assert r["cpu_budget"] == hardware.cpu_budget() and r["isa"] == hardware.cpu_isa()
    assert r["native_bf16_cpu"] == hardware.native_bf16_cpu()
    assert r["compute"]["precision"] == hardware.resolve("auto", "auto", doctor.training_device()).precision
    assert r["threads_per_process"] == max(1, hardware.cpu_budget() // 2)
    assert r["probe"]["train_images_per_s"] > 0 and r["probe"]["inference_images_per_s"] > 0
    prediction = r["prediction_s"]
    assert prediction["total"] == pytest.approx(sum(v for k, v in prediction.items() if k != "total"))
    assert prediction["start-up (processes, DVC, MLflow)"] == doctor.STARTUP_S
    text = doctor.render(r)
    for label in ("CPU", "CPU budget", "instruction set", "native bf16 (CPU)", "GPUs", "NCCL", "versions", "disk",
                  "MLflow store", "compute", "processes", "speed probe", "predicted dvc repro"):
        assert any(line.startswith(label + " ") for line in text.splitlines()), label
    assert "no such database" in r["mlflow"] or "answers" in r["mlflow"]
    monkeypatch.setenv(hardware.THREADS_ENV, "1")  # set by the user: what the stages take, and it says why
    assert doctor.threads_per_process(load_params(tiny_params), doctor.torch.device("cpu")) == 1
    assert " training processes x 1 threads (PIPELINES_THREADS)\n" in doctor.render({**r, "threads_per_process": 1})


def test_the_prediction_adds_up_the_parts_from_the_probe_rates(tiny_params):
    p = load_params(tiny_params)
    found = doctor.Probe(train_images_per_s=2.0, inference_images_per_s=8.0, seconds=3.0)
    parts = doctor.predict_seconds(p, found)
    d, t = p.dataset, p.train
    assert parts["train"] == pytest.approx(t.max_iter * t.ims_per_batch / (t.nproc * 2.0 * doctor.PARALLEL))
    # test-time augmentation: each extra scale costs its area relative to the test size, flips double it
    for tta, scales, flip, views in ((False, [192], True, 1), (True, [192], False, 5), (True, [192, 96], True, 12)):
        p.evaluate.tta, p.evaluate.tta_scales, p.evaluate.tta_flip = tta, scales, flip  # test size 96
        assert doctor.predict_seconds(p, found)["evaluate"] == pytest.approx(d.val_size * views / (t.nproc * 8.0))
        # the export's parity: five test-size passes and every test-time view twice (PyTorch, ONNX Runtime)
        all_views = (1 + 4 * len(scales) if scales == [192] else 1 + 4 + 1) * (2 if flip else 1)
        assert doctor.predict_seconds(p, found)["export"] == pytest.approx(
            doctor.EXPORT_S + d.val_size * (5 + 2 * all_views) / (t.nproc * 8.0))
    assert parts["prepare"] == pytest.approx((d.train_size + d.val_size) * doctor.PREPARE_S_PER_IMAGE)
    faster = doctor.predict_seconds(p, doctor.Probe(4.0, 16.0, 3.0))
    assert faster["total"] < parts["total"] and faster["start-up (processes, DVC, MLflow)"] == doctor.STARTUP_S


def test_held_to_avx2_the_report_says_fp32_and_why(tiny_params):
    done = subprocess.run([sys.executable, "-m", "pipelines.doctor", "--params", str(tiny_params), "--json"],
                          cwd=REPO, env={**os.environ, **HOLD_AVX2}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["isa"] == "AVX2, oneDNN held to AVX2" and r["native_bf16_cpu"] is None
    assert (r["compute"]["precision"], r["compute"]["channels_last"]) == ("fp32", False)
    assert r["compute"]["reason"].startswith("auto: no native bf16 on this CPU")
    assert r["prediction_s"]["total"] > 0


def test_a_bad_params_file_is_one_line(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("model: [")
    done = subprocess.run([sys.executable, "-m", "pipelines.doctor", "--params", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {bad}:1:9: not valid YAML")  # line and column
    assert len(done.stderr.strip().splitlines()) == 1
