"""The one entry point every stage goes through: logging set-up and clean user errors."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import PipelineError

DEBUG_ENV = "PIPELINES_DEBUG"


def parse_args(description: str, argv: list[str] | None, *, params: bool = True, **paths: str) -> argparse.Namespace:
    """A stage's command line: ``--params`` (default ``params.yaml``) and one required path option per
    keyword, ``--some-name`` for ``some_name``, whose value is its help text."""
    parser = argparse.ArgumentParser(description=description)
    if params:
        parser.add_argument("--params", default="params.yaml", help="the parameters file")
    for name, text in paths.items():
        parser.add_argument("--" + name.replace("_", "-"), type=Path, required=True, help=text)
    return parser.parse_args(argv)


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


def run(main: Callable[[list[str] | None], None], argv: list[str] | None = None) -> None:
    """Run a stage's ``main``; a :class:`PipelineError` becomes one line on stderr and exit code 2.

    Under ``torchrun`` every failing process also records its error in the file torchrun names
    (``TORCHELASTIC_ERROR_FILE``), so the message reaches the user even when another process fails
    first and torchrun stops rank 0 before it prints. Set ``PIPELINES_DEBUG=1`` to get the full
    traceback instead.
    """
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    try:
        main(argv)
    except PipelineError as err:
        if os.environ.get(DEBUG_ENV):
            raise
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(err)
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
