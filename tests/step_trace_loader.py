"""Modules of ``benchmarks/`` (not a package) loaded by path for the tests that check them:
``step_trace`` (the one definition of what a Muon step enters and of its lr walk, for the tests
that hold those counts) and ``flops`` (the orthogonalisers' flop counts)."""

import importlib.util
from pathlib import Path

_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step_trace = benchmark_module("step_trace")
flops = benchmark_module("flops")
