"""Small file helpers: writers that never leave half-written output behind, and the checks and
settings around reading (:func:`file_problem` before opening a file, :func:`gc_paused` while a large
JSON is parsed)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import gc
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import OutputError, first_line, raise_if_stopped

_UMASK = os.umask(0o022)  # reading the umask means setting it: put it straight back
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` in one rename.

    If the body raises, the temporary folder is removed and ``path`` is left as it was. A write that
    failed for lack of space (see :func:`atomic_file`) becomes an :class:`OutputError` naming ``path``
    (or the file in it) rather than the temporary folder.

    A stop (:class:`~pipelines.errors.Stopped`, raised by a signal handler between any two bytecodes)
    can come at any point, even right after the folder is made or between the two renames that put it
    in place: both temporary names are chosen before anything exists under them, and every step is
    inside the ``try``, so the clean-up always knows what to remove and what to put back.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (path.with_name(f".{path.name}.{what}{secrets.token_hex(6)}") for what in ("", "old-"))
    try:
        tmp.mkdir()
        yield tmp
        raise_if_stopped()  # a stop a finaliser swallowed: the previous output stays
        if path.exists() or path.is_symlink():
            path.rename(old)
        tmp.rename(path)
        _remove(old)
    except BaseException as err:
        full = None if isinstance(err, OutputError) else _out_of_space(err, tmp, written=_tree_size(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
        if (old.exists() or old.is_symlink()) and not path.exists():  # stopped between the renames
            old.rename(path)  # the previous output goes back
        _remove(old)  # stopped after the new output went in (or while the previous one was removed)
        if isinstance(err, OutputError) and str(tmp) in str(err):  # a file written inside: name where it was going
            raise OutputError(str(err).replace(str(tmp), str(path))) from None
        if full:
            raise OutputError(f"{path}: {full}; nothing was replaced") from None
        raise


def _remove(path: Path) -> None:
    """Remove a file or folder if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_file(path: str | Path, *, size: int | None = None) -> Iterator[Path]:
    """Yield a temporary path to write; on success its file replaces ``path`` in one rename. If the body
    raises, the temporary file is removed and ``path`` is left as it was.

    On Linux the file is unnamed until the write is complete (``O_TMPFILE``, yielded as
    ``/proc/self/fd/N``, which any writer can open), so a writer killed mid-write, even by SIGKILL,
    leaves nothing behind; it is then linked beside ``path`` (``.<name>.<random>``) and renamed.
    Elsewhere, or where the filesystem has no ``O_TMPFILE``, the temporary file is named from the start.

    A write that fails for lack of space (``ENOSPC``, ``EDQUOT``; or, where the writer loses the errno,
    as ``torch.save`` and numpy do, a failed write on a disk that is now full) raises
    :class:`OutputError`: ``<path>: no space left on device while writing it (about <size> needed, <free>
    free); nothing was replaced``. ``size``, if known, is the file's size, for that message.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    named = str(path.parent / f".{path.name}.{secrets.token_hex(6)}")  # chosen first: a stop anywhere knows it
    anonymous = None
    tmp = named
    try:
        anonymous = _unnamed_file(path.parent)
        if anonymous is None:
            os.close(os.open(named, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # as open() makes it (umask)
        else:
            tmp = f"/proc/self/fd/{anonymous}"
            os.chmod(tmp, 0o666 & ~_UMASK)  # as open() would create it (O_TMPFILE was asked for 0o600)
        yield Path(tmp)
        raise_if_stopped()
        with open(tmp, "rb+") as f:  # on disk before the rename, so a power loss cannot leave it empty
            os.fsync(f.fileno())
        if anonymous is not None:
            _link_unnamed(tmp, named)
        os.replace(named, path)
    except BaseException as err:
        full = None if isinstance(err, OutputError) else _out_of_space(err, path, written=_size_of(tmp), size=size)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(named)
        if full:
            raise OutputError(f"{path}: {full}; nothing was replaced") from None
        raise
    finally:
        if anonymous is not None:
            os.close(anonymous)


_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400


def _unnamed_file(folder: Path) -> int | None:
    """A descriptor of a new unnamed file in ``folder`` (Linux ``O_TMPFILE``), or None where there is none."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:  # a filesystem without O_TMPFILE (EOPNOTSUPP; EISDIR on old kernels)
        return None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _link_unnamed(proc_path: str, name: str) -> None:
    """Give the unnamed file at ``proc_path`` the temporary ``name``. (``linkat`` with ``AT_SYMLINK_FOLLOW``
    through libc: Python 3.11's ``os.link`` does not follow ``/proc/self/fd`` links.)"""
    if _libc().linkat(_AT_FDCWD, proc_path.encode(), _AT_FDCWD, os.fsencode(name), _AT_SYMLINK_FOLLOW) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), name)


# Writers that lose the errno of a failed write: torch.save ("[enforce fail at inline_container.cc:672] .
# unexpected pos 576 vs 534", "PytorchStreamWriter failed writing file data/0: file write failed",
# "basic_ios::clear: iostream error") and numpy's tofile ("100000 requested and 8176 written").
_FAILED_WRITE = re.compile(r"inline_container\.cc|PytorchStreamWriter|file write failed|basic_ios::clear"
                           r"|iostream error|\d+ requested and \d+ written")
_NEARLY_FULL = 16 * 2**20  # free bytes left when such a write failed for lack of space (blocks, reserves)


def _out_of_space(err: BaseException, tmp: Path, *, written: int, size: int | None = None) -> str | None:
    """The rest of the message if ``err`` is a write that failed for lack of space, else None.

    Called before the temporary file or folder ``tmp`` is removed, so the free space is the space
    that was left to the write; ``written`` is what it had written."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free(tmp)
    elif isinstance(err, (RuntimeError, OSError)) and _FAILED_WRITE.search(str(err)):
        free = _free(tmp)
        if free is None or free >= _NEARLY_FULL:
            return None  # failed for another reason: let it through as it is
    else:
        return None
    quota = isinstance(err, OSError) and err.errno == errno.EDQUOT
    needed = f"about {_human(size)}" if size else f"more than {_human(written)}" if written else None
    known = ", ".join(filter(None, [needed and needed + " needed", free is not None and not quota and
                                    f"{_human(free)} free"]))
    return ("no space left on device (disk quota exceeded)" if quota else "no space left on device") + \
        " while writing it" + (f" ({known})" if known else "")


def _free(path: Path) -> int | None:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(path if path.is_dir() else path.parent).free
    return None


def _size_of(file: str | Path) -> int:
    try:
        return os.stat(file).st_size
    except OSError:
        return 0


def _tree_size(folder: Path) -> int:
    return sum(_size_of(os.path.join(top, name)) for top, _, names in os.walk(folder) for name in names)


def _human(n: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_file(path, size=len(data)) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON (keys in insertion order), atomically."""
    text = json.dumps(obj, indent=indent, separators=None if indent else (",", ":"))
    atomic_write_bytes(path, (text + "\n").encode())


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    return _file_digest(path, hashlib.sha256())


def file_md5(path: str | Path) -> str:
    """Hex MD5 of a file's bytes (what DVC records for a file in ``dvc.lock``)."""
    return _file_digest(path, hashlib.md5())


def _file_digest(path: str | Path, digest) -> str:
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


_MIN_FREE = 1 << 20  # an output folder with less free space than this is full before the work starts


def check_outputs(*, folders: Iterable[str | Path] = (), files: Iterable[str | Path] = ()) -> None:
    """Check, before any work, that the output folders and files can be written where they go.

    Each output is written beside itself (:func:`atomic_dir`, :func:`atomic_file`), in its parent folder,
    which is made where missing: the parent's nearest existing ancestor must be a folder (not a file, not
    a broken symlink) that takes a new file (not on a read-only filesystem, not denied) and has free space;
    an output file must not exist as a folder. Nothing is left behind: the probe file is unnamed.

    Raises:
        OutputError: one line naming the folder or file and what was expected.
    """
    for path, is_file in [(Path(f), False) for f in folders] + [(Path(f), True) for f in files]:
        if is_file and path.is_dir():
            raise OutputError(f"{path}: a folder; expected a file to write (or nothing) there")
        probe_folder(_existing_ancestor(path, path.parent), expected=f"a writable folder for {path}")


def _existing_ancestor(path: Path, folder: Path) -> Path:
    """The nearest folder at or above ``folder`` that exists, or an :class:`OutputError` at the first thing
    in the way: a file, or a symlink to nothing."""
    for name in [folder, *folder.parents]:
        if name.is_dir():
            return name
        if name.is_symlink() and not name.exists():
            raise OutputError(f"{name}: a broken symlink (to {os.readlink(name)}); expected a folder for {path}")
        if name.exists():
            raise OutputError(f"{name}: not a folder; expected a folder for {path}")
    return Path(".")


def probe_folder(folder: Path, *, expected: str = "a writable folder", min_free: int = _MIN_FREE) -> None:
    """Check that ``folder`` takes a new file and has ``min_free`` bytes free, writing an unnamed probe file
    (``O_TMPFILE`` where there is one); ``expected`` ends the message.

    Raises:
        OutputError: ``<folder>: cannot write there (Read-only file system); expected <expected>`` (or
            ``Permission denied``, ...), ``<folder>: no space left on device (... free); expected ...``.
    """
    tail = f"; expected {expected}"
    try:
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(b"\0")
            probe.flush()
        space = os.statvfs(folder)  # what is free to any user (f_bavail), as a stage's writes will find it
        free = space.f_bavail * space.f_frsize
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"{folder}: no space left on device{tail}") from None
        raise OutputError(f"{folder}: cannot write there ({err.strerror or err}){tail}") from None
    if free < min_free:
        raise OutputError(f"{folder}: no space left on device ({_human(free)} free){tail} with at least "
                          f"{_human(min_free)} free")


def remove_temporaries(*paths: str | Path) -> None:
    """Remove the temporary files that :func:`atomic_file` writes for ``paths`` (``.<name>.*`` beside each)
    and a killed writer left behind. Only for a caller that owns the paths (no writer can be running)."""
    for path in map(Path, paths):
        for tmp in path.parent.glob(f".{glob.escape(path.name)}.*"):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                tmp.unlink()


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a readable regular file, found without opening it (opening a FIFO blocks for
    ever; a device or a socket never ends or fails oddly); None if it is one."""
    name = os.fspath(path)
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        broken = f" (broken symlink to {os.readlink(name)})" if os.path.islink(name) else ""
        return "image file not found" + broken
    except (OSError, ValueError) as err:  # a symlink loop, permission, name too long, a NUL or undecodable character
        text = getattr(err, "strerror", None) or first_line(err)
        return f"cannot read the file ({text})"
    if not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _FILE_KINDS if test(mode)), "a special file")
        return f"not a regular file ({kind})"
    return None


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector.

    Parsing a COCO-scale JSON allocates millions of containers, and every collection walks all of
    them: most of ``json.load``'s time (docs/benchmarks.md). Callers pause it only around work that
    builds nothing cyclic (parsing JSON, converting it to arrays), so reference counting frees it all.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
