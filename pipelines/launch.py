"""The launcher in front of torchrun's elastic-launch API: ``python -m pipelines.launch MODULE [ARGS...]``.

It validates ``params.yaml`` first (one line and exit code 2 on a bad value, before any process
starts), then runs ``python -m MODULE ARGS...`` in ``train.nproc`` processes per node through
:func:`torch.distributed.launcher.api.elastic_launch`, as ``torchrun`` does: ``--standalone`` for
``launch.nodes: 1`` (c10d rendezvous on localhost), else a c10d rendezvous of ``launch.nodes`` nodes at
``launch.rdzv_endpoint`` under ``launch.rdzv_id``, with ``launch.max_restarts`` restarts of the group;
gloo on CPU, NCCL on GPU. What it adds is the way failures read:

* a failed process is reported in one line, ``error: <message>``, taken from the error file that
  :func:`pipelines.cli.run` writes in every failing process (the root cause: a recorded error before
  a process killed by a signal, then the earliest, then the lowest rank), with exit code 2; a
  process killed by a signal is named with its rank, pid and signal. torchrun's ``ChildFailedError``
  block and the agent's log lines appear only with ``PIPELINES_DEBUG=1``;
* ``--run-file`` is passed on to the module (with ``--params``), which keeps its MLflow run's id
  there while the run is open; a run that the failed processes left RUNNING is closed (FAILED, or
  KILLED when a signal stopped it);
* SIGTERM, SIGINT or SIGHUP reads the same whenever it comes: before the processes start, while they
  run (torchrun's agent forwards it and they stop at an iteration boundary) or while they finish,
  ``error: stopped by SIGTERM`` and exit code 128 + the signal number. Once every process has
  succeeded (or the stop is reported), the signals are ignored: the work is done and the exit code
  says so (0), where Python's interpreter shutdown would otherwise die silently by the signal;
* nothing outlives it: the processes it starts die (SIGKILL) the moment it dies, however it dies,
  and a launcher that DVC started dies the moment ``dvc`` does (:mod:`pipelines.lifetime`).

One process on one node (``train.nproc: 1``, the evaluate stage with ``--single-node`` on one
process) has no group to form: the launcher starts it itself, with torchrun's environment for it
(``RANK`` 0, ``WORLD_SIZE`` 1, a run id, an error file), and reads the same way. torchrun's agent,
whose import and rendezvous cost seconds of CPU per stage for nothing when there is no group, is left out;
``launch.max_restarts`` > 0 still goes through it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from . import cli, lifetime
from .config.load import load_params
from .errors import STOP_SIGNALS, ConfigError, Stopped
from .tracking.run import close_run_file

log = logging.getLogger("launch")
LOGS_PREFIX = "torchelastic_pipelines_"
STOP_GRACE_S = 30.0  # how long a stopped process has to end before SIGKILL (torchrun's agent waits as long)
STOPPED_CODES = {code for signum in STOP_SIGNALS for code in (-signum, 128 + signum)}


class _Signalled(Stopped):
    """A stop signal that reached the launcher before torchrun's agent handled signals, or after."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.sigval = signum
        self.exit_code = 128 + signum


def _raise_signalled(signum: int, _frame) -> None:
    raise _Signalled(signum)


def _message(failure) -> str:
    message = failure.message
    return message if isinstance(message, str) else str(message.get("message", "")) if isinstance(message, dict) else ""


def root_cause(failures: dict) -> tuple[int, object]:
    """The ``(rank, ProcessFailure)`` that explains a failed group.

    A user error first; then a process killed by a signal (its peers then fail with connection
    errors); then an unexpected error; a process stopped by SIGTERM (which the agent sends to stop the
    others), SIGINT or SIGHUP, dead of it or exited with 128 + its number, last. Among equals the
    earliest, then the lowest rank.
    """
    def key(item):
        rank, failure = item
        if failure.exitcode in STOPPED_CODES:  # stopped by the agent (or a stop signal), not the cause
            kind = 3
        elif failure.exitcode < 0:
            kind = 1
        else:
            kind = 2 if _message(failure).startswith("unexpected ") else 0
        return kind, failure.timestamp, rank

    return min(failures.items(), key=key)


def describe(rank: int, pid: int, exitcode: int, message: str = "") -> str:
    """One line for a failed process (``exitcode`` < 0: killed by that signal; ``message``: its error file's)."""
    if exitcode < 0:
        return (f"process rank {rank} (pid {pid}) was killed by {signal.Signals(-exitcode).name}; "
                "run the stage again to resume from its newest checkpoint")
    return message or f"process rank {rank} (pid {pid}) exited with code {exitcode}"


def launch(module: str, args: list[str], *, nproc: int, nodes: int = 1, rdzv_endpoint: str = "localhost:0",
           rdzv_id: str | None = None, max_restarts: int = 0, run_file: str | None = None) -> int:
    """Run ``python -m module args`` in ``nproc`` processes on this node; return the launcher's exit code.

    ``nodes == 1`` is torchrun's ``--standalone`` (a rendezvous on a free local port, a fresh id).
    With more, every node runs the same command; they meet at ``rdzv_endpoint`` (c10d, hosted by the
    agent on the machine that has that address) under ``rdzv_id``. ``max_restarts`` > 0 restarts the
    whole group after a failure (a stage then resumes from its newest checkpoint)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each process sets its own thread count
    os.environ[cli.LAUNCHED_ENV] = str(os.getpid())  # processes leave the reporting to the launcher
    if nproc * nodes == 1 and max_restarts == 0:
        return _launch_one(module, args, run_file=run_file)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    debug = bool(os.environ.get(cli.DEBUG_ENV))
    if not debug:
        for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:  # torch sets each one's level
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    # Each round of processes gets a store of its own (hosted by its rank 0): with the agent's store
    # shared across rounds, the processes of a restarted group read the previous round's gloo
    # addresses and fail to connect (torch 2.14; tried: every restart failed).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if nodes == 1:
        rdzv_endpoint, rdzv_id = "localhost:0", str(uuid.uuid4())
    # The agent keeps the processes' error files in a folder of its own (torchelastic_* in the
    # temporary folder) that it never removes: give it one that goes when the launch ends, named by
    # this launcher's pid so that the next launch removes it where this one was killed.
    _remove_stale_log_folders()
    with tempfile.TemporaryDirectory(prefix=f"{LOGS_PREFIX}{os.getpid()}_", ignore_cleanup_errors=True) as logs:
        config = LaunchConfig(min_nodes=nodes, max_nodes=nodes, nproc_per_node=nproc, run_id=rdzv_id,
                              rdzv_backend="c10d", rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
                              logs_specs=DefaultLogsSpecs(log_dir=logs))
        try:
            elastic_launch(config, sys.executable)("-u", "-m", "pipelines.lifetime", "--die-with", str(os.getpid()),
                                                   module, *args)
            # Done: a late signal changes nothing. Inside the try, so that one that comes before this line
            # is a stop; after it, none can raise (the agent leaves its own handler in place, which
            # would otherwise raise SignalException out of the log folder's clean-up: exit code 1).
            _ignore_stop_signals()
        except ChildFailedError as err:
            if debug:
                raise
            rank, failure = root_cause(err.failures)
            close_run_file(run_file, "KILLED" if failure.exitcode < 0 else "FAILED")
            print(f"\nerror: {describe(rank, failure.pid, failure.exitcode, _message(failure))}", file=sys.stderr)  # on its own line, after any progress bar
            return 2
        except (SignalException, _Signalled) as err:
            return _stopped(int(err.sigval), run_file)
    return 0


def _launch_one(module: str, args: list[str], *, run_file: str | None) -> int:
    """Run ``python -m module args`` as the one process of a one-process group, reporting as :func:`launch`
    does: a stop signal is passed on to the process (which stops at an iteration boundary), and the
    process's failure is one line read from its error file."""
    _remove_stale_log_folders()
    with tempfile.TemporaryDirectory(prefix=f"{LOGS_PREFIX}{os.getpid()}_", ignore_cleanup_errors=True) as logs:
        error_file = Path(logs, "error.json")
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
               "TORCHELASTIC_ERROR_FILE": str(error_file)}
        received: list[int] = []
        process = None

        def pass_on(signum, _frame):
            received.append(signum)
            if process is not None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

        for signum in STOP_SIGNALS:
            signal.signal(signum, pass_on)
        process = subprocess.Popen([sys.executable, "-u", "-m", "pipelines.lifetime", "--die-with", str(os.getpid()),
                                    module, *args], env=env)
        if received:  # came while it was being started
            process.send_signal(received[0])
        exitcode = _wait(process, received)
        if received:
            return _stopped(received[0], run_file)
        _ignore_stop_signals()  # done: a late signal changes nothing
        if exitcode == 0:
            return 0
        message = ""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            message = str(json.loads(error_file.read_text()).get("message", ""))
        close_run_file(run_file, "KILLED" if exitcode < 0 else "FAILED")
        print(f"\nerror: {describe(0, process.pid, exitcode, message)}", file=sys.stderr)
        return 2


def _wait(process: subprocess.Popen, received: list[int]) -> int:
    """``process``'s exit code; once a stop signal is in ``received``, SIGKILL after torchrun's grace
    period if it has not stopped by then. Wakes twice a second (on the process's pidfd where there is one)."""
    try:
        exited = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # no pidfds: poll
        exited = None
    stop_deadline = None
    try:
        while (exitcode := process.poll()) is None:
            if exited is None:
                time.sleep(0.5)
            else:
                select.select([exited], [], [], 0.5)
            if received and stop_deadline is None:
                stop_deadline = time.monotonic() + STOP_GRACE_S
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                process.kill()
        return exitcode
    finally:
        if exited is not None:
            os.close(exited)


def _stopped(signum: int, run_file: str | None) -> int:
    """Report a stop by signal ``signum``: the run file's run KILLED, one line, exit code 128 + ``signum``."""
    _ignore_stop_signals()  # a second signal must not cut the report short
    close_run_file(run_file, "KILLED")
    print(f"\nerror: stopped by {signal.Signals(signum).name}", file=sys.stderr)
    return 128 + signum


def _remove_stale_log_folders() -> None:
    """Remove the agents' log folders that launchers killed without a chance to clean up left behind
    (this user's, whose launcher pid is gone)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{LOGS_PREFIX}*_*"):
        pid = folder.name[len(LOGS_PREFIX):].split("_")[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and folder.stat().st_uid == os.getuid() and not lifetime.alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


def _ignore_stop_signals() -> None:
    """Ignore the stop signals from now on (process-wide, and kept through Python's shutdown, which
    resets handlers, not ignored signals, to the default: death)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


# The least memory one training process takes, with its share of the launcher (docs/hardware.md, "Memory per
# process"): below every configuration measured, so that only a train.nproc that cannot fit is refused.
PROCESS_MEMORY_MIB = 512


def memory_bytes(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> int | None:
    """This machine's memory (``MemTotal``), capped by this process's cgroup memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); None where the kernel does not say."""
    limits = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        total = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
        limits.append(int(total.split()[1]) * 1024)
    with contextlib.suppress(OSError):
        for line in proc.read_text().splitlines():
            hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            v2 = hierarchy == "0" and controllers == ""
            if v2 or "memory" in controllers.split(","):
                file = (root if v2 else root / "memory") / path.strip("/") / ("memory.max" if v2 else
                                                                              "memory.limit_in_bytes")
                with contextlib.suppress(OSError, ValueError):
                    limits.append(int(file.read_text().strip()))  # "max": no limit, a ValueError
    return min(limits) if limits else None


def refuse_unfit(nproc: int, source: str, *, memory: int | None = None, cores: int | None = None) -> None:
    """Raise ConfigError where ``train.nproc`` processes cannot fit in this node's memory even at
    :data:`PROCESS_MEMORY_MIB` each. The rule is per node, as ``train.nproc`` is, and holds on GPUs too (a
    process's host memory is no less there), so a run that fits is never refused."""
    memory = memory_bytes() if memory is None else memory
    if memory is None or nproc * PROCESS_MEMORY_MIB * 2**20 <= memory:
        return
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    raise ConfigError(f"{source}: train.nproc: {nproc} processes need at least "
                      f"{nproc * PROCESS_MEMORY_MIB / 1024:.1f} GiB of memory ({PROCESS_MEMORY_MIB} MiB each: "
                      f"docs/hardware.md), this machine has {memory / 2**30:.1f} GiB and {cores} cores; expected at "
                      f"most {memory // (PROCESS_MEMORY_MIB * 2**20)} processes ({cores}: one per core)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="the parameters file (also passed to the module)")
    parser.add_argument("--run-file", help="the module's MLflow run file (passed on): closed if the processes die "
                        "with the run RUNNING")
    parser.add_argument("--single-node", action="store_true",
                        help="run on this node only, whatever launch.nodes says (the evaluate stage)")
    parser.add_argument("module", help="the stage module, e.g. stages.train")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the module's arguments")
    args = parser.parse_args(argv)
    if os.environ.get("DVC_STAGE"):  # started by DVC: once dvc is gone, so is the stage's lock
        lifetime.die_with(lifetime.owner_beyond_shells())
    for signum in STOP_SIGNALS:  # until torchrun's agent installs its own (which raise SignalException)
        signal.signal(signum, _raise_signalled)
    p = load_params(args.params)
    refuse_unfit(p.train.nproc, args.params)
    passed_on = ["--params", args.params, *(["--run-file", args.run_file] if args.run_file else [])]
    sys.exit(launch(args.module, [*passed_on, *args.args], nproc=p.train.nproc,
                    nodes=1 if args.single_node else p.launch.nodes,
                    rdzv_endpoint=p.launch.rdzv_endpoint, rdzv_id=p.launch.rdzv_id,
                    max_restarts=p.launch.max_restarts, run_file=args.run_file))


if __name__ == "__main__":
    cli.run(main)
