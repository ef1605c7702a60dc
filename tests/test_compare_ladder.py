"""`muonclip compare --preset ladder`: the budget-matched ratio at three widths, shrunk to seconds. The rungs'
sizes and schedules (the same tokens per parameter), each rung's rates bracketed around the rung below's best
and used by its reported runs, the report's structure and its reading on synthetic figures (not the values of
a real run)."""

from __future__ import annotations

import json
import math

import pytest

from muonclip.app import ladder
from muonclip.app.config import make_config
from muonclip.app.main import main
from muonclip.app.model import parameter_count
from muonclip.app.report.ladder import WEN_2025, ladder_markdown, ladder_reading, ratio_text, slope
from muonclip.app.sweep import SQRT2


def test_the_default_ladder_keeps_tokens_per_parameter_and_schedule_shares():
    """1x, 1.5x, 2x the default model's width and heads (head width 32, 2 layers): 115k, 246k, 427k
    parameters; steps in proportion to the parameters (the same tokens per parameter to within one step's
    rounding), warm-ups and eval interval the same share of the run."""
    cfg = make_config("ladder")
    rungs = ladder.rungs(cfg)
    assert [(r.cfg.n_embd, r.cfg.n_head, r.cfg.n_layer) for r in rungs] == [(64, 2, 2), (96, 3, 2), (128, 4, 2)]
    assert [r.params for r in rungs] == [parameter_count(r.cfg) for r in rungs] and rungs[0].params == 115008
    per_param = [r.cfg.steps / r.params for r in rungs]
    for r, p in zip(rungs, per_param):
        assert abs(p - per_param[0]) * r.params <= 0.5  # round(steps) at most half a step off
        assert r.cfg.warmup("adamw") == round(200 * r.cfg.steps / 400) and r.cfg.warmup("muon") == round(
            20 * r.cfg.steps / 400)
        assert r.cfg.budgets == (1.0, 1.5, 2.0, 3.0) and r.cfg.lr_adamw_budgets == ()
    assert [r.cfg.steps for r in rungs] == [400, 856, 1484]
    # 3 seeds and 5-point grids below the largest rung; one seed and a 3-point grid at it
    assert [(r.cfg.seeds, r.points) for r in rungs] == [(3, 5), (3, 5), (1, 3)]
    assert [r.cfg.seeds for r in ladder.rungs(make_config("ladder", sets=["seeds=1"]))] == [1, 1, 1]


def test_a_width_factor_that_splits_a_head_is_refused():
    with pytest.raises(ValueError, match=r"width factor 1\.5 of n_embd 64 and n_head 1 gives 96 and 1\.5"):
        ladder.rungs(make_config("ladder", sets=["n_head=1"]))
    with pytest.raises(ValueError, match="budgets needs 1 and at least one larger budget"):
        ladder.check(make_config("ladder", sets=["budgets=1"]))


@pytest.fixture(scope="module")
def ladder_run(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("ladder") / "cmp"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ladder, "MAX_EXTENSIONS", 1)  # 4 steps: the best rate is the highest; one extension shows it
        rc = main(["compare", "--preset", "ladder", "--quiet", "--threads", "1", "--jobs", "1", "--data", text,
                   "--steps", "4", "--set", "n_embd=16", "--set", "block_size=16", "--set", "batch_size=2",
                   "--set", "eval_every=4", "--set", "eval_batches=1", "--set", "seeds=1", "--set", "budgets=1,2",
                   "--set", "warmup_adamw=2", "--set", "warmup_muon=1", "--out", str(out)])
    assert rc == 0
    return out


def test_each_rung_brackets_its_rates_around_the_rung_below_and_reports_with_them(ladder_run):
    data = json.loads((ladder_run / "summary.json").read_text())
    rungs = data["rungs"]
    assert [r["n_embd"] for r in rungs] == [16, 24, 32] and data["rungs_planned"] == 3
    centre = {"adamw": data["config"]["lr_adamw"], "muon": data["config"]["lr_muon"]}
    for r in rungs:
        sweep = json.loads((ladder_run / f"width{r['n_embd']}" / "sweep" / "sweep.json").read_text())
        for opt in ("adamw", "muon"):
            rates = sorted(p["lr"] for p in sweep["points"] if p["optimizer"] == opt)
            assert len(rates) >= r["points"] and all(p["seeds"] == [1000] for p in sweep["points"])
            # the first grid: 5 points (3 at the largest rung) sqrt 2 apart centred on the rung below's best (the
            # config's at the first)
            half = r["points"] // 2
            assert all(any(math.isclose(x, centre[opt] * SQRT2**k, rel_tol=1e-9) for x in rates)
                       for k in range(-half, half + 1))
            assert r["lr"][opt] in rates and (rates[0] < r["lr"][opt] < rates[-1]) == r["bracketed"][opt]
        for name, opt, budget in (("muon-x1-s0", "muon", 1), ("adamw-x1-s0", "adamw", 1), ("adamw-x2-s0", "adamw", 2)):
            saved = json.loads((ladder_run / f"width{r['n_embd']}" / "runs" / name / "config.json").read_text())
            assert saved[f"lr_{opt}"] == r["lr"][opt] and saved["steps"] == r["steps"] * budget
            assert saved["n_embd"] == r["n_embd"]
        centre = r["lr"]


def test_the_report_has_a_row_per_rung_the_plot_and_the_published_points(ladder_run):
    md = (ladder_run / "summary.md").read_text()
    assert md.count("\n| 16 x 2 |") == md.count("\n| 24 x 3 |") == md.count("\n| 32 x 4 |") == 1
    assert "| AdamW 1x (one seed) | AdamW 2x (one seed) | Muon 1x (one seed) |" in md
    assert "finished: 3 of 3 rungs" in md and "AdamW at its 1x rate at every budget" in md
    assert "Wen et al. 2025" in md and "± 0.0000" not in md and "1 seeds" not in md
    assert (ladder_run / "ratio_vs_params.png").stat().st_size > 10_000


def _rung(params, per_seed, mean, top=3.0):
    eff = {"seeds": list(range(len(per_seed))), "budgets": [1.0, 2.0, 3.0], "table": [
        {"optimizer": o, "budget": b, "final_val_loss": [2.0] * len(per_seed)} for o, b in
        (("adamw", 1.0), ("adamw", 2.0), ("adamw", 3.0), ("muon", 1.0))],
        "ratios": {"muon": {"budget_matched": mean, "budget_matched_per_seed": per_seed, "max_budget": top}}}
    return {"n_embd": 64, "n_head": 2, "params": params, "steps": 400, "tokens": 7 * params,
            "tokens_per_param": 7.0, "lr": {"adamw": 0.03, "muon": 0.04}, "bracketed": {"adamw": True, "muon": False},
            "efficiency": eff}


def test_the_reading_judges_the_trend_by_the_seed_spread():
    """Known answers: a fall from 2.56 (2.44–2.64) to 1.80 (1.7–1.9) with every seed apart is beyond the spread,
    -0.38 per doubling over 4x the parameters; overlapping seeds are not; a rung beyond the largest budget is a
    lower bound, never a number."""
    falling = [_rung(100_000, [2.44, 2.57, 2.64], 2.56), _rung(400_000, [1.7, 1.8, 1.9], 1.80)]
    assert slope(falling) == pytest.approx((1.80 - 2.56) / 2)
    text = ladder_reading(falling, 2)
    assert "0.100M parameters: about 2.6x (2.4–2.6 per seed); 0.400M parameters: about 1.8x (1.7–1.9 per seed)" in text
    assert "moves by -0.8 (2.4–2.6 per seed at the smallest, 1.7–1.9 at the largest); every seed of the largest " \
           "width is below every seed of the smallest, a fall beyond the seed spread; least squares over the widths: " \
           "-0.38 per doubling" in text
    assert "Not extrapolated" in text and "1.4x at 0.1B" in text and "1.1x at 1.2B" in text
    overlapping = [_rung(100_000, [2.2, 2.6, 3.0], 2.6), _rung(400_000, [2.0, 2.3, 2.7], 2.3)]
    assert "the per-seed ranges overlap, so no change beyond the seed spread" in ladder_reading(overlapping, 3)
    assert "Only 2 of the 3 widths finished" in ladder_reading(overlapping, 3)
    assert ratio_text(_rung(1, [None], None)["efficiency"]) == "> 3x"
    assert ratio_text(_rung(1, [2.5, None], 2.9)["efficiency"]) == "about 2.9x on the means (> 3x for 1 of 2 seeds)"
    md = ladder_markdown(falling)
    assert "| 64 x 2 | 0.100M | 400 | 3 | 0.70M (7.0) | 0.03 | 0.04 (at an edge) |" in md
    # one seed at the largest rung: where it lies against the smallest's seeds, never a spread of its own
    top_one = [_rung(100_000, [2.44, 2.57, 2.64], 2.56), _rung(400_000, [1.8], 1.8)]
    text = ladder_reading(top_one, 2)
    assert "(3 seeds at 0.100M, one seed at 0.400M, 7.0 tokens per parameter" in text
    assert "0.400M parameters: about 1.8x (one seed: no spread measured)" in text
    assert "the largest width's one seed is below every seed of the smallest, a fall suggested but not " \
           "established (one seed: the largest width's own spread is not measured)" in text
    assert "within the smallest's per-seed range, so no change beyond the seed spread" in ladder_reading(
        [_rung(100_000, [2.44, 2.57, 2.64], 2.56), _rung(400_000, [2.5], 2.5)], 2)
    # beyond AdamW's largest budget at one seed: the margin it misses by, the bound against the smallest's seeds
    beyond = _rung(400_000, [None], None)
    beyond["efficiency"]["table"][2]["final_val_loss"] = [2.0003]  # AdamW 3x, 0.0003 above Muon's 2.0
    text = ladder_reading([_rung(100_000, [2.44, 2.57, 2.64], 2.56), beyond], 2)
    assert "0.400M parameters: > 3x" in text
    assert "At 0.400M parameters AdamW at its largest budget, 3x, ends +0.0003 nats from Muon's 1x loss (one " \
           "seed): the ratio is above 3x, by an amount the budgets run cannot measure; that bound is above every " \
           "seed of the smallest width (2.4–2.6x), so the ratio does not fall across the ladder (one seed at this " \
           "width: suggested, not established)." in text
    md = ladder_markdown(top_one)
    assert "(mean ± sd; one seed: the value)" in md and "| 1 | 2.80M (7.0) |" in md
    assert WEN_2025 == ((130e6, 1.4), (1.2e9, 1.1))


def test_a_ladder_stopped_part_way_leaves_the_rungs_it_finished_and_goes_on_from_them(tmp_path, text, monkeypatch):
    """The report is rewritten after each rung: stopped while tuning the second rung, it holds the first. Run
    again into the same folder with the same settings, the first rung is read (not tuned, not rerun: its runs'
    files untouched) and the other two run; other settings, or a folder holding something else, are refused
    before anything is written."""
    real = ladder.tune
    calls = []

    def stop_at_the_second_rung(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ladder, "tune", stop_at_the_second_rung)
    monkeypatch.setattr(ladder, "MAX_EXTENSIONS", 0)
    out = tmp_path / "part"
    args = ["compare", "--preset", "ladder", "--quiet", "--threads", "1", "--jobs", "1", "--data", text,
            "--steps", "3", "--set", "n_embd=16", "--set", "block_size=16", "--set", "batch_size=2",
            "--set", "eval_every=3", "--set", "eval_batches=1", "--set", "seeds=2", "--set", "budgets=1,2",
            "--set", "warmup_adamw=1", "--set", "warmup_muon=1", "--out", str(out)]
    assert main(args) == 130
    md = (out / "summary.md").read_text()
    assert "finished: 1 of 3 rungs" in md and "Only 1 of the 3 widths finished." in md
    assert "\n| 16 x 2 |" in md and "\n| 24 x 3 |" not in md
    first = json.loads((out / "summary.json").read_text())["rungs"][0]
    kept = {p: p.stat().st_mtime_ns for p in (out / "width16").rglob("*") if p.is_file()}

    assert main([*args[:-1], str(out), "--set", "lr_muon=0.03"]) == 2  # other settings: refused, nothing touched
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    assert main([*args[:-1], str(stray)]) == 2
    assert sorted(p.name for p in stray.iterdir()) == ["notes.txt"]

    calls.clear()
    monkeypatch.setattr(ladder, "tune", real)
    assert main(args) == 0
    data = json.loads((out / "summary.json").read_text())
    assert data["rungs"][0] == first and [r["n_embd"] for r in data["rungs"]] == [16, 24, 32]
    assert {p: p.stat().st_mtime_ns for p in (out / "width16").rglob("*") if p.is_file()} == kept
    assert [r["seeds"] for r in data["rungs"]] == [[0, 1], [0, 1], [0]]  # one seed at the largest rung
    assert [r["points"] for r in data["rungs"]] == [5, 5, 3]
    top = json.loads((out / "width32" / "sweep" / "sweep.json").read_text())["points"]
    assert sorted(p["lr"] for p in top if p["optimizer"] == "muon") == pytest.approx(
        [data["rungs"][1]["lr"]["muon"] * SQRT2**k for k in (-1, 0, 1)], rel=1e-9)
    md = (out / "summary.md").read_text()
    assert "finished: 3 of 3 rungs (1 read from this folder" in md
    assert "2 seeds (0, 1) at 16, 2 seeds (0, 1) at 24, seed 0 at 32" in md
    assert "5 points at 16, 5 points at 24, 3 points at 32" in md
    assert "(mean ± sd; one seed: the value)" in md and "± 0.0000" not in md and "1 seeds" not in md
