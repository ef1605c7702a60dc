"""The code blocks of docs/integrations.md marked ``<!-- recipe: NAME -->``, run as they stand.

A recipe is the fenced ``python`` block that follows its marker. `recipe(name)` executes it in a
fresh namespace and returns that namespace (its functions and classes), so a test calls what the
page shows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
_BLOCK = re.compile(r"<!-- recipe: (?P<name>[\w-]+) -->\s*```python\n(?P<code>.*?)\n```", re.S)


def recipes() -> dict[str, str]:
    """Every recipe of the page: name -> code."""
    return {m["name"]: m["code"] for m in _BLOCK.finditer(PAGE.read_text(encoding="utf-8"))}


def recipe(name: str) -> dict[str, Any]:
    """Run recipe ``name`` in a fresh namespace and return the namespace."""
    code = recipes()[name]
    namespace: dict[str, Any] = {"__name__": f"recipe_{name}"}
    exec(compile(code, f"{PAGE.name}:recipe:{name}", "exec"), namespace)
    return namespace
