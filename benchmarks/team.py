"""Benchmark: what a shared tracking server costs (docs/team.md), measured side by side in one run.

- **Stages.** The train and evaluate stages of a small configuration (``--overrides``, by default the
  ``ci`` profile), run as ``dvc repro`` runs them (``benchmarks.policies.train_and_evaluate``) on data
  prepared once, alternately against a SQLite store (the baseline) and against a tracking
  server on PostgreSQL with proxied artifacts (``python -m pipelines.team.mlflow_server``, started here in a
  temporary folder, or ``--server URL``); ``--repeats`` pairs, medians of each stage's wall time.
- **Checkpoint upload.** A file of ``--megabytes`` (a checkpoint's size) logged as an artifact of a run,
  as the tracker logs checkpoints and models: into the SQLite store's local artifact folder (the
  baseline) and through the server; medians over ``--repeats``, and the throughput through the server.

    python -m benchmarks.team [--repeats 3] [--megabytes 152] [--overrides "profile=ci"] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipelines.cli import exit_now
from pipelines.compose import compose_params
from pipelines.lifetime import free_port

from .policies import train_and_evaluate
from .sizing import prepare_and_cache

REPO = Path(__file__).resolve().parents[1]


def _server(folder: Path) -> str:
    """Start a tracking server (PostgreSQL, proxied artifacts, one worker as in the recorded figures) in
    ``folder``; its URL."""
    folder.parent.chmod(0o755)  # PostgreSQL runs as `postgres` when this runs as root
    started = subprocess.run([sys.executable, "-m", "pipelines.team.mlflow_server", "--folder", str(folder), "--port",
                              str(free_port()), "--workers", "1", "--detach"], capture_output=True, text=True)
    if started.returncode:
        raise SystemExit(f"error: the tracking server did not start: {started.stderr.strip().splitlines()[-1]}")
    return json.loads((folder / "server.json").read_text())["url"]


def _upload_s(uri: str, path: Path, artifacts: str | None) -> float:
    """Seconds to log ``path`` as an artifact of a new run in ``uri``'s store (a new experiment whose
    artifacts go to ``artifacts``; None: the tracking server's own, as the pipeline's runs get there)."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiment_id = client.create_experiment(f"benchmark-upload-{os.urandom(4).hex()}", artifact_location=artifacts)
    run_id = client.create_run(experiment_id).info.run_id
    start = time.perf_counter()
    client.log_artifact(run_id, str(path), "checkpoints")
    seconds = time.perf_counter() - start
    client.set_terminated(run_id)
    return seconds


def measure(*, overrides: str, repeats: int, megabytes: int, server: str | None, root: Path) -> dict:
    params_file = root / "params.yaml"
    params_file.write_text(compose_params(REPO, shlex.split(overrides)))
    raw = yaml.safe_load(params_file.read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    data = prepare_and_cache(params_file, raw, root, env)
    url = server or _server(root / "server")
    import mlflow

    stores = {"sqlite": f"sqlite:///{root / 'mlflow.db'}", "server": url}
    for uri in stores.values():  # both stores exist before the clock starts, as a team's and a user's do
        mlflow.MlflowClient(uri).search_experiments()
    stages = {name: {"train_s": [], "evaluate_s": []} for name in stores}
    checkpoint = root / "checkpoint.pth"
    with checkpoint.open("wb") as out:
        out.write(os.urandom(megabytes * 2**20))  # incompressible, as weights are
    upload = {name: [] for name in stores}
    try:
        for i in range(repeats):  # alternately, so that both see the same machine
            for name, uri in stores.items():
                folder = root / f"{name}-{i}"
                folder.mkdir()
                done = train_and_evaluate(raw, prepared=data / "prepared", cache=data / "cache", folder=folder,
                                          store=uri)
                stages[name]["train_s"].append(done["seconds"]["train"])
                stages[name]["evaluate_s"].append(done["seconds"]["evaluate"])
                artifacts = (folder / "artifacts").as_uri() if name == "sqlite" else None
                upload[name].append(round(_upload_s(uri, checkpoint, artifacts), 2))
    finally:
        if not server:
            from pipelines.team import mlflow_server

            mlflow_server.stop(root / "server")
    import torch

    from pipelines.hardware import resolve

    precision = resolve(raw["model"]["precision"], raw["model"]["channels_last"], torch.device("cpu")).precision
    return {"config": {"overrides": overrides, "repeats": repeats, "megabytes": megabytes, "precision": precision,
                       "server": "given" if server else "started here"},
            "stages": stages, "upload": upload}


def table(figures: dict) -> str:
    c = figures["config"]
    median = statistics.median
    base = figures["stages"]["sqlite"]
    base_total = median(base["train_s"]) + median(base["evaluate_s"])
    label = {"sqlite": "SQLite store (baseline)", "server": "tracking server on PostgreSQL"}
    precision = f", {c['precision']}" if "precision" in c else ""
    lines = [f"`{c['overrides']}`{precision}, {c['repeats']} runs each, alternately; medians.", "",
             "| store | train s | evaluate s | both s | vs SQLite |", "|---|---|---|---|---|"]
    for name, s in figures["stages"].items():
        total = median(s["train_s"]) + median(s["evaluate_s"])
        lines.append(f"| {label[name]} | {median(s['train_s']):.1f} | {median(s['evaluate_s']):.1f} | {total:.1f} | "
                     f"{total / base_total:.2f} |")
    up = figures["upload"]
    lines += ["", f"| {c['megabytes']} MB checkpoint logged as an artifact | s | MB/s | vs local |", "|---|---|---|---|"]
    where = {"sqlite": "into the SQLite store's local folder (baseline)", "server": "uploaded through the server"}
    for name, seconds in up.items():
        s = median(seconds)
        lines.append(f"| {where[name]} | {s:.2f} | {c['megabytes'] / s:.0f} | {s / median(up['sqlite']):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default="profile=ci", help="Hydra overrides of the configuration (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs against each store (default %(default)s)")
    parser.add_argument("--megabytes", type=int, default=152, help="the checkpoint's size (default %(default)s)")
    parser.add_argument("--server", help="a running tracking server's URL (default: one started here)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.megabytes < 1:
        parser.error("--repeats and --megabytes: expected at least 1")
    root = Path(tempfile.mkdtemp(prefix="bench_team_"))
    try:
        figures = measure(overrides=args.overrides, repeats=args.repeats, megabytes=args.megabytes,
                          server=args.server, root=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures) if args.json else table(figures))


if __name__ == "__main__":
    main()
    exit_now()  # without the interpreter's teardown of its modules (about 2 s of CPU with torch loaded)
