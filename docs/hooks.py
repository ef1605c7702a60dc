"""MkDocs hook: the Benchmarks page shows ``benchmarks/RESULTS.md`` from the repository, as it is now.

The page's ``{{ benchmarks/RESULTS.md }}`` marker is replaced by the file's text, with every
relative link turned into a plain path (the benchmark scripts and figures are not part of the
site, so a link to them would be a broken link). Without the file the marker becomes a note
saying how to produce the figures.
"""

from __future__ import annotations

import re
from pathlib import Path

MARKER = "{{ benchmarks/RESULTS.md }}"
_LINK = re.compile(r"(!?)\[([^\]]*)\]\((?!https?://|#)([^)\s]+)\)")


def _inline(text: str) -> str:
    text = _LINK.sub(lambda m: f"{m.group(2)} (`benchmarks/{m.group(3)}`)", text)
    # headings of the included file sit below the page's own title
    return re.sub(r"^(#{1,5}) ", lambda m: "#" + m.group(1) + " ", text, flags=re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - mkdocs hook signature
    if MARKER not in markdown:
        return markdown
    results = Path(config["config_file_path"]).parent / "benchmarks" / "RESULTS.md"
    if results.is_file():
        body = _inline(results.read_text(encoding="utf-8"))
    else:
        body = ("!!! note\n    `benchmarks/RESULTS.md` is not in this checkout yet: run the scripts in "
                "`benchmarks/` (`make bench`) to measure the figures on your machine.")
    return markdown.replace(MARKER, body)
