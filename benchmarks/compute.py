"""Benchmark: the training compute of a configuration against the params', as images x pixels x FLOPs per pixel.

Two factors, each measured for the baseline (``--params``, ``--baseline`` over them) and the candidate
(``--params``, ``--set`` over them):

- **padded pixels**: the train stage's batching over the whole schedule replayed from the annotation cache's
  image sizes (:func:`benchmarks.padding.padding`: every image and its padding, as many images as the
  schedule trains; nothing decoded or trained);
- **FLOPs per pixel**: one training forward and backward pass (the losses included) of one batch of
  ``train.ims_per_batch`` images of ``model.min_size_train[0]`` pixels square, counted by
  ``torch.utils.flop_counter.FlopCounterMode`` (matrix products and convolutions: what dominates), divided by
  the batch's pixels.

Their product is the training compute; the table gives each factor and the candidate's ratio to the baseline.

    python -m benchmarks.compute --cache data/cache/train --set model.dfl_bins=16 [--params params.yaml] [--json]
    python -m benchmarks.compute --cache data/cache/train --baseline model.dfl_bins=null   # today's against before
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from pipelines import cli
from pipelines.build import model as build_model
from pipelines.config.load import load_params
from pipelines.config.schema import Params
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.hardware import resolve

from .padding import padding


def flops_per_pixel(p: Params, num_classes: int) -> dict:
    """FLOPs of one training forward and backward pass per input pixel (fp32, random weights, seed 0)."""
    torch.manual_seed(0)
    model = build_model.detector(p, num_classes=num_classes, compute=resolve("fp32", False, torch.device("cpu")),
                                 pretrained=False)
    model.train()
    side = -(-p.model.min_size_train[0] // p.loader.size_divisibility) * p.loader.size_divisibility
    batch = p.train.ims_per_batch
    images = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8)
    boxes = torch.tensor([[8.0, 8.0, side / 2, side / 3], [side / 3, side / 4, side - 8.0, side - 8.0]])
    targets = [{"boxes": boxes, "labels": torch.tensor([1, min(2, num_classes)])} for _ in range(batch)]
    with FlopCounterMode(display=False) as counter:
        losses = model(images, [(side, side)] * batch, targets)
        sum(losses.values()).backward()
    total = counter.get_total_flops()
    return {"flops": total, "per_pixel": total / (batch * side * side), "side": side}


def measure(base: Params, candidate: Params, cache: AnnotationCache) -> dict:
    arms = {}
    for name, p in (("baseline", base), ("candidate", candidate)):
        pixels, flops = padding(p, cache), flops_per_pixel(p, len(cache.categories))
        arms[name] = {"padded_pixels": pixels["padded_pixels"], "padding": pixels["padding"],
                      "flops_per_pixel": flops["per_pixel"], "forward_backward_gflop": flops["flops"] / 1e9,
                      "side": flops["side"], "compute": pixels["padded_pixels"] * flops["per_pixel"]}
    b, c = arms["baseline"], arms["candidate"]
    return {**arms, "ratio": {"padded_pixels": c["padded_pixels"] / b["padded_pixels"],
                              "flops_per_pixel": c["flops_per_pixel"] / b["flops_per_pixel"],
                              "compute": c["compute"] / b["compute"]}}


def table(figures: dict) -> str:
    b, c, r = figures["baseline"], figures["candidate"], figures["ratio"]
    return "\n".join([
        "| factor | baseline | candidate | candidate / baseline |", "|---|---|---|---|",
        f"| padded training pixels, whole schedule | {b['padded_pixels'] / 1e6:.1f} M ({b['padding']:.1%} padding) | "
        f"{c['padded_pixels'] / 1e6:.1f} M ({c['padding']:.1%} padding) | {r['padded_pixels']:.4f} |",
        f"| FLOPs per pixel, training forward + backward ({b['side']} px batch: {b['forward_backward_gflop']:.2f} vs "
        f"{c['forward_backward_gflop']:.2f} GFLOP) | {b['flops_per_pixel']:.0f} | {c['flops_per_pixel']:.0f} | "
        f"{r['flops_per_pixel']:.4f} |",
        f"| training compute (pixels x FLOPs per pixel) | {b['compute'] / 1e12:.1f} TFLOP | {c['compute'] / 1e12:.1f} TFLOP | "
        f"**{r['compute']:.4f}** |"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the training split's annotation cache")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the candidate's params")
    parser.add_argument("--baseline", action="append", default=[], metavar="KEY=VALUE", help="the baseline's params")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    figures = measure(load_params(args.params, overrides=args.baseline), load_params(args.params, overrides=args.set),
                      AnnotationCache(args.cache, verify=False))
    print(json.dumps(figures) if args.json else table(figures), flush=True)


if __name__ == "__main__":
    cli.run(main)
