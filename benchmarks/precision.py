"""Benchmark: training speed of each precision and memory layout on each CPU class, side by side.

What ``model.precision: auto`` and ``model.channels_last: auto`` decide rests on these figures. For
each CPU class, one training process runs the configured model (``--params``, default ``params.yaml``)
on the very same batches, made by the train stage's loader from synthetic images written to files,
``train.ims_per_batch / train.nproc`` images each, with the threads a training process gets
(``cpu_budget / train.nproc``), in four variants: fp32 contiguous (the baseline), fp32 channels_last,
bf16 contiguous and bf16 channels_last. Each variant runs in a fresh process (``--worker``), one
warm-up step and ``--steps`` timed ones; the variants take turns, in an order that rotates from
repeat to repeat. Ratios are step times against the baseline of the same class and repeat
(medians over repeats); below 1 is faster.

CPU classes: this machine as it is (``native``), and this machine held to what a lesser CPU can do,
where it is above it: ``avx512`` (AVX-512 without BF16, as Skylake-SP, Cascade Lake and Ice Lake:
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI``) and ``avx2`` (``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``). A held machine runs the lesser
kernels (tests/test_hardware.py checks it) but keeps its own cache and memory system, so its ratios
stand for the class and its absolute times do not. Where bf16 is emulated (auto picks fp32), bf16
runs ``--emulated-steps`` timed steps only: it is 2 to 20 times slower.

    python -m benchmarks.precision [--classes native avx2 ...] [--steps 4] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipelines import hardware
from pipelines.build import model as build_model
from pipelines.build import train as build_train
from pipelines.cli import exit_now
from pipelines.config.schema import Params
from pipelines.engine import train_step
from pipelines.hardware import Compute
from pipelines.lifetime import parent_death_signal

from .loader import _loader, add_dataset_arguments, load_benchmark_params, make_dataset

CLASSES = {
    "native": {},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
CLASS_NAMES = {"native": "this machine as the environment leaves it", "avx512": "held to AVX-512 without BF16",
               "avx2": "held to AVX2"}
VARIANTS = (("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True))


def worker(batches_file: Path, params_file: str, augment: str | None, precision: str, channels_last: bool,
           steps: int, emulated_steps: int) -> dict:
    """In a fresh process under a class's environment: time training steps of one variant."""
    p = load_benchmark_params(params_file, augment=augment)
    cpu = torch.device("cpu")
    torch.set_num_threads(max(1, hardware.cpu_budget() // p.train.nproc))
    auto = hardware.resolve("auto", "auto", cpu)
    emulated = precision == "bf16" and auto.precision != "bf16"
    saved = torch.load(batches_file, weights_only=False)
    torch.manual_seed(p.seed)
    compute = Compute(precision, channels_last, "benchmark variant")
    model = build_model.detector(p, num_classes=saved["num_classes"], compute=compute, pretrained=False)
    optimizer = build_train.optimizer(p, model)
    scheduler = build_train.scheduler(p, optimizer)
    model.train()
    times = []
    batches = saved["batches"]
    for step in range(1 + (emulated_steps if emulated else steps)):
        start = time.perf_counter()
        train_step(model, batches[step % len(batches)], optimizer, scheduler, p.train.clip_grad_norm)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:]), "step_times_s": times[1:], "emulated": emulated,
            "auto": [auto.precision, auto.channels_last], "isa": hardware.cpu_isa(),
            "threads": torch.get_num_threads(), "images": statistics.mean(len(b.image_sizes) for b in batches)}


def _run_worker(cls: str, batches_file: Path, args, precision: str, channels_last: bool) -> dict:
    env = dict(os.environ)
    if CLASSES[cls]:  # a held class replaces any hold of the environment; native keeps the environment as it is
        for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
            env.pop(key, None)
    env.update(CLASSES[cls], OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "benchmarks.precision", "--worker", str(batches_file), "--params", args.params,
               "--precision", precision, "--steps", str(args.steps), "--emulated-steps", str(args.emulated_steps)]
    if channels_last:
        command.append("--channels-last")
    if args.augment:
        command += ["--augment", args.augment]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                          preexec_fn=parent_death_signal)  # a killed benchmark takes its runs with it
    return json.loads(done.stdout.strip().splitlines()[-1])


def benchmark(p: Params, args, root: Path) -> dict:
    dataset = make_dataset(p, root, images=args.images)
    batches = list(_loader(p, dataset, workers=0, batches=4))
    batches_file = root / "batches.pt"
    torch.save({"batches": batches, "num_classes": len(dataset.cache.categories)}, batches_file)
    runs: dict[str, dict[str, list[dict]]] = {cls: {} for cls in args.classes}
    plan = [(cls, precision, layout) for cls in args.classes for precision, layout in VARIANTS]
    for repeat in range(args.repeats):
        shift = repeat % len(plan)
        for cls, precision, layout in plan[shift:] + plan[:shift]:
            found = _run_worker(cls, batches_file, args, precision, layout)
            runs[cls].setdefault(f"{precision}/{'channels_last' if layout else 'contiguous'}", []).append(found)
    classes = {}
    for cls, variants in runs.items():
        baseline = variants["fp32/contiguous"]
        rows = {}
        for name, found in variants.items():
            ratios = [f["step_s"] / b["step_s"] for f, b in zip(found, baseline)]
            rows[name] = {"step_s": statistics.median(f["step_s"] for f in found),
                          "images_per_s": found[0]["images"] / statistics.median(f["step_s"] for f in found),
                          "ratio": statistics.median(ratios), "emulated": found[0]["emulated"],
                          "runs_step_s": [f["step_s"] for f in found]}
        auto = baseline[0]["auto"]
        classes[cls] = {"isa": baseline[0]["isa"], "auto": f"{auto[0]}/{'channels_last' if auto[1] else 'contiguous'}",
                        "threads": baseline[0]["threads"], "variants": rows}
    first = runs[args.classes[0]]["fp32/contiguous"][0]
    config = {"model": p.model.name, "min_size_train": list(p.model.min_size_train),
              "max_size_train": p.model.max_size_train, "batch_per_process": first["images"],
              "steps": args.steps, "emulated_steps": args.emulated_steps, "repeats": args.repeats,
              "cpu": hardware.cpu_model(), "cores": hardware.cpu_budget(), "torch": torch.__version__}
    return {"config": config, "classes": classes}


def table(figures: dict) -> str:
    c = figures["config"]
    lines = [f"{c['model']} at {c['min_size_train']}..{c['max_size_train']} px, batch {c['batch_per_process']:g} per "
             f"process; {c['cpu']}, {c['cores']} cores; {c['steps']} timed steps after 1 warm-up "
             f"({c['emulated_steps']} where bf16 is emulated), {c['repeats']} repeats, variants taking turns.", ""]
    for cls, found in figures["classes"].items():
        lines += [f"**{cls}** ({CLASS_NAMES[cls]}; ATen {found['isa']}; {found['threads']} thread per process; "
                  f"auto picks {found['auto']})", "",
                  "| variant | s per step, median | images/s | vs fp32/contiguous |", "|---|---|---|---|"]
        for name, row in found["variants"].items():
            note = " (bf16 emulated)" if row["emulated"] else ""
            baseline = " (baseline)" if name == "fp32/contiguous" else ""
            lines.append(f"| {name}{note} | {row['step_s']:.3f} | {row['images_per_s']:.2f} | "
                         f"{row['ratio']:.2f}{baseline} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_arguments(parser)
    parser.add_argument("--classes", nargs="+", choices=list(CLASSES), default=list(CLASSES))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant (after 1 warm-up step)")
    parser.add_argument("--emulated-steps", type=int, default=1, help="timed steps where bf16 is emulated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--channels-last", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.params, args.augment, args.precision, args.channels_last,
                                args.steps, args.emulated_steps)))
        return
    p = load_benchmark_params(args.params, augment=args.augment)
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as root:
        figures = benchmark(p, args, Path(root))
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
