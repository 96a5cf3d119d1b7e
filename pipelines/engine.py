"""The training loop (the seed's ``do_train``), with explicit arguments."""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import checkpoint
from .data.collate import Batch
from .distributed import is_main_process, reduce_loss_dict
from .tracking import Tracker

log = logging.getLogger(__name__)


class MetricLog:
    """Appends logged metrics to a CSV file (for ``dvc plots``) on the main process."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path and is_main_process() else None
        self._writer = None
        self._file = None

    def write(self, row: dict[str, float]) -> None:
        if self.path is None:
            return
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=list(row))
            self._writer.writeheader()
        self._writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
        self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


def train_step(model: torch.nn.Module, batch: Batch, optimizer: torch.optim.Optimizer, scheduler,
               clip_grad_norm: float = 0.0) -> dict[str, torch.Tensor]:
    """One iteration: forward, backward of the summed losses, gradient clipping (if ``clip_grad_norm``
    > 0), optimizer and scheduler step.

    ``batch`` is a :class:`~pipelines.data.collate.Batch` on the model's device. Returns this
    process's losses (detached scalars), before any reduction across processes.
    """
    loss_dict = model(batch.images, batch.image_sizes, batch.targets)
    losses = sum(loss_dict.values())
    optimizer.zero_grad(set_to_none=True)
    losses.backward()
    if clip_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    optimizer.step()
    scheduler.step()
    return {k: v.detach() for k, v in loss_dict.items()}


def train(model: torch.nn.Module, loader, optimizer: torch.optim.Optimizer, scheduler, *, device: torch.device,
          max_iter: int, start_iter: int = 0, ims_per_batch: int, log_period: int = 20, checkpoint_period: int = 1000,
          checkpoint_dir: str | Path, clip_grad_norm: float = 0.0, tracker: Tracker | None = None,
          metric_log: MetricLog | None = None) -> None:
    """Train for ``max_iter - start_iter`` iterations, one batch each (:func:`train_step`).

    Losses are averaged across processes (:func:`reduce_loss_dict`) and, on the main process, logged
    every ``log_period`` iterations with the learning rate and images per second (``ims_per_batch``
    is the global batch) to ``tracker`` and ``metric_log``. Every ``checkpoint_period`` iterations
    the main process writes ``model_<iteration>.pth`` to ``checkpoint_dir``.
    """
    tracker = tracker or Tracker()
    metric_log = metric_log or MetricLog(None)
    main = is_main_process()
    model.train()
    progress = tqdm(total=max_iter, initial=start_iter, desc="train", unit="it", disable=not main, mininterval=2.0)
    window_start, window_iters = time.perf_counter(), 0
    iteration = start_iter
    for batch in loader:
        iteration += 1
        losses = train_step(model, batch.to(device, non_blocking=True), optimizer, scheduler, clip_grad_norm)
        reduced = reduce_loss_dict(losses)
        window_iters += 1

        if main and (iteration % log_period == 0 or iteration == max_iter):
            elapsed = time.perf_counter() - window_start
            total = float(sum(reduced.values()))
            if not torch.isfinite(torch.tensor(total)):
                log.warning("iteration %d: loss is %s", iteration, total)
            row = {"iteration": iteration, "loss": total, **{k: float(v) for k, v in reduced.items()},
                   "lr": optimizer.param_groups[0]["lr"]}
            metric_log.write(row)  # deterministic: the same params give the same file
            images_per_sec = ims_per_batch * window_iters / elapsed
            tracker.log_metrics({**{f"train/{k}": v for k, v in row.items() if k != "iteration"},
                                 "train/images_per_sec": images_per_sec}, step=iteration)
            progress.set_postfix(loss=f"{total:.3f}", lr=f"{row['lr']:.2e}", ips=f"{images_per_sec:.1f}")
            window_start, window_iters = time.perf_counter(), 0
        progress.update(1)

        if main and iteration % checkpoint_period == 0 and iteration < max_iter:
            path = Path(checkpoint_dir) / f"model_{iteration:07d}.pth"
            checkpoint.save_training_state(path, model=model, optimizer=optimizer, scheduler=scheduler, iteration=iteration)
            tracker.log_artifact(path, "checkpoints")
            log.info("iteration %d: checkpoint %s", iteration, path)
    progress.close()
    metric_log.close()
    if iteration != max_iter:
        raise RuntimeError(f"the loader ended at iteration {iteration}, expected {max_iter}")
