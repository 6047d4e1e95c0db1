"""No file cites a document the repository does not ship: every ``docs/<name>.md`` named in the
package, the tests, the benchmarks, the examples and the top-level guides exists, every
``docs/<name>.md §N`` names a section of it, and nothing cites the internal ``spec/`` notes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITE = re.compile(r"docs/([\w.-]+\.md)(?:,?\s+(?:§\s?(\d+(?:\.\d+)*)))?")


def _sources():
    for folder in ("fp16kit", "tests", "benchmarks", "examples"):
        yield from sorted((ROOT / folder).rglob("*.py"))
    yield from sorted(ROOT.glob("*.md"))
    yield from sorted((ROOT / "docs").glob("*.md"))


def _sections(doc: Path) -> set[str]:
    text = doc.read_text(encoding="utf-8")
    found = set(re.findall(r"(?m)^#{1,4}\s+§?(\d+(?:\.\d+)*)[.\s]", text))
    return found | set(re.findall(r"\*\*(\d+(?:\.\d+)*)\*\*", text))


def test_every_cited_document_and_section_exists():
    missing = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for m in CITE.finditer(text):
            doc = ROOT / "docs" / m.group(1)
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            if not doc.exists():
                missing.append(f"{where}: docs/{m.group(1)}")
            elif m.group(2) and m.group(2) not in _sections(doc):
                missing.append(f"{where}: docs/{m.group(1)} §{m.group(2)}")
    assert not missing, "cited but not shipped:\n" + "\n".join(missing)


def test_nothing_cites_the_internal_spec_notes():
    this = Path(__file__).resolve()
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _sources()
        if p.resolve() != this
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bspec/\w", line)
    ]
    assert not hits, "cite docs/ instead:\n" + "\n".join(hits)
