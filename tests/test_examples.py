"""Smoke tests: every script in ``examples/`` runs with tiny settings and prints real results.

Each runs as a subprocess (torchrun scripts with 2 gloo processes on CPU) and its output is
checked for what the script claims: the loss falls, the clip fires with a low ``--tau``, a
Lightning resume matches the uninterrupted run, DDP/FSDP2 runs match a single-process run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(args: list[str], timeout: int = 300) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{args} exited {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    return out.stdout


def torchrun(script: str, *args: str, nproc: int = 2) -> str:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this build")
    return run(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(EXAMPLES / script),
                *args])


def test_every_example_has_a_smoke_test():
    tested = {"plain_pytorch.py", "hf_trainer_llama.py", "lightning_gpt.py", "torchrun_ddp.py", "torchrun_fsdp.py",
              "torchrun_fsdp_tp.py", "torchrun_pipeline.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_plain_pytorch():
    out = run([str(EXAMPLES / "plain_pytorch.py"), "--steps", "3", "--batch-size", "4", "--block-size", "32",
               "--tau", "0.1"])
    rows = re.findall(r"step\s+(\d+) \| loss ([\d.]+) \| max logit\s+([\d.]+) \| clipped heads (\d+)", out)
    assert [int(r[0]) for r in rows] == [1, 2, 3], out
    losses = [float(r[1]) for r in rows]
    assert losses[-1] < losses[0], out
    assert sum(int(r[3]) for r in rows) > 0, "tau=0.1 should clip heads of a fresh model"


def test_hf_trainer_llama():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = run([str(EXAMPLES / "hf_trainer_llama.py"), "--steps", "2", "--block-size", "32", "--tau", "0.1"])
    m = re.search(r"trained 2 steps: loss ([\d.]+) -> ([\d.]+), peak max logit ([\d.]+), clipped heads in total (\d+)",
                  out)
    assert m, out
    assert float(m.group(3)) > 0 and int(m.group(4)) > 0


def test_lightning_gpt():
    pytest.importorskip("lightning")
    out = run([str(EXAMPLES / "lightning_gpt.py"), "--steps", "2", "--block-size", "32"])
    assert re.search(r"uninterrupted: 2 steps, loss [\d.]+, max logit [\d.]+, clipped heads \d+, update RMS 0\.\d+", out), out
    assert "resumed from step 1 to 2: weights identical to the uninterrupted run: True" in out


@pytest.mark.parametrize("script,tag", [("torchrun_ddp.py", "ddp"), ("torchrun_fsdp.py", "fsdp"),
                                        ("torchrun_fsdp_tp.py", "fsdp_tp")])
def test_torchrun(script, tag):
    out = torchrun(script, "--steps", "2", "--batch-size", "2", "--block-size", "16", "--tau", "0.03", "--check")
    rows = re.findall(r"step (\d) \| loss\(rank 0\) [\d.]+ \| max logit [\d.]+ \| clipped heads (\d+)", out)
    assert [r[0] for r in rows] == ["1", "2"], out
    assert sum(int(r[1]) for r in rows) > 0, out
    m = re.search(rf"max \|W_{tag} - W_single_process\| = ([\d.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-3, out


def test_torchrun_pipeline():
    """Two stages of two FSDP2 ranks (4 processes), 1F1B: both stages clip heads (each with its own layers' maxima)
    and the gathered weights equal one process trained on the same micro-batches."""
    out = torchrun("torchrun_pipeline.py", "--dp", "2", "--schedule", "1F1B", "--steps", "2", "--batch-size", "2",
                   "--block-size", "16", "--tau", "0.03", "--check", nproc=4)
    rows = re.findall(r"step (\d) \| loss\(last stage\) [\d.]+ \| max logit [\d.]+ \| clipped heads (\d+) "
                      r"\(stage 0: (\d+), stage 1: (\d+)\)", out)
    assert [r[0] for r in rows] == ["1", "2"], out
    assert all(int(r[1]) == int(r[2]) + int(r[3]) for r in rows) and int(rows[0][2]) > 0 and int(rows[0][3]) > 0, out
    assert "2 stages x 2 ranks, 1F1B, 2 micro-batches" in out
    m = re.search(r"max \|W_pipeline - W_single_process\| = ([\d.e+-]+)", out)
    assert m and float(m.group(1)) <= 1e-3, out
