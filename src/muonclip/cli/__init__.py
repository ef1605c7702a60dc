"""The ``muonclip`` command-line tool: ``muonclip compare`` (AdamW vs Muon vs MuonClip on real
text, with plots and a summary table) and ``muonclip train`` (one optimizer, checkpoints,
exact resume). See `muonclip.cli.main`."""

from .config import OPTIMIZERS, PRESETS, RunConfig, make_config
from .main import main

__all__ = ["OPTIMIZERS", "PRESETS", "RunConfig", "main", "make_config"]
