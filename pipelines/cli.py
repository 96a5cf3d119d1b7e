"""The one entry point every stage goes through: logging set-up and clean user errors."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .errors import STOP_SIGNALS, PipelineError, Stopped, clear_stops, first_line, raise_if_stopped, request_stop
from .fileio import check_outputs

DEBUG_ENV = "PIPELINES_DEBUG"
LAUNCHED_ENV = "PIPELINES_LAUNCHED"  # the launcher's pid, set by pipelines.launch for the processes it starts


def parse_args(description: str, argv: list[str] | None, *, params: bool = True, overrides: bool = False,
               arguments: Callable[[argparse.ArgumentParser], None] | None = None,
               output_folders: Sequence[str] = (), output_files: Sequence[str] = (),
               **paths: str) -> argparse.Namespace:
    """A stage's command line: ``--params`` (default ``params.yaml``), with ``overrides`` also ``--set
    KEY=VALUE`` (repeatable, applied over the file), and one required path option per keyword,
    ``--some-name`` for ``some_name``, whose value is its help text. ``arguments``, if given, adds a command's
    own (positional ones, options with defaults) to the parser first.

    ``output_folders`` and ``output_files`` name the options (``out``, ``metrics``) that the stage writes:
    before any work, the main process (rank 0) checks that each can be written where it goes
    (:func:`~pipelines.fileio.check_outputs`), so that a read-only checkout, a full disk or a file in the
    way of a folder is refused in one line (:class:`~pipelines.errors.OutputError`), not after the work."""
    parser = argparse.ArgumentParser(description=description)
    if arguments is not None:
        arguments(parser)
    if params:
        parser.add_argument("--params", default="params.yaml", help="the parameters file")
    if overrides:
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="a param set over the file's (e.g. augment.name=flip); repeatable")
    for name, text in paths.items():
        parser.add_argument("--" + name.replace("_", "-"), type=Path, required=True, help=text)
    args = parser.parse_args(argv)
    if int(os.environ.get("RANK", "0")) == 0:  # the main process writes the outputs
        check_outputs(folders=[getattr(args, name) for name in output_folders],
                      files=[getattr(args, name) for name in output_files])
    return args


def setup_logging(rank: int = 0) -> None:
    """Log INFO to stderr on the main process, WARNING and above elsewhere."""
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = "" if rank == 0 else f"[rank {rank}] "
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {prefix}%(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def run(main: Callable[[list[str] | None], None], argv: list[str] | None = None, *,
        announce: Callable[[], None] | None = None) -> None:
    """Run a stage's ``main``; an error becomes one line, ``error: <message>``, and an exit code.

    ``announce`` (a stage that records into MLflow passes :func:`pipelines.tracking.store.announce`) is called
    first, on the main process, with its errors reported as ``main``'s: its first log line names the store
    the stage uses and why, so that a clone that joined a team never records into its own ``mlflow.db``
    unnoticed.

    A :class:`PipelineError` exits with its ``exit_code`` (2), a :class:`Stopped` with 128 + the signal's
    number (SIGTERM, SIGINT or SIGHUP, which every stage reads alike); any other
    exception with 1, its type named and no traceback. ``PIPELINES_DEBUG=1`` re-raises instead.
    Under torchrun or :mod:`pipelines.launch`, the failing process also writes the line to the error
    file torchrun names (``TORCHELASTIC_ERROR_FILE``); under the launcher only the launcher prints it
    (once, for the whole group), otherwise rank 0 does.

    Where ``main`` is the program's own (``python -m stages.train``: its module is ``__main__``), the process
    then ends through :func:`exit_now`; called from other code (a test), it raises ``SystemExit`` as
    ``sys.exit`` does.
    """
    program = getattr(main, "__module__", None) == "__main__"
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    clear_stops()
    stop, previous = _stop_on_signals()
    unraisable_hook, sys.unraisablehook = sys.unraisablehook, _quiet_stops(sys.unraisablehook)
    code: int | str | None = 0
    try:
        with logging_redirect_tqdm():  # a log record goes above the progress bar, not after its text on its line
            if announce is not None and rank == 0:
                announce()
            main(argv)
            raise_if_stopped()  # a stop a finaliser swallowed still ends the run as a stop
    except (PipelineError, Stopped, Exception) as err:
        if os.environ.get(DEBUG_ENV):
            raise
        _close_progress_bars()
        if isinstance(err, (PipelineError, Stopped)):
            line, code = str(err), err.exit_code
        else:
            line, code = f"unexpected {type(err).__name__}: {first_line(err)} (set {DEBUG_ENV}=1 for the traceback)", 1
        _record(line)
        if rank == 0 and not os.environ.get(LAUNCHED_ENV):
            print(f"error: {line}", file=sys.stderr)
    except KeyboardInterrupt:  # a SIGINT that came while another handler was in place
        code = 130
    except SystemExit as exit_:  # argparse's usage errors, --help
        if not program:
            raise
        code = exit_.code
    finally:
        clear_stops()  # handled: a later run in this process starts without it
        sys.unraisablehook = unraisable_hook
        for signum, handler in previous.items():  # those the stage did not replace with its own
            if signal.getsignal(signum) is stop:
                signal.signal(signum, handler)
    if program:
        exit_now(code)
    if code:
        sys.exit(code)


def _close_progress_bars() -> None:
    """Close the progress bars still open, so that the error starts a line of its own.

    A stop can come while a bar is being made, after its first display: the error would then follow the
    bar's text on its line (``synthetic train: 0%| | 0/4000 [00:00<?, ?img/s]error: stopped by SIGHUP``),
    as nothing has closed the bar (the traceback keeps it alive). tqdm keeps its open bars in
    ``tqdm._instances`` (what ``tqdm.write`` reads too); a bar made in full ends its line as it closes, one
    the stop left half made (without ``last_print_t``, which its constructor sets last) cannot, so its line
    is ended here."""
    for bar in list(tqdm._instances):
        made = hasattr(bar, "last_print_t")
        with contextlib.suppress(Exception):
            bar.close()
            if not made:
                bar.fp.write("\n")
                bar.fp.flush()


def exit_now(code: int | str | None = 0) -> NoReturn:
    """End this process as ``sys.exit(code)`` would, less the interpreter's teardown of its modules.

    That teardown costs seconds of CPU, paid by every process of every stage, and does nothing a stage
    needs. What an exit does that matters is done first, in the interpreter's order:
    ``threading._shutdown`` (its exit callbacks, which stop idle thread pools, then a join of the other
    non-daemon threads), the ``atexit`` handlers (logging's flush, multiprocessing's clean-up of loader
    workers, ``weakref.finalize``), standard output and error flushed; then ``os._exit``. Files the stages write are closed or flushed where they are written, never left to the
    garbage collector."""
    if isinstance(code, str):  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


def _stop_on_signals():
    """Make SIGTERM, SIGINT and SIGHUP alike: each raises :class:`Stopped` (``error: stopped by SIGINT``,
    exit code 128 + its number) unless the stage installs its own (training stops at an iteration
    boundary after a checkpoint). Each stop is also recorded (:func:`~pipelines.errors.request_stop`), so
    one raised inside a finaliser, where Python prints and drops it, still stops the stage. Returns the handler and those it replaced (none off the main thread)."""
    def stop(signum, _frame):
        raise request_stop(signum)

    if threading.current_thread() is not threading.main_thread():
        return stop, {}
    return stop, {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}


def _quiet_stops(hook):
    """``hook`` (``sys.unraisablehook``) less the stops a finaliser swallowed: Python would print each as
    "Exception ignored in ..." with a traceback, where the stop is recorded and ends the stage in its one line
    (:func:`~pipelines.errors.raise_if_stopped`)."""
    def quiet(unraisable):
        if not isinstance(unraisable.exc_value, Stopped):
            hook(unraisable)
    return quiet


def _record(line: str) -> None:
    """Write ``line`` where torchrun's agent reads a failed process's message (its error-file format)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:  # a full disk: the launcher then names the process and its exit code instead
            pass
