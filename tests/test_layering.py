"""The architecture stays as documented: import-linter's layering contracts, and ``dvc.yaml`` deps that
match each stage's import closure (so an edit re-runs exactly the stages that import it)."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from .conftest import REPO, dvc_stages



def _lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` (import-linter's command) on the project at ``root``."""
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])},
                          capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    done = _lint(REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "12 kept, 0 broken" in done.stdout


def test_contracts_catch_a_violation(tmp_path):
    for name in ("pipelines", "stages", "benchmarks"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    policy = tmp_path / "pipelines" / "policy.py"
    policy.write_text(policy.read_text() + "\nimport torch  # noqa\n")
    dataset = tmp_path / "pipelines" / "data" / "dataset.py"
    dataset.write_text(dataset.read_text() + "\nfrom ..model import Detector  # noqa\n")
    postprocess = tmp_path / "pipelines" / "inference" / "postprocess.py"
    postprocess.write_text(postprocess.read_text() + "\nimport torchvision.ops  # noqa\n")
    schema = tmp_path / "pipelines" / "config" / "schema.py"
    schema.write_text(schema.read_text() + "\nfrom .validate import check_values  # noqa\n")
    done = _lint(tmp_path)
    assert done.returncode == 1
    assert "Loading and validating params imports neither torch nor torchvision BROKEN" in done.stdout
    assert "The data package never imports the model, training, evaluation or tracking BROKEN" in done.stdout
    assert "over model facts BROKEN" in done.stdout
    assert "pipelines.inference.postprocess is not allowed to import torchvision" in done.stdout  # the ONNX path's


def _file(module: str) -> Path:
    path = REPO / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _is_docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def import_closure(graph, module: str) -> set[str]:
    """Repository-relative files that ``python -m module`` executes: the module, everything it imports
    (also inside functions), and their packages' ``__init__`` files unless those hold only a docstring."""
    modules = {module} | graph.find_upstream_modules(module)
    for name in list(modules):
        parts = name.split(".")
        modules |= {".".join(parts[:i]) for i in range(1, len(parts))}
    files = {_file(name) for name in modules}
    return {str(f.relative_to(REPO)) for f in files if not (f.name == "__init__.py" and _is_docstring_only(f))}


def _stages() -> dict[str, tuple[set[str], list[str]]]:
    """Per stage of ``dvc.yaml``: the modules its command runs and its deps, as DVC resolves them."""
    stages = {}
    for name, stage in dvc_stages(REPO).items():
        modules = set(re.findall(r"-m (pipelines\.\w+)", stage["cmd"])) | set(re.findall(r"\b(stages\.\w+)", stage["cmd"]))
        stages[name] = modules, [dep.rstrip("/") for dep in stage["deps"]]
    return stages


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("pipelines", "stages")


@pytest.mark.parametrize("stage, module", [
    ("prepare", "prepare"), ("cache", "cache"), ("train", "train"), ("evaluate", "evaluate"),
    ("export", "export"), ("search/dvc.yaml:holdout", "holdout"), ("search/dvc.yaml:cache", "cache"), ("search/dvc.yaml:baseline", "train"),
    ("search/dvc.yaml:search", "search"), ("search/dvc.yaml:confirm", "confirm")])
def test_dvc_deps_list_exactly_the_code_each_stage_imports(graph, stage, module):
    modules, deps = _stages()[stage]
    assert f"stages.{module}" in modules
    closure = set().union(*(import_closure(graph, m) for m in modules))
    code_deps = [d for d in deps if d.split("/")[0] in ("stages", "pipelines")]
    missing = sorted(f for f in closure if not any(f == d or f.startswith(d + "/") for d in code_deps))
    assert not missing, f"dvc.yaml: stage {stage} imports {missing} but does not list them under deps"
    stale = sorted(d for d in code_deps if d.endswith(".py") and d not in closure)
    assert not stale, f"dvc.yaml: stage {stage} lists {stale} under deps but does not import them"
    for folder in (d for d in code_deps if not d.endswith(".py")):
        assert any(f.startswith(folder + "/") for f in closure), f"dvc.yaml: stage {stage}: nothing in {folder} is used"


def test_editing_the_transforms_does_not_rerun_prepare(graph):
    modules, deps = _stages()["prepare"]
    assert not any("pipelines/data/transforms.py" == d or "pipelines/data/transforms.py".startswith(d + "/")
                   for d in deps)
    assert "pipelines/data/transforms.py" not in set().union(*(import_closure(graph, m) for m in modules))
    _, train_deps = _stages()["train"]
    assert "pipelines/data" in train_deps


def test_editing_the_training_loop_does_not_rerun_evaluate(graph):
    modules, deps = _stages()["evaluate"]
    closure = set().union(*(import_closure(graph, m) for m in modules))
    for path in ("pipelines/engine.py", "pipelines/solver.py", "pipelines/build/train.py"):
        assert path not in closure and not any(path == d or path.startswith(d + "/") for d in deps), path


def test_package_init_files_hold_only_a_docstring():
    """The project's rule for ``__init__.py``: a docstring and nothing else, so that importing one module
    never pulls in its package's other modules (torch, MLflow) and every import names the module it uses;
    the layering contracts then see each edge where it is."""
    inits = [REPO / name for name in subprocess.run(["git", "ls-files", "*__init__.py"], cwd=REPO, capture_output=True,
                                                     text=True, check=True).stdout.split()]
    assert inits and [str(p.relative_to(REPO)) for p in inits if not _is_docstring_only(p)] == []


def test_dvc_yaml_writes_each_path_once_under_vars():
    """Stages and plots name data and outputs only through ``${paths.*}``: a path is written once."""
    text = (REPO / "dvc.yaml").read_text()
    head, body = text.split("\nstages:\n", 1)
    assert "vars:" in head
    literal = [line for line in body.splitlines() if re.search(r"(?<![\w/$])(data|outputs|metrics)/", line.split("#")[0])]
    assert literal == []
    names = re.findall(r"\$\{paths\.(\w+)\}", body)
    declared = re.findall(r"^      (\w+): ", head, flags=re.MULTILINE)
    assert sorted(set(names)) == sorted(declared)  # every declared path is used, every used one declared
