"""What every team server shares: a process kept in a folder, started, watched and stopped by one command.

The folder holds ``server.json`` (what runs, for ``stop`` and ``status``; no secret), ``server.log`` (the
process's output) and the secrets, each in a file of mode 600. The process leads a session of its own, so
that stopping it ends everything it started.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import PipelineError
from ..lifetime import StopSignals, alive, end_group

STATE, LOG = "server.json", "server.log"
STOP_TIMEOUT = 15.0


def running(folder: Path) -> dict | None:
    """What ``folder/server.json`` records, if its process is alive; else None."""
    state = folder / STATE
    found = json.loads(state.read_text()) if state.is_file() else None
    return found if found and alive(found["pid"]) else None


def write_state(folder: Path, record: dict) -> None:
    (folder / STATE).write_text(json.dumps(record, indent=1) + "\n")


def stop(folder: Path) -> bool:
    """End the process group that ``folder/server.json`` records and forget it; whether it ran."""
    state = folder / STATE
    if not state.is_file():
        return False
    pid = json.loads(state.read_text())["pid"]
    ran = alive(pid)
    if ran:
        end_group(pid, grace_s=STOP_TIMEOUT)
    state.unlink()
    return ran


def write_secret(path: Path, text: str) -> None:
    """Write ``path`` readable by its owner only, from its first byte (through a temporary file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)  # touch keeps the mode of a file an interrupted write left; libpq ignores a readable one
    tmp.write_text(text)
    tmp.replace(path)


def secret(path: Path, make: Callable[[], str]) -> str:
    """The text kept in ``path`` (mode 600), made by ``make`` on first use."""
    if not path.is_file():
        write_secret(path, make())
    return path.read_text()


def program(name: str) -> str | None:
    """The command ``name`` beside this Python (a virtual environment not activated), else on ``PATH``, else None."""
    local = Path(sys.executable).with_name(name)
    return str(local) if local.is_file() else shutil.which(name)


def parser(doc: str, *, actions: tuple[str, ...], folder: str, port: int, helps: dict[str, str]):
    """The shared command line: ACTION (default start), --folder, --host, --port, --detach; ``helps`` per option."""
    cli = argparse.ArgumentParser(description=doc.splitlines()[0], epilog="docs/team.md")
    cli.add_argument("action", nargs="?", choices=("start", *actions), default="start", help=helps.get("action"))
    cli.add_argument("--folder", type=Path, default=Path(folder), help=helps["folder"])
    cli.add_argument("--host", default="127.0.0.1", help=helps["host"])
    cli.add_argument("--port", type=int, default=port, help=helps.get("port"))
    cli.add_argument("--detach", action="store_true", help="start it in the background and return")
    return cli


@dataclass(frozen=True)
class Service:
    """One kind of team server: how its messages name it and its process, its module, the error they raise."""

    name: str  # "S3 server", after `article` ("an")
    article: str
    program: str  # "weed mini"
    module: str  # python -m MODULE runs it
    error: type[PipelineError]

    def refuse_second(self, folder: Path, shown: str = "") -> None:
        """Raise if a server of ``folder`` runs; ``shown``: a field of its state that the message names too."""
        if found := running(folder):
            extra = f", {found[shown]}" if shown else ""
            raise self.error(f"{folder}: {self.article} {self.name} runs already (pid {found['pid']}{extra}); "
                             f"stop it first: python -m {self.module} stop --folder {folder}")

    def spawn(self, command: list[str], *, folder: Path, env: dict, ready: Callable[[], bool], unready: str,
              timeout: float, cause: bool = False) -> subprocess.Popen:
        """Start ``command`` in ``folder``, its output in ``server.log``, and wait until ``ready()``. Raises if it
        exits first (with ``cause``, quoting the log's last error) or is not ready within ``timeout`` s (it is
        then ended; the message begins with ``unready``)."""
        log = folder / LOG
        with open(log, "ab") as out:
            process = subprocess.Popen(command, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not ready():
            if process.poll() is not None:
                lines = log.read_text(errors="replace").strip().splitlines() or [""]
                last = [line for line in lines if "Error:" in line or "Exception:" in line][-1:] or lines[-1:]
                why = f": {last[0].strip()}" if cause else ""
                raise self.error(f"{self.program} exited with {process.returncode}{why} (log: {log})")
            if time.monotonic() > deadline:
                end_group(process.pid, grace_s=STOP_TIMEOUT)
                raise self.error(f"{unready} within {timeout:.0f} s (log: {log})")
            time.sleep(0.5)
        return process

    def stopped(self, folder: Path, ran: bool) -> None:
        print("stopped" if ran else f"{folder}: no {self.name} runs")

    def serve(self, folder: Path, start: Callable[[], tuple[str, subprocess.Popen]], *, detach: bool,
              stop: Callable[[Path], bool] = stop) -> None:
        """``start()`` the server and print the description it returns with the process. Unless ``detach``, wait
        for Ctrl-C, SIGTERM, SIGHUP or the process's own end (an error), then ``stop(folder)``."""
        with StopSignals() as signals:
            description, process = start()
            print(description, flush=True)
            if detach:
                return
            print("Ctrl-C stops it.", flush=True)
            code = signals.wait(process)
        stop(folder)
        if code is not None:
            raise self.error(f"{self.program} exited with {code} (log: {folder / LOG})")
        print("stopped")
