"""`muonclip compare --preset guards` / ``guards-mla``: the guards of the attention logits side by side, shrunk
to seconds. The structure of the runs and of the report, and the figures' invariants (not their values):
each arm's config, the soft cap's capped peak, the interleaved step cost's reference, divergence kept."""

from __future__ import annotations

import json
import math
import re

import pytest

from muonclip.app.config import make_config
from muonclip.app.guards import MHA_ARMS, MLA_ARMS, arm_config, step_costs
from muonclip.app.main import main
from muonclip.app.metrics import read_rows
from muonclip.app.report.guards import guard_figures, guards_markdown, held

TINY = ["--set", "block_size=16", "--set", "batch_size=4", "--set", "eval_every=2", "--set", "eval_batches=1",
        "--set", "stability_steps=4", "--set", "stability_tau=0.3", "--set", "stability_tuned_tau=0.3",
        "--set", "attn_softcap=0.2"]


@pytest.fixture(scope="module")
def guards_run(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("guards") / "cmp"
    rc = main(["compare", "--preset", "guards", "--quiet", "--threads", "1", "--jobs", "1", "--data", text,
               "--set", "n_embd=16", "--set", "seeds=2", *TINY, "--out", str(out)])
    assert rc == 0
    return out


def test_every_arm_trains_every_segment_and_seed_with_its_own_guard(guards_run):
    cfg = json.loads((guards_run / "summary.json").read_text())["config"]
    for segment, lr_muon, adamw_factor in (("excessive", 0.1, 0.1 / 0.04), ("tuned", 0.04, 1.0)):
        for arm in MHA_ARMS:
            for seed in (0, 1):
                saved = json.loads((guards_run / segment / f"{arm.name}-s{seed}" / "config.json").read_text())
                assert saved["optimizer"] == arm.optimizer and saved["seed"] == seed
                assert saved["qk_norm"] == arm.qk_norm and saved["attn_softcap"] == (0.2 if arm.softcap else 0.0)
                assert (saved["steps"], saved["weight_decay"], saved["min_lr_ratio"]) == (4, 0.0, 1.0)
                assert saved["lr_muon"] == lr_muon and saved["tau"] == 0.3
                assert saved["lr_adamw"] == pytest.approx(cfg["lr_adamw"] * (adamw_factor if arm.optimizer == "adamw"
                                                                             else 1.0), rel=1e-12)
                assert read_rows(guards_run / segment / f"{arm.name}-s{seed}")[-1]["step"] == 4


def test_the_report_has_a_row_per_arm_and_the_figures_keep_their_invariants(guards_run):
    data = json.loads((guards_run / "summary.json").read_text())
    md = (guards_run / "summary.md").read_text()
    assert set(data["segments"]) == {"excessive", "tuned"}
    for segment, fig in data["segments"].items():
        assert list(fig["arms"]) == [a.name for a in MHA_ARMS] and fig["seeds"] == [0, 1]
        for arm in MHA_ARMS:
            entry = fig["arms"][arm.name]
            rows = {s: read_rows(guards_run / segment / f"{arm.name}-s{s}") for s in (0, 1)}
            assert entry["peak_max_logit"] == [max(r["max_logit"] for r in rows[s]) for s in (0, 1)]
            assert entry["final_val_loss"] == [rows[s][-1]["val_loss"] for s in (0, 1)]
            assert entry["diverged_at"] == [None, None]
            capped = [0.2 * math.tanh(p / 0.2) if arm.softcap else p for p in entry["peak_max_logit"]]
            assert entry["softmax_peak"] == pytest.approx(capped, rel=1e-12)
            muon = fig["arms"]["muon"]["final_val_loss"]
            assert entry["minus_muon"] == pytest.approx([a - b for a, b in zip(entry["final_val_loss"], muon)])
        cost = fig["step_cost"]
        assert set(cost) == {a.name for a in MHA_ARMS} and all(c["rounds"] == 4 for c in cost.values())
        assert cost["muon"]["ratio"] == 1.0  # every round's Muon step over itself
        assert all(c["ratio_q1"] <= c["ratio"] <= c["ratio_q3"] for c in cost.values())
        assert fig["arms"]["muon-softcap"]["softmax_peak"][0] < 0.2  # the softmax never sees c or more
    sections = re.findall(r"^## (.*)$", md, flags=re.M)
    assert sections == ["The excessive rate: Muon's arms at lr 0.1 (2.5 times Muon's tuned rate, 0.04), AdamW's at "
                        "0.08485 (the same multiple of its own 0.03394); tau 0.3, c 0.2",
                        "Muon's tuned rate: Muon's arms at lr 0.04, AdamW's at its own 0.03394; tau 0.3, c 0.2"]
    for label in (a.label for a in MHA_ARMS):
        assert md.count(f"| {label} |") == 2
    assert "In short:" in data["reading"] and "At the excessive rate:" in data["reading"]
    assert "interleaved" in md and (guards_run / "max_logit.png").stat().st_size > 10_000


def test_the_mla_arms_on_k2_minis_model_say_how_qk_norm_is_defined_there(tmp_path, text):
    """k2-mini's MLA model: Muon's four arms, one seed, its hand-set rate never called tuned, and the note on what
    QK-Norm means on MLA."""
    out = tmp_path / "mla"
    rc = main(["compare", "--preset", "guards-mla", "--quiet", "--threads", "1", "--jobs", "1", "--data", text,
               "--set", "seeds=1", "--set", "expert_hidden=8", "--set", "stability_segments=tuned", *TINY,
               "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "summary.json").read_text())
    assert list(data["segments"]["tuned"]["arms"]) == [a.name for a in MLA_ARMS]
    saved = json.loads((out / "tuned" / "muon-qknorm-s0" / "config.json").read_text())
    assert (saved["attention"], saved["qk_norm"], saved["n_expert"]) == ("mla", True, 8)
    md = (out / "summary.md").read_text()
    assert "non-rotary q^C and k^C of each head" in md and "why Kimi K2 chose QK-Clip" in md
    assert "Muon's hand-set, untuned rate" in md and "Muon's tuned" not in md
    assert "final val loss (one seed)" in md and "± 0.0000" not in md and "1 seeds" not in md


def _run(folder, logits, losses):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for i, (m, v) in enumerate(zip(logits, losses)):
            f.write(json.dumps({"step": i + 1, "tokens": i + 1, "val_loss": v, "max_logit": m, "clipped_heads": 0,
                                "clipped": [0], "step_time": 0.01, "elapsed": i + 1.0}) + "\n")
    return folder


def test_a_diverged_seed_is_reported_not_dropped(tmp_path):
    """Seed 1 of plain Muon diverged at step 3 (its metrics stop at step 2): its loss is left out of the mean and
    named in the table, and the arm does not count as holding the logits."""
    arms = MHA_ARMS[:2]
    runs = {("muon", 0): (_run(tmp_path / "m0", [10, 50, 200], [2.5, 2.2, 2.1]), None),
            ("muon", 1): (_run(tmp_path / "m1", [10, 80], [2.5, 2.4]), 3),
            ("muonclip", 0): (_run(tmp_path / "c0", [10, 31, 32], [2.5, 2.2, 2.0]), None),
            ("muonclip", 1): (_run(tmp_path / "c1", [10, 33, 31], [2.5, 2.3, 2.05]), None)}
    fig = guard_figures(runs, arms, 30.0, 30.0)
    muon, clip = fig["arms"]["muon"], fig["arms"]["muonclip"]
    assert muon["final_val_loss"] == [2.1, None] and muon["mean"] == 2.1 and muon["diverged_at"] == [None, 3]
    assert clip["minus_muon"] == [pytest.approx(-0.1), None]
    assert not held(muon, 30.0) and held(clip, 30.0)
    md = guards_markdown(fig, arms)
    assert "| Muon, no guard | 200.0 (2.67–6.67x) | 200.0 | 2.1000 (1 of 2) | 2.1000, div. |  | - | seed 1 at step 3 |" in md
    assert "| MuonClip (Muon + QK-Clip) | 33.0 (1.07–1.10x) | 33.0 | 2.0250 ± 0.0354 | 2.0000, 2.0500 | -0.1000 (1 of 2) |" in md


def test_the_step_cost_is_against_plain_muon_in_the_same_rounds(tmp_path, text):
    """Two identical Muon runs and a MuonClip run timed interleaved: each one's ratio to the reference is
    measured round by round (the reference's own is exactly 1), from the runs' checkpoints; MuonClip's step
    with the capture its clip reads."""
    from muonclip.app.data import load_corpus
    from muonclip.app.runner import RunSpec, run_all

    cfg = make_config("guards", sets=["n_embd=16", "block_size=16", "batch_size=4", "stability_steps=2",
                                      "eval_every=2", "eval_batches=1", f"data={text}"])
    corpus = load_corpus(cfg.data, cfg.val_fraction)
    c = arm_config(cfg, MHA_ARMS[0], "tuned")
    specs = {name: RunSpec(c, opt, tmp_path / name, name) for name, opt in (("muon", "muon"), ("again", "muon"),
                                                                            ("clip", "muonclip"))}
    run_all(list(specs.values()), corpus, progress=False)
    cost = step_costs(specs, corpus, 3)
    assert cost["muon"]["ratio"] == 1.0 and all(c["rounds"] == 3 for c in cost.values())
    assert all(c["ratio"] > 0 and c["median_ms"] > 0 for c in cost.values())


@pytest.mark.parametrize(("argv", "match"), [
    (["--preset", "guards", "--set", "attn_softcap=0"], "the soft-capping arm needs its cap, attn_softcap > 0"),
    (["--preset", "guards", "--set", "stability_steps=0"], "trains the stability segments"),
    (["--preset", "guards", "--sweep"], "runs its own protocol .*--optimizers and --sweep do not apply"),
    (["--preset", "ladder", "--optimizers", "adamw,muon,normuon"], "runs its own protocol"),
    (["--preset", "guards", "--set", "attn_softcap=-1"], "attn_softcap must be >= 0"),
])
def test_settings_the_presets_cannot_run_are_refused_before_anything_is_written(tmp_path, capsys, argv, match):
    out = tmp_path / "never"
    assert main(["compare", *argv, "--quiet", "--out", str(out)]) == 2
    assert re.search(match, capsys.readouterr().err) and not out.exists()


@pytest.mark.parametrize("preset", ["guards", "guards-mla", "ladder", "finetune"])
def test_the_standard_protocol_refuses_a_preset_with_its_own(tmp_path, preset):
    """`muonclip.app.compare.compare` runs the standard protocol only: called from Python with a preset that runs
    its own (`muonclip.app.compare_runs.OWN_PROTOCOL`, dispatched by `muonclip compare`), it names the module and
    the command, before anything is written (it used to dispatch there itself)."""
    from muonclip.app.compare import compare
    from muonclip.app.compare_runs import OWN_PROTOCOL
    from muonclip.app.config import make_config

    out = tmp_path / "never"
    with pytest.raises(ValueError, match=rf"--preset {preset} runs its own protocol \({OWN_PROTOCOL[preset]}\).*"
                                         rf"muonclip compare --preset {preset}"):
        compare(make_config(preset), out)
    assert not out.exists()
