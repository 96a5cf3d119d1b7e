"""Benchmark: full-schedule AP of augmentation presets, several seeds each (docs/results.md).

For each preset of ``--augment`` and each seed of ``--seeds``, the pipeline's own train and evaluate
stages run, as ``dvc repro`` runs them (``pipelines.launch``, ``train.nproc`` processes), on the prepared
data of ``--prepared`` and ``--cache``, with the params of ``--params`` except two: the ``augment``
section, composed from ``conf/augment/<preset>.yaml`` as ``-S augment=<preset>`` would, and ``seed``
(the model's initialisation, the loader's order and every augmentation draw). ``searched`` takes its
genes from ``--policy-file``, a search's ``policy.json`` (by default the published one that ``augment=searched``
trains, ``benchmarks/records/search/policy.json``). ``trivial_zoom`` is the bar without any search
(TrivialAugment's uniform op after a uniform zoom, docs/augmentation.md). One arm is not a preset:
``sa_autoaug-auto``, the published policy with the bounds a search with ``search.scale_splits: auto`` uses
(the original's scaled to the smallest training size), so that the published policy and a ``searched-auto``
result are compared at the same bounds (policy and bounds not confounded). MLflow records the runs in a store
of their own in the scratch folder, which is deleted with the models.

Every finished run is kept at once as ``--runs/<name>-s<seed>.json`` (its metrics, wall times, the
machine and, for ``searched``, the genes and bounds): a run already kept is not run again, so a
comparison that was stopped resumes where it was, and more seeds or presets can be added later. The
name is the preset's, or ``searched-<label>`` with ``--label`` (to compare the results of two searches).
The table covers every run kept in ``--runs``: per name, the mean over seeds with the spread (largest
minus smallest) beside it, then a row per run.

    python -m benchmarks.policies [--augment sa_autoaug sa_autoaug-auto searched trivial_zoom trivial flip none]
                                  [--seeds 0 1] [--json]
    python -m benchmarks.policies --augment searched --label auto --policy-file other/policy.json
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

import yaml

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("sa_autoaug", "searched", "trivial_zoom", "trivial", "flip", "none")
AUTO_BOUNDS = "sa_autoaug-auto"  # the published policy with the search's auto bounds: an arm, not a preset
ARMS = (PRESETS[0], AUTO_BOUNDS, *PRESETS[1:])
METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def preset_of(arm: str) -> str:
    """The ``conf/augment/`` preset that ``arm`` (one of :data:`ARMS`) trains."""
    return "sa_autoaug" if arm == AUTO_BOUNDS else arm


def auto_bounds(raw: dict) -> list[int]:
    """The scale bounds of a search with ``search.scale_splits: auto`` on ``raw`` params (its training sizes)."""
    from pipelines.config.load import params_from_dict
    from pipelines.search.proxy import scale_splits

    return scale_splits(params_from_dict({**raw, "search": {**raw["search"], "scale_splits": "auto"}}))


def run_params(params: Path, arm: str, seed: int, policy_file: Path) -> dict:
    """``params`` with the ``augment`` section of ``arm``'s preset (for :data:`AUTO_BOUNDS`, with the auto
    bounds as ``augment.scale_splits``) and ``seed``."""
    from pipelines.compose import compose_params

    raw = yaml.safe_load(params.read_text())
    raw["augment"] = yaml.safe_load(compose_params(REPO, [f"augment={preset_of(arm)}"]))["augment"]
    raw["seed"] = seed
    if arm == "searched":
        raw["augment"]["policy_file"] = str(policy_file.resolve())
    if arm == AUTO_BOUNDS:
        raw["augment"]["scale_splits"] = auto_bounds(raw)
    return raw


def train_and_evaluate(raw: dict, *, prepared: Path, cache: Path, folder: Path, store: str | None = None,
                       env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> dict:
    """Run the train and evaluate stages on ``raw`` params in ``folder``, tracked in ``store`` (an MLflow
    tracking URI; by default a SQLite store in ``folder``); their metrics and wall times. ``env``: more of the
    stages' environment (a server's user and password); ``prefix``: what runs them (``ip netns exec NS``)."""
    params = folder / "params.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = {name: folder / name for name in ("checkpoints", "train", "eval")}
    env = {**os.environ, "MLFLOW_TRACKING_URI": store or f"sqlite:///{folder / 'mlflow.db'}",
           "DVC_ROOT": str(folder), **(env or {})}  # a local store's artifacts (mlartifacts/) go to the scratch folder
    launch = [*prefix, sys.executable, "-m", "pipelines.launch", "--params", str(params)]
    commands = {
        "train": [*launch, "--run-file", str(out["checkpoints"] / "run.json"), "stages.train",
                  "--cache", str(cache), "--checkpoints", str(out["checkpoints"]), "--model", str(out["train"] / "model.pth"),
                  "--run", str(out["train"] / "run.json"), "--train-log", str(out["train"] / "log.csv"),
                  "--preview", str(out["train"] / "preview.png")],
        "evaluate": [*launch, "--single-node", "--run-file", str(out["eval"] / "run.json"), "stages.evaluate",
                     "--cache", str(cache), "--prepared", str(prepared), "--model", str(out["train"] / "model.pth"),
                     "--train-run", str(out["train"] / "run.json"), "--metrics", str(out["eval"] / "metrics.json"),
                     "--per-category", str(out["eval"] / "per_category.json"), "--run-ids", str(out["eval"] / "ids.json"),
                     "--plots", str(out["eval"] / "pr.json"), "--detections", str(out["eval"] / "detections.json")],
    }
    seconds = {}
    for stage, command in commands.items():
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL)  # stderr: the progress bars
        if done.returncode:
            raise SystemExit(f"error: the {stage} stage exited with {done.returncode}; this run is not kept")
        seconds[stage] = round(time.perf_counter() - start, 1)
    metrics = json.loads((out["eval"] / "metrics.json").read_text())
    return {"metrics": {k: metrics[k] for k in METRICS}, "seconds": seconds}


def run_name(arm: str, label: str | None) -> str:
    return f"{arm}-{label}" if arm == "searched" and label else arm


def run(arm: str, seed: int, *, params: Path, prepared: Path, cache: Path, policy_file: Path, runs: Path,
        label: str | None = None) -> dict:
    """One arm (a preset, or :data:`AUTO_BOUNDS`) and seed: the kept record, or a new run kept before it is
    returned."""
    name, preset = run_name(arm, label), preset_of(arm)
    path = runs / f"{name}-s{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    from benchmarks.record import machine
    from pipelines.fileio import write_json

    raw = run_params(params, arm, seed, policy_file)
    with tempfile.TemporaryDirectory(prefix=f"policies-{preset}-") as tmp:
        print(f"{name}, seed {seed}: training and evaluating", file=sys.stderr, flush=True)
        result = train_and_evaluate(raw, prepared=prepared, cache=cache, folder=Path(tmp))
    import torch

    from pipelines.hardware import resolve

    found = json.loads(policy_file.read_text()) if preset == "searched" else {}
    precision = resolve(raw["model"]["precision"], raw["model"]["channels_last"], torch.device("cpu")).precision
    record = {"name": name, "preset": preset, "seed": seed, **result, "genes": found.get("policy"),
              "scale_splits": found.get("scale_splits", raw["augment"].get("scale_splits")), "machine": machine(),
              "precision": precision, "model": raw["model"]["name"],
              "schedule": f"{raw['train']['max_iter']} iterations of batch {raw['train']['ims_per_batch']}"}
    runs.mkdir(parents=True, exist_ok=True)
    write_json(path, record)
    return record


def kept(runs: Path) -> list[dict]:
    """Every run kept in ``runs``, in the order of ``PRESETS`` (another preset after them), then by name and seed."""
    records = [json.loads(path.read_text()) for path in runs.glob("*.json")]
    order = {preset: i for i, preset in enumerate(PRESETS)}
    return sorted(records, key=lambda r: (order.get(r["preset"], len(PRESETS)), r["preset"], r["name"], r["seed"]))


def bounds(run: dict) -> str:
    """The scale bounds a Scale-aware AutoAugment policy trained with (the published preset's, or a policy file's
    genes'): its small / medium / large box areas; "-" for a run without such a policy (flip, trivial, a searched
    file that held another preset's section), whose bounds select nothing."""
    scale_aware = run["preset"].startswith("sa_autoaug") or run["name"].startswith("sa_autoaug") or run.get("genes")
    splits = run.get("scale_splits")
    return " / ".join(str(x) for x in splits) if scale_aware and splits else "-"


def figures(records: list[dict]) -> dict:
    """The runs, and per name the mean and spread (max - min) of each metric over its seeds."""
    presets = {}
    for r in records:
        presets.setdefault(r["name"], []).append(r)
    summary = {}
    for preset, rs in presets.items():
        # a metric COCO cannot compute (no object of that size in val) is null in eval.json: left out
        values = {k: [r["metrics"][k] for r in rs if r["metrics"][k] is not None] for k in METRICS}
        summary[preset] = {"seeds": [r["seed"] for r in rs],
                           "mean": {k: statistics.fmean(v) if v else None for k, v in values.items()},
                           "spread": {k: max(v) - min(v) if v else None for k, v in values.items()}}
    return {"runs": records, "summary": summary}


def paired(runs: list[dict], name: str, baseline: str = "flip") -> list[float]:
    """AP of ``name`` minus AP of ``baseline`` at each seed both have (same initialisation and data order)."""
    base = {r["seed"]: r["metrics"]["AP"] for r in runs if r["name"] == baseline and r["metrics"]["AP"] is not None}
    return [r["metrics"]["AP"] - base[r["seed"]] for r in runs
            if r["name"] == name and r["seed"] in base and r["metrics"]["AP"] is not None]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(f: dict) -> str:
    """Per name, the mean of each metric over its seeds with its spread and the AP against flip at the same
    seed; then one row per run."""
    runs = f["runs"]
    first = runs[0]
    m = first["machine"]
    lines = [f"`{first['model']}`, {first['schedule']}, {first['precision']} precision on the {m['class']} class; "
             "mean over seeds (in brackets the spread: largest minus smallest); bounds: the scale bounds the "
             "policy's small / medium / large boxes were told apart by (areas in pixels at the training size; the "
             "original's are 2048 / 10240 / 51200); the last column is AP minus the flip's AP at the same seed.", "",
             "| augment | bounds | seeds | " + " | ".join(METRICS) + " | AP - flip, per seed |",
             "|---|---|---|" + "---|" * len(METRICS) + "---|"]
    for name, s in f["summary"].items():
        cells = [f"{_fmt(s['mean'][k])} ({_fmt(s['spread'][k])})" for k in METRICS]
        delta = ", ".join(f"{d:+.3f}" for d in paired(runs, name)) if name != "flip" else ""
        trained = "; ".join(dict.fromkeys(bounds(r) for r in runs if r["name"] == name))  # one, unless runs differ
        lines.append(f"| {name} | {trained} | {', '.join(map(str, s['seeds']))} | " + " | ".join(cells)
                     + f" | {delta} |")
    lines += ["", "| augment | seed | " + " | ".join(METRICS) + " | train | evaluate |",
              "|---|---|" + "---|" * len(METRICS) + "---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['seed']} | " + " | ".join(_fmt(r["metrics"][k]) for k in METRICS)
                     + f" | {r['seconds']['train']:.0f} s | {r['seconds']['evaluate']:.0f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--augment", nargs="+", choices=ARMS, default=list(PRESETS),
                        help=f"the presets compared (and {AUTO_BOUNDS}: the published policy with the auto bounds)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="the seeds of every preset")
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml", help="the params of every run")
    parser.add_argument("--prepared", type=Path, default=REPO / "data" / "prepared", help="the prepare stage's output")
    parser.add_argument("--cache", type=Path, default=REPO / "data" / "cache", help="the cache stage's output")
    parser.add_argument("--policy-file", type=Path, default=REPO / "benchmarks" / "records" / "search" / "policy.json",
                        help="the search result that `searched` trains with (default: the published one, which "
                             "augment=searched trains)")
    parser.add_argument("--label", help="names the searched runs searched-LABEL (another search's result)")
    parser.add_argument("--runs", type=Path, default=REPO / "benchmarks" / "records" / "policies",
                        help="where each finished run is kept (and found again); the table covers them all")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if "searched" in args.augment and not args.policy_file.is_file():
        parser.error(f"--policy-file: {args.policy_file} is not a file; run the search (make search: it publishes "
                     "its result) or name a policy file")
    for arm in args.augment:
        for seed in args.seeds:
            run(arm, seed, params=args.params, prepared=args.prepared, cache=args.cache,
                policy_file=args.policy_file, runs=args.runs, label=args.label)
    f = figures(kept(args.runs))
    print(json.dumps(f) if args.json else table(f))


if __name__ == "__main__":
    main()
