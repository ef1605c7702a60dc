"""The figures of `muonclip compare`'s report, computed from the runs' metrics: final losses with
their spread, the budget-matched and crossing ratios, the wall-clock match, the stability peaks,
and the experts' and MLA clips' probes (the protocol: `muonclip.app.report`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..metrics import read_rows


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for one value)."""
    vals = [float(v) for v in values]
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """``y`` at ``x`` on the piecewise-linear curve through ``(xs, ys)`` (xs increasing); None outside them."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return float(ys[0]) if len(xs) == 1 and x == xs[0] else None


def budget_to_reach(budgets: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """The smallest budget at which the piecewise-linear curve of final ``losses`` against
    ``budgets`` (increasing) first reaches ``target``; ``budgets[0]`` if the first loss already
    does; None if no budget does."""
    if losses[0] <= target:
        return float(budgets[0])
    for (b0, l0), (b1, l1) in zip(zip(budgets, losses), zip(budgets[1:], losses[1:])):
        if l1 <= target:
            return b0 + (b1 - b0) * (l0 - target) / (l0 - l1)
    return None


def tokens_to_reach(rows: list[dict[str, Any]], target: float) -> float | None:
    """Tokens at which the validation loss first reaches ``target`` (interpolated), or None."""
    prev: tuple[float, float] | None = None
    for r in rows:
        v = r.get("val_loss")
        if v is None:
            continue
        t = float(r["tokens"])
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            t0, v0 = prev
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        prev = (t, v)
    return None


def summarize_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-run figures from its metric rows: steps, tokens, final validation loss, peak and final
    max logit, clip events (head-steps) and clipped steps, clip events per layer, wall time and
    median step time (the first 5 steps skipped as warm-up)."""
    if not rows:
        raise ValueError("the run wrote no metrics")
    evals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    logged = [r for r in rows if r.get("max_logit") is not None]
    logits = [r["max_logit"] for r in logged]
    peak = max(logged, key=lambda r: r["max_logit"]) if logged else {}
    times = [r["step_time"] for r in rows[5:]] or [r["step_time"] for r in rows]
    per_layer = [0] * max((len(r.get("clipped") or []) for r in rows), default=0)
    for r in rows:
        for i, c in enumerate(r.get("clipped") or []):
            per_layer[i] += int(c)
    return {
        "steps": rows[-1]["step"],
        "tokens": rows[-1]["tokens"],
        "final_val_loss": evals[-1] if evals else None,
        "peak_max_logit": max(logits) if logits else None,
        "final_max_logit": logits[-1] if logits else None,
        "peak_max_logit_is_bound": bool(peak.get("max_logit_is_bound")),
        "final_max_logit_is_bound": bool(logged and logged[-1].get("max_logit_is_bound")),
        "clip_events": sum(int(r.get("clipped_heads") or 0) for r in rows),
        "clip_steps": sum(1 for r in rows if r.get("clipped_heads")),
        "clip_events_per_layer": per_layer,
        "wall_time": rows[-1]["elapsed"],
        "step_time": statistics.median(times),
    }


def efficiency(runs: dict[tuple[str, float, int], Path], budgets: Sequence[float]) -> dict[str, Any]:
    """The token-efficiency figures (module docstring) of runs keyed ``(optimizer, budget, seed)``.

    AdamW runs at every budget of every seed are needed for the ratios; the other optimizers
    run at budget 1.
    """
    rows = {k: read_rows(d) for k, d in runs.items()}
    per = {k: summarize_run(r) for k, r in rows.items()}
    seeds = sorted({k[2] for k in runs})
    table = []
    for (opt, budget) in sorted({(k[0], k[1]) for k in runs}, key=lambda ob: (ob[0] != "adamw", ob)):
        mine = [per[(opt, budget, s)] for s in seeds if (opt, budget, s) in per]
        finals = [m["final_val_loss"] for m in mine]
        mean, sd = mean_sd(finals)
        table.append({"optimizer": opt, "budget": budget, "tokens": mine[0]["tokens"], "steps": mine[0]["steps"],
                      "final_val_loss": finals, "mean": mean, "sd": sd,
                      "step_time": statistics.median(m["step_time"] for m in mine),
                      "wall_time": statistics.fmean(m["wall_time"] for m in mine),
                      "peak_max_logit": max(m["peak_max_logit"] for m in mine if m["peak_max_logit"] is not None)
                      if any(m["peak_max_logit"] is not None for m in mine) else None})
    out: dict[str, Any] = {"table": table, "seeds": seeds, "budgets": list(budgets), "ratios": {}}
    adamw_budgets = sorted(b for b in budgets if all(("adamw", b, s) in per for s in seeds))
    if not adamw_budgets or adamw_budgets[0] != 1.0:
        return out
    for opt in sorted({k[0] for k in runs} - {"adamw"}):
        if not all((opt, 1.0, s) in per for s in seeds):
            continue
        per_seed, crossing = [], []
        for s in seeds:
            target = per[(opt, 1.0, s)]["final_val_loss"]
            losses = [per[("adamw", b, s)]["final_val_loss"] for b in adamw_budgets]
            per_seed.append(budget_to_reach(adamw_budgets, losses, target))
            reach = tokens_to_reach(rows[(opt, 1.0, s)], per[("adamw", 1.0, s)]["final_val_loss"])
            crossing.append(None if reach is None else reach / per[("adamw", 1.0, s)]["tokens"])
        means = [statistics.fmean(per[("adamw", b, s)]["final_val_loss"] for s in seeds) for b in adamw_budgets]
        target = statistics.fmean(per[(opt, 1.0, s)]["final_val_loss"] for s in seeds)
        # AdamW's 1x runs: the same work per step as the other optimizer's; the longer budgets run at
        # other times, under whatever else shares the machine then
        t_adamw = statistics.median(per[("adamw", 1.0, s)]["step_time"] for s in seeds)
        t_opt = statistics.median(per[(opt, 1.0, s)]["step_time"] for s in seeds)
        matched = t_opt / t_adamw
        out["ratios"][opt] = {
            "budget_matched": budget_to_reach(adamw_budgets, means, target),  # on the seed means
            "budget_matched_per_seed": per_seed,
            "crossing_per_seed": crossing,
            "max_budget": adamw_budgets[-1],
            "loss": target,
            "adamw_means": means,
            "step_time": t_opt, "adamw_step_time": t_adamw,
            "wall_clock_budget": matched,
            "adamw_loss_wall_clock": interpolate(adamw_budgets, means, matched),
        }
    return out


def stability(runs: dict[tuple[str, int], Path], tau: float) -> dict[str, Any]:
    """The stability figures (module docstring) of runs keyed ``(optimizer, seed)``, Muon and MuonClip."""
    rows = {k: read_rows(d) for k, d in runs.items()}
    per = {k: summarize_run(r) for k, r in rows.items()}
    seeds = sorted({k[1] for k in runs})
    out: dict[str, Any] = {"tau": tau, "seeds": seeds, "table": []}
    for opt in ("muon", "muonclip"):
        if not all((opt, s) in per for s in seeds):
            continue
        mine = [per[(opt, s)] for s in seeds]
        after, after_bound = [], []
        for s in seeds:
            rs = rows[(opt, s)]
            first = next((i for i, r in enumerate(rs) if r.get("clipped_heads")), None)
            top = None if first is None else max(rs[first:], key=lambda r: r["max_logit"])
            after.append(None if top is None else top["max_logit"])
            after_bound.append(bool(top and top.get("max_logit_is_bound")))
        finals = [m["final_val_loss"] for m in mine]
        layers = [sum(col) for col in zip(*(m["clip_events_per_layer"] for m in mine))]
        out["table"].append({
            "optimizer": opt, "peak_max_logit": [m["peak_max_logit"] for m in mine],
            "final_max_logit": [m["final_max_logit"] for m in mine], "peak_after_first_clip": after,
            "peak_after_first_clip_is_bound": after_bound,
            "clip_events": [m["clip_events"] for m in mine], "clip_steps": [m["clip_steps"] for m in mine],
            "clip_events_per_layer": layers, "final_val_loss": finals, "mean": mean_sd(finals)[0],
            "sd": mean_sd(finals)[1],
        })
    growth = []
    for s in seeds:
        logits = [r["max_logit"] for r in rows.get(("muon", s), []) if r.get("max_logit") is not None]
        growth += [b - a for a, b in zip(logits, logits[1:]) if a >= tau]
    out["muon_one_step_growth"] = max(growth) if growth else None
    return out


def experts(runs: dict[str, Path]) -> list[dict[str, Any]]:
    """Per run (label -> folder) and expert stack: each expert's update RMS averaged over the steps
    (`muonclip.app.probes.ExpertRMS`, the rows' ``expert_rms``); runs without experts are left out."""
    out = []
    for label, d in runs.items():
        per: dict[str, list[list[float]]] = {}
        for r in read_rows(d):
            for stack, values in (r.get("expert_rms") or {}).items():
                per.setdefault(stack, []).append(values)
        for stack, steps in per.items():
            means = [statistics.fmean(col) for col in zip(*steps)]
            out.append({"run": label, "stack": stack, "per_expert": means, "steps": len(steps)})
    return out


def clip_audit(runs: dict[str, Path]) -> dict[str, Any]:
    """Every `muonclip.app.probes.MLAClipAudit` event of the runs (label -> folder): their count per
    layer, the largest gap to Kimi K2's rule (`muonclip.app.probes.k2_rule_error`), the first events."""
    from ..probes import k2_rule_error

    events = [dict(e, run=label, step=r["step"]) for label, d in runs.items() for r in read_rows(d)
              for e in (r.get("clip_audit") or [])]
    layers: dict[str, int] = {}
    for e in events:
        layers[e["layer"]] = layers.get(e["layer"], 0) + 1
    return {"events": len(events), "per_layer": layers, "first": events[:6],
            "max_rule_error": max((k2_rule_error(e) for e in events), default=None)}
