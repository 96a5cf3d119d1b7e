"""CI on parameter changes: the pipeline on the tiny CI profile, before and after a change, and what moved.

Both ways work in a fresh temporary git repository (so DVC works) and print ``dvc params diff --md`` and
``dvc metrics diff --md`` (changed metrics only) between the two runs. DVC recomposes ``params.yaml`` on
every ``dvc exp run``, so the profile is passed to each run.

- ``python .ci/pipeline_check.py`` (``.ci/run``, after the tests): a copy of the working tree runs
  ``dvc exp run -S profile=ci``; the results are committed; then ``dvc exp run -S profile=ci -S CHANGE``
  (``--change``, default ``augment.box_prob=0.5``) must re-run only train, evaluate and export, with prepare and
  cache reported unchanged; then one more val image (``dataset.val_size``) must re-run everything but train.
- ``python .ci/pipeline_check.py --base REV --head REV`` (``.github/workflows/pipeline.yml``): the profile
  on the base revision, then on the head revision in the same repository, so stages whose code, params
  and data did not change are reused, as in a developer's ``dvc exp run``.

``--report FILE`` also writes the tables as Markdown (a pull-request comment). Exit status 1 with one
``error:`` line when a run fails or the wrong stages re-run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@localhost", "GIT_COMMITTER_NAME": "ci",
                "GIT_COMMITTER_EMAIL": "ci@localhost"}
DOWNSTREAM = {"train", "evaluate", "export"}  # what a change of an augmentation parameter must re-run, and nothing else
VAL_DOWNSTREAM = {"prepare", "cache", "evaluate", "export"}  # a larger val split: everything but training


class CheckError(Exception):
    """The pipeline check failed; the message is one line."""


def _env() -> dict[str, str]:
    """This environment without MLflow or DVC settings (the copy records into its own store), with the
    interpreter's bin folder (the venv that `make` installed: dvc, torchrun) first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    return {**env, **GIT_IDENTITY, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}


def _run(repo: Path, *command: str, timeout: float = 900) -> str:
    """Run ``command`` in ``repo``; its standard output, or :class:`CheckError` with the tail of its output."""
    done = subprocess.run(command, cwd=repo, env=_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise CheckError(f"`{' '.join(command)}` exited with status {done.returncode} (its output is above)")
    return done.stdout


def copy_worktree(source: Path, dest: Path) -> None:
    """The files git would commit in ``source`` (tracked and untracked, not ignored) as a fresh git repository,
    without the committed results of the full default run (``dvc.lock``, ``metrics/``)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=source,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (source / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, dest / name)
    _drop_results(dest)
    _run(dest, "git", "init", "-q")
    commit(dest, "copy of the working tree")


def clone_at(source: Path, dest: Path, rev: str) -> None:
    """A clone of ``source`` at revision ``rev`` (a commit its history holds), without committed results."""
    _run(source, "git", "clone", "-q", "--no-checkout", str(source), str(dest))
    _run(dest, "git", "checkout", "-q", "--detach", rev)
    _drop_results(dest)
    commit(dest, f"{rev} without the committed results")


def switch_tree(repo: Path, rev: str) -> None:
    """Make the files ``rev``'s but keep the last run's ``dvc.lock`` and ``metrics/`` (committed at HEAD) and the
    ignored outputs they describe, so that DVC re-runs exactly the stages whose code, params or data differ."""
    _run(repo, "git", "read-tree", "-u", "--reset", rev)
    _run(repo, "git", "checkout", "HEAD", "--", "dvc.lock", "metrics")


def _drop_results(repo: Path) -> None:
    for stale in ("dvc.lock", "metrics"):
        path = repo / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def commit(repo: Path, message: str) -> None:
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "commit", "-q", "--allow-empty", "-m", message)


def exp_run(repo: Path, overrides: list[str]) -> tuple[set[str], set[str], float]:
    """``dvc exp run -S ...`` in the workspace: ``(stages that ran, stages reported unchanged, seconds)``."""
    start = time.monotonic()
    out = _run(repo, "dvc", "exp", "run", *[arg for o in overrides for arg in ("-S", o)])
    ran = set(re.findall(r"Running stage '([\w-]+)'", out))
    unchanged = set(re.findall(r"Stage '([\w-]+)' didn't change, skipping", out))
    return ran, unchanged, time.monotonic() - start


def diffs(repo: Path) -> str:
    """``dvc params diff --md`` and ``dvc metrics diff --md`` between the last commit and the workspace."""
    params = _run(repo, "dvc", "params", "diff", "--md").strip() or "No param changed."
    metrics = _run(repo, "dvc", "metrics", "diff", "--md").strip() or "No metric changed."
    return f"### Params\n\n{params}\n\n### Metrics\n\n{metrics}\n"


def check(*, profile: str, change: str | None, base: str | None, head: str | None, workdir: Path) -> str:
    """Run the two pipelines in ``workdir``; the Markdown report. Raises :class:`CheckError`."""
    repo = workdir / "repo"
    overrides = [f"profile={profile}"]
    if base:
        clone_at(ROOT, repo, base)
    else:
        copy_worktree(ROOT, repo)
    ran, _, seconds = exp_run(repo, overrides)
    print(f"baseline ({base or 'working tree'}, {' '.join(overrides)}): ran {', '.join(sorted(ran))} "
          f"in {seconds:.0f} s", flush=True)
    commit(repo, "baseline results")

    if base:
        switch_tree(repo, head)
        label = f"{head}, {' '.join(overrides)}"
    else:
        overrides.append(change)
        label = " ".join(overrides)
    ran, unchanged, seconds = exp_run(repo, overrides)
    print(f"changed ({label}): ran {', '.join(sorted(ran)) or 'nothing'}; unchanged: "
          f"{', '.join(sorted(unchanged)) or 'nothing'} ({seconds:.0f} s)", flush=True)
    if not base and (ran != DOWNSTREAM or not {"prepare", "cache"} <= unchanged):
        raise CheckError(f"after {change}, expected exactly train, evaluate and export to re-run with prepare and cache "
                         f"unchanged; ran {sorted(ran)}, unchanged {sorted(unchanged)}")
    before = f"`{base}`" if base else "baseline"
    after = f"`{head}`" if base else f"`{change}`"
    title = f"## Pipeline on the `{profile}` profile: {before} → {after}\n\n"
    report = title + f"Re-ran: {', '.join(sorted(ran)) or 'nothing'}\n\n" + diffs(repo)
    if not base:
        val_size = int(re.search(r"^  val_size: (\d+)$", (repo / "params.yaml").read_text(), re.MULTILINE).group(1))
        val_ran, val_unchanged, val_seconds = exp_run(repo, [*overrides, f"dataset.val_size={val_size + 1}"])
        print(f"val split {val_size} -> {val_size + 1} images: ran {', '.join(sorted(val_ran))}; unchanged: "
              f"{', '.join(sorted(val_unchanged)) or 'nothing'} ({val_seconds:.0f} s)", flush=True)
        if val_ran != VAL_DOWNSTREAM or "train" not in val_unchanged:
            raise CheckError(f"after dataset.val_size={val_size + 1}, expected everything but train to re-run; "
                             f"ran {sorted(val_ran)}, unchanged {sorted(val_unchanged)}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="ci", help="the conf/profile preset (default: ci)")
    parser.add_argument("--change", default="augment.box_prob=0.5", help="the override of the second run")
    parser.add_argument("--base", help="compare revisions: the base (with --head)")
    parser.add_argument("--head", help="compare revisions: the head (with --base)")
    parser.add_argument("--report", type=Path, help="also write the Markdown report here")
    args = parser.parse_args(argv)
    if bool(args.base) != bool(args.head):
        parser.error("--base and --head go together")

    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="pipeline-check-") as tmp:
            report = check(profile=args.profile, change=args.change, base=args.base, head=args.head, workdir=Path(tmp))
    except CheckError as err:
        print(f"error: pipeline check: {err}", file=sys.stderr)
        return 1
    print(report)
    if args.report:
        args.report.write_text(report)
    print(f"pipeline check passed in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
