"""Benchmark: AP and training time of candidate configurations, each through the real train and evaluate stages.

How the default configuration was sized (``docs/hardware.md``): each candidate is a list of Hydra
overrides over ``conf/``; for each, this composes its params, prepares and caches the built-in dataset
once (shared by all candidates with the same ``dataset`` section), then runs ``python -m
pipelines.launch stages.train`` and ``stages.evaluate`` exactly as ``dvc repro`` does, in a
temporary folder with a store of its own, and reports the wall time of each stage, the training
rate (MLflow's ``train/images_per_sec``, median of the logged windows after the first), the
resolved precision and the COCO figures. ``--hold avx2`` (or ``avx512``) runs the stages held to
that CPU class (see ``benchmarks/precision.py``). Candidates run one after the other; the first is
the baseline the others' times are divided by, measured in the same run.

    python -m benchmarks.sizing --candidate "" --candidate "augment=flip" [--hold avx2] [--json]

Each candidate takes minutes (a full training); the default candidate list (``--candidate`` not
given) is the default configuration against the one it replaced.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipelines.cli import exit_now
from pipelines.compose import compose_params
from pipelines.lifetime import parent_death_signal

from .precision import CLASSES

REPO = Path(__file__).resolve().parents[1]
# The default before it was sized for a common machine: ResNet-18, 128-channel FPN, 320 px, 700
# iterations, bf16 and channels_last wherever it ran.
PREVIOUS_DEFAULT = "model=fcos_small train.max_iter=700"
DEFAULT_CANDIDATES = ["", PREVIOUS_DEFAULT]


def _run(command: list[str], env: dict, log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                              preexec_fn=parent_death_signal)  # a killed benchmark takes its runs with it
    if done.returncode:
        raise SystemExit(f"error: {' '.join(command[:5])}... failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def prepare_and_cache(params_file: Path, params: dict, root: Path, env: dict) -> Path:
    """The prepared and cached dataset of ``params``' dataset section (made once per distinct section)."""
    key = hashlib.sha256(json.dumps(params["dataset"], sort_keys=True).encode()).hexdigest()[:12]
    data = root / f"data-{key}"
    if not (data / "cache").is_dir():
        _run([sys.executable, "-m", "stages.prepare", "--params", str(params_file), "--out", str(data / "prepared"),
              "--metrics", str(data / "dataset.json")], env, root / f"prepare-{key}.log")
        _run([sys.executable, "-m", "stages.cache", "--prepared", str(data / "prepared"), "--out", str(data / "cache")],
             env, root / f"cache-{key}.log")
    return data


def run_candidate(overrides: str, root: Path, index: int, hold: str | None) -> dict:
    folder = root / f"candidate-{index}"
    folder.mkdir()
    params_file = folder / "params.yaml"
    params_file.write_text(compose_params(REPO, shlex.split(overrides)))
    params = yaml.safe_load(params_file.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
    data = prepare_and_cache(params_file, params, root, env)
    env.update(CLASSES[hold] if hold else {})
    out = folder / "out"
    train_s = _run([sys.executable, "-m", "pipelines.launch", "--params", str(params_file), "stages.train",
                    "--cache", str(data / "cache"), "--checkpoints", str(out / "train" / "checkpoints"),
                    "--run-file", str(out / "train" / "checkpoints" / "run.json"),
                    "--model", str(out / "train" / "model_final.pth"), "--run", str(out / "train" / "run.json"),
                    "--train-log", str(out / "log.csv"),
                    "--preview", str(out / "preview.png")], env, folder / "train.log")
    evaluate_s = _run([sys.executable, "-m", "pipelines.launch", "--params", str(params_file), "--single-node",
                       "stages.evaluate", "--cache", str(data / "cache"), "--prepared", str(data / "prepared"),
                       "--model", str(out / "train" / "model_final.pth"), "--train-run", str(out / "train" / "run.json"),
                       "--run-file", str(out / "eval-run.json"), "--metrics", str(out / "eval.json"),
                       "--per-category", str(out / "per_category.json"), "--run-ids", str(out / "run_ids.json"),
                       "--plots", str(out / "pr.json"), "--detections", str(out / "detections.json")],
                      env, folder / "evaluate.log")
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    run_id = json.loads((out / "train" / "run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    speed = [m.value for m in client.get_metric_history(run_id, "train/images_per_sec")][1:]
    t = params["train"]
    return {"overrides": overrides or "(the configuration in conf/)", "train_s": train_s, "evaluate_s": evaluate_s,
            "images": t["max_iter"] * t["ims_per_batch"], "images_per_s": statistics.median(speed) if speed else None,
            "precision": run.data.params["compute.precision"], "channels_last": run.data.params["compute.channels_last"],
            "metrics": json.loads((out / "eval.json").read_text())}


def table(figures: dict) -> str:
    c = figures["config"]
    rows = figures["candidates"]
    baseline = rows[0]["train_s"]
    lines = [f"{c['cpu']}, {c['cores']} cores, {c['class']}; candidates one after the other, the first the baseline.",
             "", "| candidate | precision | images | train s | vs first | images/s | evaluate s | AP | APs | APm | APl |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["metrics"]
        rate = f"{r['images_per_s']:.2f}" if r["images_per_s"] else "-"
        lines.append(f"| `{r['overrides']}` | {r['precision']} | {r['images']} | {r['train_s']:.0f} | "
                     f"{r['train_s'] / baseline:.2f} | {rate} | {r['evaluate_s']:.0f} | {m['AP']:.3f} | "
                     f"{m['APs']:.3f} | {m['APm']:.3f} | {m['APl']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidate", action="append", help="Hydra overrides of one candidate ('' for conf/ as is)")
    parser.add_argument("--hold", choices=[k for k in CLASSES if k != "native"], help="run the stages held to this class")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    from pipelines.hardware import cpu_budget, cpu_model

    with tempfile.TemporaryDirectory(prefix="bench_sizing_") as root:
        candidates = [run_candidate(overrides, Path(root), i, args.hold)
                      for i, overrides in enumerate(args.candidate if args.candidate is not None else DEFAULT_CANDIDATES)]
    figures = {"config": {"cpu": cpu_model(), "cores": cpu_budget(), "class": f"held to {args.hold}" if args.hold
                          else "as it is"}, "candidates": candidates}
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
