"""What one `muonclip.Muon.step` runs, counted by `benchmarks/step_trace.py` (deterministic
counts of code, not timings): the files of ``src/muonclip`` it enters in one process. The
distributed lr walk is held in `test_distributed.py` (its two-rank launch)."""

import pytest
from step_trace_loader import step_trace


@pytest.mark.parametrize("workspace", ["auto", "core"])
def test_one_step_in_one_process_enters_at_most_ten_files(workspace):
    """The step of a GPT-like set of weights (and a stacked-expert weight, and an AdamW group) on
    CPU enters at most 10 files (17 with the default workspace, 14 with ``workspace="core"``, when the
    distributed engine had its own copy of the step): the optimizer shell, its checks and
    distribution hook, the one step body with its structure and matrix views, the workspace, the
    orthogonaliser, the AdamW branch."""
    entered = step_trace.files_and_functions(workspace)
    assert "optim/functional.py" in entered and "optim/_stepping.py" in entered  # the trace sees the step
    assert "muon_step" in entered["optim/functional.py"]
    assert len(entered) <= 10, sorted(entered)
    assert not any(f.startswith("distributed/") for f in entered)
