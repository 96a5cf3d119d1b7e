"""Benchmark: what the AP bootstrap (``evaluate.bootstrap``) adds to the evaluate stage's scoring.

For a ground truth and detections (the evaluate stage's ``data/prepared/val.json`` and
``outputs/eval/detections.json``), times :func:`pipelines.evaluation.coco_evaluate` as the stage calls it
with each backend, without and with the bootstrap, and splits the bootstrap's time into its parts:
pycocotools' ``evaluate()`` (run for the per-image matches when the backend is faster-coco-eval), reading
the matches, and the resamples. Times are medians over ``--repeats`` in this one process, of the wall
clock and of this process's CPU time (steadier than the wall clock on a busy machine). Usage::

    python -m benchmarks.bootstrap --gt data/prepared/val.json --detections outputs/eval/detections.json
        [--resamples 1000] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import statistics
import time
from pathlib import Path

import orjson
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from pipelines import ap_bootstrap
from pipelines.evaluation import BACKENDS, coco_evaluate


def _timed(function) -> tuple[tuple[float, float], object]:
    """((wall seconds, CPU seconds), result) of ``function()``."""
    start, cpu = time.perf_counter(), time.process_time()
    result = function()
    return (time.perf_counter() - start, time.process_time() - cpu), result


def _pycocotools_evaluate(gt: Path, detections: list[dict]) -> COCOeval:
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(gt))
        evaluator = COCOeval(coco_gt, coco_gt.loadRes(detections), "bbox")
        evaluator.evaluate()
    return evaluator


def measure(gt: Path, detections: list[dict], *, resamples: int, repeats: int, seed: int = 0) -> dict:
    """Median (wall, CPU) seconds per backend (``plain``, ``bootstrap``, ``added``) and of the bootstrap's
    parts."""
    times: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, seconds: tuple[float, float]) -> None:
        times.setdefault(name, []).append(seconds)

    for _ in range(repeats):
        for backend in BACKENDS:
            add(f"{backend}/plain", _timed(lambda: coco_evaluate(gt, copy.deepcopy(detections), backend=backend))[0])
            add(f"{backend}/bootstrap", _timed(lambda: coco_evaluate(gt, copy.deepcopy(detections), backend=backend,
                                                                     bootstrap=resamples, seed=seed))[0])
        seconds, evaluator = _timed(lambda: _pycocotools_evaluate(gt, copy.deepcopy(detections)))
        add("parts/pycocotools_evaluate", seconds)
        seconds, matches = _timed(lambda: ap_bootstrap.extract_matches(evaluator))
        add("parts/extract_matches", seconds)
        add("parts/resamples", _timed(lambda: ap_bootstrap.bootstrap(matches, resamples, seed))[0])
    medians = {name: [statistics.median(v[i] for v in values) for i in (0, 1)] for name, values in times.items()}
    for backend in BACKENDS:
        with_bootstrap, plain = medians[f"{backend}/bootstrap"], medians[f"{backend}/plain"]
        medians[f"{backend}/added"] = [b - p for b, p in zip(with_bootstrap, plain)]
    images = len(json.loads(gt.read_text())["images"])
    return {"images": images, "detections": len(detections), "resamples": resamples, "repeats": repeats,
            "detections_kept": int(matches.image.size), "seconds": medians}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gt", type=Path, required=True, help="COCO ground truth JSON")
    parser.add_argument("--detections", type=Path, required=True, help="COCO results JSON")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    detections = [{k: d[k] for k in ("image_id", "category_id", "bbox", "score")}
                  for d in orjson.loads(args.detections.read_bytes())]
    result = measure(args.gt, detections, resamples=args.resamples, repeats=args.repeats)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['images']} images, {result['detections']} detections ({result['detections_kept']} kept in the "
          f"matches), {result['resamples']} resamples, median of {result['repeats']}; wall and CPU seconds:")
    for name, (wall, cpu) in result["seconds"].items():
        print(f"  {name:32s} {wall:7.3f} s {cpu:7.3f} s")


if __name__ == "__main__":
    main()
