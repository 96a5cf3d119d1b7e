"""Benchmark: pycocotools ``COCO(path)`` against the memory-mapped annotation cache, at COCO scale.

One run measures, each in its own fresh process (medians of repeats):

* opening: ``COCO(path)`` vs :class:`pipelines.data.annotation_cache.AnnotationCache`: wall time of the
  call, peak RSS of the process, and RSS added by the call and the random access below;
* random access right after opening: the boxes of 10,000 random images, as numpy arrays
  (``imgToAnns[id]`` -> float32 array for pycocotools; ``annotations(index)`` -> boxes, labels
  and crowd views for the cache);
* building the cache from the JSON, against parsing the same file with ``json.load`` and with
  ``orjson.loads`` (collector paused).

Targets (issue 4): opening at least 200x faster than ``COCO()``, at most 1/10 of its peak memory,
random access under 2 us per image, build no slower than ``json.load``.

The annotation file comes from :mod:`benchmarks.coco_scale` (made once, kept under the system
temporary folder) unless ``--annotations`` names one; caches are built in a temporary folder.
Usage::

    python -m benchmarks.annotations [--repeats 3] [--json]
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

from pipelines.lifetime import parent_death_signal

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"open_speedup": 200.0, "memory_fraction": 0.1, "access_us": 2.0}
KINDS = ("coco", "cache", "build", "json", "orjson")


def _rss_mb() -> tuple[float, float]:
    """``(current, peak)`` resident set size of this process in MB (from /proc)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _random_rows(count: int, accesses: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, count, size=accesses)


def child(kind: str, *, source: Path, cache: Path, accesses: int, seed: int) -> dict:
    """One measurement in this (fresh) process: wall seconds, RSS before/peak, access time per image."""
    import numpy as np

    result: dict = {}
    if kind == "coco":
        import contextlib
        import io

        from pycocotools.coco import COCO

        base, _ = _rss_mb()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(source))
        result["seconds"] = time.perf_counter() - start
        image_ids = sorted(coco.imgs)
        wanted = [image_ids[i] for i in _random_rows(len(image_ids), accesses, seed).tolist()]
        start = time.perf_counter()
        for image_id in wanted:
            np.array([a["bbox"] for a in coco.imgToAnns[image_id]], dtype=np.float32)
        result["access_us"] = (time.perf_counter() - start) / accesses * 1e6
    elif kind == "cache":
        from pipelines.data.annotation_cache import AnnotationCache

        base, _ = _rss_mb()
        start = time.perf_counter()
        annotations = AnnotationCache(cache)
        result["seconds"] = time.perf_counter() - start
        wanted = _random_rows(len(annotations), accesses, seed).tolist()
        fetch = annotations.annotations
        start = time.perf_counter()
        for index in wanted:
            fetch(index)
        result["access_us"] = (time.perf_counter() - start) / accesses * 1e6
    elif kind == "build":
        from pipelines.data.annotation_cache import build_cache

        base, _ = _rss_mb()
        start = time.perf_counter()
        build_cache(source, cache, image_root="images", drop_empty=False)
        result["seconds"] = time.perf_counter() - start
    elif kind == "json":
        base, _ = _rss_mb()
        start = time.perf_counter()
        with open(source, "rb") as f:
            json.load(f)
        result["seconds"] = time.perf_counter() - start
    elif kind == "orjson":
        import gc

        import orjson

        base, _ = _rss_mb()
        start = time.perf_counter()
        gc.disable()
        orjson.loads(source.read_bytes())
        gc.enable()
        result["seconds"] = time.perf_counter() - start
    else:
        raise ValueError(f"unknown measurement {kind!r}; expected one of {', '.join(KINDS)}")
    _, peak = _rss_mb()
    return {**result, "base_rss_mb": base, "peak_rss_mb": peak, "added_rss_mb": peak - base}


def run_child(kind: str, *, source: Path, cache: Path, accesses: int, seed: int) -> dict:
    """Run :func:`child` in a fresh interpreter and return its figures."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.annotations", "--child", kind, "--annotations", str(source),
           "--cache", str(cache), "--accesses", str(accesses), "--seed", str(seed)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, preexec_fn=parent_death_signal)
    if done.returncode:
        raise RuntimeError(f"measurement {kind!r} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def medians(runs: list[dict]) -> dict:
    """Median of every figure over the repeats (and the raw repeats under ``runs``)."""
    return {**{key: statistics.median(r[key] for r in runs) for key in runs[0]}, "runs": runs}


def benchmark(*, source: Path, repeats: int, cache_repeats: int, accesses: int, seed: int, workdir: Path) -> dict:
    """All measurements; the COCO-scale file at ``source`` must exist."""
    cache = workdir / "cache"
    figures = {"build": medians([run_child("build", source=source, cache=cache, accesses=accesses, seed=seed)
                                 for _ in range(repeats)])}
    for kind in ("json", "orjson"):
        figures[kind] = medians([run_child(kind, source=source, cache=cache, accesses=accesses, seed=seed)
                                 for _ in range(repeats)])
    figures["coco"] = medians([run_child("coco", source=source, cache=cache, accesses=accesses, seed=seed + r)
                               for r in range(repeats)])
    figures["cache"] = medians([run_child("cache", source=source, cache=cache, accesses=accesses, seed=seed + r)
                                for r in range(cache_repeats)])
    from pipelines.data.annotation_cache import read_meta

    meta = read_meta(cache)
    coco, cached = figures["coco"], figures["cache"]
    figures["dataset"] = {"file": str(source), "megabytes": source.stat().st_size / 1e6, "images": meta["num_images"],
                          "boxes": meta["num_boxes"], "cache_megabytes": sum(p.stat().st_size for p in cache.iterdir()) / 1e6}
    figures["ratios"] = {
        "open_speedup": coco["seconds"] / cached["seconds"],
        "memory_fraction": cached["peak_rss_mb"] / coco["peak_rss_mb"],
        "access_speedup": coco["access_us"] / cached["access_us"],
        "build_vs_json_load": figures["build"]["seconds"] / figures["json"]["seconds"],
    }
    figures["targets_met"] = {
        "open_speedup": figures["ratios"]["open_speedup"] >= TARGETS["open_speedup"],
        "memory_fraction": figures["ratios"]["memory_fraction"] <= TARGETS["memory_fraction"],
        "access_us": cached["access_us"] < TARGETS["access_us"],
        "build_vs_json_load": figures["ratios"]["build_vs_json_load"] <= 1.0,
    }
    figures["settings"] = {"repeats": repeats, "cache_repeats": cache_repeats, "accesses": accesses, "seed": seed,
                           "load_average": os.getloadavg()[0]}
    return figures


def _time(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def table(f: dict) -> str:
    """The figures as two markdown tables."""
    d, r, coco, cache = f["dataset"], f["ratios"], f["coco"], f["cache"]
    n = f["settings"]["accesses"]
    lines = [
        f"Annotations: {d['images']:,} images, {d['boxes']:,} boxes, {d['megabytes']:.0f} MB JSON; "
        f"cache {d['cache_megabytes']:.0f} MB. Medians of {f['settings']['repeats']} (COCO) / "
        f"{f['settings']['cache_repeats']} (cache) fresh processes.",
        "",
        f"| | open | peak RSS of the process | RSS added by open + access | boxes of {n:,} random images |",
        "|---|---|---|---|---|",
        f"| pycocotools `COCO(path)` | {_time(coco['seconds'])} | {coco['peak_rss_mb']:.0f} MB | "
        f"{coco['added_rss_mb']:.0f} MB | {coco['access_us'] * n / 1e3:.1f} ms ({coco['access_us']:.2f} us/image) |",
        f"| `AnnotationCache(path)` | {_time(cache['seconds'])} | {cache['peak_rss_mb']:.0f} MB | "
        f"{cache['added_rss_mb']:.1f} MB | {cache['access_us'] * n / 1e3:.1f} ms ({cache['access_us']:.2f} us/image) |",
        f"| cache vs COCO | {r['open_speedup']:,.0f}x faster (target >= {TARGETS['open_speedup']:.0f}x) | "
        f"{r['memory_fraction']:.3f} of it (target <= {TARGETS['memory_fraction']}) | | "
        f"{r['access_speedup']:.1f}x faster (target < {TARGETS['access_us']:.0f} us/image) |",
        "",
        "| building the cache, same file | wall time | peak RSS |",
        "|---|---|---|",
        f"| `json.load` (collector on, the default) | {_time(f['json']['seconds'])} | {f['json']['peak_rss_mb']:.0f} MB |",
        f"| `orjson.loads`, collector paused | {_time(f['orjson']['seconds'])} | {f['orjson']['peak_rss_mb']:.0f} MB |",
        f"| `build_cache(path)`: read, hash, parse, arrays, write | {_time(f['build']['seconds'])} | "
        f"{f['build']['peak_rss_mb']:.0f} MB |",
        "",
        "Targets met: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in f["targets_met"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--annotations", type=Path, help="a COCO JSON (default: the COCO-scale synthetic file)")
    parser.add_argument("--images", type=int, default=None, help="images of the generated file (default COCO's)")
    parser.add_argument("--boxes", type=int, default=None, help="boxes of the generated file (default COCO's)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per slow measurement")
    parser.add_argument("--cache-repeats", type=int, default=7, help="fresh processes opening the cache")
    parser.add_argument("--accesses", type=int, default=10_000, help="random images fetched after opening")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(child(args.child, source=args.annotations, cache=args.cache, accesses=args.accesses,
                               seed=args.seed)))
        return

    source = args.annotations
    if source is None:
        from benchmarks.coco_scale import COCO_BOXES, COCO_IMAGES, write_coco_scale

        images, boxes = args.images or COCO_IMAGES, args.boxes or COCO_BOXES
        source = Path(tempfile.gettempdir()) / "coco_scale" / f"instances_seed{args.seed}_{images}_{boxes}.json"
        if not source.exists():
            print(f"generating {source} ...", file=sys.stderr)
            write_coco_scale(source, seed=args.seed, num_images=images, num_boxes=boxes)
    with tempfile.TemporaryDirectory(prefix="bench_annotations_") as workdir:
        figures = benchmark(source=source, repeats=args.repeats, cache_repeats=args.cache_repeats,
                            accesses=args.accesses, seed=args.seed, workdir=Path(workdir))
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
