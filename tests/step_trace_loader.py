"""``benchmarks/step_trace.py`` as a module: the one definition of what a Muon step enters and of
its lr walk, for the tests that hold those counts."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "step_trace.py"
_spec = importlib.util.spec_from_file_location("step_trace", _PATH)
step_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_trace)
