"""Benchmark: predict end to end on real photos, ONNX Runtime against PyTorch eager, side by side.

One process times the same photos, in the same batches, with the same number of threads, the cases
taking turns (a round-robin of passes over all the photos, the first case of each pass rotating;
medians), each pass decoding every photo from its file again:

* ``torch_fp32`` (the baseline): PyTorch eager in fp32, as ``stages.predict --precision fp32`` runs a
  ``.pth``: predict's own reader and test resize, then evaluation's detection code
  (:func:`pipelines.evaluation.detect`) on the :class:`~pipelines.inference.torch_backend.TorchBackend`,
  torchvision's post-processing;
* ``torch_auto``: the same in the precision ``auto`` resolves to on this machine (bf16 where it is
  native, as on the AVX512-BF16 class; fp32 on the AVX2 class), predict's default;
* ``onnx``: the export in ONNX Runtime through the torch-free path that the served model runs
  (:meth:`pipelines.inference.onnx_runtime.OnnxDetector.predict` on the file paths: PIL decode,
  resize, pad, the graph, the numpy post-processing);
* ``onnx_runner``: the same graph behind predict's runner, as ``stages.predict --model model.onnx``
  runs it (predict's reader and resize, the numpy post-processing), torch at the one thread that
  :func:`pipelines.inference.onnx_backend.load` leaves it.

End to end: decode, resize, network, post-processing; drawing and writing the outputs are left out.
After the timed passes, the two PyTorch cases and the ``onnx`` path are timed step by step (decode,
resize and pad, the network, the post-processing; the PyTorch network from the detector's call to its
head's outputs, by hooks), to say where the time goes and what bounds the goals.
The model is ``--model FILE.pth`` (default ``outputs/train/model_final.pth`` where it exists) with its
params (``--params``, else ``dvc.lock``'s train entry), or, with ``--random`` or without a trained
model, the detector of ``params.yaml`` with random weights and the photos' 80 COCO categories: random
heads pass thousands of candidates to post-processing (a worst case for it). The model is exported once,
with :func:`pipelines.inference.onnx_export.export` into a temporary folder; the export's time is reported
on its own. Threads: ``--threads``, else the thread budget of one process
(:func:`pipelines.hardware.threads_per_process`), for torch and ONNX Runtime alike (but torch beside
``onnx_runner``, as above). Usage::

    python -m benchmarks.predict [--model FILE.pth [--params FILE] | --random] [--batch 1] [--repeats 5] [--json]
    python -m benchmarks.predict --quick      # a few seconds: 2 photos, 1 pass, no warm-up pass
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from pipelines import checkpoint, cli, hardware
from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.config.load import load_params
from pipelines.errors import ConfigError
from pipelines.inference import onnx_backend, onnx_export, runner, torch_backend
from pipelines.inference.onnx_runtime import OnnxDetector
from pipelines.inference.postprocess import detections
from pipelines.inference.preprocess import decode, prepare

REPO = Path(__file__).resolve().parents[1]
PHOTOS = REPO.parent / "shared" / "data" / "coco-real-33"
TRAINED = REPO / "outputs" / "train" / "model_final.pth"
BASELINE = "torch_fp32"
CASES = {
    "torch_fp32": "PyTorch eager, fp32 (`--precision fp32`)",
    "torch_auto": "PyTorch eager, `--precision auto` (predict's default)",
    "onnx": "ONNX Runtime, torch-free (`OnnxDetector.predict` on the files)",
    "onnx_runner": "ONNX Runtime behind predict's runner (`--model model.onnx`)",
}
GOALS = {"onnx_vs_fp32": 2.0, "onnx_vs_auto": 1.0}  # ONNX Runtime's images/s over each PyTorch case's
QUICK = {"images": 2, "repeats": 1, "warmup": 0}

log = logging.getLogger("benchmarks.predict")


def photos(folder: Path, limit: int | None) -> list[str]:
    """The JPEG files of ``folder``/images, sorted (the first ``limit``).

    Raises:
        ConfigError: the folder is absent or holds no JPEG.
    """
    images = folder / "images"
    if not images.is_dir():
        raise ConfigError(f"{images}: folder not found; the benchmark times predict on the real photos of "
                          "../shared/data/coco-real-33 (or give --photos FOLDER with images/*.jpg)")
    found = sorted(str(p) for p in images.glob("*.jpg"))
    if not found:
        raise ConfigError(f"{images}: no .jpg file; expected the photos of coco-real-33")
    return found[:limit]


def coco_categories(folder: Path) -> list[dict]:
    """The categories ``[{"id", "name"}, ...]`` of the photos' annotations (COCO's 80)."""
    path = folder / "annotations" / "instances.json"
    try:
        categories = json.loads(path.read_text())["categories"]
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"{path}: cannot read its categories ({type(err).__name__})") from None
    return [{"id": int(c["id"]), "name": str(c["name"])} for c in categories]


def random_model(params_file: Path, categories: list[dict], workdir: Path) -> Path:
    """The detector of ``params_file`` with random weights (seed 0) and ``categories``, saved into ``workdir``
    as the train stage saves ``model_final.pth``."""
    p = load_params(params_file)
    torch.manual_seed(0)
    fp32 = hardware.resolve("fp32", False, torch.device("cpu"))
    model = build_model.detector(p, num_classes=len(categories), compute=fp32, pretrained=False)
    path = workdir / "model_final.pth"
    checkpoint.save(path, model=model.state_dict(), categories=categories, iteration=0, precision="fp32",
                    channels_last=False)
    return path


def export(backend: torch_backend.TorchBackend, p, path: Path) -> float:
    """Export ``backend``'s detector to ``path`` (with its card); the seconds it took."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the exporter's progress lines are not the figures
        onnx_export.export(backend.detector, path, categories=backend.categories,
                           min_size_test=p.model.min_size_test, max_size_test=p.model.max_size_test,
                           size_divisibility=p.loader.size_divisibility,
                           max_image_pixels=p.dataset.max_image_pixels)
    return time.perf_counter() - start


def through_runner(backend, p, *, torch_threads: int) -> Callable[[list[str]], list[int]]:
    """What predict's runner does with a batch of files on ``backend``: read each as training reads images,
    resize by the test transform, detect (:func:`pipelines.evaluation.detect`); the detections per image.
    Torch runs with ``torch_threads`` threads meanwhile (as many as predict gives it with this backend)."""
    run = runner.Runner(backend, outputs=None, settings=runner_settings(p))  # outputs: not written here

    def call(paths: list[str]) -> list[int]:
        before = torch.get_num_threads()
        torch.set_num_threads(torch_threads)
        try:
            found = run._detect([run._read(path) for path in paths])  # the runner's own read and detect
        finally:
            torch.set_num_threads(before)
        return [len(d["scores"]) for d in found]

    return call


def runner_settings(p) -> runner.Settings:
    """Predict's runner settings for the params ``p``, on the CPU, without test-time augmentation."""
    return runner.Settings(transforms=build_data.test_transforms(p), size_divisibility=p.loader.size_divisibility,
                           tta=None, max_pixels=p.dataset.max_image_pixels, device=torch.device("cpu"))


def torch_free(detector: OnnxDetector) -> Callable[[list[str]], list[int]]:
    """:meth:`OnnxDetector.predict` on a batch of files; the detections per image."""
    def call(paths: list[str]) -> list[int]:
        return [len(d) for d in detector.predict(paths)]

    return call


def measure(cases: dict[str, Callable[[list[str]], list[int]]], batches: list[list[str]], *, repeats: int,
            warmup: int) -> dict[str, dict]:
    """Seconds per pass over ``batches`` of each case, ``warmup`` untimed passes then ``repeats`` timed ones,
    the cases taking turns (the first of each pass rotating); and the detections per image of the last."""
    names = list(cases)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    detections: dict[str, list[int]] = {}
    rounds = [(r, names[r % len(names):] + names[:r % len(names)]) for r in range(warmup + repeats)]
    with tqdm(total=len(rounds) * len(names), desc="predict benchmark", unit="pass", mininterval=1.0) as bar:
        for r, order in rounds:
            for name in order:
                counts = []
                start = time.perf_counter()
                for batch in batches:
                    counts += cases[name](batch)
                elapsed = time.perf_counter() - start
                if r >= warmup:
                    seconds[name].append(elapsed)
                detections[name] = counts
                bar.update()
    return {name: {"seconds": seconds[name], "detections": detections[name]} for name in names}


STEPS = ("decode", "resize_pad", "network", "postprocess")
STEP_CASES = {  # the cases timed step by step, and how each does the steps
    "torch_fp32": "torchvision.io, torch resize, eager fp32, torchvision",
    "torch_auto": "torchvision.io, torch resize, eager `auto`, torchvision",
    "onnx": "PIL, PIL resize, ONNX Runtime, numpy",
}


def breakdown(detector: OnnxDetector, batches: list[list[str]], *, repeats: int) -> dict[str, float]:
    """Milliseconds per image of each step of the torch-free path (PIL decode, resize and pad, the graph,
    the numpy post-processing), medians of ``repeats`` passes."""
    card = detector.card
    steps: dict[str, list[float]] = {name: [] for name in STEPS}
    count = sum(len(batch) for batch in batches)
    for _ in range(repeats):
        took = dict.fromkeys(steps, 0.0)
        for batch in batches:
            start = time.perf_counter()
            pixels = [decode(path, max_pixels=card.max_image_pixels).pixels for path in batch]
            decoded = time.perf_counter()
            padded = prepare(pixels, min_size=card.min_size_test, max_size=card.max_size_test,
                             size_divisibility=card.size_divisibility)
            prepared = time.perf_counter()
            outputs = detector.network(padded.images)
            networked = time.perf_counter()
            detections(outputs["cls_logits"], outputs["bbox_regression"], outputs["bbox_ctrness"],
                       padded_size=padded.padded_size, image_sizes=padded.image_sizes,
                       anchor_sizes=card.anchor_sizes, thresholds=detector.thresholds)
            done = time.perf_counter()
            for name, seconds in zip(STEPS, (decoded - start, prepared - decoded, networked - prepared,
                                             done - networked)):
                took[name] += seconds
        for name in steps:
            steps[name].append(1000 * took[name] / count)
    return {name: statistics.median(values) for name, values in steps.items()}


def eager_breakdown(backend: torch_backend.TorchBackend, p, batches: list[list[str]], *,
                    repeats: int) -> dict[str, float]:
    """Milliseconds per image of each step of a PyTorch case as predict's runner runs it: read
    (torchvision.io's decoder), resize and pad (the test transform, the collate, evaluation's padding), the
    network (from the detector's call to its head's outputs, timed by hooks) and the post-processing
    (torchvision's, and the boxes scaled back), medians of ``repeats`` passes."""
    run = runner.Runner(backend, outputs=None, settings=runner_settings(p))
    marks: dict[str, float] = {}
    hooks = [backend.detector.register_forward_pre_hook(lambda *_: marks.__setitem__("network", time.perf_counter())),
             backend.detector.head.register_forward_hook(lambda *_: marks.__setitem__("head", time.perf_counter()))]
    steps: dict[str, list[float]] = {name: [] for name in STEPS}
    count = sum(len(batch) for batch in batches)
    try:
        for _ in range(repeats):
            took = dict.fromkeys(steps, 0.0)
            for batch in batches:
                start = time.perf_counter()
                images = [run._read(path) for path in batch]
                decoded = time.perf_counter()
                run._detect(images)
                done = time.perf_counter()
                for name, seconds in zip(STEPS, (decoded - start, marks["network"] - decoded,
                                                 marks["head"] - marks["network"], done - marks["head"])):
                    took[name] += seconds
            for name in steps:
                steps[name].append(1000 * took[name] / count)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: statistics.median(values) for name, values in steps.items()}


def benchmark(*, model: Path | None, params: Path | None, folder: Path, images: int | None, batch: int,
              threads: int, repeats: int, warmup: int, workdir: Path) -> dict:
    load_at_start = os.getloadavg()[0]
    files = photos(folder, images)
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    if model is None:
        params = params or REPO / "params.yaml"
        model_file, weights = random_model(params, coco_categories(folder), workdir), "random"
    else:
        model_file, weights = model, "trained"
    fp32, p = torch_backend.load(model_file, device=cpu, precision="fp32", params_file=params)
    auto, _ = torch_backend.load(model_file, device=cpu, precision="auto", params_file=params)
    onnx_file = workdir / "export" / "model.onnx"
    onnx_file.parent.mkdir()
    export_seconds = export(fp32, p, onnx_file)
    detector = OnnxDetector(onnx_file, threads=threads)
    cases = {"torch_fp32": through_runner(fp32, p, torch_threads=threads),
             "torch_auto": through_runner(auto, p, torch_threads=threads),
             "onnx": torch_free(detector),
             "onnx_runner": through_runner(onnx_backend.OnnxBackend(detector), p,
                                           torch_threads=onnx_backend.TORCH_THREADS)}
    batches = [files[k:k + batch] for k in range(0, len(files), batch)]
    measured = measure(cases, batches, repeats=repeats, warmup=warmup)
    steps = {"torch_fp32": eager_breakdown(fp32, p, batches, repeats=repeats),
             "torch_auto": eager_breakdown(auto, p, batches, repeats=repeats),
             "onnx": breakdown(detector, batches, repeats=repeats)}

    precisions = {"torch_fp32": fp32.precision, "torch_auto": auto.precision, "onnx": "fp32", "onnx_runner": "fp32"}
    layouts = {"torch_fp32": fp32.compute.channels_last, "torch_auto": auto.compute.channels_last,
               "onnx": False, "onnx_runner": False}
    figures: dict = {"cases": {}, "steps_ms": steps}
    for name, m in measured.items():
        median = statistics.median(m["seconds"])
        figures["cases"][name] = {"precision": precisions[name], "channels_last": layouts[name],
                                  "seconds": m["seconds"], "median_seconds": median,
                                  "images_per_second": len(files) / median, "ms_per_image": 1000 * median / len(files),
                                  "detections_per_image": sum(m["detections"]) / len(files)}
    base = figures["cases"][BASELINE]["images_per_second"]
    for case in figures["cases"].values():
        case["vs_baseline"] = case["images_per_second"] / base
    onnx = figures["cases"]["onnx"]["images_per_second"]
    auto_speed = figures["cases"]["torch_auto"]["images_per_second"]
    figures["goals"] = {"onnx_vs_fp32": onnx / base, "onnx_vs_auto": onnx / auto_speed}
    from importlib.metadata import version

    native = hardware.native_bf16_cpu()
    figures["model"] = {"file": str(model) if model else None, "weights": weights, "name": p.model.name,
                        "params": fp32.params_source, "categories": len(fp32.categories),
                        "score_thresh": fp32.score_thresh, "min_size_test": p.model.min_size_test,
                        "max_size_test": p.model.max_size_test, "export_seconds": export_seconds}
    figures["settings"] = {
        "photos": len(files), "folder": folder.name, "batch": batch, "threads": threads, "repeats": repeats,
        "warmup": warmup, "cpu": hardware.cpu_model(),
        "class": "AVX512-BF16" if native else hardware.cpu_isa().split(",")[0].upper(),
        "isa": hardware.cpu_isa(), "auto_precision": auto.precision, "auto_reason": auto.compute.reason,
        "cores": hardware.cpu_budget(), "torch": torch.__version__, "onnxruntime": version("onnxruntime"),
        "load_average": {"start": load_at_start, "end": os.getloadavg()[0]}}
    return figures


def table(f: dict) -> str:
    """The figures as a markdown table, with a line on the setting above and the goals below."""
    m, s = f["model"], f["settings"]
    weights = ("random weights (no trained model given)" if m["weights"] == "random"
               else f"trained weights, params from {m['params']}")
    lines = [
        f"`{m['name']}`, {weights}, {m['categories']} categories, score threshold {m['score_thresh']:g}, test size "
        f"{m['min_size_test']}..{m['max_size_test']}; {s['photos']} photos of {s['folder']} decoded from their "
        f"files in every pass; batch {s['batch']}, {s['threads']} thread(s) for every case; medians of "
        f"{s['repeats']} passes taking turns after {s['warmup']} warm-up pass(es). CPU: {s['cpu']}, "
        f"{s['class']} class (ATen at {s['isa']}); `auto` resolves to {s['auto_precision']} here. torch "
        f"{s['torch']}, ONNX Runtime {s['onnxruntime']}; the export took {m['export_seconds']:.1f} s (not timed "
        "below).",
        "",
        "| case | precision | images/s | ms/image | vs PyTorch eager fp32 | detections/image |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in f["cases"].items():
        ratio = "1 (baseline)" if name == BASELINE else f"{c['vs_baseline']:.2f}x"
        layout = ", channels_last" if c["channels_last"] else ""
        lines.append(f"| `{name}`: {CASES[name]} | {c['precision']}{layout} | {c['images_per_second']:.2f} | "
                     f"{c['ms_per_image']:.1f} | {ratio} | {c['detections_per_image']:.1f} |")
    g = f["goals"]
    ms = f["steps_ms"]
    lines += [
        "",
        "| step by step, ms/image (medians of the passes after those above) | decode | resize + pad | network | "
        "post-processing | sum |",
        "|---|---|---|---|---|---|",
    ]
    for name, how in STEP_CASES.items():
        steps = ms[name]
        lines.append(f"| `{name}`: {how} | " + " | ".join(f"{steps[k]:.1f}" for k in STEPS)
                     + f" | {sum(steps[k] for k in STEPS):.1f} |")
    fp32_ms = f["cases"][BASELINE]["ms_per_image"]
    lines += [
        "",
        f"- ONNX Runtime (`onnx`) / PyTorch eager fp32: {g['onnx_vs_fp32']:.2f}x, goal >= "
        f"{GOALS['onnx_vs_fp32']:g}x: {'met' if g['onnx_vs_fp32'] >= GOALS['onnx_vs_fp32'] else 'NOT met'}",
        f"- ONNX Runtime (`onnx`) / PyTorch eager `auto` ({s['auto_precision']}): {g['onnx_vs_auto']:.2f}x, goal > "
        f"{GOALS['onnx_vs_auto']:g}x: {'met' if g['onnx_vs_auto'] > GOALS['onnx_vs_auto'] else 'NOT met'}",
        f"- {GOALS['onnx_vs_fp32']:g}x PyTorch eager fp32 is {fp32_ms / GOALS['onnx_vs_fp32']:.1f} ms/image end to "
        f"end; ONNX Runtime's network alone takes {ms['onnx']['network']:.1f}, decode + resize + pad + "
        f"post-processing {sum(ms['onnx'][k] for k in STEPS) - ms['onnx']['network']:.1f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="a train stage's .pth (default: outputs/train/model_final.pth where it exists)")
    parser.add_argument("--params", type=Path, default=None,
                        help="the params it was trained with (default: dvc.lock's train entry; with random "
                             "weights: params.yaml)")
    parser.add_argument("--random", action="store_true",
                        help="random weights and the photos' 80 COCO categories, even where a trained model exists")
    parser.add_argument("--photos", type=Path, default=PHOTOS, help="the folder of the photos (images/*.jpg)")
    parser.add_argument("--images", type=int, default=None, help="the first N photos only (default: all)")
    parser.add_argument("--batch", type=int, default=1, help="images per call, every case (default 1, predict's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of torch and ONNX Runtime (default: one process's thread budget)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per case (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes per case first (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a tiny run for tests: {QUICK['images']} photos, {QUICK['repeats']} pass, no warm-up")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.repeats, args.warmup = QUICK["images"], QUICK["repeats"], QUICK["warmup"]
    for name, least in (("images", 1), ("batch", 1), ("threads", 1), ("repeats", 1), ("warmup", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"--{name}: expected a whole number, at least {least}, got {value}")
    if args.random and args.model is not None:
        raise ConfigError("--random and --model: give one of them")
    model = None if args.random else args.model or (TRAINED if TRAINED.is_file() else None)
    if model is not None and not model.is_file():
        raise ConfigError(f"--model {model}: file not found; expected a train stage's .pth (or --random)")
    if model is None:
        log.info("no trained model: random weights (a worst case for post-processing)")
    threads = args.threads or hardware.threads_per_process(1)
    with tempfile.TemporaryDirectory(prefix="bench_predict_") as workdir:
        figures = benchmark(model=model, params=args.params, folder=args.photos, images=args.images,
                            batch=args.batch, threads=threads, repeats=args.repeats, warmup=args.warmup,
                            workdir=Path(workdir))
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    cli.run(main)
