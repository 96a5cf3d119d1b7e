"""Speed of Scale-aware AutoAugment on one CPU thread: the full transform, and each op alone.

Full call (the published policy at full ramp, iteration = max_iter; one seeded context per call, so
every case runs the same sequence of draws), in absolute milliseconds, on three inputs:

- ``synthetic 600x800``: a 600x800 uint8 RGB image (smooth random content plus noise) with 7 boxes
  (width x height 32x24, 48x40, 80x64, 100x96, 160x120, 240x200, 360x280; areas 768 to 100,800
  pixels across the splits 2048 / 10240 / 51200); zoom_out fillers from a fake ``ctx.fetch`` over 8
  stored 480x640 images with 5 boxes each, which the filler cache keeps after their first use;
- ``COCO photos``: the training images of ``coco-real-33`` (real COCO photos of about 640x480 with
  1 to 33 boxes, crowd regions left out), each decoded from its file once and augmented at its stored
  size, in turn; fillers are those photos, kept in memory as the filler cache would;
- ``COCO photos, fillers decoded``: the same photos as training at COCO scale augments them with the
  default configuration (``conf/``, composed): zoom_out's fillers drawn from a pool of
  ``augment.filler_pool`` of COCO train2017's 118,287 indices that changes every
  ``augment.filler_pool_iters`` iterations, loaded through the filler cache of
  ``augment.filler_cache_mb`` MB, each miss decoded from its JPEG file by
  :meth:`DetectionDataset.load` (index ``k`` is photo ``k mod 32``, so that every distinct index is
  decoded); the iteration advances every ``train.ims_per_batch / (train.nproc *
  loader.num_workers)`` calls, the samples one loader worker augments per iteration;
- ``COCO photos, fillers decoded, no pool``: the same with ``augment.filler_pool: 0`` (fillers
  drawn from all 118,287 indices, so the cache almost never hits): what a pool saves.

The COCO cases need ``coco-real-33`` (``--coco-real``; by default ``$SHARED_DATA/coco-real-33``, else
``../shared/data/coco-real-33`` from the repository root, where the tests look too); without it they
are skipped with a message. Calls alternate between the cases in rounds, so that load from other
processes falls on all of them alike; ``--clock cpu`` times this process's CPU time instead of the
wall clock, which such load disturbs less. Each op alone runs on the synthetic input with every box
selected (color and geometric ops at level 5; zoom_in at level 3, ratio 1.2; zoom_out at level 9,
ratio 0.5, with 3 fillers).

The original implementation's times are not measured here: the README quotes them as a reference
measured separately, and the benchmark prints no ratio. Usage::

    python -m benchmarks.sa_autoaug [--calls 2000] [--clock wall|cpu] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from pipelines.cli import exit_now
from pipelines.compose import compose_params
from pipelines.config.load import params_from_dict
from pipelines.data.annotation_cache import AnnotationCache, build_cache
from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.autoaug.color import color_op_on_boxes
from pipelines.data.autoaug.geometric import geometric_op
from pipelines.data.autoaug.zoom import zoom_in, zoom_in_ratio, zoom_out, zoom_out_ratio
from pipelines.data.dataset import DetectionDataset
from pipelines.data.transforms import SampleContext
from pipelines.policy import COLOR_OPS, GEO_OPS, PUBLISHED_POLICY, decode_policy

REPO = Path(__file__).resolve().parents[1]
COCO_REAL = Path(os.environ.get("SHARED_DATA", REPO.parent / "shared" / "data")) / "coco-real-33"
HEIGHT, WIDTH = 600, 800
# x1, y1, x2, y2 of the 7 boxes (sizes in the module docstring).
BOXES = [
    [40, 30, 72, 54],
    [700, 60, 748, 100],
    [120, 420, 200, 484],
    [600, 480, 700, 576],
    [300, 40, 460, 160],
    [520, 200, 760, 400],
    [60, 120, 420, 400],
]
OP_LEVEL = 5
SYNTHETIC, PHOTOS, DECODED = "synthetic 600x800", "COCO photos", "COCO photos, fillers decoded"
NO_POOL = "COCO photos, fillers decoded, no pool"
COCO_TRAIN_IMAGES = 118_287
# Issue 10's goals for the mean of a full call, in milliseconds on the project's 2-core machine.
GOAL_MEAN_MS = {SYNTHETIC: 2.0, PHOTOS: 1.2, DECODED: 1.8, NO_POOL: None}
QUICK = {"calls": 24, "op_calls": 1, "rounds": 2, "warmup": 2}

Sample = tuple[torch.Tensor, dict]


def _image(height: int, width: int, gen: torch.Generator) -> torch.Tensor:
    coarse = torch.rand((1, 3, height // 32, width // 32), generator=gen) * 255
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)[0]
    noise = torch.randn((3, height, width), generator=gen) * 12
    return (smooth + noise).clamp(0, 255).to(torch.uint8)


def _random_boxes(n: int, height: int, width: int, gen: torch.Generator) -> torch.Tensor:
    xy = torch.rand((n, 2), generator=gen) * torch.tensor([width * 0.7, height * 0.7])
    wh = 16 + torch.rand((n, 2), generator=gen) * torch.tensor([width * 0.3, height * 0.3])
    return torch.cat([xy, xy + wh], dim=1)


def make_inputs() -> tuple[torch.Tensor, dict, list[Sample]]:
    """The synthetic 600x800 image, its target and the 8 stored filler samples."""
    gen = torch.Generator().manual_seed(0)
    image = _image(HEIGHT, WIDTH, gen)
    target = {"boxes": torch.tensor(BOXES, dtype=torch.float32), "labels": torch.arange(1, 8, dtype=torch.int64)}
    fillers = [(_image(480, 640, gen), {"boxes": _random_boxes(5, 480, 640, gen),
                                        "labels": torch.randint(1, 10, (5,), generator=gen)}) for _ in range(8)]
    return image, target, fillers


def coco_real_dataset(root: Path, cache_dir: Path) -> DetectionDataset:
    """The training images of ``coco-real-33`` at ``root`` as training reads them (images without boxes
    dropped, crowd regions left out), through an annotation cache built in ``cache_dir``."""
    build_cache(root / "annotations" / "instances.json", cache_dir, image_root=str(root / "images"), drop_empty=True)
    return DetectionDataset(AnnotationCache(cache_dir), transforms=None)


def _stats(times: list[float]) -> dict[str, float]:
    ms = np.asarray(times) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)),
            "max": float(ms.max()), "n": len(ms)}


# Wall-clock time by default; ``--clock cpu`` uses this process's CPU time, which other processes
# on a busy machine disturb less (it leaves out the time this one waits for a core).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _time(fn, n: int, warmup: int, clock) -> dict[str, float]:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(n):
        start = clock()
        fn(i)
        times.append(clock() - start)
    return _stats(times)


def _full_call(augment: ScaleAwareAutoAugment, samples: list[Sample], fetch, num_samples: int,
               per_iteration: int | None = None):
    """One full call for index ``i``: sample ``i mod len(samples)``, the context seeded by ``i``; at
    iteration ``max_iter`` (``max_iter`` is 1: full ramp), or with ``per_iteration``, at iteration
    ``1 + i // per_iteration`` (the ramp is full from iteration 1)."""
    def call(i: int) -> None:
        image, target = samples[i % len(samples)]
        iteration = augment.max_iter if per_iteration is None else 1 + i // per_iteration
        ctx = SampleContext(rng=np.random.default_rng((0, iteration, i)), iteration=iteration, fetch=fetch,
                            num_samples=num_samples)
        augment(image, target, ctx)
    return call


def default_training() -> dict:
    """What the COCO-scale case takes from the default configuration: the filler settings and the
    samples one loader worker augments per iteration."""
    p = params_from_dict(yaml.safe_load(compose_params(REPO, ["augment=sa_autoaug"])), source="conf/")
    augment, train = p.augment, p.train
    workers = train.nproc * max(p.loader.num_workers, 1)
    return {"filler_pool": augment.filler_pool, "filler_pool_iters": augment.filler_pool_iters,
            "filler_cache_mb": augment.filler_cache_mb,
            "samples_per_worker_iteration": max(train.ims_per_batch // workers, 1)}


def time_full_calls(cases: dict, calls: int, rounds: int, warmup: int, clock=time.perf_counter) -> dict:
    """Time ``calls`` calls of each case (a function of the call's index), alternating between the
    cases in ``rounds`` rounds; the statistics of each, in milliseconds."""
    times = {name: [] for name in cases}
    for name, call in cases.items():
        for i in range(warmup):
            call(10 * calls + i)  # seeds (and iterations: filler pools) the timed calls do not use
    per_round = -(-calls // rounds)
    for start in range(0, calls, per_round):
        for name, call in cases.items():
            for i in range(start, min(start + per_round, calls)):
                t0 = clock()
                call(i)
                times[name].append(clock() - t0)
    return {name: _stats(t) for name, t in times.items()}


def time_ops(image: torch.Tensor, target: dict, fillers: list[Sample], op_calls: int, warmup: int,
             clock=time.perf_counter) -> dict:
    """Each op alone on ``image`` with every box selected."""
    policy = decode_policy(PUBLISHED_POLICY)
    splits = ScaleAwareAutoAugment(policy, max_iter=1).scale_splits
    everything = np.ones(len(target["boxes"]), dtype=bool)
    results = {}
    for name in COLOR_OPS:
        results[name] = _time(lambda i: color_op_on_boxes(name, image, target["boxes"], level=OP_LEVEL,
                                                          area_ratios=policy.area_ratios, scale_splits=splits),
                              op_calls, warmup, clock)
    for name in GEO_OPS:
        results[name] = _time(lambda i: geometric_op(name, image, target, level=OP_LEVEL, selected=everything,
                                                     rng=np.random.default_rng(i)), op_calls, warmup, clock)
    results["zoom_in"] = _time(lambda i: zoom_in(image, target, ratio=zoom_in_ratio(3), rng=np.random.default_rng(i)),
                               op_calls, warmup, clock)
    results["zoom_out"] = _time(lambda i: zoom_out(image, target, ratio=zoom_out_ratio(9),
                                                   fillers=fillers[i % 6:i % 6 + 3]), op_calls, warmup, clock)
    return results


def run(calls: int = 2000, op_calls: int = 200, *, rounds: int = 10, warmup: int = 100,
        coco_real: Path | None = COCO_REAL, clock: str = "wall") -> dict:
    """All the figures, as one dict (what ``--json`` prints); ``clock`` is ``"wall"`` or ``"cpu"``."""
    policy = decode_policy(PUBLISHED_POLICY)
    image, target, fillers = make_inputs()
    cases = {SYNTHETIC: _full_call(ScaleAwareAutoAugment(policy, max_iter=1), [(image, target)],
                                   fillers.__getitem__, len(fillers))}
    skipped, photos, train = None, [], None
    with tempfile.TemporaryDirectory() as tmp:
        if coco_real is not None and (coco_real / "annotations" / "instances.json").is_file():
            dataset = coco_real_dataset(coco_real, Path(tmp) / "cache")
            photos = [dataset.load(i) for i in range(len(dataset))]
            cases[PHOTOS] = _full_call(ScaleAwareAutoAugment(policy, max_iter=1), photos, photos.__getitem__,
                                       len(photos))
            train = default_training()
            per_iteration = train["samples_per_worker_iteration"]

            def fetch(index: int) -> Sample:  # 118,287 distinct indices over the 32 photos' files
                return dataset.load(index % len(dataset))

            for name, pool in ((DECODED, train["filler_pool"]), (NO_POOL, 0)):
                augment = ScaleAwareAutoAugment(policy, max_iter=1, filler_cache_mb=train["filler_cache_mb"],
                                                filler_pool=pool, filler_pool_iters=train["filler_pool_iters"])
                cases[name] = _full_call(augment, photos, fetch, COCO_TRAIN_IMAGES, per_iteration)
        else:
            skipped = f"coco-real-33 not found at {coco_real}: the COCO photo cases were skipped"
        full = time_full_calls(cases, calls, rounds, warmup, CLOCKS[clock])
    return {
        "threads": torch.get_num_threads(),
        "clock": clock,
        "calls": calls,
        "full_call_ms": full,
        "ops_ms": time_ops(image, target, fillers, op_calls, warmup=min(warmup, 10), clock=CLOCKS[clock]),
        "inputs": {
            SYNTHETIC: {"height": HEIGHT, "width": WIDTH, "boxes": len(BOXES)},
            **({PHOTOS: {"images": len(photos), "boxes": sum(len(t["boxes"]) for _, t in photos),
                         "mean_pixels": float(np.mean([im.shape[-1] * im.shape[-2] for im, _ in photos]))}}
               if photos else {}),
        },
        "training": train,
        "goal_mean_ms": {name: GOAL_MEAN_MS[name] for name in full},
        "meets_goal": {name: full[name]["mean"] <= GOAL_MEAN_MS[name] for name in full if GOAL_MEAN_MS[name]},
        "skipped": skipped,
    }


def table(out: dict) -> str:
    """The figures as the plain-text table the README quotes."""
    lines = [f"Scale-aware AutoAugment, published policy at full ramp, {out['threads']} thread(s), "
             f"{out['calls']} calls per case, {out['clock']}-clock time", "",
             f"{'full call':38s} {'mean':>7s} {'median':>7s} {'p90':>7s} {'max':>7s}  goal (mean, ms)"]
    for name, s in out["full_call_ms"].items():
        if out["goal_mean_ms"][name] is None:
            goal = "-"
        else:
            verdict = ("met" if out["meets_goal"][name] else "NOT met") if not out.get("quick") else "(quick run)"
            goal = f"{out['goal_mean_ms'][name]:.1f} {verdict}"
        lines.append(f"{name:38s} {s['mean']:7.3f} {s['median']:7.3f} {s['p90']:7.3f} {s['max']:7.3f}  {goal}")
    if out["skipped"]:
        lines.append(f"({out['skipped']})")
    if out["training"]:
        t = out["training"]
        lines.append(f"(fillers decoded: pool of {t['filler_pool']} images changing every {t['filler_pool_iters']} "
                     f"iterations, {t['filler_cache_mb']:g} MB cache, {t['samples_per_worker_iteration']} samples "
                     "per loader worker per iteration)")
    lines += ["", f"{'op alone, every box selected':38s} {'mean':>7s} {'median':>7s} {'p90':>7s} {'max':>7s}  (ms)"]
    for name, s in out["ops_ms"].items():
        lines.append(f"{name:38s} {s['mean']:7.3f} {s['median']:7.3f} {s['p90']:7.3f} {s['max']:7.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="full calls to time per case, after a warm-up")
    parser.add_argument("--op-calls", type=int, default=200, help="calls per op alone")
    parser.add_argument("--rounds", type=int, default=10, help="rounds the cases alternate in")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--coco-real", type=Path, default=COCO_REAL, help="the coco-real-33 folder")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall-clock time, or this process's CPU time (steadier on a busy machine)")
    parser.add_argument("--quick", action="store_true", help="a few calls only: checks that it runs, times nothing")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        out = run(QUICK["calls"], QUICK["op_calls"], rounds=QUICK["rounds"], warmup=QUICK["warmup"],
                  coco_real=args.coco_real, clock=args.clock)
        out["quick"] = True
    else:
        out = run(args.calls, args.op_calls, rounds=args.rounds, coco_real=args.coco_real, clock=args.clock)
    print(json.dumps(out) if args.json else table(out))


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
