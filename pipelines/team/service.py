"""What every team server shares: a process kept in a folder, started, watched and stopped by one command.

The folder holds ``server.json`` (what runs, for ``stop`` and ``status``; no secret), ``server.log`` (the
process's output) and the secrets, each in a file of mode 600. The process leads a session of its own, so
that stopping it ends everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import PipelineError
from ..lifetime import StopSignals, alive, end_group
from . import address

STATE, LOG = "server.json", "server.log"
PROJECT = "detection-pipelines"  # the state folders' name (state_folder)
STOP_TIMEOUT = 15.0


def state_folder(part: str) -> Path:
    """Where a team server keeps ``part`` by default, outside any checkout (where ``git clean -xdf`` would delete
    the team's data): ``/var/lib/PROJECT/PART`` for root, else ``$XDG_DATA_HOME/PROJECT/PART`` (``~/.local/share``)."""
    if os.geteuid() == 0:
        return Path("/var/lib") / PROJECT / part
    data = os.environ.get("XDG_DATA_HOME", "")
    return (Path(data) if os.path.isabs(data) else Path.home() / ".local" / "share") / PROJECT / part


def old_folder_note(old: Path, folder: Path, *, kept: str, what: str) -> str | None:
    """One line where this directory holds ``old``, the in-checkout state folder of an earlier version (with its
    ``kept`` data), and ``folder`` is another: its data is not moved silently."""
    old = old.resolve()
    if not (old / kept).exists() or old == folder.resolve():
        return None
    return (f"note: {old} holds an earlier {what}'s data (the old default, inside the checkout); this one "
            f"keeps its data in {folder}: stop the old one and move the folder there, or pass --folder {old}")


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


def port_number(text: str) -> int:
    """``--port``: a TCP port, 1 to 65535 (argparse type)."""
    value = int(text) if re.fullmatch(r"[+-]?\d{1,6}", text.strip()) else None
    if value is None or not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}")
    return value


def listen_host(text: str) -> str:
    """``--host``: a name or address of this machine that a server can listen on (argparse type): bound once to
    a free port, so that a name that does not resolve or an address of another machine stops here."""
    expected = "expected an address or name of this machine (127.0.0.1; 0.0.0.0: all)"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(text, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(address)
    except (socket.gaierror, UnicodeError):
        raise argparse.ArgumentTypeError(f"{text!r} does not resolve; {expected}") from None
    except OSError as err:
        why = ("is not an address of this machine" if err.errno == errno.EADDRNOTAVAIL
               else f"cannot be bound ({err.strerror})")
        raise argparse.ArgumentTypeError(f"{text!r} {why}; {expected}") from None
    return text


def refuse_taken_port(host: str, port: int, error: type[PipelineError]) -> None:
    """Raise ``error`` (one line naming ``--port``) if something already listens on ``port`` of ``host``."""
    with contextlib.suppress(OSError), socket.create_connection((address.reach(host), port), timeout=2):
        raise error(f"--port {port}: something already listens on {host}:{port}; choose another port")


def folder_path(text: str) -> Path:
    """``--folder``: a folder, made at start if missing, so neither it nor a parent may be another kind of file
    (argparse type)."""
    path = Path(text)
    for above in (path, *path.parents):
        if above.exists() or above.is_symlink():
            if not above.is_dir():
                raise argparse.ArgumentTypeError(f"{'' if above == path else f'{text}: '}{above} is not a folder; "
                                                 "expected a folder (made if missing)")
            break
    return path


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every error here, instead of argparse's usage block
        self.exit(2, f"error: {message} (--help for usage)\n")


def parser(doc: str, *, actions: tuple[str, ...], folder: str, port: int, helps: dict[str, str],
           default_action: str = "start", detach: bool = True):
    """The shared command line: ACTION (default start), --folder, --host, --port, --public-url, --detach;
    ``helps`` per option. Each is checked as it is read (:func:`port_number`, :func:`listen_host`,
    :func:`folder_path`, :func:`.address.public_url`); a bad one is one line, exit 2."""
    cli = _Parser(description=doc.splitlines()[0], epilog="docs/team.md")
    choices = actions if default_action in actions else (default_action, *actions)
    cli.add_argument("action", nargs="?", choices=choices, default=default_action, help=helps.get("action"))
    cli.add_argument("--folder", type=folder_path, default=Path(folder), help=helps["folder"])
    cli.add_argument("--host", type=listen_host, default="127.0.0.1", help=helps["host"])
    cli.add_argument("--port", type=port_number, default=port, help=helps.get("port"))
    cli.add_argument("--public-url", type=address.public_url, metavar="URL",
                     help="the address teammates reach it at, printed for them (default http://HOST:PORT, this "
                          "machine's name for --host 0.0.0.0): http(s)://NAME[:PORT][/PATH]")
    if detach:
        cli.add_argument("--detach", action="store_true", help="start it in the background and return")
    return cli


# glog's prefix (SeaweedFS): severity, date, time, [thread id], file:line, [']']
_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+(?:\d+\s+)?[\w.-]+:\d+\]?\s+(.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def log_cause(text: str) -> str:
    """The line of a server's log that says why it stopped: the first that names an address in use, else the
    first error of glog (SeaweedFS: ``E1205 ... mini.go:1244 Port allocation failed: ...``, its prefix dropped),
    else the first PostgreSQL ``FATAL:``/``PANIC:``, else the last Python ``...Error:``/``...Exception:``, else the
    last line; "" for an empty log."""
    lines = [_ANSI.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and any(c.isalnum() for c in line)]
    message = [(m[2] if (m := _GLOG.match(line)) else line) for line in lines]
    tests = (lambda i: "address already in use" in lines[i].lower(),
             lambda i: (m := _GLOG.match(lines[i])) is not None and m[1] in "EF",
             lambda i: re.search(r"\b(FATAL|PANIC):", lines[i]) is not None)
    for test in tests:
        if found := [i for i in range(len(lines)) if test(i)]:
            return message[found[0]]
    python = [line for line in message if "Error:" in line or "Exception:" in line]
    return (python or message or [""])[-1]


def log_size(log: Path) -> int:
    """Where the next start's lines will begin in ``log`` (a log keeps earlier starts' lines)."""
    return log.stat().st_size if log.is_file() else 0


def cause_since(log: Path, offset: int) -> str:
    """:func:`log_cause` of what ``log`` holds past ``offset`` (one start's lines); "" without it."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return log_cause(f.read().decode(errors="replace"))
    except OSError:
        return ""


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
              timeout: float) -> subprocess.Popen:
        """Start ``command`` in ``folder``, its output in ``server.log``, and wait until ``ready()``. Raises if it
        exits first (quoting why from what this start added to the log: :func:`log_cause`) or is not ready
        within ``timeout`` s (it is then ended; the message begins with ``unready``)."""
        log = folder / LOG
        start = log_size(log)
        with open(log, "ab") as out:
            process = subprocess.Popen(command, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not ready():
            if process.poll() is not None:
                why = cause_since(log, start)
                raise self.error(f"{self.program} exited with {process.returncode}{': ' + why if why else ''} "
                                 f"(log: {log})")
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
