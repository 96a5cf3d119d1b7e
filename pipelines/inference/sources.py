"""What predict's SOURCE arguments name: image and video files, each with the relative path its outputs keep.

A SOURCE is an image or video file, a folder (searched recursively for files with an image or video
suffix), a glob (``'photos/**/*.jpg'``, quoted so that the shell leaves it to us), or a ``.txt`` file
listing paths one per line (relative ones from the list's folder; blank lines and ``#`` comments skipped).
Each input's *root* is its folder source, the literal folder a glob starts from, or the file's own folder;
every input keeps its path relative to the common folder of all the roots, so that ``a/img.jpg`` and
``b/img.jpg`` stay two outputs (a single folder source keeps the paths inside it). Nothing is opened
here; what cannot be read is found when it is read, and a missing path or a glob without a match is an
input with a ``problem``.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif")  # what the decoder reads (pipelines/data/decode.py)
VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv", ".ts")
LIST_SUFFIX = ".txt"
_MAGIC = ("*", "?", "[")


@dataclass(frozen=True)
class Input:
    """One file to predict on: ``path`` as found, ``relative`` the path its outputs keep (POSIX), ``kind``
    ``image`` or ``video`` (by suffix; a file named on the command line with another suffix is an image),
    ``problem`` why it cannot be used before it is even read (not found), else None."""

    path: str
    relative: str
    kind: str
    problem: str | None = None


def expand(sources: list[str], *, exclude: str | os.PathLike | None = None) -> list[Input]:
    """The inputs ``sources`` name, in order (a folder's and a glob's sorted), each file once, none under the
    folder ``exclude`` (the output folder: a run on a folder that holds it must not read its last outputs).

    Raises:
        ConfigError: a list file cannot be read (one line naming it).
    """
    found: list[tuple[str, str, str | None]] = []  # (path, root, problem)
    for source in sources:
        found.extend(_expand_one(source))
    if exclude is not None:
        outside = os.path.abspath(exclude) + os.sep
        found = [entry for entry in found if not os.path.abspath(entry[0]).startswith(outside)]
    if not found:
        return []
    roots = [os.path.abspath(root) for _, root, _ in found]
    common = os.path.commonpath(roots)
    inputs, seen = [], set()
    for path, _, problem in found:
        absolute = os.path.abspath(path)
        if absolute in seen:
            continue
        seen.add(absolute)
        relative = PurePosixPath(*Path(os.path.relpath(absolute, common)).parts).as_posix()
        inputs.append(Input(path, relative, kind_of(path), problem))
    return inputs


def kind_of(path: str) -> str:
    """``video`` for a video suffix, else ``image``."""
    return "video" if Path(path).suffix.lower() in VIDEO_SUFFIXES else "image"


def _expand_one(source: str) -> list[tuple[str, str, str | None]]:
    if os.path.isdir(source):
        return [(path, source, None) for path in _walk(source)]
    if os.path.lexists(source):
        if Path(source).suffix.lower() == LIST_SUFFIX and os.path.isfile(source):
            return _listed(source)
        return [(source, os.path.dirname(source) or ".", None)]
    if any(ch in source for ch in _MAGIC):
        matches = sorted(glob.glob(source, recursive=True))
        root = _literal_prefix(source)
        if not matches:
            return [(source, root, "no file matches this pattern")]
        return [(path, root, None) for path in matches]
    return [(source, os.path.dirname(source) or ".", "file not found")]


def _walk(folder: str) -> list[str]:
    """The files under ``folder`` with an image or video suffix, sorted; folders are searched, whatever their
    name, and special files (a FIFO named ``x.jpg``) are kept, to be refused when read."""
    found = []
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        found.extend(os.path.join(top, name) for name in names
                     if Path(name).suffix.lower() in IMAGE_SUFFIXES + VIDEO_SUFFIXES)
    return sorted(found)


def _listed(list_file: str) -> list[tuple[str, str, str | None]]:
    try:
        text = Path(list_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{list_file}: cannot read the list of paths ({getattr(err, 'strerror', None) or err})") \
            from None
    base = os.path.dirname(list_file)
    out = []
    for line in text.splitlines():
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        path = entry if os.path.isabs(entry) else os.path.join(base, entry)
        problem = None if os.path.lexists(path) else "file not found"
        out.append((path, os.path.dirname(path) or ".", problem))
    return out


def _literal_prefix(pattern: str) -> str:
    """The folder a glob starts from: its components before the first with a wildcard."""
    parts = []
    for part in Path(pattern).parts[:-1]:
        if any(ch in part for ch in _MAGIC):
            break
        parts.append(part)
    return os.path.join(*parts) if parts else "."
