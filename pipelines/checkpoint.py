"""Checkpoints: written atomically by the main process, loaded with clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError
from .fileio import atomic_file


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (or the module itself)."""
    return model.module if hasattr(model, "module") else model


def save(path: str | Path, **state: Any) -> None:
    """``torch.save`` to a temporary file, then rename: a crash never leaves a truncated checkpoint."""
    with atomic_file(path) as tmp:
        torch.save(state, str(tmp))


def save_training_state(path: str | Path, *, model: nn.Module, optimizer, scheduler, iteration: int, **extra: Any) -> None:
    """Everything needed to resume: model, optimizer, scheduler and the iteration reached."""
    save(path, model=unwrap(model).state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
         iteration=iteration, **extra)


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save` onto the CPU."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt files
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(err).__name__}: {err})".splitlines()[0]) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: expected a checkpoint with a 'model' state dict")
    return state
