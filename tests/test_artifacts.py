"""The models as DVC artifacts: dvc.yaml's ``artifacts:`` (read by DVC) and artifacts.yaml (read by the locked GTO,
1.10, which does not read dvc.yaml) declare the same ones, and in a clone ``gto register`` / ``gto assign --stage
prod`` version them and ``dvc artifacts get`` fetches their bytes from the DVC remote (docs/using.md, "Artifacts").

The round trip runs on a tiny git + DVC repository with the project's own ``vars:`` and ``artifacts:``, a bare git
repository as the git remote and a folder as the DVC remote; a stage that writes a few bytes at each artifact's path
stands in for train and export.
"""

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from .conftest import REPO

NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")  # lowercase letters, digits and '-': valid for DVC, GTO and Studio
PRODUCED_BY = {"detector-onnx": "export", "detector-pth": "train"}


def _resolve(text: str, variables: dict) -> str:
    """``text`` with each ``${paths.<name>}`` replaced from dvc.yaml's ``vars:`` (its paths use no other)."""
    return re.sub(r"\$\{paths\.(\w+)\}", lambda m: variables["paths"][m.group(1)], text)


def _dvc_yaml() -> tuple[dict, dict]:
    """dvc.yaml as written, and its ``vars:`` merged into one dict."""
    pipeline = yaml.safe_load((REPO / "dvc.yaml").read_text())
    variables = {}
    for entry in pipeline.get("vars", []):
        variables.update(entry)
    return pipeline, variables


def _outs(stage: dict, variables: dict) -> list[str]:
    entries = [*stage.get("outs", []), *stage.get("metrics", []), *stage.get("plots", [])]
    return [_resolve(next(iter(e)) if isinstance(e, dict) else e, variables) for e in entries]


def test_dvc_and_gto_declare_the_same_artifacts_at_outputs_of_their_stages():
    pipeline, variables = _dvc_yaml()
    dvc = pipeline["artifacts"]
    gto = yaml.safe_load((REPO / "artifacts.yaml").read_text())
    assert sorted(dvc) == sorted(gto) == sorted(PRODUCED_BY)
    for name, artifact in dvc.items():
        assert NAME.match(name), name
        path = _resolve(artifact["path"], variables)
        assert gto[name] == {"type": "model", "path": path, "description": artifact["desc"],
                             "labels": artifact["labels"]}, name
        assert artifact["type"] == "model" and artifact["desc"] and artifact["labels"], name
        assert all(NAME.match(label) for label in artifact["labels"]), name
    registry = yaml.safe_load((REPO / ".gto").read_text())
    assert registry == {"types": ["model"], "stages": ["dev", "staging", "prod"]}
    # each path is an output of the stage that makes it, or a file in one of its output folders
    missing, absent = [], sorted(set(PRODUCED_BY.values()) - set(pipeline["stages"]))
    for name, stage in PRODUCED_BY.items():
        path = Path(_resolve(dvc[name]["path"], variables))
        outs = [Path(out) for out in _outs(pipeline["stages"].get(stage, {}), variables)]
        if stage not in absent and not any(out == path or out in path.parents for out in outs):
            missing.append(f"{name}: {path} is no output of stage {stage!r}")
    assert not missing, "\n".join(missing)
    if absent:
        pytest.skip(f"no stage {absent} in dvc.yaml to check its artifact's path against")


def _holding_out(pipeline: dict, variables: dict, name: str) -> str:
    """The output entry, as written, of the stage that makes artifact ``name`` and holds its path (the path itself
    where that stage is not in dvc.yaml)."""
    path = Path(_resolve(pipeline["artifacts"][name]["path"], variables))
    stage = pipeline["stages"].get(PRODUCED_BY[name], {})
    written = [next(iter(e)) if isinstance(e, dict) else e for e in stage.get("outs", [])]
    holding = [out for out in written if Path(_resolve(out, variables)) in (path, *path.parents)]
    return holding[0] if holding else pipeline["artifacts"][name]["path"]


def _env() -> dict:
    """No Studio token (``dvc artifacts get`` then reads the DVC remote), no MLflow settings; this venv's commands."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "GTO_", "GIT_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env | {"DVC_NO_ANALYTICS": "1", "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}


def _run(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done


MAKE = """import pathlib, sys
for arg in sys.argv[1:]:
    name, path = arg.split("=", 1)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(f"{name} TOKEN\\n")
"""


def test_a_clone_registers_assigns_and_gets_the_artifacts_through_a_git_and_a_dvc_remote(tmp_path):
    pipeline, variables = _dvc_yaml()
    token = uuid.uuid4().hex
    git_remote, dvc_remote, repo = tmp_path / "origin.git", tmp_path / "dvc-remote", tmp_path / "repo"
    _run(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(git_remote))
    _run(tmp_path, "git", "init", "-q", "-b", "main", str(repo))
    for key, value in (("user.name", "Test"), ("user.email", "test@example.com"), ("commit.gpgsign", "false"),
                       ("tag.gpgsign", "false")):
        _run(repo, "git", "config", key, value)
    (repo / ".dvc").mkdir()  # what `dvc init` writes that matters here, without its process start
    (repo / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
    (repo / ".dvc" / "config").write_text(f"[core]\n    analytics = false\n    remote = store\n"
                                          f"['remote \"store\"']\n    url = {dvc_remote}\n")
    # the project's own vars and artifacts; one stage writes the bytes at each artifact's path, as DVC resolves it,
    # and tracks the output of the real stage that holds it (export's is a folder)
    artifacts = pipeline["artifacts"]
    (repo / "make.py").write_text(MAKE.replace("TOKEN", token))
    targets = [f"{name}={artifact['path']}" for name, artifact in artifacts.items()]
    stage = {"cmd": f"python make.py {' '.join(targets)}", "deps": ["make.py"],
             "outs": sorted({_holding_out(pipeline, variables, name) for name in artifacts})}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"vars": pipeline["vars"], "stages": {"models": stage},
                                                   "artifacts": artifacts}, sort_keys=False))
    for name in ("artifacts.yaml", ".gto"):
        (repo / name).write_text((REPO / name).read_text())
    _run(repo, "dvc", "repro", "-q")
    _run(repo, "dvc", "push", "-q")
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "commit", "-q", "-m", "models")
    _run(repo, "git", "remote", "add", "origin", str(git_remote))
    _run(repo, "git", "push", "-q", "origin", "main")

    # the maintainer: version 0.0.1 of the ONNX, then prod; the weights straight to prod (registered on the way)
    registered = _run(repo, "gto", "register", "detector-onnx", "--push")
    assert "Created git tag 'detector-onnx@v0.0.1'" in registered.stdout
    assigned = _run(repo, "gto", "assign", "detector-onnx", "--stage", "prod", "--push")
    assert "Created git tag 'detector-onnx#prod#1'" in assigned.stdout
    _run(repo, "gto", "assign", "detector-pth", "--stage", "prod", "--push")
    tags = _run(repo, "git", "ls-remote", "--tags", "origin").stdout
    assert set(re.findall(r"refs/tags/([^\s^]+)\n", tags)) == {"detector-onnx@v0.0.1", "detector-onnx#prod#1",
                                                                "detector-pth@v0.0.1", "detector-pth#prod#1"}

    # a colleague's clone: `.` is the clone, the bytes come from the DVC remote its .dvc/config names
    clone = tmp_path / "clone"
    _run(tmp_path, "git", "clone", "-q", str(git_remote), str(clone))
    got = _run(clone, "dvc", "artifacts", "get", ".", "detector-onnx", "--stage", "prod", "-o", "prod.onnx")
    assert "Downloaded 1 file(s) to 'prod.onnx'" in got.stdout
    assert (clone / "prod.onnx").read_text() == f"detector-onnx {token}\n"
    # no clone at all: the git remote's URL
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run(elsewhere, "dvc", "artifacts", "get", f"file://{git_remote}", "detector-pth", "--stage", "prod")
    weights = elsewhere / Path(_resolve(artifacts["detector-pth"]["path"], variables)).name
    assert weights.read_text() == f"detector-pth {token}\n"
