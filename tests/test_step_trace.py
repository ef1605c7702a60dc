"""What one `muonclip.Muon.step` and one `muonclip.MuonClip.step` run, counted by `benchmarks/step_trace.py` (deterministic
counts of code, not timings): the files of ``src/muonclip`` it enters in one process. The
distributed lr walk is held in `test_distributed.py` (its two-rank launch)."""

import pytest
from step_trace_loader import step_trace


@pytest.mark.parametrize("workspace", ["auto", "core"])
def test_one_step_in_one_process_enters_at_most_eight_files(workspace):
    """The step of a GPT-like set of weights (and a stacked-expert weight, and an AdamW group) on
    CPU enters at most 8 files: the optimizer shell with its decision that no distribution is
    needed, its checks, the one step body with its structure, the workspace, the orthogonaliser
    (its registry and its kernels), the AdamW branch. Neither the matrix views (slots are V's
    matrices as they are) nor the distribution layer's registry."""
    entered = step_trace.files_and_functions(workspace)
    assert "optim/functional.py" in entered and "optim/_stepping.py" in entered  # the trace sees the step
    assert "muon_step" in entered["optim/functional.py"]
    assert len(entered) <= 8, sorted(entered)
    assert not any(f.startswith("distributed/") or f == "optim/multiprocess.py" for f in entered)


@pytest.mark.parametrize("workspace", ["auto", "core"])
def test_one_muonclip_step_in_one_process_enters_no_distributed_file(workspace):
    """The MuonClip step of the reference GPT on CPU, whose clip scales rows: the Muon step's files
    and at most four more (the optimizer with the clip's path, the recorders, the layouts that scale
    rows, the runtime check), none of the distributed layer. The binding, the wrapper lookup and
    the DTensor geometry are entered only when a wrapper replaced a parameter, ``clip`` is called
    through a framework's wrapper, or a weight is a DTensor: 12 files in all."""
    opt, backward = step_trace.clip_optimizer(workspace)
    entered = step_trace.files_and_functions(workspace, clip=True)
    assert "MuonClip.step" in entered["qkclip/_muonclip.py"]  # the trace sees the step and the clip scaling rows
    assert any("scale_rows_" in functions for functions in entered.values())
    backward()
    opt.step()
    assert any(c.any() for c in opt.last_clipped.values())  # the traced steps scale rows (same model and batch)
    assert not any(f.startswith("distributed/") for f in entered), sorted(entered)
    added = set(entered) - set(step_trace.files_and_functions(workspace))
    assert added <= {"qkclip/_muonclip.py", "attention/_recorder.py", "qkclip/_layouts.py", "qkclip/check.py"}, \
        sorted(added)
    assert len(entered) <= 12, sorted(entered)
