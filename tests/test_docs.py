"""The README stays short, every link in it and in docs/ resolves inside the repository, the layout page names
exactly the modules that exist, and every figure of a generated or quoted results table comes from a record."""

import re

from .conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "notes").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    """``text`` without its fenced code blocks and inline code (a link there is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    found = set()
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M).splitlines():
        if heading := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 120


def test_every_link_resolves_inside_the_repository():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(_outside_code(doc.read_text())):
            if re.match(r"[a-z]+://|mailto:", target):
                continue  # a web page, not a file
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            inside = resolved == REPO or REPO in resolved.parents
            if not inside or not resolved.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file in the repository)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_no_text_points_outside_the_repository():
    """Facts taken from elsewhere are written down here, not referred to by a path outside the repository."""
    outside = [f"{doc.relative_to(REPO)}: {line.strip()[:80]}" for doc in DOCS for line in doc.read_text().splitlines()
               if "../shared/docs" in line]
    assert not outside, "\n".join(outside)


def test_benchmark_tables_are_written_from_their_records(tmp_path):
    """The record tables of docs/benchmarks.md, docs/results.md and docs/search.md are each benchmark's own ``table()`` of a
    record in benchmarks/records/; a figure changed in a record (or in the page) makes them disagree."""
    import json
    import shutil

    from benchmarks.record import BLOCK, DOCS, RECORDS, render

    pages = [page.read_text() for page in DOCS]
    names = [name for text in pages for name in BLOCK.findall(text)]
    # every record has its block, but a comparison's (lever-*), which is a row of the levers table
    tabled = sorted(p.stem for p in RECORDS.glob("*.json") if not p.stem.startswith("lever-"))
    assert len(names) >= 7 and sorted(names) == tabled
    assert all(render(text) == text for text in pages)  # python -m benchmarks.record docs --check
    text = pages[0]
    names = BLOCK.findall(text)
    for name in names:
        record = json.loads((RECORDS / f"{name}.json").read_text())
        assert record["machine"]["class"] and record["machine"]["cpu"] and "load_before" in record["machine"]
    changed = tmp_path / "records"
    shutil.copytree(RECORDS, changed)
    record = json.loads((changed / f"{names[0]}.json").read_text())
    record["machine"]["load_before"] += 1.0
    (changed / f"{names[0]}.json").write_text(json.dumps(record))
    assert render(text, changed) != text


def test_policy_records_agree_with_the_table_written_from_them():
    """The policies table's record holds the per-run records of benchmarks/records/policies/, unchanged."""
    import json

    from benchmarks import policies
    from benchmarks.record import RECORDS

    kept = policies.figures(policies.kept(RECORDS / "policies"))
    assert json.loads((RECORDS / "policies.json").read_text())["figures"] == json.loads(json.dumps(kept))


def test_the_lever_table_holds_every_lever_record():
    """The levers table's record is what benchmarks.levers gathers from the lever-*.json records, unchanged: a
    comparison kept but missing from the table (or a table row without its record) fails."""
    import json

    from benchmarks import levers
    from benchmarks.record import RECORDS

    assert json.loads((RECORDS / "levers.json").read_text())["figures"] == json.loads(json.dumps(levers.gather()))
    reused = [r for r in levers.gather()["levers"] if r["bootstrap95"] is None]  # arms reused from records
    assert all(f"`{' '.join(r['candidate'])}` | " in levers.table({"levers": [r]}) for r in reused)
    assert "(arms reused from records)" in levers.table({"levers": reused}) or not reused


def _section(text: str, heading: str) -> str:
    """The text of the section under ``heading`` (a whole heading line), up to the next heading of its level."""
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"^{level} ", body, maxsplit=1, flags=re.M)[0]


def test_readme_results_are_the_records_they_name():
    """Each row of the README's results table links its record; its times and AP figures are the record's."""
    import json

    from benchmarks.fresh_clone import _minutes

    rows = [line for line in _section((REPO / "README.md").read_text(), "## Results").splitlines()
            if line.startswith("|") and "benchmarks/records/" in line]
    assert len(rows) >= 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        name = re.search(r"benchmarks/records/([\w-]+)\.json", cells[-1]).group(1)
        figures = json.loads((REPO / "benchmarks" / "records" / f"{name}.json").read_text())["figures"]
        repro, ap, ap50, aps, tests = cells[1:6]
        pipeline = figures["pipeline"]
        assert [ap, ap50, aps] == [f"{pipeline[k]:.3f}" for k in ("AP", "AP50", "APs")], row
        if re.match(r"\d+ min", repro):
            assert repro == _minutes(pipeline["seconds"]), row
        if re.match(r"\d+ min", tests):
            assert tests == _minutes(figures["tests"]["seconds"]), row


def test_readme_own_data_command_is_the_data_page_s():
    """The README's own-data command is docs/data.md's, which tests/test_own_data.py runs."""
    def first_bash_block(text: str) -> str:
        return re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip()

    readme = _section((REPO / "README.md").read_text(), "## Your own data")
    data = (REPO / "docs" / "data.md").read_text().split("## Your own COCO-format data", 1)[1]
    assert first_bash_block(readme) == first_bash_block(data)


LAYOUT_PATH = re.compile(r"\b((?:pipelines|stages)/(?:\w+/)*(?:\w+\.py\b)?)")


def test_the_layout_page_names_exactly_the_modules_that_exist():
    """docs/development.md's layout names every ``.py`` module of pipelines/ and stages/ (package ``__init__.py``
    files aside), and every path it names exists."""
    layout = _section((REPO / "docs" / "development.md").read_text(), "## Layout")
    named = set(LAYOUT_PATH.findall(layout))
    missing = sorted(name for name in named if not (REPO / name).exists())
    modules = {str(path.relative_to(REPO)) for top in ("pipelines", "stages") for path in (REPO / top).rglob("*.py")
               if path.name != "__init__.py"}
    unlisted = sorted(modules - named)
    assert not missing and not unlisted, f"named but absent: {missing}; present but not named: {unlisted}"
