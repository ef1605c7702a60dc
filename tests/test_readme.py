"""The README is the quick start, and its figures are the docs' (docs/compare.md, docs/benchmarks.md).

The README's evidence table states each figure once more, as a pointer into the page that
records it with its machine and protocol: every number of a row's figure must stand, as the same
number, in the section of the page the row links to (the heading its anchor names, down to the
next heading of the same level or above), so a figure edited in the README alone, or a link to
a section that does not hold it, fails here. And the first screen is the quick start: the README
is at most 150 lines, with install, use and the two commands before the evidence, and `.ci/run`
runs the README's test command.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# a figure: a number, with its sign, its range or its spread (2.4–2.6, -0.0076 ± 0.0050, 117.0–147.7x)
NUMBER = re.compile(r"(?<![\w.])[-−]?\d+(?:\.\d+)?(?![\w.]*\d)")
LINK = re.compile(r"\]\((docs/[\w/]+\.md)(?:#([\w-]+))?\)")


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def section(page: str, anchor: str | None) -> str:
    """The text of ``page`` under the heading whose anchor is ``anchor`` (the whole page for None)."""
    if anchor is None:
        return page
    lines = page.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(#+)\s+(.*)", line)
        if m and slug(m.group(2)) == anchor:
            level = len(m.group(1))
            end = next((j for j in range(i + 1, len(lines))
                        if re.match(r"#+\s", lines[j]) and len(lines[j].split()[0]) <= level), len(lines))
            return "\n".join(lines[i + 1:end])
    raise AssertionError(f"no heading with the anchor #{anchor}")


def evidence_rows() -> list[tuple[str, str, str | None]]:
    """(figure, linked page, anchor) of each row of the README's evidence table."""
    text = README.split("\n## The evidence", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("claim", "---"):
            continue
        link = LINK.search(cells[2])
        assert link, f"the row {cells[0]!r} links to no page of docs/"
        rows.append((cells[1], link.group(1), link.group(2)))
    return rows


def numbers(text: str) -> set[str]:
    return {n.replace("−", "-") for n in NUMBER.findall(text.replace("**", ""))}


def test_every_figure_of_the_readme_is_the_linked_pages():
    rows = evidence_rows()
    assert len(rows) >= 6, "the README's evidence table (## The evidence) is missing or nearly empty"
    for figure, page, anchor in rows:
        assert page in ("docs/compare.md", "docs/benchmarks.md"), f"figures live in compare.md or benchmarks.md: {page}"
        found = numbers(section((ROOT / page).read_text(encoding="utf-8"), anchor))
        wanted = numbers(figure)
        assert wanted, f"no figure in the row linking to {page}#{anchor}"
        assert wanted <= found, f"{sorted(wanted - found)} of the README's {figure!r} is not in {page}#{anchor}"


def test_an_edited_figure_is_caught():
    """The check itself: one README figure changed alone is not in its section."""
    figure, page, anchor = evidence_rows()[0]
    edited = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), figure, count=1)
    found = numbers(section((ROOT / page).read_text(encoding="utf-8"), anchor))
    assert not numbers(edited) <= found


def test_the_readme_is_the_quick_start():
    lines = README.splitlines()
    assert len(lines) <= 150, f"the README has {len(lines)} lines; at most 150 (move the rest to docs/)"
    headings = [ln for ln in lines if ln.startswith("## ")]
    assert headings[:4] == ["## Install", "## Use", "## Two commands", "## The evidence"], headings
    assert "make test " in README and "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
