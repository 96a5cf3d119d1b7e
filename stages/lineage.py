"""From an MLflow run to its DVC experiment, and back: ``python -m stages.lineage RUN_OR_EXP``.

* an MLflow run id (32 hex digits): prints the run's git commit, DVC experiment and params hash, and
  the commands that restore its experiment (``dvc exp apply NAME``, or ``git checkout COMMIT`` then
  ``dvc checkout``);
* a DVC experiment name, a git revision or ``workspace``: prints the MLflow runs that
  ``metrics/run.json`` names there (falling back to runs tagged with the experiment name) with
  their URLs in the MLflow UI (``http://127.0.0.1:5000``, where ``mlflow ui`` serves by default).

Run it in the repository root; not a DVC stage. The store is the pipeline's (``MLFLOW_TRACKING_URI``
overrides). Anything unknown is one line, ``error: ...``, with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import re

from pipelines import cli
from pipelines.errors import TrackingError
from pipelines.tracking.lineage import (BASELINE_TAG, COMMIT_TAG, EXP_NAME_TAG, PARAMS_HASH_TAG, STAGE_TAG,
                                        TRAINING_RUN_TAG, UI_URL, git, run_url)
from pipelines.tracking.store import find_runs, get_run

RUN_IDS_FILE = "metrics/run.json"  # written by the evaluate stage (dvc.yaml)
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="an MLflow run id, a DVC experiment name, a git revision or 'workspace'")
    name = parser.parse_args(argv).name
    run = get_run(name) if _RUN_ID.fullmatch(name) else None
    print(describe_run(run) if run is not None else describe_experiment(name))


def describe_run(run) -> str:
    """What made ``run`` and how to restore it."""
    tags, info = run.data.tags, run.info
    lines = [f"MLflow run {info.run_id} ({tags.get(STAGE_TAG, 'run')} \"{info.run_name}\", {info.status})",
             f"  {run_url(info.experiment_id, info.run_id)}"]
    if training := tags.get(TRAINING_RUN_TAG):
        lines.append(f"  model from training run {training}")
    commit, exp, baseline = tags.get(COMMIT_TAG), tags.get(EXP_NAME_TAG), tags.get(BASELINE_TAG)
    params_hash = tags.get(PARAMS_HASH_TAG)
    experiment = (exp + (f" (baseline {baseline})" if baseline else "")) if exp else "none (dvc repro)"
    lines += [f"  git commit:       {commit or 'unknown'}",
              f"  DVC experiment:   {experiment}",
              f"  params.yaml:      sha256 {params_hash or 'unknown'}"]
    lines += [f"  {key}: {value}" for key, value in sorted(tags.items()) if key.startswith("data.cache.")]
    lines.append("To restore its experiment:")
    if exp:
        lines.append(f"  dvc exp apply {exp}")
        if commit:
            lines.append(f"  (if it was removed: git checkout {commit}, then dvc exp run with the run's params)")
    elif commit:
        lines.append(f"  git checkout {commit} && dvc checkout   # the commit `dvc repro` ran on; the outputs are "
                     "there if they were committed")
    else:
        lines.append("  unknown: the run has no git commit")
    if params_hash:
        lines.append(f"then `sha256sum params.yaml` prints {params_hash} for exactly the params of this run.")
    return "\n".join(lines)


def describe_experiment(name: str) -> str:
    """The MLflow runs of a DVC experiment, git revision or the workspace, with their UI URLs."""
    where, recorded = _run_ids_at(name)
    ids = [v for v in (recorded.get("mlflow_run_id"), recorded.get("mlflow_training_run_id")) if v]
    runs = [r for r in map(get_run, ids) if r is not None] if ids else []
    if not runs and where.startswith("DVC experiment"):
        runs = find_runs(f"tags.`{EXP_NAME_TAG}` = '{name}'")
    if not runs:
        raise TrackingError(f"{name}: {where} has no MLflow run in {RUN_IDS_FILE} or the store")
    lines = [f"{where}:"]
    for run in runs:
        stage = run.data.tags.get(STAGE_TAG, "run")
        lines.append(f"  {stage:<9} {run.info.run_id}  \"{run.info.run_name}\"  {run.info.status}")
        lines.append(f"            {run_url(run.info.experiment_id, run.info.run_id)}")
    lines.append(f"(URLs under {UI_URL}, where `mlflow ui --backend-store-uri sqlite:///mlflow.db` serves by default)")
    return "\n".join(lines)


def _run_ids_at(name: str) -> tuple[str, dict]:
    """Where ``name`` points (in words) and the ``metrics/run.json`` recorded there (``{}`` if none)."""
    if name == "workspace":
        try:
            return "the workspace", _as_dict(open(RUN_IDS_FILE).read())
        except OSError:
            return "the workspace", {}
    refs = git("for-each-ref", "--format=%(refname)", "refs/exps") or ""
    matches = [ref for ref in refs.split() if ref.rsplit("/", 1)[-1] == name]
    if matches:
        where, rev = f"DVC experiment {name}", matches[0]
    elif (commit := git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}")) is not None:
        where, rev = f"git revision {name} ({commit[:12]})", commit
    elif _RUN_ID.fullmatch(name):
        raise TrackingError(f"{name}: no such MLflow run in the store, DVC experiment or git revision")
    else:
        raise TrackingError(f"{name}: not an MLflow run id, DVC experiment or git revision of this repository")
    return where, _as_dict(git("show", f"{rev}:{RUN_IDS_FILE}") or "")


def _as_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


if __name__ == "__main__":
    cli.run(main)
