"""`muonclip compare --preset k2-mini`: MLA with decoupled RoPE and a mixture of experts, shrunk to
seconds. MuonClip clips MLA heads by Kimi K2's rule (measured on the weights), and Muon moves every
expert of a 3-D stack by its own orthogonalised update (per-expert update RMS)."""

from __future__ import annotations

import json

import pytest

from muonclip.app.data import builtin_corpus_dir, read_document
from muonclip.app.main import main
from muonclip.app.metrics import read_rows
from muonclip.app.probes import k2_rule_error


@pytest.fixture(scope="module")
def k2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("k2")
    text = root / "macbeth.txt"
    text.write_text(read_document(builtin_corpus_dir() / "tragedies" / "macbeth.md"))
    out = root / "cmp"
    rc = main(["compare", "--preset", "k2-mini", "--quiet", "--threads", "1", "--jobs", "1", "--data", str(text),
               "--steps", "6", "--set", "block_size=16", "--set", "batch_size=8", "--set", "eval_every=3",
               "--set", "expert_hidden=8",
               "--set", "stability_steps=6", "--set", "stability_tau=0.05", "--out", str(out)])
    assert rc == 0
    return out


def test_k2_mini_clips_mla_heads_by_the_k2_rule(k2_run):
    """Every head clip of MuonClip's runs, measured on the weights: q^C and k^C x sqrt(gamma), q^R x gamma,
    the shared k^R and the values untouched (float32 weights: ratios of norms within 1e-5)."""
    rows = read_rows(k2_run / "stability" / "muonclip-s0")
    events = [e for r in rows for e in r.get("clip_audit", [])]
    assert len(events) == sum(r["clipped_heads"] for r in rows) > 0  # one event per clipped head
    assert {e["layer"] for e in events} == {"blocks.0.attn", "blocks.1.attn"}
    assert all(0 < e["gamma"] < 1 for e in events)
    assert max(k2_rule_error(e) for e in events) < 1e-5
    assert all(abs(e["k_rope"] - 1) < 1e-6 and abs(e["q_rope"] - e["gamma"]) < 1e-5 for e in events)
    assert not any("clip_audit" in r for r in read_rows(k2_run / "stability" / "muon-s0"))
    data = json.loads((k2_run / "summary.json").read_text())
    assert data["clip_audit"]["events"] == len(events)
    assert data["clip_audit"]["max_rule_error"] == pytest.approx(max(k2_rule_error(e) for e in events))
    md = (k2_run / "summary.md").read_text()
    assert "## QK-Clip on MLA heads: Kimi K2's rule, measured" in md
    by = {t["optimizer"]: t for t in data["stability"]["table"]}
    assert by["muonclip"]["clip_events_per_layer"] == [sum(e["layer"] == f"blocks.{i}.attn" for e in events)
                                                       for i in range(2)]


def test_k2_mini_moves_every_expert_by_its_own_orthogonalised_update(k2_run):
    """Per-expert update RMS of the 3-D stacks: under Muon every expert moves by 0.2 x the RMS of its
    orthogonalised momentum's singular values, which lie in about [0.68, 1.13] once the momentum has full
    rank (from step 2 here: an expert's first gradient has the rank of the tokens routed to it), each
    expert on its own; under AdamW the first update is sign(g), RMS 1, for every expert."""
    for run in ("runs/muon-x1-s0", "stability/muonclip-s0"):
        rows = read_rows(k2_run / run)
        assert sorted(rows[0]["expert_rms"]) == [f"blocks.{i}.mlp.experts.{w}" for i in range(2)
                                                 for w in ("w_fc", "w_proj")]
        assert all(len(per) == 8 for r in rows for per in r["expert_rms"].values())
        later = [v for r in rows[1:] for per in r["expert_rms"].values() for v in per]
        assert all(0.2 * 0.68 < v < 0.2 * 1.13 for v in later), later
    adam = read_rows(k2_run / "runs" / "adamw-x1-s0")
    assert all(0.99 < v <= 1.0 for per in adam[0]["expert_rms"].values() for v in per)
    data = json.loads((k2_run / "summary.json").read_text())
    assert {r["run"] for r in data["experts"]} == {"adamw-x1-s0", "muon-x1-s0", "stability muon-s0",
                                                  "stability muonclip-s0"}
    assert "## Experts: each expert's update RMS" in (k2_run / "summary.md").read_text()


def test_k2_mini_report_says_what_its_one_seed_and_hand_set_rates_support(k2_run):
    """k2-mini runs one seed at rates set by hand: its report gives values, not spreads or ranges of one value,
    and never calls Muon's rate tuned."""
    import re

    md = (k2_run / "summary.md").read_text()
    for forbidden in ("± 0.000", "1 seeds", "Muon's tuned", "tuned rate"):
        assert forbidden not in md, forbidden
    assert not re.search(r"(?<![\d.])(\d+(?:\.\d+)?)x?–\1(?![\d.])", md), "a range of one value"
    assert "(one seed, 0)" in md and "final val loss (one seed)" in md and "Muon's rate (not tuned)" in md
