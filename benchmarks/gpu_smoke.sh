#!/usr/bin/env bash
# GPU smoke run: a short training and evaluation of the pipeline on the GPUs (NCCL; two processes, one per
# GPU, when two or more are present, else one), in a temporary copy of the repository, in under 5
# minutes. Prints images per second (MLflow's train/images_per_sec, median of the logged windows after
# the first), peak GPU memory (train/max_memory_mb) and AP.
#
#   bash benchmarks/gpu_smoke.sh [PRECISION] [EXTRA OVERRIDES...]     # PRECISION: auto (default) | bf16 | fp16 | fp32
#
# Needs CUDA and the project's venv (make install). Nothing is written to this checkout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
precision="${1:-auto}"; shift || true
gpus=$("$python" -c "import torch, sys; n = torch.cuda.device_count(); print(min(n, 2)) if n else sys.exit('error: no CUDA device: the GPU smoke run needs one')")
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
(cd "$root" && git ls-files -z --cached --others --exclude-standard) | (cd "$root" && xargs -0 cp --parents -t "$work")
rm -rf "$work/dvc.lock" "$work/metrics"
cd "$work" && git init -q && git add -A && git -c user.name=smoke -c user.email=smoke@localhost commit -qm smoke
export PATH="$(dirname "$python"):$PATH" MLFLOW_TRACKING_URI="sqlite:///$work/mlflow.db"
"$python" -m pipelines.compose dataset.train_size=2048 dataset.val_size=256 train.nproc="$gpus" train.ims_per_batch=16 \
  train.max_iter=300 train.warmup_iters=50 train.log_period=20 evaluate.ims_per_batch=16 loader.num_workers=4 \
  model.precision="$precision" "$@"
start=$(date +%s)
dvc repro
"$python" - "$work" "$(( $(date +%s) - start ))" <<'PY'
import json, statistics, sys
from pathlib import Path
import mlflow
import yaml
work, seconds = Path(sys.argv[1]), sys.argv[2]
iterations = yaml.safe_load((work / "params.yaml").read_text())["train"]["max_iter"]
client = mlflow.MlflowClient()
runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`pipeline.stage` = 'train'")
run = runs[0].info.run_id
speed = [m.value for m in client.get_metric_history(run, "train/images_per_sec")][1:]
memory = [m.value for m in client.get_metric_history(run, "train/max_memory_mb")]
ap = json.loads((work / "metrics" / "eval.json").read_text())["AP"]
params = yaml.safe_load((work / "params.yaml").read_text())
print(f"| pipeline (prepare, cache, train {iterations} it on {params['train']['nproc']} GPU processes, evaluate) | {seconds} s |")
print(f"| training images/s (median of {len(speed)} windows) | {statistics.median(speed):.1f} |")
print(f"| peak GPU memory | {f'{max(memory):.0f} MB' if memory else 'not recorded (not on CUDA)'} |")
print(f"| AP (val) | {ap:.4f} |")
PY
