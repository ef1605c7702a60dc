"""`muonclip train` under torchrun (2 CPU processes, gloo): DDP and FSDP2 runs equal the one-process
run of the same config, and checkpoints move between 2 ranks and 1 process in both directions.

Every comparison uses fp32 orthogonalisation and a constant learning rate (so a run of 3 steps
resumed to 6 is the same computation as 6 steps straight); tau = 0.05 makes QK-Clip fire.
Tolerance: 1e-5 on every parameter and optimizer-state entry, and on every logged loss
(measured: ~2e-7, the float reduction order of the gradient all-reduce).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muonclip.app.checkpoints import load_checkpoint, load_file, read_checkpoint
from muonclip.app.config import RunConfig
from muonclip.app.main import main
from muonclip.app.metrics import read_rows
from muonclip.app.model import build_model, build_optimizer

TOL = 1e-5
EXACT = ["--preset", "tiny", "--quiet", "--set", "orth_dtype=float32", "--set", "warmup_steps=0",
         "--set", "min_lr_ratio=1", "--tau", "0.05", "--set", "eval_every=3"]
SCRIPT = shutil.which("muonclip", path=str(Path(sys.executable).parent)) or shutil.which("muonclip")


def torchrun(args, nproc=2, timeout=120):
    """Run ``muonclip <args>`` on ``nproc`` CPU processes with torchrun; return the CompletedProcess."""
    launcher = [SCRIPT] if SCRIPT else ["-m", "muonclip.app.main"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *launcher, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run_ok(args, nproc=2):
    proc = torchrun(args, nproc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def final_state(run_dir):
    """(model state dict, optimizer state dict, step) of the latest checkpoint, in one process."""
    found = read_checkpoint(run_dir)
    if found.kind == "file":
        data = load_file(found.path)
        return data["model"], data["optim"], found.step
    cfg = RunConfig.from_dict(found.config)
    model = build_model(cfg)
    opt = build_optimizer(found.optimizer, model, cfg)
    load_checkpoint(found, model, opt)
    return model.state_dict(), opt.state_dict(), found.step


def max_diff(a, b, where="") -> float:
    """Largest |a - b| over the tensors of two nested state dicts; non-tensors must be equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, where
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        return max((max_diff(a[k], b[k], f"{where}.{k}") for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return max((max_diff(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))), default=0.0)
    assert a == b, (where, a, b)
    return 0.0


def assert_same_run(run_dir, ref_dir, steps):
    """Same final parameters and optimizer state (within TOL) and the same logged numbers per step."""
    m, o, step = final_state(run_dir)
    rm, ro, rstep = final_state(ref_dir)
    assert step == rstep == steps
    assert max_diff(m, rm, "model") <= TOL
    assert max_diff(o, ro, "optim") <= TOL
    assert_same_rows(run_dir, ref_dir, steps)


def assert_same_rows(run_dir, ref_dir, steps):
    """The same logged numbers per step (within TOL): loss, validation loss, max logits, clipped heads, update RMS."""
    rows, ref = read_rows(run_dir), read_rows(ref_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, steps + 1))
    for r, q in zip(rows, ref):
        assert math.isfinite(r["loss"]) and abs(r["loss"] - q["loss"]) <= TOL, (r, q)
        assert abs(r["max_logit"] - q["max_logit"]) <= TOL * q["max_logit"], (r, q)
        assert r["clipped"] == q["clipped"] and r["tokens"] == q["tokens"]
        assert (r["val_loss"] is None) == (q["val_loss"] is None)
        if q["val_loss"] is not None:
            assert abs(r["val_loss"] - q["val_loss"]) <= TOL
        assert abs(r["update_rms"] - q["update_rms"]) <= TOL * q["update_rms"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text):
    """One-process runs of 6 steps, for adamw and muonclip."""
    root = tmp_path_factory.mktemp("ref")
    for opt in ("adamw", "muonclip"):
        assert main(["train", *EXACT, "--data", text, "--optimizer", opt, "--steps", "6", "--threads", "1",
                     "--out", str(root / opt)]) == 0
    return root


def test_fsdp_run_equals_one_process(tmp_path, text, reference):
    out = tmp_path / "fsdp"
    proc = run_ok(["train", *EXACT, "--data", text, "--optimizer", "muonclip", "--steps", "6", "--out", str(out),
                   "--fsdp"])
    assert proc.stdout.count("6 steps on 2 processes (fsdp)") == 1  # printed by rank 0 only
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock", "checkpoint-step6.dcp", "checkpoint.json", "config.json", "metrics.csv", "metrics.jsonl"]
    rows = read_rows(out)
    assert rows[0]["clipped_heads"] > 0 and all(2.0 < r["loss"] < 6.0 for r in rows)
    assert_same_run(out, reference / "muonclip", 6)


@pytest.mark.parametrize("optimizer", ["adamw", "muonclip"])
def test_ddp_saves_on_two_ranks_resumes_on_one(tmp_path, text, reference, optimizer):
    out = tmp_path / "ddp"
    proc = run_ok(["train", *EXACT, "--data", text, "--optimizer", optimizer, "--steps", "3", "--out", str(out)])
    assert "3 steps on 2 processes (ddp)" in proc.stdout
    assert read_checkpoint(out).kind == "sharded" and read_checkpoint(out).step == 3
    rows = read_rows(out)
    ref = read_rows(reference / optimizer)
    for r, q in zip(rows, ref[:3]):  # AdamW's max logits: each rank's recorders, all-reduced with MAX
        assert abs(r["loss"] - q["loss"]) <= TOL and abs(r["max_logit"] - q["max_logit"]) <= TOL * q["max_logit"]
    assert main(["train", "--quiet", "--out", str(out), "--resume", "--steps", "6", "--threads", "1"]) == 0
    assert read_checkpoint(out).kind == "file" and sorted(p.name for p in out.glob("checkpoint-step*")) == [
        "checkpoint-step6.pt"]  # the sharded one removed
    assert_same_run(out, reference / optimizer, 6)


def test_one_process_checkpoint_resumes_on_two_ranks_with_fsdp(tmp_path, text, reference):
    out = tmp_path / "one-then-two"
    assert main(["train", *EXACT, "--data", text, "--optimizer", "muonclip", "--steps", "3", "--threads", "1",
                 "--out", str(out)]) == 0
    run_ok(["train", "--quiet", "--out", str(out), "--resume", "--steps", "6", "--fsdp"])
    assert sorted(p.name for p in out.glob("checkpoint-step*")) == ["checkpoint-step6.dcp"]
    assert read_checkpoint(out).kind == "sharded"
    assert_same_run(out, reference / "muonclip", 6)


def test_fsdp_x_tp_run_resumes_on_one_process_like_one_process(tmp_path, text, reference):
    """--fsdp --tp 2 on 2 ranks (a 1x2 (dp, tp) mesh: heads split, q/k/v strided-sharded by FSDP2): 3 steps,
    saved with DCP, resumed on one process to 6 steps: the same run as one process (TOL)."""
    out = tmp_path / "tp"
    proc = run_ok(["train", *EXACT, "--data", text, "--optimizer", "muonclip", "--steps", "3", "--out", str(out),
                   "--fsdp", "--tp", "2"])
    assert "3 steps on 2 processes (fsdp x tp)" in proc.stdout
    assert read_checkpoint(out).kind == "sharded"
    assert read_rows(out)[0]["clipped_heads"] > 0
    assert main(["train", "--quiet", "--out", str(out), "--resume", "--steps", "6", "--threads", "1"]) == 0
    assert_same_run(out, reference / "muonclip", 6)


def test_fsdp_x_tp_mla_update_rms_counts_replicated_weights_once(tmp_path, text):
    """MLA under --fsdp --tp 2 on 2 ranks: the rotary down-projections (q_a_proj, kv_a_proj_with_mqa) stay
    whole on both TP ranks while q_b/kv_b/o/MLP are split. update_rms equals the one-process run's (TOL, with
    every other logged number): each element of each matrix is counted once, the replicated ones not twice
    (counted twice: 0.17184 against 0.17294 at step 1). The final state is not compared here: the tied
    embedding's AdamW update of rarely seen tokens magnifies the reduction-order noise of their tiny gradients
    to ~1e-5 in this run (the Muon matrices agree to 4e-7; TP parity of MLA: tests/test_distributed_tp.py)."""
    mla = [*EXACT, "--set", "attention=mla", "--data", text, "--optimizer", "muonclip", "--steps", "3"]
    ref = tmp_path / "one"
    assert main(["train", *mla, "--threads", "1", "--out", str(ref)]) == 0
    out = tmp_path / "tp"
    assert "3 steps on 2 processes (fsdp x tp)" in run_ok(["train", *mla, "--out", str(out), "--fsdp", "--tp", "2"]).stdout
    assert read_rows(out)[0]["clipped_heads"] > 0
    assert_same_rows(out, ref, 3)


def test_fsdp_without_torchrun_says_how_to_launch(tmp_path, text, capsys):
    rc = main(["train", *EXACT, "--data", text, "--fsdp", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "--fsdp" in err and "torchrun --standalone --nproc_per_node=2" in err
    assert not (tmp_path / "run").exists()


def test_bad_input_under_torchrun_exits_on_every_rank_without_hanging(tmp_path, text):
    out = tmp_path / "run"
    proc = torchrun(["train", *EXACT, "--data", text, "--set", "batch_size=7", "--out", str(out)], timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("batch_size (7) is the global batch") == 1  # rank 0 reports, rank 1 stays quiet
    assert not out.exists()
    # a step no machine can hold (10^7 tokens a sequence): every rank stops before any work,
    # after agreeing on it (one all-reduce, so a rank with more memory does not go on alone)
    proc = torchrun(["train", *EXACT, "--data", text, "--set", "block_size=10000000", "--out", str(out)], timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("one training step needs about") == 1 and "Lower batch_size" in proc.stderr
    assert not out.exists()


def test_each_rank_takes_its_block_of_the_global_batch():
    """Exact: pure indexing."""
    from muonclip.app.launch import check_batch, rank_rows
    from muonclip.distributed._context import SINGLE, GroupContext

    x = torch.arange(8 * 3).reshape(8, 3)
    parts = [rank_rows(x, GroupContext(None, r, 4)) for r in range(4)]
    assert all(p.shape == (2, 3) for p in parts) and torch.equal(torch.cat(parts), x)
    assert torch.equal(rank_rows(x, SINGLE), x)
    with pytest.raises(ValueError, match="must be divisible by 3"):
        check_batch(8, GroupContext(None, 0, 3))


def test_interrupted_sharded_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Exact: the checkpoint that is kept holds copies of the tensors' bytes. The next writer (another
    token, the killed one's recorded in the lock) removes the torn temporary folder."""
    import muonclip.distributed.checkpoint as dcp_ckpt
    from muonclip.app.checkpoint_write import save_checkpoint
    from muonclip.app.checkpoints import verify
    from muonclip.app.config import make_config
    from muonclip.app.run_state import RunIdentity
    from muonclip.app.runfolder import RunLock
    from muonclip.app.safe_files import new_token

    cfg = make_config("tiny", {"threads": 1})
    model = build_model(cfg)
    opt = build_optimizer("muon", model, cfg)
    model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))[1].backward()
    opt.step()
    meta = {"optimizer": "muon", "config": cfg.to_dict(), "run": RunIdentity("r", "d").to_dict(), "extra": {}}
    lock, killed = RunLock(tmp_path), new_token()
    lock.stamp(killed)
    first = save_checkpoint(tmp_path, model, opt, sharded=True, step=1, meta=meta, previous=None, token=killed)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    real = dcp_ckpt.save

    def torn(path, *args, **kwargs):  # writes the shards, then dies before the checkpoint is complete
        real(path, *args, **kwargs)
        (Path(path) / ".metadata").unlink()
        raise KeyboardInterrupt

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    monkeypatch.setattr(dcp_ckpt, "save", torn)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, model, opt, sharded=True, step=2, meta=meta, previous=first, token=killed)
    assert read_checkpoint(tmp_path).step == 1
    verify(read_checkpoint(tmp_path))
    state, _, _ = final_state(tmp_path)
    assert max_diff(state, saved) == 0.0
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(f".muonclip-tmp-{killed}")]
    lock.stamp(next_writer := new_token())
    save_checkpoint(tmp_path, model, opt, sharded=True, step=3, meta=meta, previous=first, token=next_writer)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint-step3.dcp", "checkpoint.json"]
    assert read_checkpoint(tmp_path).step == 3


def test_the_apps_collectives_return_once_gloo_has_let_go_of_their_tensors(tmp_path):
    """`launch._settled`, under every collective of the app (`all_sum`, `all_max`, `all_gather_text`,
    so `agree`): when it returns True, nothing but this thread holds the collective's tensors, so gloo's
    worker thread never needs the GIL after a rank stops (it cannot take it while the interpreter
    finalises: the rank would abort instead of exiting with its code). One process, one gloo rank."""
    import torch.distributed as dist

    from muonclip.app import launch

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for _ in range(20):
            t, parts = torch.zeros(4), [torch.zeros(2)]
            # (outside `assert`: pytest's rewriting would keep the work alive for its message)
            reduced = launch._settled(dist.all_reduce(t, async_op=True), [t], limit=5.0)
            gathered = launch._settled(dist.all_gather(parts, torch.ones(2), async_op=True), parts, limit=5.0)
            assert reduced and gathered
            assert t._use_count() == 1 and parts[0]._use_count() == 1
            assert parts[0].tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
