"""Checkpoints: written atomically by the main process, loaded with clear errors, resumed exactly.

A training checkpoint ``model_<iteration>.pth`` holds the model, optimizer and scheduler states, the
iteration reached, the run's *fingerprint* (a hash of everything that determines the weights:
training params, the training data and the code, see :func:`fingerprint`) and the random generator
states of every process. :class:`Checkpointer` writes them (keeping the newest few) and finds the
one to resume from: the newest readable checkpoint with the same fingerprint, whatever else the
folder says. Any other checkpoint file is set aside in ``previous/`` (one generation is kept), never
loaded; a finished run removes its checkpoints.

Files are written to a temporary name, flushed to disk and renamed: a process killed while writing
leaves a ``.model_*.pth.*`` temporary file, which is never loaded and is removed at the next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import distributed
from .errors import CheckpointError, first_line
from .fileio import atomic_file, check_writable, file_sha256, remove_temporaries
from .lifetime import FolderLock

log = logging.getLogger(__name__)
NAME = re.compile(r"^model_(\d{7})\.pth$")
SET_ASIDE = "previous"


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (or the module itself)."""
    return model.module if hasattr(model, "module") else model


def save(path: str | Path, **state: Any) -> None:
    """``torch.save`` to a temporary file, flushed, then renamed: a crash never leaves a truncated checkpoint.

    Saved through a file object, so the archive inside is named ``archive`` whatever the temporary
    file is called (given a path, ``torch.save`` names it after the file): the same state gives the
    same bytes."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save` onto the CPU."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt files
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(err).__name__}: {first_line(err)})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: expected a checkpoint with a 'model' state dict")
    return state


# Params that may name a local file whose content, not only its path, determines the weights.
WEIGHT_FILES = ("model.backbone_weights",)


def fingerprint(*, params: dict[str, Any], data: str, root: Path | None = None) -> str:
    """SHA-256 of what determines the trained weights: ``params`` (those that change the weights),
    ``data`` (a hash of the training data), the content of any file named by a :data:`WEIGHT_FILES`
    param (pretrained weights) and the source of every project module loaded in this process
    (``pipelines`` and ``stages`` under ``root``, the repository by default)."""
    root = (root or Path(__file__).resolve().parents[1]).resolve()
    files = {key: file_sha256(params[key]) for key in WEIGHT_FILES
             if isinstance(params.get(key), str) and Path(params[key]).is_file()}
    code = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).suffix == ".py":
            path = Path(file).resolve()
            if path.is_relative_to(root) and path.relative_to(root).parts[0] in ("pipelines", "stages"):
                code.append((str(path.relative_to(root)), hashlib.sha256(path.read_bytes()).hexdigest()))
    content = {"params": params, "data": data, "code": sorted(code)}
    if files:
        content["files"] = files
    blob = json.dumps(content, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def rng_state() -> dict[str, Any]:
    """This process's random generator states (torch, its current CUDA device's where CUDA is in use,
    numpy, Python), as plain types."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "python": list(map(lambda x: list(x) if isinstance(x, tuple) else x, random.getstate()))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (the CUDA state where it holds one and CUDA is available)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """``(iteration, path)`` of the checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


class Checkpointer:
    """Writes and finds the training checkpoints of one run in ``folder``.

    Args:
        folder: where ``model_<iteration>.pth`` files go.
        keep: how many of the run's newest checkpoints to keep (older ones are deleted after each save).
        fingerprint: the run's :func:`fingerprint`; only checkpoints with the same one are resumed.
        extra: more entries for every checkpoint (e.g. the categories, the MLflow run id).

    One rule decides what is resumed: the newest checkpoint in ``folder`` that loads, holds the
    iteration its name says and has this fingerprint, whatever else the folder holds. Every other
    ``model_*.pth`` (unreadable, another fingerprint, or appearing there during the run) is set aside
    in ``previous/`` with a warning and never counted among the ``keep`` newest. :meth:`save` and
    :meth:`resume` are collective: every process calls them at the same iteration.
    """

    def __init__(self, folder: str | Path, *, keep: int, fingerprint: str, extra: dict[str, Any] | None = None):
        self.folder = Path(folder)
        self.keep = keep
        self.fingerprint = fingerprint
        self.extra = dict(extra or {})
        self._ours: list[tuple[int, Path]] = []  # this run's loadable checkpoints, oldest first (main process)
        self._lock: FolderLock | None = None  # held by the main process from claim() to its end

    def save(self, iteration: int, *, model: nn.Module, optimizer, scheduler, scaler=None) -> Path:
        """Write the checkpoint of ``iteration`` (main process), then drop all of this run's but the newest
        ``keep`` and set aside any checkpoint file that is not this run's. An enabled gradient ``scaler``
        (fp16) is saved too."""
        rngs = distributed.gather_objects(rng_state())
        path = self.folder / f"model_{iteration:07d}.pth"
        if distributed.is_main_process():
            scaled = {"grad_scaler": scaler.state_dict()} if scaler is not None and scaler.is_enabled() else {}
            save(path, model=unwrap(model).state_dict(), optimizer=optimizer.state_dict(),
                 scheduler=scheduler.state_dict(), iteration=iteration, fingerprint=self.fingerprint, rng=rngs,
                 **scaled, **self.extra)
            self._ours = sorted({*((i, p) for i, p in self._ours if p != path), (iteration, path)})
            ours = {p for _, p in self._ours}
            strangers = [p for _, p in checkpoints(self.folder) if p not in ours]
            if strangers:
                self._set_aside(strangers, "not written by this run", replace=False)
            for _, old in self._ours[: -self.keep]:
                old.unlink(missing_ok=True)
            self._ours = self._ours[-self.keep:]
        return path

    def latest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint to resume from (see the class), or ``None`` (main process only).

        Removes temporary files of interrupted writes and sets every other checkpoint file aside.
        """
        for tmp in self.folder.glob(".model_*.pth.*"):
            tmp.unlink(missing_ok=True)
        found, aside = None, {}
        self._ours = []
        for iteration, path in reversed(checkpoints(self.folder)):
            try:
                state = load(path)
            except CheckpointError as err:
                aside[path] = str(err).replace(str(path), path.name)
                continue
            if state.get("fingerprint") != self.fingerprint:
                aside[path] = f"{path.name}: made with other training params, data or code"
            elif state.get("iteration") != iteration:
                aside[path] = f"{path.name}: holds iteration {state.get('iteration')}, not the one its name says"
            else:
                self._ours.insert(0, (iteration, path))
                found = found or (path, state)
        if aside:
            why = next(iter(aside.values())) if len(aside) == 1 else "; ".join(sorted(aside.values())[:3])
            self._set_aside(list(aside), f"not resumable ({why})", replace=True)
        if found is None and aside:
            log.warning("%s: no resumable checkpoint; training starts from iteration 0", self.folder)
        return found

    def _set_aside(self, paths: list[Path], why: str, *, replace: bool) -> None:
        """Move ``paths`` to ``previous/`` (emptied first where ``replace``), saying ``why`` in one line."""
        aside = self.folder / SET_ASIDE
        if replace:
            shutil.rmtree(aside, ignore_errors=True)
        aside.mkdir(parents=True, exist_ok=True)
        for path in paths:
            path.rename(aside / path.name)
        log.warning("%s: %d checkpoint file(s) set aside in %s: %s", self.folder, len(paths), aside, why)

    def claim(self, model: nn.Module, final: Path, *, others: list[Path]) -> None:
        """Before training (main process): take the folder's lock (a second trainer on the same folder is
        refused in one line), remove the temporary files that a killed writer left for the outputs (``final``,
        the final model, and ``others``; no writer can run now), and check that the folder has room for
        ``keep`` + 1 checkpoints of ``model`` (weights and optimizer moments: 3 x its weights) and every
        output's folder takes a file, ``final``'s with room for the weights."""
        self._lock = FolderLock(self.folder, job=os.environ.get("TORCHELASTIC_RUN_ID", "")).acquire()
        remove_temporaries(final, *others)
        model_bytes = sum(x.numel() * x.element_size() for x in model.state_dict().values())
        check_writable(self.folder, needed_bytes=3 * model_bytes * (self.keep + 1))
        check_writable(final.parent, needed_bytes=model_bytes)
        for path in others:
            check_writable(path.parent)

    def promote(self, files: dict[Path, Path]) -> None:
        """Copy this run's working files (the training log, the preview) to their outputs, each atomically
        (main process): until the run has finished, the previous outputs stay."""
        for source, target in files.items():
            with atomic_file(target) as tmp:
                shutil.copyfile(source, tmp)

    def finish(self) -> None:
        """The run is over (its final model written): remove its checkpoints and what was set aside, so
        that running it again trains from iteration 0 (main process)."""
        if distributed.is_main_process():
            for _, path in checkpoints(self.folder):
                path.unlink(missing_ok=True)
            shutil.rmtree(self.folder / SET_ASIDE, ignore_errors=True)
            self._ours = []

    def resume(self, *, model: nn.Module, optimizer, scheduler, scaler=None) -> tuple[int, dict[str, Any]]:
        """Load the checkpoint :meth:`latest` finds into ``model``, ``optimizer``, ``scheduler`` (and ``scaler``)
        and this process's random generators; return ``(iteration, checkpoint extras)``, ``(0, {})`` if none.

        The main process reads the file and sends the states to the others, so only its node needs the folder.
        """
        found = self.latest() if distributed.is_main_process() else None
        state = distributed.broadcast_object(found[1] if found else None)
        if state is None:
            return 0, {}
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None and "grad_scaler" in state:
            scaler.load_state_dict(state["grad_scaler"])
        rngs = state.get("rng") or []
        if distributed.get_rank() < len(rngs):
            set_rng_state(rngs[distributed.get_rank()])
        if found:
            log.info("resuming from %s (iteration %d)", found[0], state["iteration"])
        extras = {k: v for k, v in state.items() if k not in ("model", "optimizer", "scheduler", "grad_scaler", "rng")}
        return int(state["iteration"]), extras
