"""Speed of Scale-aware AutoAugment on one CPU thread: the full transform and each op alone.

Input: a 600x800 uint8 RGB image (smooth random content plus noise) with 7 boxes of mixed sizes
(width x height): small 32x24 and 48x40, medium 80x64 and 100x96, large 160x120, 240x200 and
360x280 (areas 768, 1920, 5120, 9600, 19200, 48000, 100800 pixels with splits 2048 / 10240 / 51200).
zoom_out fillers come from a fake ``ctx.fetch`` over 8 stored 480x640 images with 5 boxes each.

- full call: the published policy at full ramp (iteration = max_iter), one seeded context per call;
- each op alone with every box selected (color and geometric ops at level 5; zoom_in at level 3,
  ratio 1.2; zoom_out at level 9, ratio 0.5, with 3 fillers).

Reference: the original implementation costs 9.5 ms mean per call on this input (600x800, 7 boxes,
full ramp, one thread). Usage: ``python -m benchmarks.sa_autoaug [--calls 2000] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pipelines.data.autoaug.augment import ScaleAwareAutoAugment
from pipelines.data.autoaug.color import color_op_on_boxes
from pipelines.data.autoaug.geometric import geometric_op
from pipelines.data.autoaug.zoom import zoom_in, zoom_in_ratio, zoom_out, zoom_out_ratio
from pipelines.data.transforms import SampleContext
from pipelines.policy import COLOR_OPS, GEO_OPS, PUBLISHED_POLICY, decode_policy

ORIGINAL_MEAN_MS = 9.5
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


def _image(height: int, width: int, gen: torch.Generator) -> torch.Tensor:
    coarse = torch.rand((1, 3, height // 32, width // 32), generator=gen) * 255
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)[0]
    noise = torch.randn((3, height, width), generator=gen) * 12
    return (smooth + noise).clamp(0, 255).to(torch.uint8)


def _random_boxes(n: int, height: int, width: int, gen: torch.Generator) -> torch.Tensor:
    xy = torch.rand((n, 2), generator=gen) * torch.tensor([width * 0.7, height * 0.7])
    wh = 16 + torch.rand((n, 2), generator=gen) * torch.tensor([width * 0.3, height * 0.3])
    return torch.cat([xy, xy + wh], dim=1)


def make_inputs() -> tuple[torch.Tensor, dict, list]:
    gen = torch.Generator().manual_seed(0)
    image = _image(HEIGHT, WIDTH, gen)
    target = {"boxes": torch.tensor(BOXES, dtype=torch.float32), "labels": torch.arange(1, 8, dtype=torch.int64)}
    fillers = [(_image(480, 640, gen), {"boxes": _random_boxes(5, 480, 640, gen),
                                        "labels": torch.randint(1, 10, (5,), generator=gen)}) for _ in range(8)]
    return image, target, fillers


def _stats(times: list[float]) -> dict[str, float]:
    ms = np.asarray(times) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)),
            "max": float(ms.max()), "n": len(ms)}


def _time(fn, n: int, warmup: int) -> dict[str, float]:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return _stats(times)


def run(calls: int, op_calls: int) -> dict:
    image, target, fillers = make_inputs()
    fetch = fillers.__getitem__
    policy = decode_policy(PUBLISHED_POLICY)
    augment = ScaleAwareAutoAugment(policy, max_iter=1)
    everything = np.ones(len(BOXES), dtype=bool)

    def full(i):
        ctx = SampleContext(rng=np.random.default_rng((0, 1, i)), iteration=1, fetch=fetch, num_samples=len(fillers))
        augment(image, target, ctx)

    results = {"full call": _time(full, calls, warmup=200)}
    for name in COLOR_OPS:
        results[name] = _time(lambda i: color_op_on_boxes(name, image, target["boxes"], level=OP_LEVEL,
                                                          area_ratios=policy.area_ratios,
                                                          scale_splits=augment.scale_splits), op_calls, warmup=10)
    for name in GEO_OPS:
        results[name] = _time(lambda i: geometric_op(name, image, target, level=OP_LEVEL, selected=everything,
                                                     rng=np.random.default_rng(i)), op_calls, warmup=10)
    results["zoom_in"] = _time(lambda i: zoom_in(image, target, ratio=zoom_in_ratio(3), rng=np.random.default_rng(i)),
                               op_calls, warmup=10)
    results["zoom_out"] = _time(lambda i: zoom_out(image, target, ratio=zoom_out_ratio(9),
                                                   fillers=fillers[i % 6:i % 6 + 3]), op_calls, warmup=10)
    return {
        "input": {"height": HEIGHT, "width": WIDTH, "boxes": BOXES, "threads": torch.get_num_threads()},
        "ms": results,
        "reference_mean_ms": ORIGINAL_MEAN_MS,
        "ratio_to_reference": results["full call"]["mean"] / ORIGINAL_MEAN_MS,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="full calls to time (after 200 of warm-up)")
    parser.add_argument("--op-calls", type=int, default=200, help="calls per op alone")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = run(args.calls, args.op_calls)
    if args.json:
        print(json.dumps(out))
        return
    print(f"Scale-aware AutoAugment, {HEIGHT}x{WIDTH}, {len(BOXES)} boxes, {torch.get_num_threads()} thread(s); "
          f"ops alone: every box selected")
    print(f"{'':14s} {'mean':>8s} {'median':>8s} {'p90':>8s} {'max':>8s}  (ms)")
    for name, s in out["ms"].items():
        print(f"{name:14s} {s['mean']:8.3f} {s['median']:8.3f} {s['p90']:8.3f} {s['max']:8.3f}")
    print(f"full-call mean / original {ORIGINAL_MEAN_MS} ms = {out['ratio_to_reference']:.3f} "
          f"({1 / out['ratio_to_reference']:.1f}x faster)")


if __name__ == "__main__":
    main()
