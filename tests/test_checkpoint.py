"""Checkpoints of `muonclip train`: atomic writes, validation on load, bit-identical resume."""

from __future__ import annotations

import signal

import pytest
import torch

import muonclip.app.train as train_mod
import muonclip.distributed.checkpoint as ckpt_mod
from muonclip.app.config import MODEL_FIELDS, make_config
from muonclip.app.data import builtin_corpus_dir, load_corpus, read_document
from muonclip.app.metrics import read_rows
from muonclip.app.train import CHECKPOINT, Interrupted, build_model, build_optimizer, train_run
from muonclip.distributed.checkpoint import (
    CheckpointError,
    FoundCheckpoint,
    check_compatible,
    find_checkpoint,
    load_file,
    save_file,
)


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


def _payload(model, opt, step):
    return {"optimizer": "muon", "config": tiny().to_dict(), "step": step, "model": model.state_dict(),
            "optim": opt.state_dict(), "rng": ckpt_mod.rng_state(), "extra": {}}


def _trained(cfg, name="muon"):
    model = build_model(cfg)
    opt = build_optimizer(name, model, cfg)
    model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))[1].backward()
    opt.step()
    return model, opt


def test_roundtrip(tmp_path):
    """Exact: a checkpoint holds copies of the tensors' bytes."""
    cfg = tiny()
    model, opt = _trained(cfg)
    save_file(tmp_path / "c.pt", _payload(model, opt, 1))
    data = load_file(tmp_path / "c.pt")
    assert data["step"] == 1 and data["optimizer"] == "muon"
    assert_same_state(data["model"], model.state_dict())
    assert_same_state(data["optim"]["state"], opt.state_dict()["state"])
    check_compatible(FoundCheckpoint("file", tmp_path / "c.pt", data), optimizer="muon", config=cfg.to_dict(),
                     model=model, fields=MODEL_FIELDS)
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_interrupted_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = tiny()
    model, opt = _trained(cfg)
    path = tmp_path / "c.pt"
    save_file(path, _payload(model, opt, 1))
    before = path.read_bytes()
    real_save = torch.save

    def crash_half_way(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.seek(0)
        f.truncate(f.tell() + 100)  # a torn file ...
        raise OSError("disk full")  # ... and the process dies

    monkeypatch.setattr(ckpt_mod.torch, "save", crash_half_way)
    with pytest.raises(OSError, match="disk full"):
        save_file(path, _payload(model, opt, 2))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert load_file(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left


def test_corrupt_and_foreign_files(tmp_path):
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_file(tmp_path / "torn.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a muonclip checkpoint"):
        load_file(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_file(tmp_path / "absent.pt")


def test_mismatched_checkpoint(tmp_path):
    cfg = tiny()
    model, opt = _trained(cfg)
    save_file(tmp_path / "c.pt", _payload(model, opt, 1))
    found = FoundCheckpoint("file", tmp_path / "c.pt", load_file(tmp_path / "c.pt"))
    with pytest.raises(CheckpointError, match="'muon' run, this run uses 'adamw'"):
        check_compatible(found, optimizer="adamw", config=cfg.to_dict(), model=model, fields=MODEL_FIELDS)
    wide = tiny(n_embd=64)
    with pytest.raises(CheckpointError, match="another shape.*n_embd: checkpoint 32, now 64"):
        check_compatible(found, optimizer="muon", config=wide.to_dict(), model=build_model(wide), fields=MODEL_FIELDS)
    # without the config check, the tensors' shapes tell the same, for a file and for a sharded checkpoint
    with pytest.raises(CheckpointError, match=r"another shape: .*\(256, 32\) vs \(256, 64\)"):
        check_compatible(found, optimizer="muon", config=wide.to_dict(), model=build_model(wide))
    ckpt_mod.save_sharded(tmp_path / "sharded", model, opt, meta={"optimizer": "muon", "config": cfg.to_dict(),
                                                                   "step": 1}, rng=ckpt_mod.rng_state())
    sharded = find_checkpoint(tmp_path / "sharded")
    assert sharded.kind == "sharded"
    check_compatible(sharded, optimizer="muon", config=cfg.to_dict(), model=build_model(cfg), fields=MODEL_FIELDS)
    with pytest.raises(CheckpointError, match=r"another shape: .*\(256, 32\) vs \(256, 64\)"):
        check_compatible(sharded, optimizer="muon", config=wide.to_dict(), model=build_model(wide))


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
    batches are chunked only by a fixed rule, never by timing: muonclip.fast.chunks)."""
    cfg = tiny(tau=0.05) if optimizer == "muonclip" else tiny()
    straight = train_run(cfg, optimizer, tmp_path / "straight", corpus=corpus, progress=False)

    _interrupt_at(monkeypatch, 4)
    with pytest.raises(Interrupted) as info:
        train_run(cfg, optimizer, tmp_path / "resumed", corpus=corpus, progress=False)
    assert info.value.step == 4
    assert load_file(tmp_path / "resumed" / CHECKPOINT)["step"] == 4
    monkeypatch.undo()
    resumed = train_run(cfg, optimizer, tmp_path / "resumed", resume=True, corpus=corpus, progress=False)

    a = load_file(straight.run_dir / CHECKPOINT)
    b = load_file(resumed.run_dir / CHECKPOINT)
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
