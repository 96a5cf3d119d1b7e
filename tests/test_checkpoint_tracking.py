import pytest
import torch

from pipelines import checkpoint, tracking
from pipelines.errors import CheckpointError


def test_checkpoint_round_trip_and_errors(tmp_path):
    model = torch.nn.Linear(3, 2)
    checkpoint.save(tmp_path / "m.pth", model=model.state_dict(), iteration=7, categories=[{"id": 3, "name": "x"}])
    state = checkpoint.load(tmp_path / "m.pth")
    assert state["iteration"] == 7 and torch.equal(state["model"]["weight"], model.weight)
    assert not list(tmp_path.glob(".m.pth.*"))  # no temporary file left behind

    with pytest.raises(CheckpointError, match="checkpoint not found"):
        checkpoint.load(tmp_path / "absent.pth")
    (tmp_path / "bad.pth").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="bad.pth: not a readable checkpoint"):
        checkpoint.load(tmp_path / "bad.pth")


def test_repo_root_escapes_dvc_temporary_workspaces(monkeypatch, tmp_path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "tmpab12"))
    assert tracking.repo_root() == tmp_path / "repo"
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo"))
    assert tracking.repo_root() == tmp_path / "repo"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path / 'repo' / 'mlflow.db'}"
    assert tracking.artifact_location("detection") == (tmp_path / "repo" / "mlartifacts" / "detection").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.tracking_uri() == "http://127.0.0.1:5000"


def test_tracker_is_silent_off_the_main_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = tracking.Tracker.start(experiment="x", params={"a": 1}, main_process=False)
    assert not tracker.active
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.log_artifact(tmp_path / "absent")  # would raise if it reached MLflow
    tracker.finish()
    assert not (tmp_path / "mlflow.db").exists()


def test_run_file_round_trip_and_errors(tmp_path):
    from pipelines.errors import TrackingError

    tracking.write_run_file(tmp_path / "run.json", run_id="abc123", experiment="detection")
    assert tracking.read_run_id(tmp_path / "run.json") == "abc123"
    for content in ("", "{}", '{"run_id": 5}', "[1]"):
        (tmp_path / "bad.json").write_text(content)
        with pytest.raises(TrackingError, match="bad.json"):
            tracking.read_run_id(tmp_path / "bad.json")
    with pytest.raises(TrackingError, match="not a run file"):
        tracking.read_run_id(tmp_path / "absent.json")
