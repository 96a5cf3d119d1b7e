"""The machine report: ``python -m pipelines.doctor`` (or ``make doctor``), what a bug report should paste.

It says what this machine offers training: the CPU and the cores this process may use (affinity and
cgroup quota), the instruction set torch runs at and whether bf16 is native, the GPUs, the torch and
CUDA versions, free disk where outputs go and whether the MLflow store answers. Then, for
``params.yaml``: what ``auto`` resolves to, the threads each training process gets, and a speed probe
of a few seconds that predicts how long ``dvc repro`` of that configuration takes here from scratch.

The probe runs what one training process runs per iteration: ``train.ims_per_batch / train.nproc``
images at the training size (random pixels and boxes: only sizes and the model matter to speed), one
warm-up step and :data:`PROBE_STEPS` timed ones, with the threads a training process gets; then one
inference batch at the test size. The prediction adds up

    STARTUP_S + prepare + train images / (nproc x probe rate x PARALLEL) + val images x views / inference rate
    + EXPORT_S + val images x export views / inference rate

(views: 1, or with ``evaluate.tta`` one plus each extra scale's area relative to the test size,
doubled with flips; export views: the export's parity runs the test-size view five times and all the
test-time views twice, in PyTorch and in ONNX Runtime, whether or not ``evaluate.tta`` is on)

with the constants measured on both CPU classes (``docs/hardware.md`` gives the measurements and
the prediction next to the real time). ``--no-probe`` leaves the probe out; ``--json`` prints one JSON
object instead of the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torchvision

from . import cli, hardware
from .build import model as build_model
from .build import train as build_train
from .tracking import store
from .config.load import load_params
from .config.schema import Params, SyntheticDataset
from .data.collate import Batch

PROBE_STEPS = 3
# Calibration of the prediction (docs/hardware.md): training processes on a shared CPU run at this
# fraction of the probe's rate (which runs alone), and a pipeline spends this long starting
# processes, DVC, MLflow and the preview; the synthetic set takes this long per image to generate.
PARALLEL = 0.88
STARTUP_S = 45.0
PREPARE_S_PER_IMAGE = 0.016
EXPORT_S = 20.0  # the ONNX exporter and the export stage's start-up


@dataclass
class Probe:
    train_images_per_s: float  # one training process
    inference_images_per_s: float
    seconds: float  # the probe's own duration


def training_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def threads_per_process(p: Params, device: torch.device) -> int:
    """The torch threads each of ``train.nproc`` processes gets (as :func:`pipelines.distributed.init_from_env`
    sets them on the CPU; on GPUs torchrun's one)."""
    return hardware.threads_per_process(p.train.nproc) if device.type == "cpu" else 1


def probe(p: Params, compute: hardware.Compute, device: torch.device, *, steps: int = PROBE_STEPS) -> Probe:
    """Time what one training process does per iteration, and one inference batch (see the module docstring)."""
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_process(p, device))
    try:
        torch.manual_seed(0)
        num_classes = p.dataset.num_classes if isinstance(p.dataset, SyntheticDataset) else 80
        model = build_model.detector(p, num_classes=num_classes, compute=compute, pretrained=False).to(device)
        optimizer = build_train.optimizer(p, model)
        scheduler = build_train.scheduler(p, optimizer)
        scaler = build_train.grad_scaler(compute, device)
        from .engine import train_step

        per_process = max(1, p.train.ims_per_batch // p.train.nproc)
        side = max(p.model.min_size_train)
        batch = _batch(per_process, side, min(p.model.max_size_train, side * 5 // 4), device,
                       p.loader.size_divisibility, num_classes)
        model.train()
        times = []
        for _ in range(steps + 1):
            tick = time.perf_counter()
            train_step(model, batch, optimizer, scheduler, p.train.clip_grad_norm, scaler)
            _sync(device)
            times.append(time.perf_counter() - tick)
        train_rate = per_process / statistics.median(times[1:])

        model.eval()
        test = _batch(p.evaluate.ims_per_batch // p.train.nproc or 1, p.model.min_size_test,
                      min(p.model.max_size_test, p.model.min_size_test * 5 // 4), device, p.loader.size_divisibility,
                      num_classes)
        with torch.no_grad():
            model(test.images, test.image_sizes)  # warm-up
            tick = time.perf_counter()
            model(test.images, test.image_sizes)
            _sync(device)
            inference_rate = len(test.image_sizes) / (time.perf_counter() - tick)
    finally:
        torch.set_num_threads(threads)
    return Probe(train_rate, inference_rate, time.perf_counter() - start)


def _batch(images: int, height: int, width: int, device: torch.device, divisibility: int, num_classes: int) -> Batch:
    pad = lambda n: -(-n // divisibility) * divisibility  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (images, 3, pad(height), pad(width)), dtype=torch.uint8, generator=generator)
    targets = []
    for i in range(images):  # five boxes of the three COCO area ranges
        sizes = torch.tensor([16.0, 40.0, 64.0, 110.0, 180.0])
        x0 = torch.linspace(4, width - 190, 5)
        boxes = torch.stack([x0, x0 * height / width, x0 + sizes, x0 * height / width + sizes], dim=1)
        targets.append({"boxes": boxes.clamp(max=min(height, width) - 1),
                        "labels": torch.arange(5) % num_classes})
    return Batch(pixels, [(height, width)] * images, targets, list(range(images))).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def predict_seconds(p: Params, found: Probe) -> dict[str, float] | None:
    """The predicted wall time of ``dvc repro`` from scratch, by part; ``None`` for datasets of unknown size."""
    dataset = p.dataset
    if not isinstance(dataset, SyntheticDataset):
        return None
    parts = {
        "prepare": (dataset.train_size + dataset.val_size) * PREPARE_S_PER_IMAGE,
        "train": p.train.max_iter * p.train.ims_per_batch / (p.train.nproc * found.train_images_per_s * PARALLEL),
        "evaluate": dataset.val_size * _views(p) / (p.train.nproc * found.inference_images_per_s),
        "export": EXPORT_S + dataset.val_size * (5 + 2 * _views(p, always=True))
        / (p.train.nproc * found.inference_images_per_s),
        "start-up (processes, DVC, MLflow)": STARTUP_S,
    }
    parts["total"] = sum(parts.values())
    return parts


def _views(p: Params, *, always: bool = False) -> float:
    """Inference work per val image in test-size views: 1, plus each test-time scale's area, doubled by flips
    (only with ``evaluate.tta``, unless ``always``)."""
    evaluate = p.evaluate
    if not (evaluate.tta or always):
        return 1.0
    views = 1 + sum((scale / p.model.min_size_test) ** 2 for scale in evaluate.tta_scales)
    return views * (2 if evaluate.tta_flip else 1)


def report(p: Params, *, params_file: str, run_probe: bool = True) -> dict:
    """Everything the report says, as plain values."""
    device = training_device()
    compute = build_model.compute(p, device)
    root = store.repo_root()
    usage = shutil.disk_usage(root)
    gpus = [{"name": torch.cuda.get_device_name(i),
             "memory_gb": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
             "native_bf16": torch.cuda.get_device_capability(i) >= (8, 0)} for i in range(torch.cuda.device_count())]
    found = probe(p, compute, device) if run_probe else None
    return {
        "cpu": hardware.cpu_model(),
        "architecture": platform.machine(),
        "logical_cores": torch.cpu.get_capabilities().get("num_logical_cores") or 0,
        "affinity": len(os.sched_getaffinity(0)),
        "cgroup_quota": hardware.cpu_quota(),
        "cpu_budget": hardware.cpu_budget(),
        "isa": hardware.cpu_isa(),
        "native_bf16_cpu": hardware.native_bf16_cpu(),
        "gpus": gpus,
        "nccl": (".".join(map(str, torch.cuda.nccl.version())) if gpus and torch.distributed.is_nccl_available()
                 else None),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "disk_free_gb": round(usage.free / 1e9, 1),
        "disk_path": str(root),
        "mlflow": store.store_status(),
        "params": params_file,
        "device": str(device),
        "compute": asdict(compute),
        "processes": p.train.nproc,
        "threads_per_process": threads_per_process(p, device),
        "probe": asdict(found) if found else None,
        "prediction_s": predict_seconds(p, found) if found else None,
    }


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"


def render(r: dict) -> str:
    """The report as text: one ``name  value`` line each."""
    quota = f"cgroup quota {r['cgroup_quota']:g} CPUs" if r["cgroup_quota"] is not None else "no cgroup quota"
    gpus = "; ".join(f"{i}: {g['name']}, {g['memory_gb']} GiB, bf16 {'native' if g['native_bf16'] else 'emulated'}"
                     for i, g in enumerate(r["gpus"])) or "none"
    c = r["compute"]
    lines = [
        ("CPU", f"{r['cpu']} ({r['architecture']}), {r['logical_cores']} logical cores"),
        ("CPU budget", f"{r['cpu_budget']} cores (affinity {r['affinity']}, {quota})"),
        ("instruction set", r["isa"]),
        ("native bf16 (CPU)", f"yes, {r['native_bf16_cpu']}" if r["native_bf16_cpu"] else "no: bf16 is emulated"),
        ("GPUs", gpus),
        ("NCCL", r["nccl"] or "-"),
        ("versions", f"torch {r['torch']} (CUDA {r['cuda_build'] or 'none'}), torchvision {r['torchvision']}, "
                     f"Python {r['python']}"),
        ("disk", f"{r['disk_free_gb']} GB free in {r['disk_path']}"),
        ("MLflow store", r["mlflow"]),
        ("params", r["params"]),
        ("compute", f"on {r['device']}: precision {c['precision']}, "
                    f"channels_last {'on' if c['channels_last'] else 'off'} ({c['reason']})"),
        ("processes", f"{r['processes']} training processes x {r['threads_per_process']} threads"
                      + (f" ({hardware.THREADS_ENV})" if os.environ.get(hardware.THREADS_ENV, "").strip() else "")),
    ]
    if c["warning"]:
        lines.append(("warning", c["warning"]))
    probe_found = r["probe"]
    if probe_found:
        lines.append(("speed probe", f"{probe_found['train_images_per_s']:.2f} training images/s per process, "
                                     f"{probe_found['inference_images_per_s']:.1f} inference images/s "
                                     f"({probe_found['seconds']:.1f} s)"))
        prediction = r["prediction_s"]
        if prediction:
            parts = ", ".join(f"{k} {_minutes(v)}" for k, v in prediction.items() if k != "total")
            lines.append(("predicted dvc repro", f"{_minutes(prediction['total'])} from scratch, within about 25% "
                                                 f"({parts})"))
        else:
            lines.append(("predicted dvc repro", "not predicted: only the built-in dataset's size is known"))
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="the parameters file (default: params.yaml)")
    parser.add_argument("--no-probe", action="store_true", help="leave out the speed probe and the prediction")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    args = parser.parse_args(argv)
    r = report(load_params(args.params), params_file=args.params, run_probe=not args.no_probe)
    print(json.dumps(r, indent=2) if args.json else render(r))
    sys.stdout.flush()


if __name__ == "__main__":
    cli.run(main)
