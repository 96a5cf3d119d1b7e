"""The README stays short and every link in it and in docs/ resolves inside the repository."""

import re

from .conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


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
    """The record tables of docs/benchmarks.md and docs/results.md are each benchmark's own ``table()`` of a
    record in benchmarks/records/; a figure changed in a record (or in the page) makes them disagree."""
    import json
    import shutil

    from benchmarks.record import BLOCK, DOCS, RECORDS, render

    pages = [page.read_text() for page in DOCS]
    names = [name for text in pages for name in BLOCK.findall(text)]
    assert len(names) >= 7 and sorted(names) == sorted(p.stem for p in RECORDS.glob("*.json"))
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
