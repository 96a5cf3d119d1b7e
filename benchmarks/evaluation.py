"""Benchmark: COCO box evaluation at COCO val2017 scale, pycocotools against faster-coco-eval.

One run measures both backends of :func:`pipelines.evaluation.coco_evaluate` (``evaluate.backend``)
side by side, pycocotools being the baseline:

* input, written to a temporary folder first and read back from the files, as the evaluate stage
  does: ground truth shaped like ``instances_val2017.json`` (5,000 images, 36,781 boxes over COCO's
  80 category ids with their gaps, crowd regions, images without boxes; from
  :mod:`benchmarks.coco_scale`) and 500,000 detections, 100 per image as a detector with
  ``detections_per_img: 100`` gives them: most ground-truth boxes found with some localisation
  error, the rest false positives, of all sizes and categories;
* per backend, ``--repeats`` fresh processes, the backends taking turns: each loads the detections
  JSON, then times ``coco_evaluate(gt_path, detections, backend=...)`` (reading the ground truth,
  ``loadRes``, ``evaluate``, ``accumulate``, ``summarize``, per-category AP and the PR curve) and
  reports its peak RSS (``ru_maxrss``, C allocations included) and the RSS it had before the call;
* the 12 figures of every run, which must agree: recall figures bit for bit, precision figures to
  1e-14 (faster-coco-eval's precision omits pycocotools' ``+ np.spacing(1)``, see
  ``tests/test_evaluation.py``).

Times are medians; the ratio is each backend's median over pycocotools' in the same run. Usage::

    python -m benchmarks.evaluation [--images 5000] [--detections 500000] [--repeats 3] [--json]
    python -m benchmarks.evaluation --quick      # a few seconds: 100 images, 2,000 detections, 1 repeat
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

from benchmarks.coco_scale import COCO_CATEGORY_IDS, make_coco_scale
from pipelines.cli import exit_now
from pipelines.evaluation import BACKENDS, STAT_NAMES
from pipelines.fileio import atomic_write_bytes
from pipelines.lifetime import parent_death_signal

REPO = Path(__file__).resolve().parents[1]
BASELINE = "pycocotools"
BOXES_PER_IMAGE = 36_781 / 5_000  # COCO val2017
TOLERANCE = 1e-14  # on precision figures (AP*); recall figures (AR*) must be equal
QUICK = {"images": 100, "detections": 2_000, "repeats": 1}


def make_detections(coco: dict, *, num_detections: int, seed: int) -> list[dict]:
    """COCO results for the images of ``coco``: ``num_detections`` spread evenly over the images.

    About 90% of the boxes that are not crowd regions are found (with a localisation error of 1% to
    12% of their size, so that a share fails the stricter IoU thresholds, and a higher score); the
    rest of each image's detections are false positives of random size, place and category.
    """
    rng = np.random.default_rng(seed)
    images = coco["images"]
    widths = np.array([im["width"] for im in images], dtype=np.float64)
    heights = np.array([im["height"] for im in images], dtype=np.float64)
    row_of = {im["id"]: row for row, im in enumerate(images)}
    per_image = np.full(len(images), num_detections // len(images))
    per_image[: num_detections % len(images)] += 1

    anns = [a for a in coco["annotations"] if not a["iscrowd"]]
    rows = np.array([row_of[a["image_id"]] for a in anns], dtype=np.int64)
    found = rng.random(len(anns)) < 0.9
    order = np.argsort(rows[found], kind="stable")  # keep each image's first ``per_image`` found boxes
    hits = np.flatnonzero(found)[order]
    hit_rows = rows[hits]
    rank = np.arange(len(hits)) - np.searchsorted(hit_rows, hit_rows)  # position within its image
    hits = hits[rank < per_image[hit_rows]]
    hit_rows = rows[hits]

    gt = np.array([anns[i]["bbox"] for i in hits], dtype=np.float64).reshape(-1, 4)
    error = rng.uniform(0.01, 0.12, size=(len(hits), 1)) * rng.standard_normal((len(hits), 4))
    tp = gt + error * gt[:, [2, 3, 2, 3]]
    tp[:, 2:] = np.maximum(tp[:, 2:], 1.0)
    tp_cats = np.array([anns[i]["category_id"] for i in hits], dtype=np.int64)
    tp_scores = rng.beta(5, 2, size=len(hits))

    fp_rows = np.repeat(np.arange(len(images)), per_image - np.bincount(hit_rows, minlength=len(images)))
    w_img, h_img = widths[fp_rows], heights[fp_rows]
    side = np.exp(rng.uniform(np.log(4.0), np.log(0.8 * np.minimum(w_img, h_img))))  # small to large
    w = np.minimum(side * rng.uniform(0.5, 1.5, size=len(fp_rows)), w_img - 1)
    h = np.minimum(side * rng.uniform(0.5, 1.5, size=len(fp_rows)), h_img - 1)
    fp = np.stack([rng.random(len(fp_rows)) * (w_img - w), rng.random(len(fp_rows)) * (h_img - h), w, h], axis=1)
    fp_cats = np.array(COCO_CATEGORY_IDS)[rng.integers(0, len(COCO_CATEGORY_IDS), size=len(fp_rows))]
    fp_scores = rng.beta(1.5, 5, size=len(fp_rows))

    all_rows = np.concatenate([hit_rows, fp_rows])
    boxes = np.concatenate([tp, fp]).astype(np.float32).astype(np.float64)  # a detector's float32 output
    cats = np.concatenate([tp_cats, fp_cats])
    scores = np.concatenate([tp_scores, fp_scores]).astype(np.float32).astype(np.float64)
    order = np.lexsort((-scores, all_rows))  # grouped by image, best first, as the stage writes them
    image_ids = np.array([im["id"] for im in images])[all_rows[order]]
    return [{"image_id": i, "category_id": c, "bbox": b, "score": s} for i, c, b, s in
            zip(image_ids.tolist(), cats[order].tolist(), boxes[order].tolist(), scores[order].tolist())]


def write_inputs(folder: Path, *, images: int, detections: int, seed: int) -> dict:
    """Write ``gt.json`` and ``detections.json`` into ``folder``; returns what they hold."""
    boxes = max(round(images * BOXES_PER_IMAGE), 1)
    coco = make_coco_scale(seed=seed, num_images=images, num_boxes=boxes)
    results = make_detections(coco, num_detections=detections, seed=seed + 1)
    atomic_write_bytes(folder / "gt.json", orjson.dumps(coco))
    atomic_write_bytes(folder / "detections.json", orjson.dumps(results))
    return {"images": len(coco["images"]), "boxes": len(coco["annotations"]),
            "crowd": sum(a["iscrowd"] for a in coco["annotations"]), "categories": len(coco["categories"]),
            "detections": len(results), "gt_megabytes": (folder / "gt.json").stat().st_size / 1e6,
            "detections_megabytes": (folder / "detections.json").stat().st_size / 1e6}


def _rss_mb() -> float:
    """Current resident set size of this process in MB (from /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(backend: str, *, folder: Path) -> dict:
    """One measurement in this (fresh) process: ``coco_evaluate`` with ``backend`` on ``folder``'s files."""
    from pipelines.evaluation import coco_evaluate

    with open(folder / "detections.json", "rb") as f:
        detections = json.load(f)
    gc.collect()
    base = _rss_mb()
    start = time.perf_counter()
    metrics = coco_evaluate(folder / "gt.json", detections, backend=backend)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return {"seconds": seconds, "base_rss_mb": base, "peak_rss_mb": peak, "added_rss_mb": peak - base,
            "stats": metrics.stats}


def run_child(backend: str, *, folder: Path) -> dict:
    """Run :func:`child` in a fresh interpreter and return its figures."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.evaluation", "--child", backend, "--folder", str(folder)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, preexec_fn=parent_death_signal)
    if done.returncode:
        raise RuntimeError(f"measurement {backend!r} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(stats: dict[str, list[dict]]) -> dict:
    """Whether every run's 12 figures agree with the baseline's first run (AR* equal, AP* to 1e-14)."""
    reference = stats[BASELINE][0]
    differences = {name: 0.0 for name in STAT_NAMES}
    agree = True
    for runs in stats.values():
        for run in runs:
            for name in STAT_NAMES:
                a, b = reference[name], run[name]
                if a is None or b is None:
                    agree &= a is b
                    continue
                differences[name] = max(differences[name], abs(a - b))
                agree &= a == b if name.startswith("AR") else abs(a - b) <= TOLERANCE
    return {"agree": agree, "bitwise_equal": sum(d == 0 for d in differences.values()),
            "max_difference": max(differences.values()), "differences": differences, "reference": reference}


def benchmark(*, images: int, detections: int, repeats: int, seed: int, workdir: Path) -> dict:
    """Write the input into ``workdir``, then measure every backend ``repeats`` times, taking turns."""
    load_at_start = os.getloadavg()[0]
    start = time.perf_counter()
    dataset = write_inputs(workdir, images=images, detections=detections, seed=seed)
    dataset["generate_seconds"] = time.perf_counter() - start
    runs: dict[str, list[dict]] = {backend: [] for backend in BACKENDS}
    for _ in range(repeats):
        for backend in BACKENDS:
            runs[backend].append(run_child(backend, folder=workdir))
    figures: dict = {"dataset": dataset, "backends": {}}
    for backend, measured in runs.items():
        figures["backends"][backend] = {
            **{key: statistics.median(r[key] for r in measured) for key in ("seconds", "base_rss_mb", "peak_rss_mb",
                                                                              "added_rss_mb")},
            "runs": [{k: v for k, v in r.items() if k != "stats"} for r in measured],
        }
    baseline = figures["backends"][BASELINE]
    for backend, f in figures["backends"].items():
        f["time_ratio"] = f["seconds"] / baseline["seconds"]
        f["memory_ratio"] = f["peak_rss_mb"] / baseline["peak_rss_mb"]
    figures["figures"] = compare({backend: [r["stats"] for r in measured] for backend, measured in runs.items()})
    from importlib.metadata import version

    figures["settings"] = {"repeats": repeats, "seed": seed, "baseline": BASELINE, "cpus": os.cpu_count(),
                           "load_average": {"start": load_at_start, "end": os.getloadavg()[0]},
                           "versions": {"pycocotools": version("pycocotools"),
                                        "faster_coco_eval": version("faster-coco-eval")}}
    return figures


def _time(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


def table(f: dict) -> str:
    """The figures as a markdown table with a line on the input above and one on the figures below."""
    d, s, c = f["dataset"], f["settings"], f["figures"]
    lines = [
        f"Ground truth: {d['images']:,} images, {d['boxes']:,} boxes ({d['crowd']:,} crowd), {d['categories']} "
        f"categories, {d['gt_megabytes']:.1f} MB JSON; {d['detections']:,} detections, "
        f"{d['detections_megabytes']:.0f} MB JSON. Medians of {s['repeats']} fresh processes per backend, "
        f"taking turns (pycocotools {s['versions']['pycocotools']}, faster-coco-eval "
        f"{s['versions']['faster_coco_eval']}; {s['cpus']} CPUs, load average {s['load_average']['start']:.1f} "
        f"at the start, {s['load_average']['end']:.1f} at the end).",
        "",
        "| backend | median time | vs pycocotools | peak RSS of the process | RSS added by the evaluation |",
        "|---|---|---|---|---|",
    ]
    for backend, b in f["backends"].items():
        ratio = "1 (baseline)" if backend == BASELINE else f"{b['time_ratio']:.3f} ({1 / b['time_ratio']:.1f}x faster)"
        lines.append(f"| `{backend}` | {_time(b['seconds'])} | {ratio} | {b['peak_rss_mb']:,.0f} MB | "
                     f"{b['added_rss_mb']:,.0f} MB |")
    lines += [
        "",
        f"The 12 figures agree: {'yes' if c['agree'] else 'NO'} ({c['bitwise_equal']} of 12 bit for bit, "
        f"largest difference {c['max_difference']:.1e}; AP {c['reference']['AP']:.4f}, "
        f"AR100 {c['reference']['AR100']:.4f}).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=5_000, help="val images (default COCO val2017's 5,000)")
    parser.add_argument("--detections", type=int, default=500_000, help="detections, spread evenly over the images")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per backend")
    parser.add_argument("--quick", action="store_true",
                        help=f"a tiny run for tests: {QUICK['images']} images, {QUICK['detections']:,} detections, "
                             f"{QUICK['repeats']} repeat (overrides the three above)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(child(args.child, folder=args.folder)))
        return
    if args.quick:
        args.images, args.detections, args.repeats = QUICK["images"], QUICK["detections"], QUICK["repeats"]
    for name in ("images", "detections", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected at least 1, got {getattr(args, name)}")
    with tempfile.TemporaryDirectory(prefix="bench_evaluation_") as workdir:
        figures = benchmark(images=args.images, detections=args.detections, repeats=args.repeats, seed=args.seed,
                            workdir=Path(workdir))
    print(json.dumps(figures) if args.json else table(figures))
    if not figures["figures"]["agree"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
