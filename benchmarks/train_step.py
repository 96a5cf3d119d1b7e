"""Benchmark: training speed of the train stage against a bare DDP loop, side by side, in one run.

At the configuration in ``params.yaml`` (or ``--params``), on the loader benchmark's synthetic images
(:func:`benchmarks.loader.make_dataset`), with ``train.ims_per_batch / 2`` images per process:

* **bare 1x1**: one process of one thread running :func:`pipelines.engine.train_step` (forward,
  backward, clip, optimizer and scheduler step) on batches held in memory: pre-collated by the
  stage's own loader, no loader in the loop, no logging, no checkpoints;
* **bare 2x1**: the same in two gloo processes of one thread each, the model wrapped by
  :func:`pipelines.build.train.data_parallel` as the stage wraps it (each process its own shard of the batches);
* **stage**: two processes running :func:`pipelines.engine.train`, the train stage's loop, on
  what the stage builds, through the same :mod:`pipelines.build` calls: the detector, optimizer,
  schedule, gradient scaler and DDP wrapper; the stage's loader (``loader.num_workers`` worker
  processes decoding, resizing and augmenting); a :class:`~pipelines.tracking.tracker.Tracker` logging to
  MLflow every ``train.log_period`` iterations into a temporary SQLite store; the CSV training log; a
  :class:`~pipelines.checkpoint.Checkpointer` writing checkpoints; the per-iteration loss all-reduce
  and stop check. That is every per-iteration piece of work ``stages/train.py`` does; what it does
  once (process start, store creation, preview, final model) is outside the timed window, as the
  bare loop's start is. Calling ``engine.train`` in-process, rather than ``python -m pipelines.launch
  stages.train``, is what lets the stage and the bare loop run in the same processes, taking turns,
  on the very same batches, and lets the Tracker's and Checkpointer's calls be timed directly.

Figures: (a) stage / bare 2x1 images per second (goal >= 0.95); (b) bare 2x1 / bare 1x1 (goal
>= 1.85x); (c) MLflow logging overhead: the time the stage's ``Tracker.log_metrics`` calls take
(timed directly, on rank 0, where they run, every ``train.log_period`` iterations) as a fraction
of the stage's time (goal < 1%).

Method: :func:`torch.multiprocessing.spawn` starts two processes (file-based init, gloo, one torch
thread each, ``OMP_NUM_THREADS=1`` as the launcher sets). A discarded pass over the timed batches
first warms every batch shape's kernels; then each repeat runs every variant once, in an order that
rotates from repeat to repeat, each from a freshly built model: ``--warmup`` iterations, then
``--iters`` timed ones (rank 0's clock). The timed window is placed in the schedule so that it holds
the stage's ``checkpoint_period`` iteration; the stage's images/s charge that checkpoint's measured
time at the stage's rate (one per ``checkpoint_period`` iterations) instead of once per window.
For 1x1 the second process waits in a barrier (its CPU time is reported). Figures are medians over
repeats; ratios are medians of the per-repeat ratios (each pair measured minutes apart at most). As
other work on a shared machine only ever adds time, a second figure sums each iteration's fastest
repeat ("fastest"): the least disturbed estimate (the same batches and periodic work at every
iteration of every repeat).
``--variants`` adds diagnostic variants (DDP options, loader workers, no tracking; see
:data:`VARIANTS`). Usage::

    python -m benchmarks.train_step [--params params.yaml] [--repeats 3] [--iters 60] [--variants ...] [--json]
    python -m benchmarks.train_step --quick    # tiny images and few iterations: the tests' smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.loader import add_dataset_arguments, load_benchmark_params, make_dataset
from pipelines import distributed
from pipelines.build import data as build_data
from pipelines.build import model as build_model
from pipelines.build import train as build_train
from pipelines.checkpoint import Checkpointer
from pipelines.cli import exit_now
from pipelines.config.load import to_flat_dict
from pipelines.config.schema import Params
from pipelines.data.annotation_cache import AnnotationCache
from pipelines.data.dataset import DetectionDataset
from pipelines.engine import MetricLog, Reporter, StopRequest, train, train_step
from pipelines.tracking.tracker import Tracker

WORLD = 2  # the machine's cores; (b) compares 2 processes x 1 thread with 1 x 1
GOALS = {"stage_vs_bare": 0.95, "scaling": 1.85, "tracking_overhead": 0.01}
QUICK = {"images": 16, "warmup": 1, "iters": 4, "repeats": 1, "min_size_train": [96], "max_size_train": 128}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the training loop.

    ``kind``: ``bare`` (train_step on batches in memory) or ``stage`` (engine.train as the stage
    runs it); ``world``: processes; ``ddp``: keyword arguments for DDP instead of
    :func:`pipelines.build.train.data_parallel` (``None``: the pipeline's own wrapper; ``False``: no DDP,
    each process trains alone); ``hook``: a ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks`` name;
    ``workers``: loader workers instead of ``loader.num_workers``; ``tracking``: log to MLflow;
    ``pin``: every thread of each process pinned to a core of its own (rank ``r`` to core ``r``).
    """

    label: str
    kind: str = "bare"
    world: int = WORLD
    baseline: str | None = "bare_2x1"
    ddp: dict | bool | None = None
    hook: str | None = None
    workers: int | None = None
    tracking: bool = True
    pin: bool = False


VARIANTS = {
    "bare_1x1": Variant("bare loop, 1 process x 1 thread", world=1, baseline=None),
    "bare_2x1": Variant("bare DDP loop, 2 processes x 1 thread (`build.data_parallel`)", baseline="bare_1x1"),
    "stage": Variant("train stage (`engine.train`): loader, MLflow, checkpoints; 2 x 1", kind="stage"),
    # diagnostics (--variants)
    "stage_no_tracking": Variant("train stage without MLflow (inactive Tracker)", kind="stage", tracking=False),
    "stage_workers_0": Variant("train stage, loader in the training process (0 workers)", kind="stage", workers=0),
    "stage_workers_2": Variant("train stage, 2 loader workers per process", kind="stage", workers=2),
    "no_allreduce_2x1": Variant("2 processes x 1 thread, each training alone (no DDP: no all-reduce; each "
                                "iteration counted as the slower process's)", ddp=False, baseline="bare_1x1"),
    "ddp_pinned": Variant("DDP, each process's threads pinned to a core of its own", pin=True),
    "ddp_defaults": Variant("DDP with torch's defaults", ddp={}),
    "ddp_no_forward_sync": Variant("DDP, forward_sync_buffers=False", ddp={"forward_sync_buffers": False}),
    "ddp_bucket_view": Variant("DDP, gradient_as_bucket_view=True", ddp={"gradient_as_bucket_view": True}),
    "ddp_batched_grad_copy": Variant("DDP, batched_grad_copy=True", ddp={"batched_grad_copy": True}),
    "ddp_static_graph": Variant("DDP, static_graph=True", ddp={"static_graph": True}),
    "ddp_bucket_5mb": Variant("DDP, bucket_cap_mb=5", ddp={"bucket_cap_mb": 5}),
    "ddp_bucket_100mb": Variant("DDP, bucket_cap_mb=100", ddp={"bucket_cap_mb": 100}),
    "ddp_combined": Variant("DDP, forward_sync_buffers=False, batched_grad_copy, static_graph",
                            ddp={"forward_sync_buffers": False, "batched_grad_copy": True, "static_graph": True}),
    "ddp_bf16_compress": Variant("DDP, bf16 gradient compression hook (changes the weights)", ddp={},
                                 hook="bf16_compress_hook"),
}
DEFAULT_VARIANTS = ("bare_1x1", "bare_2x1", "stage")


def window(p: Params, *, warmup: int, iters: int) -> tuple[int, int, int]:
    """``(start_iter, first, last)``: the schedule position of a run of ``warmup + iters`` iterations
    whose timed ones are ``first + 1 .. last``. The timed window holds the ``checkpoint_period``
    iteration and, where it can, starts after a ``log_period`` iteration (so it holds as many
    logging iterations as the stage has per ``iters``)."""
    period, log_period = p.train.checkpoint_period, p.train.log_period
    first = max(warmup, period - (iters + 1) // 2)
    aligned = first // log_period * log_period
    if aligned >= warmup and aligned + iters > period:
        first = aligned
    return first - warmup, first, first + iters


def _timed(obj, method: str, calls: list) -> None:
    """Record ``(start, end)`` of every call of ``obj.method`` in ``calls``."""
    original = getattr(obj, method)

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            calls.append((start, time.perf_counter()))

    setattr(obj, method, call)


class _Stamped:
    """Iterates ``loader``, recording when each batch is asked for (``asked``, one more at the end) and
    when it arrives (``got``). ``asked[k]`` is the start of the loop's iteration ``k``."""

    def __init__(self, loader):
        self.loader, self.asked, self.got = loader, [], []

    def __iter__(self):
        iterator = iter(self.loader)
        while True:
            self.asked.append(time.perf_counter())
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.got.append(time.perf_counter())
            yield batch


def _wrap(p: Params, model: torch.nn.Module, variant: Variant) -> torch.nn.Module:
    if variant.world == 1 or variant.ddp is False:
        return model
    if variant.ddp is None:
        return build_train.data_parallel(p, model, device=torch.device("cpu"), world_size=variant.world)
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model, **variant.ddp)
    if variant.hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(None, getattr(default_hooks, variant.hook))
    return wrapped


def _solver(p: Params, num_classes: int, variant: Variant):
    torch.manual_seed(p.seed)
    compute = build_model.compute(p, torch.device("cpu"))
    model = build_model.detector(p, num_classes=num_classes, compute=compute)
    optimizer = build_train.optimizer(p, model)
    scheduler = build_train.scheduler(p, optimizer)
    return _wrap(p, model, variant), optimizer, scheduler, build_train.grad_scaler(compute, torch.device("cpu"))


def _window_loader(p: Params, dataset, *, rank: int, span: tuple[int, int, int], workers: int):
    """The stage's loader for ``rank`` of 2, yielding the batches of iterations ``start + 1 .. last``."""
    start, _, last = span
    variant = dataclasses.replace(p, train=dataclasses.replace(p.train, max_iter=last),
                                  loader=dataclasses.replace(p.loader, num_workers=workers))
    return build_train.train_loader(variant, dataset, rank=rank, world_size=WORLD, device=torch.device("cpu"),
                                    start_iter=start)


def run_bare(p: Params, variant: Variant, batches: list, num_classes: int, warmup: int) -> dict:
    """``train_step`` over ``batches`` (this process's, in memory): the seconds of each timed iteration
    by this process's clock."""
    model, optimizer, scheduler, scaler = _solver(p, num_classes, variant)
    model.train()
    stamps = []
    for batch in batches:
        stamps.append(time.perf_counter())
        train_step(model, batch, optimizer, scheduler, p.train.clip_grad_norm, scaler)
    stamps.append(time.perf_counter())
    return {"step_s": [b - a for a, b in zip(stamps[warmup:-1], stamps[warmup + 1:])]}


def run_stage(p: Params, variant: Variant, dataset, *, rank: int, span: tuple[int, int, int], warmup: int,
              root: Path, tag: str) -> dict:
    """``engine.train`` as ``stages/train.py`` calls it, over the iterations of ``span``: the seconds of
    each timed iteration (from asking for its batch to asking for the next) by this process's clock, less
    any checkpoint written in it (``checkpoint_s``, charged separately at the stage's period); the
    seconds of each MLflow logging call (``log_s``) and of waiting for the loader."""
    start, first, last = span
    model, optimizer, scheduler, scaler = _solver(p, len(dataset.cache.categories), variant)
    workers = p.loader.num_workers if variant.workers is None else variant.workers
    loader = _Stamped(_window_loader(p, dataset, rank=rank, span=span, workers=workers))
    if rank == 0 and variant.tracking:
        params = {k: v for k, v in to_flat_dict(p).items() if not k.startswith("evaluate.")}
        tracker = Tracker.start(experiment=p.tracking.experiment, params=params, run_name=f"benchmark {tag}")
    else:
        tracker = Tracker()
    checkpointer = Checkpointer(root / "checkpoints" / tag, keep=p.train.keep_checkpoints, fingerprint="benchmark",
                                extra={"categories": dataset.cache.categories})
    logged, saved = [], []
    _timed(tracker, "log_metrics", logged)
    _timed(checkpointer, "save", saved)
    stderr = sys.stderr
    if rank == 0:  # the progress bar goes to a file, not over the table
        sys.stderr = open(root / f"progress_{tag}.txt", "w")
    try:
        report = Reporter(max_iter=last, start_iter=start, ims_per_batch=p.train.ims_per_batch,
                          log_period=p.train.log_period, metric_log=MetricLog(root / "logs" / f"{tag}.csv"),
                          tracker=tracker)
        train(model, loader, optimizer, scheduler, device=torch.device("cpu"), max_iter=last, start_iter=start,
              **build_train.loop_settings(p), checkpointer=checkpointer, scaler=scaler, report=report,
              stop=StopRequest())
    finally:
        if rank == 0:
            sys.stderr.close()
            sys.stderr = stderr
    tracker.finish()
    if rank == 0:
        shutil.rmtree(root / "checkpoints" / tag)
    asked, steps = loader.asked[warmup:], []
    for begin, end in zip(asked[:-1], asked[1:]):
        steps.append(end - begin - sum(b - a for a, b in saved if begin <= a < end))
    return {"step_s": steps, "checkpoint_s": [b - a for a, b in saved if a >= asked[0]],
            "log_s": [b - a for a, b in logged if a >= asked[0]], "workers": workers,
            "loader_wait_s": sum(loader.got[k] - loader.asked[k] for k in range(warmup, len(loader.got)))}


def _worker(rank: int, job: dict) -> None:
    # Loader workers start as in a process that torchrun starts (Python 3.11 on Linux: fork), not as
    # this spawned process's own default.
    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)  # as distributed.init_from_env does: the node's 2 cores split between 2 processes
    root = Path(job["root"])
    os.environ["DVC_ROOT"] = str(root)  # the Tracker's store and artifact root: the scratch folder
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank, world_size=WORLD)
    try:
        results = _measure(rank, job, root)
        if rank == 0:
            (root / "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(message, file=sys.__stderr__, flush=True)


def _measure(rank: int, job: dict, root: Path) -> dict:
    p: Params = job["params"]
    warmup, iters, repeats = job["warmup"], job["iters"], job["repeats"]
    span = window(p, warmup=warmup, iters=iters)
    transforms = build_data.train_transforms(p, build_data.augmentation(p))
    dataset = DetectionDataset(AnnotationCache(root / "cache"), transforms=transforms, seed=p.seed)
    num_classes = len(dataset.cache.categories)
    batches = list(_window_loader(p, dataset, rank=rank, span=span, workers=0))  # this rank's, pre-collated
    counts = distributed.gather_objects(sum(len(b.indices) for b in batches[warmup:]))  # timed images per rank
    if rank == 0:
        Tracker.start(experiment=p.tracking.experiment, params={}).finish()  # create the store (MLflow's migrations)
    _say(rank, f"warming up: one discarded pass over {len(batches)} batches")
    run_bare(p, VARIANTS["bare_2x1"], batches, num_classes, warmup=0)
    names = job["variants"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    cores = os.sched_getaffinity(0)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            variant = VARIANTS[name]
            _pin_threads({sorted(cores)[rank % len(cores)]} if variant.pin else cores)
            allowed = sorted(os.sched_getaffinity(0))
            dist.barrier()
            cpu, wall = _cpu_s(), time.perf_counter()
            if variant.world == 1 and rank > 0:
                figures = None
            elif variant.kind == "stage":
                figures = run_stage(p, variant, dataset, rank=rank, span=span, warmup=warmup, root=root,
                                    tag=f"{name}_{repeat}")
            else:
                figures = run_bare(p, variant, batches, num_classes, warmup)
            dist.barrier()
            waiting = distributed.gather_objects({"cpu_s": _cpu_s() - cpu, "wall_s": time.perf_counter() - wall})
            steps = distributed.gather_objects(figures and figures["step_s"])
            if rank == 0:
                figures["cores"] = allowed  # rank 0's, while it ran
                if variant.world == 1:
                    figures["other_process_waiting"] = waiting[1]
                if variant.ddp is False:  # not in lock step: count each iteration as the slower process's
                    figures["step_s"] = [max(times) for times in zip(*steps)]
                    figures["rank_step_s"] = steps
                runs[name].append(figures)
                _say(rank, f"repeat {repeat + 1}/{repeats}: {name} "
                           f"{statistics.mean(figures['step_s']):.3f} s per iteration")
    return {"runs": runs, "span": span, "images": {"1": counts[0], "2": sum(counts)} if rank == 0 else None}


def _pin_threads(cores: set[int]) -> None:
    """Every thread of this process (torch's, gloo's) allowed on ``cores`` only."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:  # a thread that has ended
            pass


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rates(runs: list[dict], *, images: int, iters: int, period: int) -> tuple[list[float], float]:
    """Images per second of each run, and of the fastest of the runs at each iteration (summed), with any
    checkpoint charged once per ``period`` iterations."""
    def charge(times):
        return statistics.median(times) * iters / period if times else 0.0

    each = [images / (sum(r["step_s"]) + charge(r.get("checkpoint_s", []))) for r in runs]
    fastest = sum(min(column) for column in zip(*(r["step_s"] for r in runs)))
    return each, images / (fastest + charge([t for r in runs for t in r.get("checkpoint_s", [])]))


def summarise(p: Params, measured: dict, *, config: dict) -> dict:
    """Medians and ratios of the per-repeat runs that :func:`_measure` returned."""
    start, first, last = measured["span"]
    rates, variants = {}, {}
    for name, runs in measured["runs"].items():
        v = VARIANTS[name]
        rates[name] = _rates(runs, images=measured["images"][str(v.world)], iters=last - first,
                             period=p.train.checkpoint_period)
        figures = {"label": v.label, "processes": v.world, "baseline": v.baseline,
                   "images_per_s": statistics.median(rates[name][0]), "runs_images_per_s": rates[name][0],
                   "best_images_per_s": rates[name][1]}
        if v.kind == "stage":
            seconds = [measured["images"]["2"] / rate for rate in rates[name][0]]
            checkpoints = [t for r in runs for t in r["checkpoint_s"]]
            figures.update(
                workers=runs[0]["workers"], log_calls=statistics.median(len(r["log_s"]) for r in runs),
                log_s=statistics.median(sum(r["log_s"]) for r in runs),
                tracking_fraction=statistics.median(sum(r["log_s"]) / s for r, s in zip(runs, seconds)),
                checkpoint_s=statistics.median(checkpoints) if checkpoints else None,
                loader_wait_s=statistics.median(r["loader_wait_s"] for r in runs))
        if v.world == 1:
            figures["other_process_waiting"] = runs[0]["other_process_waiting"]
        figures["runs"] = runs
        variants[name] = figures
    for name, figures in variants.items():
        base = figures["baseline"]
        if base in rates:
            each = [a / b for a, b in zip(rates[name][0], rates[base][0])]
            figures.update(ratio=statistics.median(each), runs_ratio=each,
                           best_ratio=rates[name][1] / rates[base][1])
    goals = {}
    if "stage" in variants and "bare_2x1" in variants:
        goals["stage_vs_bare"] = (variants["stage"]["ratio"], variants["stage"]["best_ratio"])
    if "bare_2x1" in variants and "bare_1x1" in variants:
        goals["scaling"] = (variants["bare_2x1"]["ratio"], variants["bare_2x1"]["best_ratio"])
    if "stage" in variants:
        goals["tracking_overhead"] = (variants["stage"]["tracking_fraction"],) * 2

    def met(key, value):
        return value < GOALS[key] if key == "tracking_overhead" else value >= GOALS[key]

    return {"config": {**config, "window": [start, first, last], "timed_images": measured["images"]},
            "variants": variants,
            "goals": {k: {"value": v, "best": b, "goal": GOALS[k], "met": met(k, v), "best_met": met(k, b)}
                      for k, (v, b) in goals.items()}}


def benchmark(p: Params, *, root: Path, images: int, variants: list[str], warmup: int, iters: int,
              repeats: int) -> dict:
    """All measurements; ``root`` is an empty scratch folder."""
    if p.train.ims_per_batch % WORLD:
        raise SystemExit(f"error: train.ims_per_batch {p.train.ims_per_batch} is not a multiple of {WORLD}")
    if iters < 2:
        raise SystemExit("error: --iters must be at least 2")
    unknown = [n for n in variants if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"error: unknown variant {unknown[0]!r}; expected some of {', '.join(VARIANTS)}")
    make_dataset(p, root, images=images)
    load_before = os.getloadavg()
    job = {"root": str(root), "params": p, "variants": variants, "warmup": warmup, "iters": iters,
           "repeats": repeats}
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # as pipelines.launch sets it for its processes
    try:
        mp.spawn(_worker, args=(job,), nprocs=WORLD, join=True)
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    measured = json.loads((root / "results.json").read_text())
    config = {"model": p.model.name, "min_size_train": list(p.model.min_size_train),
              "max_size_train": p.model.max_size_train,
              "precision": build_model.compute(p, torch.device("cpu")).precision,
              "augment": p.augment.name,
              "batch_per_process": p.train.ims_per_batch // WORLD, "processes": WORLD,
              "num_workers": p.loader.num_workers, "log_period": p.train.log_period,
              "checkpoint_period": p.train.checkpoint_period, "images": images, "warmup": warmup, "iters": iters,
              "repeats": repeats, "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
              "load_average_before": list(load_before), "load_average_after": list(os.getloadavg())}
    return summarise(p, measured, config=config)


def table(f: dict) -> str:
    """The figures as a markdown table and the goals."""
    c, v = f["config"], f["variants"]
    first, last = c["window"][1:]
    lines = [
        f"{c['model']} at {c['min_size_train']}..{c['max_size_train']} px, {c['precision']}, augment={c['augment']}, "
        f"batch {c['batch_per_process']} per process, 1 thread per process; {c['images']} synthetic images; "
        f"{c['iters']} timed iterations ({first + 1}..{last}) after {c['warmup']}, {c['repeats']} repeats, "
        f"variants taking turns; {c['cores']} cores, load average {c['load_average_before'][0]:.2f} before, "
        f"{c['load_average_after'][0]:.2f} after (1 min).",
        "",
        "| variant | images/s, median | ratio, median | images/s, fastest | ratio, fastest | vs |",
        "|---|---|---|---|---|---|",
    ]
    for name, figures in v.items():
        if "ratio" in figures:
            ratio, best, versus = f"{figures['ratio']:.3f}", f"{figures['best_ratio']:.3f}", f"`{figures['baseline']}`"
        else:
            ratio, best, versus = ("1", "1", "(baseline)") if figures["baseline"] is None else ("-", "-", "(not run)")
        lines.append(f"| `{name}`: {figures['label']} | {figures['images_per_s']:.2f} | {ratio} | "
                     f"{figures['best_images_per_s']:.2f} | {best} | {versus} |")
    lines += ["", "median: of the repeats' images/s (ratios: median of the per-repeat ratios); fastest: each "
              "iteration's fastest repeat, summed (least disturbed by other work on the machine)."]
    for name, figures in v.items():
        if "tracking_fraction" in figures:
            ckpt = (f"a checkpoint took {figures['checkpoint_s']:.2f} s (charged once per {c['checkpoint_period']} "
                    "iterations)" if figures["checkpoint_s"] is not None else "no checkpoint in the window")
            lines.append(f"`{name}`: {figures['workers']} loader worker(s); {figures['log_calls']:.0f} MLflow "
                         f"logging calls in the window took {figures['log_s'] * 1e3:.0f} ms "
                         f"({figures['tracking_fraction']:.2%} of the time, timed directly); {ckpt}; "
                         f"waiting for the loader {figures['loader_wait_s'] * 1e3:.0f} ms.")
    goal_text = {"stage_vs_bare": "(a) stage / bare 2x1", "scaling": "(b) bare 2x1 / bare 1x1",
                 "tracking_overhead": "(c) MLflow logging share of the stage's time"}
    lines.append("")
    for key, g in f["goals"].items():
        if key == "tracking_overhead":
            value, goal = f"{g['value']:.2%}", f"< {g['goal']:.0%}"
        else:
            value, goal = f"{g['value']:.3f} (fastest: {g['best']:.3f})", f">= {g['goal']}"
        verdict = "met" if g["met"] else "NOT met"
        lines.append(f"- {goal_text[key]}: {value}, goal {goal}: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_arguments(parser)
    parser.add_argument("--warmup", type=int, default=5, help="iterations of each variant before timing")
    parser.add_argument("--iters", type=int, default=60, help="timed iterations of each variant")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--variants", nargs="+", default=[], metavar="NAME",
                        help=f"diagnostic variants to add: {', '.join(n for n in VARIANTS if n not in DEFAULT_VARIANTS)}")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run exactly these variants (any of the above)")
    parser.add_argument("--quick", action="store_true", help="tiny images, few iterations, one repeat (tests)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)

    p = load_benchmark_params(args.params, augment=args.augment)
    images, warmup, iters, repeats = args.images, args.warmup, args.iters, args.repeats
    if args.quick:
        p = dataclasses.replace(p, model=dataclasses.replace(p.model, min_size_train=QUICK["min_size_train"],
                                                             max_size_train=QUICK["max_size_train"]))
        images, warmup, iters, repeats = QUICK["images"], QUICK["warmup"], QUICK["iters"], QUICK["repeats"]
    variants = args.only or list(DEFAULT_VARIANTS) + [n for n in args.variants if n not in DEFAULT_VARIANTS]
    with tempfile.TemporaryDirectory(prefix="bench_train_step_") as root:
        figures = benchmark(p, root=Path(root), images=images, variants=variants, warmup=warmup, iters=iters,
                            repeats=repeats)
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
