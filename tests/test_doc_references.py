"""Every reference to the spec names a section of ``docs/design.md`` that exists.

Source files (docstrings, comments, tests, benchmarks) cite the spec as
``docs/design.md, "Section"`` (or ``docs/design.md ("Section")``); the quoted name must begin a
heading of that page, and any other mention of ``design.md`` in them is an error. In the
README and the docs pages a mention may also be a link to the whole page (mkdocs --strict
checks those links), but never a numbered ``design.md 1.3`` (the sections of an old spec that
is not in the repository). Code and the README no longer cite ``benchmarks/RESULTS.md`` (the
figures are in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITE = re.compile(r'docs/design\.md,?\s+\(?"([^"]+)"', re.MULTILINE)
ANY = re.compile(r"(?<![\w/])(?:docs/)?design\.md")
NUMBERED = re.compile(r"design\.md,?\s+\d")
# Files left out of the check: none since issue 18's app half was merged.
OWNED_ELSEWHERE: set[str] = set()


def cited_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "src").rglob("*.py")),
             *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]
    return [f for f in files if f.relative_to(ROOT).as_posix() not in OWNED_ELSEWHERE and f.name != Path(__file__).name]


def headings() -> list[str]:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return [ln.lstrip("#").strip() for ln in text.splitlines() if ln.startswith("#")]


def bad_references(text: str, names: list[str], *, source: bool = True) -> list[str]:
    """The spec references in ``text`` that name no heading in ``names``; in a source file
    (``source``) also every mention of design.md that is not such a citation, else the numbered ones."""
    sections = [" ".join(m.group(1).split()) for m in CITE.finditer(text)]  # a name may wrap in a docstring
    bad = [s for s in sections if not any(h.startswith(s) for h in names)]
    cited = {m.start() for m in CITE.finditer(text)}
    wrong = ANY if source else NUMBERED
    for m in wrong.finditer(text):
        if m.start() not in cited:
            start = m.start()
            end = text.find("\n", start)
            bad.append(text[text.rfind("\n", 0, start) + 1:end if end >= 0 else len(text)].strip())
    return bad


def test_every_spec_reference_names_an_existing_section():
    names = headings()
    assert "Distributed Muon" in names and "Module map" in names
    bad = {f.relative_to(ROOT).as_posix(): b for f in cited_files()
           if (b := bad_references(f.read_text(encoding="utf-8"), names, source=f.suffix == ".py"))}
    assert not bad, f"references to the spec without an existing docs/design.md section: {bad}"


def test_the_check_catches_a_numbered_or_unknown_section():
    """Control: the forms the old code used, and a section that does not exist, are reported."""
    names = headings()
    assert bad_references('see docs/design.md, "Muon".', names) == []
    assert bad_references('QK-Clip (design.md 1.3) rescales', names) == ["QK-Clip (design.md 1.3) rescales"]
    assert bad_references('docs/design.md, "No such section"', names) == ["No such section"]
    assert bad_references("Spec: docs/design.md", names) == ["Spec: docs/design.md"]
    assert bad_references("[the spec](design.md#module-map), design.md", names, source=False) == []
    assert bad_references("rules (design.md 1.1) here", names, source=False) == ["rules (design.md 1.1) here"]


def test_no_reference_to_the_removed_results_log():
    users = [f.relative_to(ROOT).as_posix() for f in cited_files() if f.suffix == ".py" or f.name == "README.md"
             if "RESULTS.md" in f.read_text(encoding="utf-8")]
    assert not users, f"benchmarks/RESULTS.md is gone (figures: docs/benchmarks.md); still cited by {users}"
