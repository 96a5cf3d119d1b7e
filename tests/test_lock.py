"""requirements.lock still matches pyproject.toml (the dependencies and the `dev` extra).

The lock is written by `make lock` (pip-compile); these checks only read files: no network, no pip.
"""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import REPO

LOCK = REPO / "requirements.lock"
PYPROJECT = REPO / "pyproject.toml"
STALE = "requirements.lock does not match pyproject.toml; run `make lock`, then the tests, and commit both"

PIN = re.compile(r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==(?P<version>[A-Za-z0-9._+!-]+)$")


def _pyproject() -> tuple[str, list[Requirement]]:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    # A requirement whose environment marker excludes this platform is legitimately absent.
    return project["name"], [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": "dev"})]


def _lock() -> tuple[dict[str, str], dict[str, set[str]]]:
    """``(pins, via)``: name -> version, and name -> the sources of pip-compile's `# via` annotation."""
    pins: dict[str, str] = {}
    via: dict[str, set[str]] = {}
    current = None
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        pin = PIN.match(line)
        if pin:
            current = canonicalize_name(pin["name"])
            pins[current] = pin["version"]
            via[current] = set()
        elif line.startswith("    #") and current is not None:
            # `    # via a` (one source) or `    # via` followed by `    #   a` lines.
            text = line.strip()[1:].strip()
            if text.startswith("via "):
                text = text[4:]
            if text and text != "via":
                via[current].add(text)
        else:
            current = None
    return pins, via


def test_lock_lines_are_comments_or_exact_pins():
    bad = [
        f"{n}: {line!r}"
        for n, line in enumerate(LOCK.read_text(encoding="utf-8").splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#") and not PIN.match(line)
    ]
    assert not bad, f"requirements.lock may hold only comments and `name==version` lines ({STALE}):\n" + "\n".join(bad)


def test_every_pyproject_requirement_is_pinned_within_its_specifier():
    _, reqs = _pyproject()
    pins, _ = _lock()
    problems = []
    for req in reqs:
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req} is not pinned")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req} is pinned at {version}")
    assert not problems, f"{STALE}:\n" + "\n".join(problems)


def test_lock_roots_are_exactly_pyproject_requirements():
    name, reqs = _pyproject()
    _, via = _lock()
    source = re.compile(r"^(.+) \(pyproject\.toml\)$")
    project = canonicalize_name(name)
    roots = {
        pkg
        for pkg, sources in via.items()
        if any((m := source.match(s)) and canonicalize_name(m[1]) == project for s in sources)
    }
    wanted = {canonicalize_name(r.name) for r in reqs}
    assert roots == wanted, (
        f"{STALE}: pinned `via {name} (pyproject.toml)` but not in pyproject: {sorted(roots - wanted)}; "
        f"in pyproject but not annotated so: {sorted(wanted - roots)}"
    )
