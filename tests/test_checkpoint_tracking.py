import pytest
import torch

from pipelines import checkpoint
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


# The tracking tests are in test_tracking.py.
