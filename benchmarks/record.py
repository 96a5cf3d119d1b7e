"""Benchmark figures kept as data, and the tables of docs/benchmarks.md, results.md and search.md written from them.

    python -m benchmarks.record run NAME -- benchmarks.sa_autoaug --clock cpu   # measure, keep the record
    python -m benchmarks.record docs [--check]                                 # write (or check) the tables

``run`` runs the benchmark module with ``--json`` in a process of its own and keeps what it prints in
``benchmarks/records/NAME.json`` with the machine it ran on (CPU model and class, the ISA torch runs
at, cores, load average before and after), the command, the date and the commit. ``docs`` replaces
each ``<!-- record: NAME -->`` ... ``<!-- /record -->`` block of those pages with the
module's own ``table(figures)`` (what it prints without ``--json``) under one line saying where and
how the figures were measured; ``--check`` changes nothing and exits with 1 where a table and its
record disagree. The prose around the blocks is written by hand.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks" / "records"
DOCS = (REPO / "docs" / "benchmarks.md", REPO / "docs" / "results.md", REPO / "docs" / "search.md")
BLOCK = re.compile(r"<!-- record: ([\w-]+) -->\n.*?<!-- /record -->", re.DOTALL)


def machine() -> dict:
    """The machine as the records describe it; ``class`` is the CPU class the docs time by."""
    import torch

    from pipelines import hardware

    native = hardware.native_bf16_cpu()
    isa = hardware.cpu_isa()
    return {"cpu": hardware.cpu_model(), "class": "AVX512-BF16" if native else isa.split(",")[0].upper(),
            "isa": isa, "native_bf16": native, "cores": hardware.cpu_budget(), "torch": torch.__version__}


def run(name: str, module_args: list[str]) -> dict:
    """Run ``python -m MODULE ARGS --json``; return (and keep) its record."""
    module, args = module_args[0], module_args[1:]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", module, *args, "--json"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"error: {module} exited with {done.returncode}; no record kept")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    record = {"module": module, "command": " ".join(["python -m", module, *args]),
              "date": datetime.date.today().isoformat(), "commit": commit.strip(),
              "seconds": round(time.perf_counter() - start, 1),
              "machine": {**machine(), "load_before": load_before, "load_after": os.getloadavg()[0]},
              "figures": json.loads(done.stdout.strip().splitlines()[-1])}
    RECORDS.mkdir(exist_ok=True)
    (RECORDS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def describe(record: dict) -> str:
    """One line: what ran, where and how loaded."""
    m = record["machine"]
    took = f"{record['seconds']:.0f} s" if record["seconds"] < 120 else f"{record['seconds'] / 60:.0f} min"
    return (f"`{record['command']}` on {record['date']} (commit {record['commit']}, {took}): "
            f"{m['cores']}-core {m['cpu']}, {m['class']} class (ATen at {m['isa']}), torch {m['torch']}, "
            f"load average {m['load_before']:.2f} before and {m['load_after']:.2f} after (1 min)")


def block(name: str, record: dict) -> str:
    table = importlib.import_module(record["module"]).table(record["figures"])
    markdown = any(line.startswith("|") for line in table.splitlines())  # else plain text, kept as printed
    body = f"{table}\n" if markdown else f"```\n{table}\n```\n"
    return f"<!-- record: {name} -->\n{describe(record)}:\n\n{body}<!-- /record -->"


def render(text: str, records: Path = RECORDS, page: str = "docs") -> str:
    """``text`` (of ``page``) with every record block written from its record."""
    def replace(match: re.Match) -> str:
        path = records / f"{match.group(1)}.json"
        if not path.is_file():
            raise SystemExit(f"error: {page}: no record {path.relative_to(REPO)} for block {match.group(1)!r}")
        return block(match.group(1), json.loads(path.read_text()))

    return BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    measure = sub.add_parser("run", help="run a benchmark and keep its record")
    measure.add_argument("name", help="the record's name (benchmarks/records/NAME.json)")
    measure.add_argument("module_args", nargs=argparse.REMAINDER, help="-- MODULE [ARGS...]")
    docs = sub.add_parser("docs", help="write the docs' record tables from the records")
    docs.add_argument("--check", action="store_true", help="change nothing; exit with 1 where a table is stale")
    args = parser.parse_args(argv)
    if args.command == "run":
        module_args = args.module_args[1:] if args.module_args[:1] == ["--"] else args.module_args
        if not module_args:
            parser.error("run: give the benchmark module after --")
        print(describe(run(args.name, module_args)))
        return
    for page in DOCS:
        text = page.read_text()
        new = render(text, page=str(page.relative_to(REPO)))
        if args.check and new != text:
            raise SystemExit(f"error: {page.relative_to(REPO)} disagrees with benchmarks/records/; "
                             "run python -m benchmarks.record docs")
        if not args.check:
            page.write_text(new)


if __name__ == "__main__":
    main()
