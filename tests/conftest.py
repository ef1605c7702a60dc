"""Fixtures shared by the test modules of the `muonclip` command."""

from __future__ import annotations

import pytest

from muonclip.app.data import builtin_corpus_dir, read_document


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A small corpus file: Macbeth, from the built-in plays, as plain text."""
    path = tmp_path_factory.mktemp("text") / "macbeth.txt"
    path.write_text(read_document(builtin_corpus_dir() / "tragedies" / "macbeth.md"))
    return str(path)
