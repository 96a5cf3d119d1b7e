"""How long a run's processes live and what they own while they do.

* :func:`die_with`: a process dies (SIGKILL) as soon as another is gone. Every stage process that
  :mod:`pipelines.launch` starts dies with its launcher, and a launcher started by DVC dies with
  ``dvc``: once DVC has recorded the stage as failed and released its lock, nothing of the run may
  go on writing (a checkpoint written then would race the next run), so it is SIGKILL, not a
  stop request. Two mechanisms, because either alone has a gap: Linux's parent-death signal
  (``prctl(PR_SET_PDEATHSIG)``, immediate, but only for the direct parent and lost if the parent
  died before it was set) and a watcher thread on a pidfd of the watched process (any process; a
  polled ``kill(pid, 0)`` where pidfds are missing). The launcher starts each process as
  ``python -m pipelines.lifetime --die-with LAUNCHER MODULE ARGS...`` (:func:`main`), so that the link
  is in place before the module imports torch: that import takes seconds of CPU, more on a loaded
  machine, and a process still importing when its launcher was killed would outlive it that long.
* :class:`FolderLock`: one training run per folder. An exclusive ``flock`` that the kernel releases
  when its holder dies, however it dies; the lock file names the holder for the refusal message.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .errors import OutputError

PR_SET_PDEATHSIG = 1
SHELLS = {"sh", "bash", "dash", "zsh", "fish", "ksh"}


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _stat(pid)[1] != "Z" if sys.platform.startswith("linux") else True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def end_group(pid: int, *, grace_s: float = 15.0) -> None:
    """End the process group that ``pid`` leads (a server started with ``start_new_session``): SIGTERM, then
    SIGKILL what is left after ``grace_s``; returns once ``pid`` is gone (reaped if it is our child)."""
    for signum, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not alive(pid):
                return
            time.sleep(0.2)


class StopSignals:
    """While active, SIGINT, SIGTERM and SIGHUP are noted rather than acted on, so that a foreground server
    can stop what it started cleanly; :meth:`wait` waits for one of them or for the server's own end."""

    def __enter__(self) -> "StopSignals":
        self.received: list[int] = []
        self._previous = {s: signal.signal(s, lambda signum, frame: self.received.append(signum))
                          for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def wait(self, process) -> int | None:
        """Until a stop signal or the end of ``process``: None after a signal, else its exit code."""
        while not self.received and process.poll() is None:
            time.sleep(0.5)
        return None if self.received else process.poll()


def _stat(pid: int) -> tuple[str, str, int]:
    """``(command name, state, parent pid)`` of ``pid`` from ``/proc`` (Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", "Z", 0
    name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    return name, rest[0], int(rest[1])


def parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``signum`` to this process when its parent (the thread that started it) exits.
    Returns whether it was set (False elsewhere than on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def die_with(pid: int, *, poll_s: float = 0.5) -> None:
    """Kill this process with SIGKILL as soon as process ``pid`` is gone (at once if it already is).

    Sets the parent-death signal where ``pid`` is the parent, and starts a daemon thread that waits
    on a pidfd of ``pid`` (polls ``kill(pid, 0)`` every ``poll_s`` seconds where there are no pidfds).
    """
    if pid == os.getppid():
        parent_death_signal(signal.SIGKILL)
    try:
        fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    except ProcessLookupError:
        _kill_self()
    except OSError:
        fd = None
    if not alive(pid):  # gone before the watch was in place
        _kill_self()

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while alive(pid):
                time.sleep(poll_s)
        _kill_self()

    threading.Thread(target=watch, name=f"die-with-{pid}", daemon=True).start()


def die_with_launcher(launcher_pid: int) -> None:
    """In a process the launcher started (its direct child): die with it. A process whose launcher died
    before this ran has already been handed to another parent and dies at once."""
    if os.getppid() != launcher_pid:
        _kill_self()
    die_with(launcher_pid)


def owner_beyond_shells(pid: int | None = None) -> int:
    """The nearest ancestor of ``pid`` (this process by default) that is not a shell: the program that
    ran a command through ``sh -c`` (DVC runs a stage's ``cmd`` through ``$SHELL -c``, which may or may
    not replace itself by the command)."""
    parent = _stat(pid or os.getpid())[2]
    while parent > 1 and _stat(parent)[0] in SHELLS:
        parent = _stat(parent)[2]
    return parent


class FolderLock:
    """An exclusive lock on ``folder`` (the file ``folder/.lock``), held until :meth:`release` or until
    the holder dies.

    ``job`` names the holder's job (torchrun's run id): a process of the same job, for example rank 0
    of an elastic restart while the previous rank 0 is still exiting, waits up to ``same_job_wait_s``
    for the lock; anyone else is refused at once.

    On a local filesystem the lock is exact. On NFS, Linux maps ``flock`` to NFS byte-range locks
    (NLM for NFSv3, built into NFSv4), which hold across machines when the server supports locking; a
    filesystem without lock support (some FUSE and SMB mounts) either refuses ``flock`` (reported as
    an error) or locks per machine only, so two trainers on different machines are then not stopped.
    """

    def __init__(self, folder: str | Path, *, job: str = "", same_job_wait_s: float = 30.0):
        self.folder, self.job = Path(folder), job
        self.path = self.folder / ".lock"
        self.same_job_wait_s = same_job_wait_s
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        """Take the lock or raise :class:`OutputError` naming the run that holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = self._holder(fd)
                if self.job and holder.get("job") == self.job:
                    deadline = deadline or time.monotonic() + self.same_job_wait_s
                    if time.monotonic() < deadline:
                        time.sleep(0.2)
                        continue
                os.close(fd)
                who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('since', '?')}"
                       if holder else "another process")
                raise OutputError(f"{self.folder}: another training run is using this folder ({who}); wait for it "
                                  "to end or stop it, then run the stage again") from None
            except OSError as err:
                os.close(fd)
                raise OutputError(f"{self.path}: cannot lock the training folder ({err.strerror or err})") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "job": self.job,
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        with contextlib.suppress(OSError):  # only for the refusal message: a full disk must not stop the run
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    @staticmethod
    def _holder(fd: int) -> dict:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            if isinstance(record, dict):
                return record
        return {}

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def main(argv: list[str] | None = None) -> None:
    """``python -m pipelines.lifetime --die-with PID MODULE ARGS...``: link this process's life to process
    ``PID`` (:func:`die_with_launcher`), then run ``MODULE`` as ``python -m MODULE ARGS...`` would, in
    this process."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.lifetime", description=main.__doc__)
    parser.add_argument("--die-with", type=int, required=True, metavar="PID", help="the launcher's pid")
    parser.add_argument("module", help="the module to run as __main__, e.g. stages.train")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the module's arguments")
    args = parser.parse_args(argv)
    die_with_launcher(args.die_with)
    sys.argv = [args.module, *args.args]  # runpy puts the module's path in sys.argv[0]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
