"""The documentation site builds with ``mkdocs build --strict`` (any warning fails), and renders what it claims.

Skipped when mkdocs (the ``docs`` extra) is not installed. A control build with one broken
link checks that ``--strict`` really turns warnings into failures in this configuration.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent, capture_output=True, text=True, timeout=300,
    )


def test_docs_build_strict_and_render_the_api(tmp_path):
    out = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    site = tmp_path / "site"
    api = (site / "api" / "optimizers" / "index.html").read_text(encoding="utf-8")
    # mkdocstrings rendered the docstrings (not just the page title)
    assert "momentum_buffer" in api and "adjust_lr_fn" in api and "muonclip.MuonClip" in api
    integrations = (site / "api" / "integrations" / "index.html").read_text(encoding="utf-8")
    assert "MuonClipTrainerCallback" in integrations and "MuonClipLightningCallback" in integrations
    algorithm = (site / "design" / "index.html").read_text(encoding="utf-8")
    assert "arithmatex" in algorithm and "3.4445" in algorithm and "gamma_h" in algorithm
    migrating = (site / "migrating" / "index.html").read_text(encoding="utf-8")
    assert "match_rms_adamw" in migrating
    bench = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    # one table, each figure with its machine and the script that made it
    assert bench.count("<table>") == 1 and "bench_step.py" in bench and "Machine" in bench
    changelog = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    assert "update_scale" in changelog and "muonclip.integrations.hf" in changelog


def test_strict_mode_fails_on_a_broken_link(tmp_path):
    """Control: the same configuration with one broken link must fail (so the build above can fail)."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(ROOT / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (root / "docs" / "index.md").write_text(
        (ROOT / "docs" / "index.md").read_text(encoding="utf-8") + "\n[broken](no-such-page.md)\n", encoding="utf-8"
    )
    out = build(root / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0
    assert "no-such-page.md" in out.stdout + out.stderr
