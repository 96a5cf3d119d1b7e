"""``python -m pipelines.check``: what DVC reads before any stage of ours runs, checked before ``dvc repro``.

DVC parses ``params.yaml`` and ``dvc.yaml`` and hashes every dependency and output of a stage before it
starts the stage's command, and it takes its lock file first. Its own handling of bad input there is to
spin (a YAML alias bomb), to wait for ever (a FIFO among the images), to fail on a lock whose holder is
gone but counts as running (a zombie, a reused pid), or to say "failed to parse 'stages.prepare.deps'"
(an empty ``params.yaml``). ``make pipeline`` runs this check first; each problem is one line, exit 2:

- ``.dvc/tmp/rwlock``: a stale entry (its pid a zombie, or now another program) is named with the
  command that clears it; a running ``dvc`` that holds a write lock is named too;
- ``params.yaml``: read and validated as every stage reads it (size and alias bounds, a mapping, no
  repeated key, every param);
- ``dvc.yaml``: readable, bounded YAML, its ``${...}`` resolved from ``vars`` and ``params.yaml``;
- the dataset's four paths exist; every path DVC hashes (each stage's deps and outs, walked) holds only
  files and folders: no FIFO, socket or device, no broken symlink or symlink loop, no unreadable folder.

Plain ``dvc repro`` keeps DVC's own behaviour (docs/failures.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from . import cli
from .config.load import load_params
from .config.yamlio import parse_yaml, read_yaml_text
from .errors import ConfigError, DatasetError, PipelineError, first_line
from .fileio import file_problem

log = logging.getLogger("check")

RWLOCK = Path(".dvc") / "tmp" / "rwlock"
_INTERPOLATION = re.compile(r"\$\{\s*([^}]*?)\s*\}")
_IGNORED_DIRS = frozenset({"__pycache__"})  # as .dvcignore says: Python caches are not hashed
_SPECIAL = ((stat.S_ISFIFO, "a FIFO", "DVC would wait on it for ever"),
            (stat.S_ISSOCK, "a socket", "DVC cannot hash it"),
            (stat.S_ISCHR, "a character device", "DVC would hash it for ever or fail"),
            (stat.S_ISBLK, "a block device", "DVC would hash the whole device"))


class LockError(PipelineError):
    """DVC's lock file names a holder that is gone, or a dvc that is still running."""


def main(argv: list[str] | None = None) -> None:
    args = cli.parse_args("Check what DVC reads (its lock, params.yaml, dvc.yaml, every path it hashes) before "
                          "dvc repro; one line per problem, exit code 2.", argv, arguments=_arguments)
    files = check(Path(args.params), Path(args.dvc_file))
    log.info("%s, %s, DVC's lock and the %d files DVC hashes: fine", args.params, args.dvc_file, files)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dvc-file", default="dvc.yaml", help="the pipeline (default dvc.yaml)")


def check(params_file: Path, dvc_file: Path) -> int:
    """Check DVC's lock, ``params_file`` and ``dvc_file`` and every path the pipeline makes DVC hash; returns
    the number of files seen.

    Raises:
        LockError, ConfigError, DatasetError: one line naming the file and what was expected.
    """
    root = dvc_file.parent
    check_lock(root / RWLOCK)
    if params_file.is_file() and not params_file.read_bytes().strip():  # DVC: "failed to parse 'stages.prepare.deps'"
        raise ConfigError(f"{params_file}: empty; expected the parameters (python -m pipelines.compose writes them "
                          "from conf/)")
    params = dataclasses.asdict(load_params(params_file))
    stages = read_stages(dvc_file, params)
    if params["dataset"]["name"] != "synthetic":
        check_dataset_paths(params["dataset"], params_file, root)
    files = 0
    for stage, paths in stages.items():
        for written, path in paths:
            named = f"{path} ({written})" if written != path else path
            files += check_hashed(root / path, f"{named}, which DVC hashes for stage {stage}")
    return files


def check_lock(path: Path) -> None:
    """Refuse DVC's ``rwlock`` file where it would stop ``dvc repro``: unreadable, or holding an entry whose
    process is a zombie or a pid now used by another program (DVC removes entries of pids that are gone, but
    counts these as running), or a write lock of a ``dvc`` still running."""
    if not (path.exists() or path.is_symlink()):
        return
    clear = f"if no dvc command is running here, clear it with `rm {path}`"
    if problem := file_problem(path):
        raise LockError(f"{path}: {problem.replace('image file', 'file')}; DVC refuses every command while it "
                        f"is so; {clear}")
    try:
        lock = json.loads(path.read_bytes())
        entries = [(mode, info) for mode in ("write", "read") for infos in lock.get(mode, {}).values()
                   for info in (infos if isinstance(infos, list) else [infos])]
        holders = {(int(info["pid"]), str(info["cmd"])): mode for mode, info in reversed(entries)}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise LockError(f"{path}: not DVC's lock format ({first_line(err, 80) or type(err).__name__}); DVC "
                        f"refuses every command while it is so; {clear}") from None
    stale = []
    for (pid, cmd), mode in holders.items():
        state = process_state(pid)
        if state is None:  # gone: DVC removes its entries itself
            continue
        status, parent, running = state
        if status == "Z":
            owner = process_state(parent)
            by = f"pid {parent} (`{owner[2]}`)" if owner else f"pid {parent}"
            stale.append(f"pid {pid} (`{cmd}`) is a zombie: it has exited, but its parent, {by}, has not "
                         f"reaped it, so DVC counts it as running")
        elif not _same_program(cmd, running):
            stale.append(f"pid {pid} (`{cmd}`) has exited and its pid is now `{running or '?'}`, which DVC takes "
                         f"for the holder")
        elif mode == "write":
            raise LockError(f"{path}: a running dvc, pid {pid} (`{cmd}`), holds a write lock on this pipeline's "
                            f"outputs; wait for it to end (or stop it) before dvc repro")
    if stale:
        raise LockError(f"{path}: a stale lock: {stale[0]}" + (f" (and {len(stale) - 1} more)" if stale[1:] else "")
                        + f"; no dvc holds it: clear it with `rm {path}`")


def process_state(pid: int) -> tuple[str, int, str] | None:
    """``(state, parent pid, command line)`` of process ``pid`` from ``/proc`` (state ``Z``: a zombie), or None
    if there is no such process (or no ``/proc``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ")
    except (OSError, ValueError):
        return None
    return fields[0], int(fields[1]), command.decode(errors="replace")


def _same_program(recorded: str, running: str) -> bool:
    """Whether the command line ``running`` is the ``dvc`` command that DVC recorded as ``recorded`` (its
    ``sys.argv``; the kernel's also names the interpreter first, and ``python -m dvc`` records the module's
    file). In doubt, it is: a running dvc is never called stale."""
    arguments = recorded.partition(" ")[2]
    return bool(running) and (running == recorded or running.endswith(" " + recorded) or (
        "dvc" in running and (not arguments or running.endswith(" " + arguments))))


def read_stages(dvc_file: Path, params: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """Each stage of ``dvc_file`` and the paths DVC hashes for it (deps, outs, metrics, plots), each as written
    and with its ``${...}`` resolved from the file's ``vars`` and ``params``.

    Raises:
        ConfigError: ``dvc_file`` missing, not a regular file, not bounded YAML, or a ``${...}`` that nothing
            defines.
    """
    if problem := file_problem(dvc_file):
        raise ConfigError(f"{dvc_file}: {problem.replace('image file', 'file')}; expected the pipeline (YAML)")
    raw = parse_yaml(read_yaml_text(dvc_file), str(dvc_file))
    pipeline = OmegaConf.to_container(raw, resolve=False) if OmegaConf.is_config(raw) else raw
    if not isinstance(pipeline, dict) or not isinstance(pipeline.get("stages"), dict):
        raise ConfigError(f"{dvc_file}: expected a mapping with 'stages'")
    context = dict(params)
    for item in pipeline.get("vars") or []:
        if isinstance(item, dict):
            context.update(item)
    stages = {}
    for name, stage in pipeline["stages"].items():
        if not isinstance(stage, dict) or "foreach" in stage or "matrix" in stage:
            continue
        paths = []
        for section in ("deps", "outs", "metrics", "plots"):
            for entry in stage.get(section) or []:
                for text in (entry if isinstance(entry, dict) else [entry]):
                    paths.append((str(text), _resolve(str(text), context, f"{dvc_file}: stages.{name}.{section}")))
        stages[name] = paths
    return stages


def _resolve(text: str, context: dict[str, Any], where: str) -> str:
    def value(match: re.Match) -> str:
        found: Any = context
        for key in match.group(1).split("."):
            if not isinstance(found, dict) or key not in found:
                raise ConfigError(f"{where}: ${{{match.group(1)}}}: defined neither in params.yaml nor in vars")
            found = found[key]
        return str(found)
    return _INTERPOLATION.sub(value, text)


def check_dataset_paths(dataset: dict[str, Any], params_file: Path, root: Path) -> None:
    """A COCO dataset's four paths exist: the image folders as folders, the annotation files as files."""
    for split in ("train", "val"):
        for key, folder in ((f"{split}_images", True), (f"{split}_annotations", False)):
            path = root / dataset[key]
            expected = f"the {split} split's image folder" if folder else f"the {split} split's annotation JSON"
            if not path.exists():
                raise DatasetError(f"{params_file}: dataset.{key}: {dataset[key]}: not found; expected {expected}")
            if folder and not path.is_dir():
                raise DatasetError(f"{params_file}: dataset.{key}: {dataset[key]}: not a folder; expected {expected}")


def check_hashed(path: Path, what: str) -> int:
    """Walk ``path`` (a file or a folder, followed where a symlink) as DVC hashes it; returns the files seen.

    Raises:
        DatasetError: at the first entry that is not a regular file or a folder, a broken symlink or a
            symlink loop, or a folder that cannot be listed: ``<entry>: <what it is>, in <what>; ...``.
    """
    if not (path.exists() or path.is_symlink()):
        return 0  # not made yet (an output), or missing: DVC says which
    files, folders = 0, [path]
    _entry_problem(path, what)
    if not path.is_dir():
        return 1
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name not in _IGNORED_DIRS:
                            folders.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        files += 1
                    else:
                        _entry_problem(Path(entry.path), what)
                        files += 1
        except OSError as err:
            raise DatasetError(f"{folder}: cannot be listed ({err.strerror or err}), in {what}; expected a "
                               "readable folder") from None
    return files


def _entry_problem(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is (or links to) a regular file or a folder."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DatasetError(f"{path}: a broken symlink (to {os.readlink(path)}), in {what}; DVC cannot hash it: "
                           "expected a file (remove the link or restore its target)") from None
    except OSError as err:
        kind = "a symlink loop" if err.errno == errno.ELOOP else f"cannot be read ({err.strerror or err})"
        raise DatasetError(f"{path}: {kind}, in {what}; DVC cannot hash it: expected a file") from None
    for test, kind, consequence in _SPECIAL:
        if test(mode):
            raise DatasetError(f"{path}: not a regular file ({kind}), in {what}; {consequence}: expected only "
                               "files and folders there (move it away)")


if __name__ == "__main__":
    cli.run(main)
