"""Benchmark: does the training data loader deliver at least twice what the training step consumes?

At the configuration in ``params.yaml`` (or ``--params``), in one run:

* training: :func:`pipelines.engine.train_step` (forward, backward, clip, optimizer step) on one
  thread (as each of the ``train.nproc`` processes runs with ``OMP_NUM_THREADS=1``) at the
  per-process batch, on batches
  from the real loader; images per second, median over steps after a warm-up. DDP's gradient
  all-reduce is not included, so this overstates what training consumes (the ratio is conservative);
* the loader: :func:`pipelines.build.train.train_loader`, as the train stage builds it (decode,
  resize, augmentation preset, collate) with 0, 1 and 2 worker processes, drained as fast as
  possible after a warm-up; images per second of one training process, median of repeats. Batches
  are taken near the end of the schedule, so any augmentation that ramps up with the iteration
  runs at full strength;
* decoders: ``torchvision.io.decode_image`` (libjpeg-turbo; what :mod:`pipelines.data.dataset` uses)
  against PIL, alone and followed by the training transforms, milliseconds per image.

Images are made by :func:`pipelines.data.synthetic.generate_split` in a temporary folder, with the
params' synthetic dataset settings. ``--augment NAME`` replaces the params' ``augment`` section with
``conf/augment/NAME.yaml`` (e.g. ``sa_autoaug``). Usage::

    python -m benchmarks.loader [--params params.yaml] [--augment sa_autoaug] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from torchvision.io import ImageReadMode, decode_image

from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.build import train as build_train
from pipelines.cli import exit_now
from pipelines.config.load import params_from_dict
from pipelines.config.schema import Params, SyntheticDataset
from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.dataset import DetectionDataset
from pipelines.data.synthetic import generate_split
from pipelines.data.transforms import SampleContext
from pipelines.engine import train_step

REPO = Path(__file__).resolve().parents[1]
REQUIRED_RATIO = 2.0
# Synthetic images like the default dataset's, for params that name another dataset.
DEFAULT_SYNTHETIC = {"num_classes": 5, "min_side": 256, "max_side": 416, "min_objects": 2, "max_objects": 8}


def decode_torchvision(path: str) -> torch.Tensor:
    """``uint8 [3, H, W]`` RGB via libjpeg-turbo, exactly as :meth:`DetectionDataset.load` decodes."""
    return decode_image(path, mode=ImageReadMode.RGB)


def decode_pil(path: str) -> torch.Tensor:
    """``uint8 [3, H, W]`` RGB via PIL (a channels-last view of PIL's ``H, W, 3`` buffer)."""
    with Image.open(path) as image:
        array = np.array(image.convert("RGB"))
    return torch.from_numpy(array).permute(2, 0, 1)


DECODERS = {"torchvision.io": decode_torchvision, "PIL": decode_pil}


def load_benchmark_params(path: str | Path, *, augment: str | None = None) -> Params:
    """Validated params from ``path``; ``augment`` swaps in ``conf/augment/<augment>.yaml``."""
    raw = yaml.safe_load(Path(path).read_text())
    if augment is not None:
        preset = REPO / "conf" / "augment" / f"{augment}.yaml"
        if not preset.is_file():
            raise SystemExit(f"error: --augment {augment}: {preset} not found")
        raw["augment"] = yaml.safe_load(preset.read_text())
    return params_from_dict(raw, source=str(path))


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """``--params``, ``--augment`` and ``--images``: what :func:`load_benchmark_params` and
    :func:`make_dataset` take, shared by the benchmarks that train on the synthetic images."""
    parser.add_argument("--params", default=str(REPO / "params.yaml"))
    parser.add_argument("--augment", help="use conf/augment/NAME.yaml instead of the params' augment section")
    parser.add_argument("--images", type=int, default=128, help="synthetic training images to generate")


def make_dataset(p: Params, root: Path, *, images: int) -> DetectionDataset:
    """Generate ``images`` synthetic training images under ``root``, cache them, wrap them as the train stage does."""
    dataset = p.dataset
    shape = ({k: getattr(dataset, k) for k in DEFAULT_SYNTHETIC} if isinstance(dataset, SyntheticDataset)
             else DEFAULT_SYNTHETIC)
    coco = generate_split(root / "images", split="train", size=images, seed=p.seed, **shape)
    source = root / "train.json"
    source.write_text(json.dumps(coco))
    build_cache(source, root / "cache", image_root=str(root / "images"), drop_empty=True)
    transforms = build_data.train_transforms(p, build_data.augmentation(p))
    return DetectionDataset(AnnotationCache(root / "cache"), transforms=transforms, seed=p.seed)


def _loader(p: Params, dataset: DetectionDataset, *, workers: int, batches: int):
    """The train stage's loader for rank 0 of ``train.nproc``, with ``workers`` workers, yielding the
    last ``batches`` batches of the schedule."""
    start = max(p.train.max_iter - batches, 0)
    variant = dataclasses.replace(p, loader=dataclasses.replace(p.loader, num_workers=workers),
                                  train=dataclasses.replace(p.train, max_iter=start + batches))
    return build_train.train_loader(variant, dataset, rank=0, world_size=p.train.nproc, device=torch.device("cpu"),
                                    start_iter=start)


def measure_decoders(dataset: DetectionDataset, *, repeats: int, iteration: int) -> dict:
    """Milliseconds per image of each decoder, alone and followed by the training transforms at ``iteration``."""
    cache = dataset.cache
    paths = [str(cache.image_path(i)) for i in range(len(cache))]
    figures = {}
    for name, decode in DECODERS.items():
        alone, with_transforms = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            for path in paths:
                decode(path)
            alone.append((time.perf_counter() - start) / len(paths) * 1e3)
            start = time.perf_counter()
            for index, path in enumerate(paths):
                boxes, labels, crowd = cache.annotations(index)
                target = {"boxes": torch.from_numpy(np.array(boxes[~crowd])),
                          "labels": torch.from_numpy(labels[~crowd].astype(np.int64))}
                ctx = SampleContext(rng=np.random.default_rng((0, index)), iteration=iteration,
                                    fetch=dataset.load, num_samples=len(cache))
                dataset.transforms(decode(path), target, ctx)
            with_transforms.append((time.perf_counter() - start) / len(paths) * 1e3)
        figures[name] = {"decode_ms": statistics.median(alone), "decode_transform_ms": statistics.median(with_transforms)}
    difference = max(int((decode_torchvision(p).int() - decode_pil(p).int()).abs().max()) for p in paths)
    faster = min(figures, key=lambda k: figures[k]["decode_ms"])
    return {**figures, "max_abs_pixel_difference": difference, "faster": faster}


def measure_training(p: Params, dataset: DetectionDataset, *, steps: int, warmup: int) -> dict:
    """Images per second of one training process: forward + backward + clip + step, one thread."""
    train = p.train
    torch.manual_seed(p.seed)
    compute = build_model.compute(p, torch.device("cpu"))
    model = build_model.detector(p, num_classes=len(dataset.cache.categories), compute=compute)
    optimizer = build_train.optimizer(p, model)
    scheduler = build_train.scheduler(p, optimizer)
    batches = list(_loader(p, dataset, workers=0, batches=min(steps + warmup, 4)))
    model.train()
    times = []
    for step in range(warmup + steps):
        batch = batches[step % len(batches)]
        start = time.perf_counter()
        train_step(model, batch, optimizer, scheduler, train.clip_grad_norm)
        times.append(time.perf_counter() - start)
    batch_size = train.ims_per_batch // train.nproc
    step_s = statistics.median(times[warmup:])
    return {"batch": batch_size, "step_s": step_s, "images_per_s": batch_size / step_s, "step_times_s": times[warmup:]}


def measure_loader(p: Params, dataset: DetectionDataset, *, workers: int, batches: int, warmup: int,
                   repeats: int) -> dict:
    """Images per second one training process's loader delivers when drained as fast as possible."""
    rates, startups = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        iterator = iter(_loader(p, dataset, workers=workers, batches=warmup + batches))
        next(iterator)
        startups.append(time.perf_counter() - start)
        for _ in range(warmup - 1):
            next(iterator)
        start = time.perf_counter()
        count = sum(len(batch.indices) for batch in iterator)
        rates.append(count / (time.perf_counter() - start))
    return {"workers": workers, "images_per_s": statistics.median(rates), "first_batch_s": statistics.median(startups),
            "runs_images_per_s": rates}


def benchmark(p: Params, *, root: Path, images: int, workers: list[int], batches: int, warmup: int, repeats: int,
              train_steps: int) -> dict:
    """All measurements; ``root`` is an empty scratch folder."""
    torch.set_num_threads(1)  # what each training process gets (OMP_NUM_THREADS=1)
    dataset = make_dataset(p, root, images=images)
    training = measure_training(p, dataset, steps=train_steps, warmup=min(2, train_steps))
    loaders = {str(w): measure_loader(p, dataset, workers=w, batches=batches, warmup=warmup, repeats=repeats)
               for w in workers}
    decoders = measure_decoders(dataset, repeats=repeats, iteration=p.train.max_iter)
    consumed = training["images_per_s"]
    ratios = {w: figures["images_per_s"] / consumed for w, figures in loaders.items()}
    default = str(p.loader.num_workers)
    return {
        "config": {"model": p.model.name, "min_size_train": list(p.model.min_size_train),
                   "max_size_train": p.model.max_size_train,
                   "precision": build_model.compute(p, torch.device("cpu")).precision,
                   "augment": p.augment.name, "nproc": p.train.nproc, "ims_per_batch": p.train.ims_per_batch,
                   "num_workers": p.loader.num_workers, "images": images, "batches": batches, "repeats": repeats,
                   "load_average": os.getloadavg()[0]},
        "training": training,
        "loader": loaders,
        "ratios": ratios,
        "decoders": decoders,
        "default_workers_meet_target": ratios.get(default, 0.0) >= REQUIRED_RATIO if default in ratios else None,
    }


def table(f: dict) -> str:
    """The figures as two markdown tables."""
    c, t = f["config"], f["training"]
    lines = [
        f"Default configuration: {c['model']} at {c['min_size_train']}..{c['max_size_train']} px, {c['precision']}, "
        f"augment={c['augment']}, {c['nproc']} processes x batch {t['batch']} (1 thread each), "
        f"{c['images']} synthetic images; medians.",
        "",
        "| per training process | images/s | vs training |",
        "|---|---|---|",
        f"| training step (forward, backward, step; batch {t['batch']}, 1 thread) | {t['images_per_s']:.1f} | 1.0x |",
    ]
    for w, figures in f["loader"].items():
        where = "in the training process" if w == "0" else f"{w} worker{'s' if w != '1' else ''}"
        default = " (default)" if int(w) == c["num_workers"] else ""
        lines.append(f"| loader, {where}{default} | {figures['images_per_s']:.0f} | {f['ratios'][w]:.0f}x |")
    d = f["decoders"]
    lines += [
        "",
        "| decoder (1 thread) | decode | decode + training transforms |",
        "|---|---|---|",
    ]
    for name in DECODERS:
        used = " (used)" if name == "torchvision.io" else ""
        lines.append(f"| {name}{used} | {d[name]['decode_ms']:.2f} ms | {d[name]['decode_transform_ms']:.2f} ms |")
    lines += ["", f"Faster decoder: {d['faster']}; largest pixel difference between them: {d['max_abs_pixel_difference']}."]
    if f["default_workers_meet_target"] is not None:
        verdict = "yes" if f["default_workers_meet_target"] else "NO"
        lines.append(f"Default loader delivers >= {REQUIRED_RATIO:.0f}x what training consumes: {verdict}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_arguments(parser)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="loader worker counts to measure")
    parser.add_argument("--batches", type=int, default=50, help="timed batches per loader run")
    parser.add_argument("--warmup", type=int, default=5, help="batches before timing starts (at least 1)")
    parser.add_argument("--repeats", type=int, default=3, help="loader runs and decoder passes per figure")
    parser.add_argument("--train-steps", type=int, default=6, help="timed training steps (after 2 warm-up steps)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)

    p = load_benchmark_params(args.params, augment=args.augment)
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as root:
        figures = benchmark(p, root=Path(root), images=args.images, workers=args.workers, batches=args.batches,
                            warmup=max(args.warmup, 1), repeats=args.repeats, train_steps=args.train_steps)
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
