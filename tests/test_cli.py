"""`muonclip compare` / `muonclip train` end to end, and every bad input: message, exit code, no files."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import muonclip.app.train as train_mod
from muonclip.app.checkpoints import load_file, read_checkpoint
from muonclip.app.config import make_config
from muonclip.app.main import main
from muonclip.app.metrics import read_rows
from muonclip.app.model import orthogonalisation
from muonclip.common._hardware import CPU_BF16_ENV

TINY = ["--preset", "tiny", "--quiet", "--threads", "1"]


def snapshot(folder):
    """Every file under folder with its bytes (to show that nothing was written or changed)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def final_file(run):
    """The dict of the run folder's current checkpoint file."""
    return load_file(read_checkpoint(run).path)


def at_training_forward(monkeypatch, n, action):
    """Patch the training loop's ``forward_loss`` so that at the ``n``-th training forward,
    ``action(model, loss)`` runs; the loss it returns, if a tensor, replaces that forward's loss."""
    real = train_mod.forward_loss
    calls = {"n": 0}

    def forward(model, x, y):
        loss = real(model, x, y)
        if model.training:
            calls["n"] += 1
            if calls["n"] == n:
                out = action(model, loss)
                return out if isinstance(out, torch.Tensor) else loss
        return loss

    monkeypatch.setattr(train_mod, "forward_loss", forward)


def test_compare_end_to_end_writes_a_real_report(tmp_path, text, capsys):
    """The protocol on the tiny preset (2 seeds; AdamW at 1x and 2x; the stability segment with a
    tau below the first logits): every run, the figures computed from the runs' own metrics, the
    plots, both tables and the reading."""
    out = tmp_path / "cmp"
    rc = main(["compare", *TINY, "--data", text, "--out", str(out), "--steps", "12", "--set", "eval_every=4",
               "--set", "stability_steps=6", "--set", "stability_tau=0.05", "--jobs", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    for name in ("val_loss.png", "budget.png", "max_logit.png", "clip_events.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / name).stat().st_size > 5000
    data = json.loads((out / "summary.json").read_text())
    eff, stab = data["efficiency"], data["stability"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "adamw-x1-s0", "adamw-x1-s1", "adamw-x2-s0", "adamw-x2-s1", "muon-x1-s0", "muon-x1-s1"]
    finals = {}
    for opt, budget in [("adamw", 1), ("adamw", 2), ("muon", 1)]:
        for seed in (0, 1):
            rows = read_rows(out / "runs" / f"{opt}-x{budget}-s{seed}")
            assert [r["step"] for r in rows] == list(range(1, 12 * budget + 1))
            assert rows[-1]["tokens"] == 12 * budget * 8 * 32
            finals[(opt, budget, seed)] = rows[-1]["val_loss"]
            assert 2.0 < rows[-1]["val_loss"] < 6.0  # ln 256 = 5.55
    table = {(t["optimizer"], t["budget"]): t for t in eff["table"]}
    for (opt, budget), t in table.items():
        vals = [finals[(opt, budget, s)] for s in (0, 1)]
        assert t["final_val_loss"] == vals
        assert t["mean"] == pytest.approx(sum(vals) / 2) and t["sd"] == pytest.approx(abs(vals[0] - vals[1]) / 2**0.5)
    ratio = eff["ratios"]["muon"]
    for seed, got in zip((0, 1), ratio["budget_matched_per_seed"]):  # the interpolation, by hand
        l1, l2, target = finals[("adamw", 1, seed)], finals[("adamw", 2, seed)], finals[("muon", 1, seed)]
        want = 1.0 if l1 <= target else (None if l2 > target else 1 + (l1 - target) / (l1 - l2))
        assert got == (want if want is None else pytest.approx(want))
    # update_rms, per unit lr with weight decay removed (UpdateRMS): AdamW's first update is
    # m_hat / sqrt(v_hat) = sign(g), RMS 1; Muon's "rms" scale gives 0.2 * RMS of ns5's singular
    # values, which lie in about [0.68, 1.13]
    assert 0.99 < read_rows(out / "runs" / "adamw-x1-s0")[0]["update_rms"] <= 1.0
    for run in ("runs/muon-x1-s0", "stability/muon-s1", "stability/muonclip-s0"):
        assert all(0.2 * 0.68 < r["update_rms"] < 0.2 * 1.13 for r in read_rows(out / run))
    # tau = 0.05 is below the initial logits, so MuonClip clips (right from step 1) and plain runs never do
    by = {t["optimizer"]: t for t in stab["table"]}
    for seed in (0, 1):
        clip_rows, plain = read_rows(out / "stability" / f"muonclip-s{seed}"), read_rows(out / "stability" / f"muon-s{seed}")
        assert clip_rows[0]["clipped_heads"] > 0 and all(r["clipped_heads"] == 0 for r in plain)
        assert by["muonclip"]["peak_max_logit"][seed] == max(r["max_logit"] for r in clip_rows)
        assert by["muonclip"]["clip_events"][seed] == sum(r["clipped_heads"] for r in clip_rows)
        assert by["muonclip"]["final_val_loss"][seed] == clip_rows[-1]["val_loss"]
        assert read_rows(out / "stability" / f"muonclip-s{seed}")[-1]["tokens"] == 6 * 8 * 32
    assert sum(by["muonclip"]["clip_events_per_layer"]) == sum(by["muonclip"]["clip_events"])
    # AdamW and Muon record exact maxima (no threshold); MuonClip's LSE bounds only ever at or below tau
    assert all(r["max_logit_is_bound"] == 0 for d in (out / "runs").iterdir() for r in read_rows(d))
    for seed in (0, 1):
        assert all(r["max_logit_is_bound"] == 0 for r in read_rows(out / "stability" / f"muon-s{seed}"))
        assert all(r["max_logit"] <= 0.05 for r in read_rows(out / "stability" / f"muonclip-s{seed}")
                   if r["max_logit_is_bound"])
    md = (out / "summary.md").read_text()
    assert "## Token efficiency: AdamW, Muon" in md and "## Stability, a rescue at an excessive rate" in md
    # the tiny preset's rates were set by hand: the segment at Muon's rate does not call it tuned
    assert "## Stability at Muon's rate (not tuned)" in md and "## Protocol: what was tuned, what was not" in md
    assert data["reading"] in md and "2 seeds 0, 1" in data["reading"] and "Wen et al. 2025" in data["reading"]
    assert "which were not tuned" in data["reading"] and "same CPU kind" in data["reading"]
    tuned = data["stability_tuned"]  # the tuned-rate segment: Muon's own rate (tiny: 0.02), its own tau
    assert tuned["tau"] == 30.0 and sorted(p.name for p in (out / "stability-tuned").iterdir()) == [
        "muon-s0", "muon-s1", "muonclip-s0", "muonclip-s1"]
    assert read_rows(out / "stability-tuned" / "muon-s0")[-1]["lr"] == pytest.approx(0.02)
    assert f"{table[('muon', 1.0)]['mean']:.4f} ± {table[('muon', 1.0)]['sd']:.4f}" in md
    assert "| adamw | 2x | 0.01M |" in printed and data["reading"] in printed
    orth = orthogonalisation(make_config("tiny"))  # the dtype "auto" picks on this machine, and why
    assert f"\n\nMuon's orthogonalisation: {orth}\n" in printed and f"orthogonalisation in {orth}" in md
    csv_lines = (out / "stability" / "muonclip-s0" / "metrics.csv").read_text().splitlines()
    assert len(csv_lines) == 7 and csv_lines[0].startswith("step,tokens,loss,val_loss,lr,max_logit,max_logit_0")


def test_train_interrupt_then_resume_matches_straight_run(tmp_path, text, monkeypatch, capsys, bf16_answer):
    """Bit for bit on any machine, for the reasons of test_checkpoint.test_resume_is_bit_identical: exact
    copies in the checkpoint, the same ops on the same values with the same kernels and --threads 1
    after it; under each answer of the CPU probe (the checkpoint holds "auto", resolved again on resume)."""
    args = ["train", *TINY, "--data", text, "--optimizer", "muonclip", "--steps", "6", "--tau", "0.05"]
    assert main([*args, "--out", str(tmp_path / "straight")]) == 0
    orth = orthogonalisation(make_config('tiny'))
    assert orth.startswith(f"{str(bf16_answer).removeprefix('torch.')} on cpu (auto: MUONCLIP_CPU_BF16=")
    assert f"; orthogonalisation in {orth}; run folder" in capsys.readouterr().out

    at_training_forward(monkeypatch, 3, lambda model, loss: signal.raise_signal(signal.SIGINT))  # Ctrl-C, step 3
    assert main([*args, "--out", str(tmp_path / "run")]) == 130
    assert "interrupted after step 3" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv(CPU_BF16_ENV, "1" if bf16_answer is torch.bfloat16 else "0")  # undone with the rest
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--quiet"]) == 0
    a = final_file(tmp_path / "straight")
    b = final_file(tmp_path / "run")
    assert a["step"] == b["step"] == 6
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


def test_nonfinite_loss_stops_names_the_step_and_keeps_the_checkpoint(tmp_path, text, monkeypatch, capsys):
    at_training_forward(monkeypatch, 5, lambda model, loss: loss * float("nan"))
    out = tmp_path / "run"
    rc = main(["train", *TINY, "--data", text, "--optimizer", "muon", "--steps", "8", "--set", "checkpoint_every=2",
               "--out", str(out)])
    assert rc == 3
    err = capsys.readouterr().err
    assert "non-finite loss (nan) at step 5" in err and "checkpoint-step4.pt" in err
    data = final_file(out)
    assert data["step"] == 4
    assert all(torch.isfinite(v).all() for v in data["model"].values())
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in out.iterdir()) == [".lock", "checkpoint-step4.pt", "checkpoint.json", "config.json",
                                                     "metrics.csv", "metrics.jsonl"]


@pytest.mark.parametrize("optimizer", ["adamw", "muonclip"])
def test_nonfinite_gradient_stops_before_the_step(tmp_path, text, monkeypatch, capsys, optimizer):
    """A NaN gradient with a finite loss (a hook on the embedding's gradient at step 3): the global norm
    of the gradient clipping is NaN, so the run stops before the optimizer step, for AdamW too (whose
    torch step would write the NaN into every weight): exit 3, the last good checkpoint kept."""
    at_training_forward(monkeypatch, 3,
                        lambda model, loss: model.wte.weight.register_hook(lambda g: torch.full_like(g, float("nan"))))
    out = tmp_path / "run"
    rc = main(["train", *TINY, "--data", text, "--optimizer", optimizer, "--steps", "6", "--set", "checkpoint_every=2",
               "--out", str(out)])
    assert rc == 3
    assert "non-finite gradient (global norm nan) at step 3" in capsys.readouterr().err
    data = final_file(out)
    assert data["step"] == 2 and all(torch.isfinite(v).all() for v in data["model"].values())
    assert [r["step"] for r in read_rows(out)] == [1, 2]


def test_nonfinite_validation_loss_stops_like_a_training_loss(tmp_path, text, monkeypatch, capsys):
    """A NaN validation loss (finite training losses) ends the run with exit 3 at that step:
    no metrics row and no checkpoint for it, the last good checkpoint kept."""
    real = train_mod.evaluate
    calls = {"n": 0}

    def evaluate(model, batches):
        calls["n"] += 1
        return float("nan") if calls["n"] == 2 else real(model, batches)

    monkeypatch.setattr(train_mod, "evaluate", evaluate)
    out = tmp_path / "run"
    rc = main(["train", *TINY, "--data", text, "--optimizer", "muonclip", "--steps", "8", "--set", "eval_every=3",
               "--set", "checkpoint_every=3", "--out", str(out)])
    assert rc == 3
    err = capsys.readouterr().err
    assert "non-finite validation loss (nan) at step 6" in err and "checkpoint-step3.pt" in err
    assert final_file(out)["step"] == 3
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4, 5]


def _bad(capsys, argv, match, code=2):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == code, err
    assert "muonclip: error:" in err and match in err, err
    return err


@pytest.mark.parametrize("command", ["train", "compare"])
def test_bad_data_inputs(tmp_path, capsys, command):
    out = tmp_path / "out"
    base = [command, *TINY, "--out", str(out)]
    _bad(capsys, [*base, "--data", str(tmp_path / "nope.txt")], "no such file or folder")
    (tmp_path / "empty.txt").write_text("")
    _bad(capsys, [*base, "--data", str(tmp_path / "empty.txt")], "is empty")
    (tmp_path / "emptydir").mkdir()
    _bad(capsys, [*base, "--data", str(tmp_path / "emptydir")], "holds no .txt/.md files")
    (tmp_path / "small.txt").write_text("Out, damned spot! out, I say!\n" * 5)
    _bad(capsys, [*base, "--data", str(tmp_path / "small.txt")], "fewer than one batch")
    binary = tmp_path / "some.bin"  # 5,000 random bytes: not text
    binary.write_bytes(bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).tolist()))
    _bad(capsys, [*base, "--data", str(binary)], f"{binary} is not UTF-8 text")
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "compare"])
def test_small_corpus_warns_before_training(tmp_path, capsys, monkeypatch, command):
    """A corpus the run reads more than 10 times, with a validation split smaller than one
    batch: two warnings on stderr before the first step (once for all of compare's runs), and
    the run goes on."""
    data = tmp_path / "lines.txt"
    data.write_text("Fair is foul, and foul is fair: hover through the fog and filthy air.\n" * 5)  # 350 bytes
    seen = []
    real = train_mod.forward_loss

    def forward(model, x, y):
        if not seen:
            seen.append(capsys.readouterr().err)  # what was printed before the first step
        return real(model, x, y)

    monkeypatch.setattr(train_mod, "forward_loss", forward)
    jobs = ["--jobs", "1", "--set", "budgets=1", "--set", "seeds=1"] if command == "compare" else []
    rc = main([command, *TINY, "--data", str(data), "--steps", "13", "--set", "val_fraction=0.12",  # 308 + 42 bytes
               *jobs, "--out", str(tmp_path / "out")])
    assert rc == 0
    before = seen[0]
    assert before.count("muonclip: warning:") == 2
    assert "308 training bytes about 11 times" in before and "validation split holds 42 bytes" in before
    assert "muonclip: warning:" not in capsys.readouterr().err  # compare: not again for its other runs


def test_bad_config_inputs(tmp_path, capsys, text):
    out = tmp_path / "out"
    base = ["train", *TINY, "--data", text, "--out", str(out)]
    _bad(capsys, [*base, "--set", "n_layers=3"], "unknown field 'n_layers'")
    _bad(capsys, [*base, "--set", "n_layer=two"], "expected int")
    _bad(capsys, [*base, "--set", "n_embd=30", "--set", "n_head=4"], "divisible by n_head")
    _bad(capsys, [*base, "--steps", "0"], "steps must be a positive integer")
    for flag, name in [("--set=lr_muon=inf", "lr_muon"), ("--set=weight_decay=nan", "weight_decay"),
                       ("--set=tau=inf", "tau"), ("--tau=-inf", "tau"), ("--lr=nan", "lr_muon"),
                       ("--set=lr_adamw=-inf", "lr_adamw"), ("--set=min_lr_ratio=nan", "min_lr_ratio")]:
        _bad(capsys, [*base, "--optimizer", "muon", flag], f"{name} must be a finite number")
    _bad(capsys, ["compare", *TINY, "--data", text, "--out", str(out), "--optimizers", "adamw,sgd"], "'sgd'")
    _bad(capsys, ["compare", *TINY, "--data", text, "--out", str(out), "--sweep", "--sweep-warmups", "10,x"],
         "--sweep-warmups expects")
    _bad(capsys, ["compare", *TINY, "--data", text, "--out", str(out), "--sweep-warmups", "10"], "needs --sweep")
    _bad(capsys, ["compare", *TINY, "--data", text, "--out", str(out), "--jobs", "0"], "--jobs must be >= 1")
    _bad(capsys, [*base, "--set", "budgets=1.5,3"], "one of them 1")
    _bad(capsys, [*base, "--set", "lr_adamw_budgets=1e-3"], "one rate > 0 per budget")
    _bad(capsys, [*base, "--set", "grad_clip=-1"], "grad_clip must be >= 0")
    _bad(capsys, ["compare", *TINY, "--data", text, "--out", str(out), "--set", "lr_muonclip=nan"],
         "lr_muonclip must be a finite number")
    assert not out.exists()


def test_unwritable_out(tmp_path, capsys, text):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    _bad(capsys, ["train", *TINY, "--data", text, "--out", str(blocker / "run")], "is a file, not a folder")
    _bad(capsys, ["compare", *TINY, "--data", text, "--out", str(blocker / "run")], "is a file, not a folder")
    if os.geteuid() != 0:  # root ignores permissions
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            _bad(capsys, ["train", *TINY, "--data", text, "--out", str(locked / "run")], "permission denied")
            assert list(locked.iterdir()) == []
        finally:
            locked.chmod(0o700)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] + (["locked"] if os.geteuid() else [])


def test_existing_output_is_never_overwritten(tmp_path, capsys, text):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", text, "--steps", "2", "--out", str(run)]) == 0
    before = snapshot(run)
    _bad(capsys, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(run)], "already holds a run")
    _bad(capsys, ["compare", *TINY, "--data", text, "--steps", "2", "--out", str(run)], "already holds a run")
    assert snapshot(run) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _bad(capsys, ["compare", *TINY, "--data", text, "--steps", "2", "--out", str(other)], "is not empty")
    assert snapshot(other) == {"notes.txt": b"mine"}


def test_bad_checkpoints_on_resume(tmp_path, capsys, text):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", text, "--optimizer", "adamw", "--steps", "2", "--out", str(run)]) == 0
    before = snapshot(run)
    resume = ["train", "--quiet", "--out", str(run), "--resume"]
    _bad(capsys, [*resume, "--optimizer", "muon"], "'adamw' run, this run uses 'muon'")
    _bad(capsys, [*resume, "--set", "n_layer=3"], "--resume cannot change n_layer (n_layer: checkpoint 2, asked 3 (it "
                                                  "fixes the model's shape))")
    _bad(capsys, [*resume, "--preset", "tiny"], "--preset cannot be used with --resume")
    assert snapshot(run) == before

    name = "checkpoint-step2.pt"
    (run / name).write_bytes(before[name][: len(before[name]) // 2])  # torn
    torn = snapshot(run)
    _bad(capsys, resume, f"{name} has {len(before[name]) // 2} bytes, its manifest (checkpoint.json) says")
    assert snapshot(run) == torn


def test_presets_are_valid_and_the_stability_segment_removes_weight_decay():
    from muonclip.app.compare_runs import stability_config

    for name in ("default", "tiny", "k2-mini"):
        make_config(name)
    d = make_config("default")
    s = stability_config(d)
    assert s.weight_decay == 0.0 and d.weight_decay > 0 and s.lr_muon == s.lr_muonclip > d.lr_muon
    assert s.min_lr_ratio == 1.0 and s.tau == d.stability_tau < d.tau and s.steps == d.stability_steps
    assert s.warmup("muon") == s.warmup("muonclip") == d.warmup("muon")
    k2 = make_config("k2-mini")
    assert k2.attention == "mla" and k2.n_expert > k2.n_expert_active >= 1


def test_train_validation_every_step_changes_nothing_and_feeds_no_recorder(tmp_path, text, monkeypatch):
    """`muonclip train` validating after every step ends bit-identical to the same run validating
    only at the end (weights and every row's max logits and clipped heads), with the clip firing:
    validation runs in eval mode under no_grad, so no recorder is fed (counted here), and it draws
    no random numbers (no dropout; the batches depend only on the seed and the step)."""
    from muonclip.attention import MaxLogitRecorder

    real_evaluate, real_update = train_mod.evaluate, MaxLogitRecorder.update
    counts = {"evaluations": 0, "fed": 0, "inside": False}

    def evaluate(model, batches):
        counts["evaluations"] += 1
        counts["inside"] = True
        try:
            return real_evaluate(model, batches)
        finally:
            counts["inside"] = False

    def update(self, per_head_max, is_bound=None):
        counts["fed"] += counts["inside"]
        real_update(self, per_head_max, is_bound)

    monkeypatch.setattr(train_mod, "evaluate", evaluate)
    monkeypatch.setattr(MaxLogitRecorder, "update", update)
    args = ["train", *TINY, "--data", text, "--optimizer", "muonclip", "--steps", "4", "--tau", "0.05"]
    assert main([*args, "--set", "eval_every=100", "--out", str(tmp_path / "rarely")]) == 0
    assert counts["evaluations"] == 1
    assert main([*args, "--set", "eval_every=1", "--out", str(tmp_path / "often")]) == 0
    assert counts["evaluations"] == 1 + 4 and counts["fed"] == 0
    rarely, often = read_rows(tmp_path / "rarely"), read_rows(tmp_path / "often")
    assert [r["val_loss"] is not None for r in often] == [True] * 4
    assert [(r["max_logits"], r["clipped"]) for r in rarely] == [(r["max_logits"], r["clipped"]) for r in often]
    assert sum(r["clipped_heads"] for r in often) > 0
    a, b = final_file(tmp_path / "rarely"), final_file(tmp_path / "often")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


def test_set_values_are_parsed_by_the_fields_own_types():
    """``--set`` reads each value as its RunConfig field's annotated type (``typing.get_type_hints``)."""
    cfg = make_config("tiny", sets=["n_kv_head=1", "qk_norm=yes", "lr_muon=2e-2", "orth_dtype=float32",
                                    "data=plays.txt", "steps=7"])
    assert (cfg.n_kv_head, cfg.qk_norm, cfg.lr_muon, cfg.orth_dtype, cfg.data, cfg.steps) == (
        1, True, 0.02, "float32", "plays.txt", 7)
    assert make_config("tiny", sets=["n_kv_head=None", "data=none", "qk_norm=off"]).n_kv_head is None
    assert make_config("tiny", sets=["data=none"]).data is None
    for item, expected in [("n_kv_head=two", "expected int | None"), ("qk_norm=maybe", "expected bool"),
                           ("steps=7.5", "expected int"), ("lr_adamw=fast", "expected float"),
                           ("steps=none", "expected int")]:
        with pytest.raises(ValueError, match=f"--set {item}: {expected}$"):
            make_config("tiny", sets=[item])


def test_summary_marks_max_logits_that_are_lse_bounds():
    """A max logit MuonClip logged as an LSE upper bound (at or below tau) carries the flag into
    the run's figures and a "≤" into the stability table; exact values print as they are."""
    from muonclip.app.report import stability_markdown, summarize_run

    rows = [{"step": 1, "tokens": 10, "val_loss": 3.0, "max_logit": 9.0, "max_logit_is_bound": 0, "clipped_heads": 1,
             "step_time": 0.1, "elapsed": 1.0},
            {"step": 2, "tokens": 20, "val_loss": 2.0, "max_logit": 7.5, "max_logit_is_bound": 1, "clipped_heads": 0,
             "step_time": 0.1, "elapsed": 2.0}]
    s = summarize_run(rows)
    assert s["peak_max_logit_is_bound"] is False and s["final_max_logit_is_bound"] is True
    row = {"optimizer": "muonclip", "peak_max_logit": [9.0, 8.0], "peak_after_first_clip": [7.5, 6.0],
           "peak_after_first_clip_is_bound": [True, False], "clip_events": [1, 1], "clip_steps": [1, 1],
           "clip_events_per_layer": [2], "final_val_loss": [2.0, 2.0], "mean": 2.0, "sd": 0.0}
    table = stability_markdown({"tau": 7.5, "seeds": [0, 1], "table": [row]})
    assert "| ≤ 7.5 (1.00x) |" in table
    row["peak_after_first_clip_is_bound"] = [False, True]
    assert "| 7.5 (1.00x) |" in stability_markdown({"tau": 7.5, "seeds": [0, 1], "table": [row]})


def test_bad_options_exit_2_naming_the_option(tmp_path, capsys, text):
    """On the old code: --tp 0 was a ZeroDivisionError (exit 1) and a seed past 64 bits 'Overflow when
    unpacking long long' (no option named)."""
    out = tmp_path / "run"
    base = ["train", *TINY, "--data", text, "--steps", "2", "--out", str(out)]
    _bad(capsys, [*base, "--tp", "0"], "--tp must be a whole number of ranks >= 1, got 0")
    _bad(capsys, [*base, "--seed", str(10**23)], "seed (--seed) must be a whole number from 0 to 2**62 - 1")
    _bad(capsys, [*base, "--timeout", "0"], "--timeout must be a number of seconds > 0")
    assert not out.exists()


def test_too_many_threads_exit_2_naming_the_option(tmp_path):
    """--threads 100000 crashed the thread pool (a segfault, exit 139, on the old code: so in a subprocess)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "muonclip.app", "train", "--preset", "tiny", "--quiet", "--steps", "2",
                           "--threads", "100000", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert f"--threads 100000: this machine has {len(os.sched_getaffinity(0))} cores for this process" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_full_disk_during_a_save_exits_2_and_keeps_the_last_checkpoint(tmp_path, capsys, text, monkeypatch):
    """ENOSPC from the second checkpoint's write (as a 600 KB tmpfs gives it: torch.save's zip writer
    then raises a RuntimeError over the OSError): exit 2 naming --out and the cause, the checkpoint of
    step 2 kept and verified, no temporary left. On the old code: a traceback, exit 1."""
    import muonclip.app.checkpoint_write as ckpt
    from muonclip.app.checkpoints import verify

    real, calls = ckpt.torch.save, {"n": 0}

    def full_disk(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    out = tmp_path / "run"
    _bad(capsys, ["train", *TINY, "--data", text, "--steps", "6", "--set", "checkpoint_every=2", "--out", str(out)],
         f"--out {out}: cannot write the checkpoint of step 4 (No space left on device); the checkpoint of step 2 "
         "is kept")
    found = read_checkpoint(out)
    verify(found)
    assert found.step == 2 and sorted(p.name for p in out.iterdir()) == [
        ".lock", "checkpoint-step2.pt", "checkpoint.json", "config.json", "metrics.csv", "metrics.jsonl"]
    monkeypatch.undo()
    assert main(["train", "--quiet", "--out", str(out), "--resume"]) == 0
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4, 5, 6]


def test_a_damaged_metrics_line_on_resume_names_the_file(tmp_path, capsys, text):
    """A torn last line (a write cut by a kill) is skipped; a bad line elsewhere is exit 2 naming the
    file and line (on the old code: exit 2 with only json's message, no file)."""
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", text, "--steps", "3", "--out", str(out)]) == 0
    jsonl = out / "metrics.jsonl"
    jsonl.write_text(jsonl.read_text() + '{"step": 4, "loss": 2.')  # torn
    assert main(["train", "--quiet", "--out", str(out), "--resume", "--steps", "4"]) == 0
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4]
    lines = jsonl.read_text().splitlines()
    jsonl.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    _bad(capsys, ["train", "--quiet", "--out", str(out), "--resume", "--steps", "5"],
         f"{jsonl}, line 2, is not a metrics row")


def test_settings_no_step_can_run_with_exit_2_before_anything_is_written(tmp_path, capsys, text):
    """Learning rates whose step coefficients overflow float32, and whole numbers past 2**62: on the old
    code --set lr_muonclip=1e39 (or 1e308, lr_adamw=1e39) passed, wrote config.json and the metrics, then
    died in the first step with a traceback, leaving a folder both --resume and a new run refused; and
    --set block_size=100000000000000000000000 was an OverflowError traceback."""
    out = tmp_path / "out"
    base = ["train", *TINY, "--data", text, "--out", str(out)]
    _bad(capsys, [*base, "--set", "lr_muonclip=1e39"], "lr_muonclip: lr=1e+39 is too large: the step multiplies it "
         "by its largest update scale (2.263), which gives 2.263e+39, beyond the largest value of the parameters' "
         "dtype (3.403e+38); use lr <= 1.504e+38")
    _bad(capsys, [*base, "--set", "lr_muonclip=1e308"], "lr_muonclip: lr=1e+308 is too large")
    _bad(capsys, [*base, "--set", "lr_adamw=1e39"], "lr_adamw: lr=1e+39 is too large: the step multiplies it by "
         "1 / (1 - beta1), AdamW's first bias correction (10)")
    _bad(capsys, [*base, "--optimizer", "muon", "--lr", "1e39"], "lr_muon: lr=1e+39 is too large")
    _bad(capsys, [*base, "--set", "stability_lr=1e39"], "stability_lr: lr=1e+39 is too large")
    _bad(capsys, [*base, "--set", "lr_adamw_budgets=0.01,1e39"], "lr_adamw_budgets: lr=1e+39 is too large")
    _bad(capsys, [*base, "--set", "weight_decay=1e300"], "the step multiplies it by weight_decay (1e+300)")
    _bad(capsys, [*base, "--set", "aux_loss_weight=1e39"], "aux_loss_weight must be at most 3.403e+38")
    for field in ("block_size", "n_expert", "steps", "eval_batches"):
        _bad(capsys, [*base, "--set", f"{field}={10**23}"], f"{field} must be at most 4611686018427387904 (2**62), "
             f"got {10**23}")
    _bad(capsys, ["compare", *TINY, "--data", text, "--out", str(out), "--set", "lr_muon=1e39"],
         "lr_muon: lr=1e+39 is too large")
    assert not out.exists()
    # just below the limit the step runs (no overflow in it); the weights it makes are not finite, which the run's
    # own guard reports (exit 3), and the folder restarts with a sane rate
    _bad(capsys, [*base, "--steps", "1", "--set", "lr_muonclip=1.5e38"], "non-finite validation loss", code=3)
    assert main(["train", "--quiet", "--out", str(out), "--resume", "--set", "lr_muonclip=0.02"]) == 0
