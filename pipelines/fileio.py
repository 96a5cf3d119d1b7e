"""Small file helpers that never leave half-written output behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import OutputError

_UMASK = os.umask(0o022)  # reading the umask means setting it: put it straight back
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` in one rename.

    If the body raises, the temporary folder is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (``.<name>.<random>``) to write; on success it replaces
    ``path`` in one rename. If the body raises, the temporary file is removed and ``path`` is left
    as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # as open() would create it (mkstemp makes it private)
        yield Path(tmp)
        with open(tmp, "rb+") as f:  # on disk before the rename, so a power loss cannot leave it empty
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON (keys in insertion order), atomically."""
    text = json.dumps(obj, indent=indent, separators=None if indent else (",", ":"))
    atomic_write_bytes(path, (text + "\n").encode())


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_writable(folder: str | Path, *, needed_bytes: int = 0) -> None:
    """Make sure ``folder`` exists, takes a file, and has ``needed_bytes`` free.

    Raises:
        OutputError: in words (``Permission denied``, ``No space left on device``, ...), naming the folder.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
        free = shutil.disk_usage(folder).free
    except OSError as err:
        raise OutputError(f"{folder}: cannot write there ({err.strerror or err})") from None
    if free < needed_bytes:
        raise OutputError(f"{folder}: No space left on device for the outputs (about {needed_bytes / 2**20:.0f} MB "
                          f"needed, {free / 2**20:.0f} MB free)")
