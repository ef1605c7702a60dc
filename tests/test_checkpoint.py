"""Checkpoints of `muonclip train`: atomic writes, verified on load, never running code from a file,
bit-identical resume (muonclip.app.checkpoints, muonclip.distributed.checkpoint)."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal

import pytest
import torch

import muonclip.app.checkpoint_write as ckpt_mod
import muonclip.app.train as train_mod
from muonclip.app.checkpoint_write import save_checkpoint
from muonclip.app.checkpoints import (
    check_shapes,
    load_checkpoint,
    load_file,
    read_checkpoint,
    verify,
)
from muonclip.app.config import make_config
from muonclip.app.data import builtin_corpus_dir, load_corpus, read_document
from muonclip.app.metrics import read_rows
from muonclip.app.model import build_model, build_optimizer
from muonclip.app.run_state import RunIdentity
from muonclip.app.safe_files import OutputError
from muonclip.app.train import Interrupted, train_run
from muonclip.distributed import checkpoint as dcp_ckpt
from muonclip.distributed.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "hamlet.txt"
    path.write_text(read_document(builtin_corpus_dir() / "tragedies" / "hamlet.md"))
    return load_corpus(path)


def tiny(**kw):
    base = dict(steps=6, eval_every=3, checkpoint_every=100, warmup_steps=2, threads=1)
    return make_config("tiny", {**base, **kw})


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and torch.equal(va, vb), k
        elif isinstance(va, dict):
            assert_same_state(va, vb)
        elif isinstance(va, (list, tuple)):
            assert len(va) == len(vb), k
            for x, y in zip(va, vb):
                if isinstance(x, dict):
                    assert_same_state(x, y)
                elif isinstance(x, torch.Tensor):
                    assert torch.equal(x, y), k
                else:
                    assert x == y, k
        else:
            assert va == vb, k


def _trained(cfg, name="muon"):
    model = build_model(cfg)
    opt = build_optimizer(name, model, cfg)
    model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))[1].backward()
    opt.step()
    return model, opt


def _meta(cfg, name="muon"):
    return {"optimizer": name, "config": cfg.to_dict(), "run": RunIdentity("run-a", "data").to_dict(), "extra": {}}


def final_file(run_dir):
    """The dict of a run folder's current checkpoint file."""
    found = read_checkpoint(run_dir)
    assert found.kind == "file"
    return load_file(found.path)


def test_roundtrip_and_manifest(tmp_path):
    """Exact: a checkpoint holds copies of the tensors' bytes; the manifest is the files' SHA-256."""
    cfg = tiny()
    model, opt = _trained(cfg)
    first = save_checkpoint(tmp_path, model, opt, sharded=False, step=1, meta=_meta(cfg), previous=None)
    found = read_checkpoint(tmp_path)
    verify(found)
    assert (found.kind, found.name, found.step, found.optimizer) == ("file", "checkpoint-step1.pt", 1, "muon")
    data = load_file(found.path)
    assert_same_state(data["model"], model.state_dict())
    assert_same_state(data["optim"]["state"], opt.state_dict()["state"])
    check_shapes(found, model)
    import hashlib
    assert found.files == {"checkpoint-step1.pt": {"bytes": found.path.stat().st_size,
                                                   "sha256": hashlib.sha256(found.path.read_bytes()).hexdigest()}}
    # the next one replaces it: one checkpoint per folder, nothing else left
    save_checkpoint(tmp_path, model, opt, sharded=False, step=2, meta=_meta(cfg), previous=first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-step2.pt", "checkpoint.json"]


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = tiny()
    model, opt = _trained(cfg)
    first = save_checkpoint(tmp_path, model, opt, sharded=False, step=1, meta=_meta(cfg), previous=None)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_save = torch.save

    def crash_half_way(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.seek(0)
        f.truncate(f.tell() + 100)  # a torn file ...
        raise OSError(28, "No space left on device")  # ... and the disk is full

    monkeypatch.setattr(ckpt_mod.torch, "save", crash_half_way)
    with pytest.raises(OutputError, match=r"cannot write the checkpoint of step 2 \(No space left on "
                                                    r"device\); the checkpoint of step 1 is kept"):
        save_checkpoint(tmp_path, model, opt, sharded=False, step=2, meta=_meta(cfg), previous=first)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary file left
    verify(read_checkpoint(tmp_path))


def test_corrupt_and_foreign_files(tmp_path):
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_file(tmp_path / "torn.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a muonclip checkpoint"):
        load_file(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_file(tmp_path / "absent.pt")
    with pytest.raises(CheckpointError, match="checkpoint.json not found"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("sharded", [False, True])
def test_flipped_truncated_or_missing_files_are_refused_naming_them(tmp_path, sharded):
    """8 bytes flipped inside tensor data, a file cut short, a file removed, a file added: each is
    refused by `verify`, which names the file (on the old code a flipped byte loaded silently)."""
    cfg = tiny()
    model, opt = _trained(cfg)
    save_checkpoint(tmp_path, model, opt, sharded=sharded, step=1, meta=_meta(cfg), previous=None)
    found = read_checkpoint(tmp_path)
    files = sorted(found.files, key=lambda f: -found.files[f]["bytes"])
    biggest = tmp_path / files[0]
    good = biggest.read_bytes()
    mid = len(good) // 2
    biggest.write_bytes(good[:mid] + bytes(b ^ 0xFF for b in good[mid:mid + 8]) + good[mid + 8:])
    with pytest.raises(CheckpointError, match=f"{biggest.name} does not match its SHA-256"):
        verify(found)
    biggest.write_bytes(good[:mid])
    with pytest.raises(CheckpointError, match=f"{biggest.name} has {mid} bytes, its manifest"):
        verify(found)
    biggest.unlink()
    with pytest.raises(CheckpointError, match=f"{biggest.name} cannot be read"):
        verify(found)
    biggest.write_bytes(good)
    verify(found)
    if sharded:
        (found.path / "__9_0.distcp").write_bytes(b"x")
        with pytest.raises(CheckpointError, match="holds files its manifest does not list"):
            verify(found)


def test_mismatched_checkpoint(tmp_path):
    cfg = tiny()
    model, opt = _trained(cfg)
    save_checkpoint(tmp_path / "f", model, opt, sharded=False, step=1, meta=_meta(cfg), previous=None)
    save_checkpoint(tmp_path / "s", model, opt, sharded=True, step=1, meta=_meta(cfg), previous=None)
    wide = tiny(n_embd=64)
    for kind in ("f", "s"):
        found = read_checkpoint(tmp_path / kind)
        check_shapes(found, build_model(cfg))
        with pytest.raises(CheckpointError, match=r"another shape: .*\(256, 32\) vs \(256, 64\)"):
            check_shapes(found, build_model(wide))


def test_sharded_roundtrip_in_one_process(tmp_path):
    """Exact: the DCP checkpoint holds copies of the bytes, and Muon's counters ride along."""
    cfg = tiny()
    model, opt = _trained(cfg)
    save_checkpoint(tmp_path, model, opt, sharded=True, step=1, meta=_meta(cfg), previous=None)
    found = read_checkpoint(tmp_path)
    verify(found)
    assert found.kind == "sharded" and sorted(found.files) == sorted(
        f"checkpoint-step1.dcp/{p.name}" for p in found.path.iterdir())
    model2 = build_model(tiny(seed=5))
    opt2 = build_optimizer("muon", model2, cfg)
    rng = load_checkpoint(found, model2, opt2)
    assert_same_state(model2.state_dict(), model.state_dict())
    assert_same_state(opt2.state_dict()["state"], opt.state_dict()["state"])
    assert opt2.steps_taken == opt.steps_taken == 1
    assert rng["torch"].dtype == torch.uint8 and rng["torch"].numel() == torch.get_rng_state().numel()


class _Evil:
    """A pickle whose loading would create a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_metadata_pickle_that_runs_code_is_refused_without_side_effect(tmp_path):
    """DCP's `.metadata` is read by the restricted unpickler: a pickle calling `open` is refused
    (CheckpointError) and the file it would create does not exist. On the old code (pickle.load)
    the file was created."""
    cfg = tiny()
    model, opt = _trained(cfg)
    dcp_ckpt.save(tmp_path / "c", model, opt, extra={"step": 1})
    marker = tmp_path / "PWNED"
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(CheckpointError, match="global 'io.open' is not part of a checkpoint's metadata"):
        dcp_ckpt.load(tmp_path / "c", model, opt)
    assert not marker.exists()


def test_non_tensor_leaves_are_read_without_running_code(tmp_path):
    """The bytes items of a DCP checkpoint (hyperparameters, counters, the JSON extra) are read with
    weights_only=True: DCP's own planner would run a pickle's code there."""
    marker = tmp_path / "PWNED"
    evil = io.BytesIO()
    torch.save(_Evil(str(marker)), evil)
    evil.seek(0)
    planner = dcp_ckpt.SafeLoadPlanner()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, evil)
    assert not marker.exists()
    ok = io.BytesIO()
    torch.save({"lr": 0.02, "orth_dtype": torch.bfloat16, "betas": (0.9, 0.95)}, ok)
    ok.seek(0)
    assert torch.load(ok, weights_only=True)["orth_dtype"] is torch.bfloat16


def test_metadata_naming_files_outside_its_folder_is_refused(tmp_path):
    cfg = tiny()
    model, opt = _trained(cfg)
    dcp_ckpt.save(tmp_path / "c", model, opt)
    meta = dcp_ckpt.read_metadata(tmp_path / "c")
    first = next(iter(meta.storage_data))
    meta.storage_data[first].relative_path = "../../etc/passwd"
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="names the data file '../../etc/passwd'"):
        dcp_ckpt.load(tmp_path / "c", model, opt)


def test_truncated_dcp_files_are_a_checkpoint_error(tmp_path):
    """DCP's CheckpointException is a BaseException: the library turns it into CheckpointError (on
    the old code it escaped as a raw traceback, exit 1)."""
    cfg = tiny()
    model, opt = _trained(cfg)
    dcp_ckpt.save(tmp_path / "c", model, opt)
    shard = next((tmp_path / "c").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot be loaded into this model"):
        dcp_ckpt.load(tmp_path / "c", model, opt)
    meta = tmp_path / "c" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable checkpoint metadata file"):
        dcp_ckpt.load(tmp_path / "c", model, opt)


def _interrupt_at(monkeypatch, at_step):
    """Make the forward pass of training step `at_step` (1-based) deliver a real SIGINT."""
    real = train_mod.forward_loss
    calls = {"n": 0}

    def forward(model, x, y):
        if model.training:
            calls["n"] += 1
            if calls["n"] == at_step:
                signal.raise_signal(signal.SIGINT)
        return real(model, x, y)

    monkeypatch.setattr(train_mod, "forward_loss", forward)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "muonclip"])
def test_resume_is_bit_identical(tmp_path, corpus, monkeypatch, optimizer):
    # muonclip with a low tau, so that the clip really fires in these few steps
    """Bit for bit on any machine: the checkpoint holds exact copies of weights, optimizer state and RNG;
    batches depend only on (seed, step); the resumed steps run the same ops on the same values with
    the same kernels and thread count (threads=1) as the uninterrupted ones (Newton-Schulz's CPU
    batches are chunked only by a fixed rule, never by timing: muonclip.fast._buffered.chunk_size)."""
    cfg = tiny(tau=0.05) if optimizer == "muonclip" else tiny()
    straight = train_run(cfg, optimizer, tmp_path / "straight", corpus=corpus, progress=False)

    _interrupt_at(monkeypatch, 4)
    with pytest.raises(Interrupted) as info:
        train_run(cfg, optimizer, tmp_path / "resumed", corpus=corpus, progress=False)
    assert info.value.step == 4
    assert final_file(tmp_path / "resumed")["step"] == 4
    monkeypatch.undo()
    resumed = train_run(cfg, optimizer, tmp_path / "resumed", resume=True, corpus=corpus, progress=False)

    a = final_file(straight.run_dir)
    b = final_file(resumed.run_dir)
    assert a["step"] == b["step"] == 6
    assert_same_state(a["model"], b["model"])
    assert_same_state(a["optim"], b["optim"])
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    rows_a, rows_b = read_rows(straight.run_dir), read_rows(resumed.run_dir)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "val_loss", "max_logits", "clipped"):
        assert [r[key] for r in rows_a] == [r[key] for r in rows_b], key
    if optimizer == "muonclip":
        assert sum(r["clipped_heads"] for r in rows_a) > 0
    assert json.loads((tmp_path / "resumed" / "config.json").read_text())["run"]["history"] == []
    assert sorted(os.listdir(tmp_path / "resumed")) == sorted(os.listdir(straight.run_dir))
