"""The training step and loop (maskrcnn-benchmark's ``do_train``, which the original SA-AutoAug builds on),
with explicit arguments.

The loop checks the losses every iteration on every process (averaged across processes, so all
stop together): a non-finite loss stops training with the iteration and the loss component named,
and no checkpoint is written after it. A stop request (SIGTERM, SIGINT or SIGHUP, see :class:`StopRequest`) is agreed
on by all processes at the next iteration boundary, which is checkpointed before the loop stops.
"""

from __future__ import annotations

import csv
import logging
import math
import signal
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import distributed
from .checkpoint import Checkpointer
from .data.collate import Batch
from .errors import STOP_SIGNALS, OutputError, Stopped, TrainingError
from .fileio import atomic_file
from .tracking.tracker import Tracker

log = logging.getLogger(__name__)


class MetricLog:
    """Logged metrics as a CSV file (for ``dvc plots``), written on the main process.

    ``start_iter`` > 0 continues a log: rows after ``start_iter`` (logged by an interrupted run past
    its last checkpoint) are dropped, so that a resumed run writes the file an uninterrupted one would;
    ``start_iter`` 0 starts a new one.
    """

    def __init__(self, path: str | Path | None, *, start_iter: int = 0):
        self.path = Path(path) if path and distributed.is_main_process() else None
        self._writer = None
        self._file = None
        if self.path is not None and start_iter == 0:
            self.path.unlink(missing_ok=True)
        if self.path is not None and start_iter > 0 and self.path.is_file():
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                fields, rows = reader.fieldnames, [r for r in reader if int(r["iteration"]) <= start_iter]
            with atomic_file(self.path) as tmp, open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)
            self._file = open(self.path, "a", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=fields)

    def write(self, row: dict[str, float]) -> None:
        """Append ``row`` (the file is flushed, so a kill loses no row written before it).

        Raises:
            OutputError: the log cannot be written (a full disk), naming the file.
        """
        if self.path is None:
            return
        try:
            if self._writer is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "w", newline="")
                self._writer = csv.DictWriter(self._file, fieldnames=list(row))
                self._writer.writeheader()
            self._writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
            self._file.flush()
        except OSError as err:
            raise OutputError(f"{self.path}: cannot write the training log ({err.strerror or err}); the last "
                              "checkpoint is kept, free space and run the stage again to resume") from None

    def close(self) -> None:
        if self._file:
            self._file.close()


class StopRequest:
    """Set by SIGTERM, SIGINT or SIGHUP (or :meth:`set`); the loop stops at the next iteration boundary
    once any process has it, after a checkpoint. The three read the same: a scheduler's preemption,
    Ctrl-C in a terminal (which signals the whole process group) and a closed terminal."""

    def __init__(self):
        self._event = threading.Event()
        self.signal_name = "a stop request"
        self.signum = signal.SIGTERM

    def install(self, signums: tuple[int, ...] = STOP_SIGNALS) -> "StopRequest":
        """Handle ``signums`` by setting the request instead of dying (main thread only)."""
        def handler(received, _frame):
            if not self._event.is_set():
                self.signal_name, self.signum = signal.Signals(received).name, received
            self._event.set()

        for signum in signums:
            signal.signal(signum, handler)
        return self

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def train_step(model: torch.nn.Module, batch: Batch, optimizer: torch.optim.Optimizer, scheduler,
               clip_grad_norm: float = 0.0, scaler: torch.amp.GradScaler | None = None) -> dict[str, torch.Tensor]:
    """One iteration: forward, backward of the summed losses, gradient clipping (if ``clip_grad_norm``
    > 0), optimizer and scheduler step. With an enabled ``scaler`` (fp16 autocast) the losses are
    scaled before the backward pass and the gradients unscaled before clipping; a step whose gradients
    overflowed is skipped, as ``torch.amp`` prescribes.

    ``batch`` is a :class:`~pipelines.data.collate.Batch` on the model's device. Returns this
    process's losses (detached scalars), before any reduction across processes.
    """
    loss_dict = model(batch.images, batch.image_sizes, batch.targets)
    losses = sum(loss_dict.values())
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None and scaler.is_enabled():
        scaler.scale(losses).backward()
        if clip_grad_norm > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
    else:
        losses.backward()
        if clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        optimizer.step()
    scheduler.step()
    return {k: v.detach() for k, v in loss_dict.items()}


class Reporter:
    """What the training loop reports. On the main process, every ``log_period`` iterations and at
    ``max_iter``: the total and per-component losses (averaged across processes), the learning rate and
    the images per second (``ims_per_batch`` is the global batch) to ``metric_log`` (the CSV log), to
    ``tracker`` (the MLflow run; steps up to ``tracked_until`` are already there and not sent again) and
    to the progress bar. On the other processes every method does nothing: they still join every
    collective of the loop, which is the loop's, not the reporter's."""

    def __init__(self, *, max_iter: int, start_iter: int = 0, ims_per_batch: int = 1, log_period: int = 20,
                 metric_log: MetricLog | None = None, tracker: Tracker | None = None, tracked_until: int = 0,
                 device: torch.device = torch.device("cpu")):
        self.main = distributed.is_main_process()
        self.max_iter, self.ims_per_batch, self.log_period = max_iter, ims_per_batch, log_period
        self.metric_log, self.tracker = metric_log or MetricLog(None), tracker or Tracker()
        self.tracked_until, self.device = tracked_until, device
        self.progress = tqdm(total=max_iter, initial=start_iter, desc="train", unit="it", disable=not self.main,
                             mininterval=2.0)
        self._window_start, self._window_iters = time.perf_counter(), 0

    def iteration(self, iteration: int, *, total: float, losses: dict[str, float], lr: float) -> None:
        """Iteration ``iteration`` is done, with these losses (averaged across processes) and learning rate."""
        self._window_iters += 1
        if self.main and (iteration % self.log_period == 0 or iteration == self.max_iter):
            elapsed = time.perf_counter() - self._window_start
            row = {"iteration": iteration, "loss": total, **losses, "lr": lr}
            self.metric_log.write(row)  # deterministic: the same params give the same file
            images_per_sec = self.ims_per_batch * self._window_iters / elapsed
            speed = {"train/images_per_sec": images_per_sec}
            if self.device.type == "cuda":  # peak GPU memory of this process so far (MB), as detectron2 logs it
                speed["train/max_memory_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            if iteration > self.tracked_until:
                self.tracker.log_metrics({**{f"train/{k}": v for k, v in row.items() if k != "iteration"}, **speed},
                                         step=iteration)
            self.progress.set_postfix(loss=f"{total:.3f}", lr=f"{lr:.2e}", ips=f"{images_per_sec:.1f}")
            self._window_start, self._window_iters = time.perf_counter(), 0
        self.progress.update(1)

    def close(self) -> None:
        self.progress.close()
        self.metric_log.close()


def train(model: torch.nn.Module, loader, optimizer: torch.optim.Optimizer, scheduler, *, device: torch.device,
          max_iter: int, start_iter: int = 0, checkpoint_period: int = 1000, checkpointer: Checkpointer | None = None,
          clip_grad_norm: float = 0.0, scaler: torch.amp.GradScaler | None = None, report: Reporter | None = None,
          stop: StopRequest | None = None) -> None:
    """Train from ``start_iter`` to ``max_iter``, one batch of ``loader`` each (:func:`train_step`).

    Losses are averaged across processes every iteration and handed to ``report`` (by default, a
    progress bar). Every ``checkpoint_period`` iterations before ``max_iter``, ``checkpointer`` writes a
    checkpoint.

    Raises:
        TrainingError: a non-finite loss (naming the iteration and the component).
        Stopped: ``stop`` was set; the iteration reached is checkpointed first.
        RuntimeError: the loader ended before ``max_iter``.
    """
    report = report or Reporter(max_iter=max_iter, start_iter=start_iter, device=device)
    main = distributed.is_main_process()
    model.train()
    iteration, last_checkpoint = start_iter, None
    for batch in loader:
        iteration += 1
        losses = train_step(model, batch.to(device, non_blocking=True), optimizer, scheduler, clip_grad_norm, scaler)
        reduced_tensors, stopping = distributed.reduce_loss_dict(losses, flag=stop is not None and stop.is_set())
        # summed as float32 tensors, as train_step sums the loss it back-propagates: the logged total is that
        # loss (a sum of the parts as Python floats would differ in the last digits)
        total = float(sum(reduced_tensors.values()))
        reduced = {k: float(v) for k, v in reduced_tensors.items()}
        bad = [k for k, v in reduced.items() if not math.isfinite(v)]
        if bad:
            kept = (f"the last checkpoint is {last_checkpoint}" if last_checkpoint
                    else f"the checkpoint of iteration {start_iter} it resumed from is kept" if start_iter
                    else "no checkpoint was written")
            raise TrainingError(f"iteration {iteration}: loss {bad[0]} is {reduced[bad[0]]} (not finite); training "
                                f"stopped, {kept} (lower train.base_lr or raise train.warmup_iters)")
        report.iteration(iteration, total=total, losses=reduced, lr=optimizer.param_groups[0]["lr"])

        periodic = iteration % checkpoint_period == 0 and iteration < max_iter
        if checkpointer is not None and (periodic or (stopping and iteration < max_iter)):
            last_checkpoint = checkpointer.save(iteration, model=model, optimizer=optimizer, scheduler=scheduler,
                                                scaler=scaler)
            if main:
                log.info("iteration %d: checkpoint %s", iteration, last_checkpoint)
        if stopping and iteration < max_iter:
            report.close()
            where = f"; checkpoint {last_checkpoint}" if last_checkpoint else ""
            raise Stopped(f"training stopped by {stop.signal_name} at iteration {iteration}{where}; "
                          "run the stage again to resume", signum=stop.signum)
    report.close()
    if iteration != max_iter:
        raise RuntimeError(f"the loader ended at iteration {iteration}, expected {max_iter}")
