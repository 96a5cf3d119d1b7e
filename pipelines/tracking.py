"""MLflow tracking, on the main process only.

One run per pipeline run: the train stage starts it and writes its id to an output file; the
evaluate stage resumes it to add the metrics. The tracking store defaults to
``sqlite:///<repository root>/mlflow.db`` with artifacts in ``<repository root>/mlartifacts``;
``MLFLOW_TRACKING_URI`` overrides. The repository root is ``DVC_ROOT`` when DVC sets it, and the
main repository when DVC runs a queued experiment in ``.dvc/tmp/exps/...`` (which is deleted
afterwards).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from .errors import TrackingError
from .fileio import write_json

log = logging.getLogger(__name__)


def repo_root() -> Path:
    """The repository whose ``mlflow.db`` records this run."""
    root = Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()
    parts = root.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return root


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def artifact_location(experiment: str) -> str:
    return (repo_root() / "mlartifacts" / experiment).as_uri()


def write_run_file(path: str | Path, *, run_id: str, experiment: str) -> None:
    """Record which MLflow run a pipeline run writes to (the train stage's output, read by evaluate)."""
    write_json(path, {"run_id": run_id, "tracking_uri": tracking_uri(), "experiment": experiment})


def read_run_id(path: str | Path) -> str:
    """The run id in a file written by :func:`write_run_file`; a :class:`TrackingError` if unusable."""
    try:
        run_id = json.loads(Path(path).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TrackingError(f"{path}: not a run file of the train stage ({type(err).__name__}: {err})") from None
    if not isinstance(run_id, str) or not run_id:
        raise TrackingError(f"{path}: run_id must be a non-empty string, got {run_id!r}")
    return run_id


def git_commit(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or os.getcwd(), capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class Tracker:
    """An MLflow run on the main process; on other processes every method is a no-op.

    Use :meth:`start` (train) or :meth:`resume` (evaluate), then ``log_*`` and :meth:`finish`.
    """

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id

    @property
    def active(self) -> bool:
        return self.run_id is not None

    @classmethod
    def start(cls, *, experiment: str, params: dict[str, Any], run_name: str | None = None, main_process: bool = True) -> "Tracker":
        """Create the run with params (dotted keys) and tags: git commit, DVC experiment name."""
        if not main_process:
            return cls()
        import mlflow

        mlflow.set_tracking_uri(tracking_uri())
        client = mlflow.MlflowClient()
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                exp_id = client.create_experiment(experiment, artifact_location=artifact_location(experiment))
            except mlflow.exceptions.MlflowException:  # created meanwhile by another pipeline
                exp_id = client.get_experiment_by_name(experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        tags = {"pipeline": "detection"}
        if commit := git_commit(repo_root()):
            tags["mlflow.source.git.commit"] = commit
        if exp_name := os.environ.get("DVC_EXP_NAME"):
            tags["dvc.exp_name"] = exp_name
        if baseline := os.environ.get("DVC_EXP_BASELINE_REV"):
            tags["dvc.baseline_rev"] = baseline
        run = client.create_run(exp_id, run_name=run_name or os.environ.get("DVC_EXP_NAME"), tags=tags)
        tracker = cls(run.info.run_id)
        items = [mlflow.entities.Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            client.log_batch(tracker.run_id, params=items[i : i + 100])
        log.info("MLflow run %s in experiment %r at %s", tracker.run_id, experiment, tracking_uri())
        return tracker

    @classmethod
    def resume(cls, run_id: str, *, main_process: bool = True) -> "Tracker":
        """Reopen an existing run (e.g. the train stage's) to add to it."""
        if not main_process:
            return cls()
        import mlflow

        mlflow.set_tracking_uri(tracking_uri())
        mlflow.MlflowClient().update_run(run_id, status="RUNNING")
        return cls(run_id)

    def _client(self):
        import mlflow

        mlflow.set_tracking_uri(tracking_uri())
        return mlflow.MlflowClient()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.active:
            return
        import time

        import mlflow

        now = int(time.time() * 1000)
        self._client().log_batch(
            self.run_id, metrics=[mlflow.entities.Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        )

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.active:
            self._client().log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        if self.active:
            self._client().log_artifacts(self.run_id, str(folder), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.active:
            self._client().log_text(self.run_id, text, artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        if self.active:
            self._client().set_tag(self.run_id, key, value)

    def finish(self, status: str = "FINISHED") -> None:
        if self.active:
            self._client().set_terminated(self.run_id, status=status)
