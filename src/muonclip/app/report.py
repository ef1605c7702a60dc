"""The report of `muonclip compare`: the figures of both claims, their tables, plots and a plain reading.

**Token efficiency** (AdamW against Muon; runs keyed ``(optimizer, budget, seed)``):

* final validation loss of every optimizer and budget: mean ± sample standard deviation over
  the seeds, and each seed's value;
* the **budget-matched ratio**, the headline: the token budget, in multiples of Muon's, at which
  AdamW — trained with its own full schedule at each budget of ``budgets`` — reaches Muon's final
  loss (`budget_to_reach`: linear interpolation of AdamW's final loss between neighbouring
  budgets). Per seed (AdamW and Muon runs of one seed share their initial weights and batch
  order), then the mean ± sd; beyond the largest budget it is reported as "> B x";
* the **crossing ratio**, secondary: tokens after which Muon's validation loss, mid-schedule,
  first reaches AdamW's final loss at 1x (`tokens_to_reach`), over AdamW's tokens. It compares a
  point inside Muon's schedule with the end of AdamW's, which favours the faster starter: it is
  not a budget-matched figure;
* **wall-clock matched**: the median step times (forward + backward + step) of Muon's and
  AdamW's 1x runs give the AdamW budget that takes as many seconds as Muon's run,
  ``t_muon / t_adamw``, and AdamW's final loss is interpolated there, against Muon's (the longer
  AdamW runs are left out of the timing: they run at other moments, under whatever else shares
  the machine then).

**Stability** (Muon against MuonClip, the segment with no weight decay and ``stability_tau``):
the peak max logit over every layer and head (before QK-Clip) as a multiple of tau; MuonClip's
peak after its first clip, whose excess over tau is compared with one update's growth: the most
that one step added to plain Muon's max logit once it was above tau; clip events per layer;
final validation losses.

Plots (PNG): ``val_loss.png`` (validation loss against tokens, every optimizer and budget,
mean over seeds with the min-max band), ``budget.png`` (AdamW's final loss against its budget,
Muon's at 1x, the crossing), ``max_logit.png`` (stability: max logit per step, tau and 3 tau)
and ``clip_events.png`` (heads clipped per step).

MuonClip's max logits at or below tau may be upper bounds from the attention kernel's LSE rather
than exact maxima (the gated capture, docs/design.md, "Max logits nearly free: the LSE gate";
the ``max_logit_is_bound`` column of `muonclip.app.metrics`): the tables print such a value with
"≤" and ``max_logit.png`` draws it as a hollow marker. Values above tau are always exact.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .metrics import read_rows

COLORS = {"adamw": "tab:blue", "muon": "tab:orange", "muonclip": "tab:green"}
STYLES = {"muonclip": "--"}  # MuonClip equals Muon until the clip first fires: dashed, so both lines stay visible


# ------------------------------------------------------------------------------------------------
# figures


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
    from .probes import k2_rule_error

    events = [dict(e, run=label, step=r["step"]) for label, d in runs.items() for r in read_rows(d)
              for e in (r.get("clip_audit") or [])]
    layers: dict[str, int] = {}
    for e in events:
        layers[e["layer"]] = layers.get(e["layer"], 0) + 1
    return {"events": len(events), "per_layer": layers, "first": events[:6],
            "max_rule_error": max((k2_rule_error(e) for e in events), default=None)}


# ------------------------------------------------------------------------------------------------
# text


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _le(is_bound: bool) -> str:
    """"≤ " before a max logit that is an LSE upper bound (module docstring), else nothing."""
    return "≤ " if is_bound else ""


def _pm(values: Sequence[float], spec: str = ".4f") -> str:
    mean, sd = mean_sd(values)
    return f"{mean:{spec}} ± {sd:{spec}}"


def _ratio(v: float | None, top: float) -> str:
    return f"> {top:g}x" if v is None else f"{v:.2f}x"


def _ratio_pm(values: Sequence[float | None], top: float) -> str:
    known = [v for v in values if v is not None]
    if len(known) < len(values):
        return f"> {top:g}x for {len(values) - len(known)} of {len(values)} seeds"
    return f"{_pm(known, '.2f')}x (range {min(known):.2f}–{max(known):.2f})"


def efficiency_markdown(eff: dict[str, Any]) -> str:
    """The token-efficiency tables (Markdown)."""
    n = len(eff["seeds"])
    lines = [f"| optimizer | token budget | tokens | final val loss (mean ± sd, {n} seeds) | per seed | "
             "step time (median) |", "|---|---|---|---|---|---|"]
    for t in eff["table"]:
        lines.append(f"| {t['optimizer']} | {t['budget']:g}x | {t['tokens'] / 1e6:.2f}M | {t['mean']:.4f} ± "
                     f"{t['sd']:.4f} | {', '.join(f'{v:.4f}' for v in t['final_val_loss'])} | "
                     f"{1000 * t['step_time']:.0f} ms |")
    for opt, r in eff["ratios"].items():
        top = r["max_budget"]
        crossing = r["crossing_per_seed"]
        crossed = _ratio_pm(crossing, 1.0) if None not in crossing else "not reached by every seed"
        lines += ["", f"| {opt} against AdamW | value |", "|---|---|",
                  f"| **tokens AdamW needs to match {opt}'s final loss** (budget-matched: AdamW's own schedule at "
                  f"each budget, interpolated), on the seed means | **{_ratio(r['budget_matched'], top)}** |",
                  f"| the same, per seed (mean ± sd) | {_ratio_pm(r['budget_matched_per_seed'], top)} |",
                  f"| crossing ratio (secondary: {opt}'s tokens, mid-schedule, to first reach AdamW's final loss at "
                  f"1x, over AdamW's tokens; favours the faster starter) | "
                  f"{crossed} |",
                  f"| wall-clock matched: AdamW given {opt}'s seconds ({r['wall_clock_budget']:.2f}x its tokens, "
                  f"step {1000 * r['adamw_step_time']:.0f} vs {1000 * r['step_time']:.0f} ms) reaches | "
                  f"{_fmt(r['adamw_loss_wall_clock'], '.4f', 'outside the budgets run')} vs {opt}'s "
                  f"{r['loss']:.4f} |"]
    return "\n".join(lines)


def stability_markdown(stab: dict[str, Any]) -> str:
    """The stability table (Markdown)."""
    tau, n = stab["tau"], len(stab["seeds"])
    lines = [f"| optimizer | peak max logit (x tau) | peak after the first clip | clip events (steps) | "
             f"clip events per layer | final val loss (mean ± sd, {n} seeds) |", "|---|---|---|---|---|---|"]
    for t in stab["table"]:
        peaks = t["peak_max_logit"]
        after = [(a, b) for a, b in zip(t["peak_after_first_clip"], t["peak_after_first_clip_is_bound"])
                 if a is not None]
        top, bound = max(after) if after else (None, False)
        lines.append(
            f"| {t['optimizer']} | {max(peaks):.1f} ({min(peaks) / tau:.1f}–{max(peaks) / tau:.1f}x) | "
            f"{f'{_le(bound)}{top:.1f} ({top / tau:.2f}x)' if after else 'no clip'} | "
            f"{sum(t['clip_events'])} ({sum(t['clip_steps'])}) | {', '.join(map(str, t['clip_events_per_layer']))} | "
            f"{t['mean']:.4f} ± {t['sd']:.4f} |")
    g = stab.get("muon_one_step_growth")
    if g is not None:
        lines += ["", f"The most one update added to plain Muon's max logit once above tau: {g:.1f}."]
    return "\n".join(lines)


def experts_markdown(rows: list[dict[str, Any]]) -> str:
    """The per-expert update RMS table (Markdown)."""
    lines = ["| run | expert stack | experts | per-expert update RMS, mean over steps: min / median / max |",
             "|---|---|---|---|"]
    for r in rows:
        v = r["per_expert"]
        lines.append(f"| {r['run']} | `{r['stack']}` | {len(v)} | {min(v):.3f} / {statistics.median(v):.3f} / "
                     f"{max(v):.3f} |")
    return "\n".join(lines)


def clip_audit_markdown(audit: dict[str, Any]) -> str:
    """The K2-rule table of the audited MLA clips (Markdown)."""
    per = ", ".join(f"{k}: {v}" for k, v in sorted(audit["per_layer"].items()))
    lines = [f"{audit['events']} head clips audited ({per}); largest gap between a measured factor and K2's rule: "
             f"{audit['max_rule_error']:.1e}.", "",
             "| run | step | layer | head | gamma | q^C x (sqrt gamma) | k^C x (sqrt gamma) | q^R x (gamma) | "
             "shared k^R x (1) | v x (1) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in audit["first"]:
        g = e["gamma"]
        lines.append(f"| {e['run']} | {e['step']} | {e['layer']} | {e['head']} | {g:.4f} | {e['q_nope']:.4f} "
                     f"({math.sqrt(g):.4f}) | {e['k_nope']:.4f} ({math.sqrt(g):.4f}) | {e['q_rope']:.4f} ({g:.4f}) | "
                     f"{e['k_rope']:.4f} | {e['v']:.4f} |")
    return "\n".join(lines)


NAMES = {"adamw": "AdamW", "muon": "Muon", "muonclip": "MuonClip"}


def reading(context: dict[str, Any], eff: dict[str, Any] | None, stab: dict[str, Any] | None) -> str:
    """One paragraph in plain words: what the numbers say, with their spread.

    ``context``: ``model`` (a phrase), ``params`` (parameters), ``tokens_per_param`` (at 1x) and
    ``rates`` (a phrase: where the learning rates come from).
    """
    parts = []
    if eff and eff["ratios"]:
        opt, r = next(iter(eff["ratios"].items()))
        name = NAMES.get(opt, opt)
        by = {(t["optimizer"], t["budget"]): t for t in eff["table"]}
        a1, m1 = by[("adamw", 1.0)], by[(opt, 1.0)]
        n = len(eff["seeds"])
        parts.append(
            f"On {context['model']} trained on {m1['tokens'] / 1e6:.2f}M tokens ({context['tokens_per_param']:.1f} "
            f"tokens per parameter), {name} ends at a validation loss of {m1['mean']:.3f} ± {m1['sd']:.3f} (mean ± "
            f"sd over {n} seeds) against AdamW's {a1['mean']:.3f} ± {a1['sd']:.3f} with the same tokens, each at "
            f"{context['rates']}.")
        ratio = r["budget_matched"]
        if ratio is None:
            parts.append(f"AdamW given up to {r['max_budget']:g} times the tokens, each with its own schedule, does "
                         f"not reach {name}'s loss (at {r['max_budget']:g}x it ends at {r['adamw_means'][-1]:.3f}), "
                         f"so on this setup AdamW needs more than {r['max_budget']:g} times the tokens.")
        elif ratio <= 1.0:
            parts.append(f"AdamW reaches {name}'s loss with the same tokens: no token advantage for {name} here.")
        else:
            known = [v for v in r["budget_matched_per_seed"] if v is not None]
            spread = (f"{min(known):.2f}–{max(known):.2f} across seeds" if len(known) == n
                      else f"more than {r['max_budget']:g} for {n - len(known)} of {n} seeds")
            parts.append(f"To match it, AdamW, retrained with its own schedule on more tokens, needs about "
                         f"{ratio:.2f} times the tokens ({spread}).")
        orders = math.log10(1e8 / context["params"])
        parts.append(f"Careful comparisons at 0.1–1.2B parameters and 20–160 tokens per parameter (1–8 times the "
                     f"Chinchilla optimum) find Muon's advantage at about 1.4x in tokens at 0.1B, falling to 1.1x at "
                     f"1.2B (Wen et al. 2025, against an equally tuned AdamW), and Moonlight's scaling-law fits "
                     f"about 2x in training compute (Liu et al. 2025); this model is {orders:.0f} orders of "
                     f"magnitude smaller than their smallest, so the ratio here describes small models, not large "
                     f"ones.")
        if r["adamw_loss_wall_clock"] is not None:
            parts.append(f"On this machine a {name} step takes {r['step_time'] / r['adamw_step_time']:.2f} times an "
                         f"AdamW step; given the same seconds, AdamW reaches {r['adamw_loss_wall_clock']:.3f}.")
    if stab and len(stab["table"]) == 2:
        tau = stab["tau"]
        mu, mc = stab["table"]
        peaks = mu["peak_max_logit"]
        after = [a for a in mc["peak_after_first_clip"] if a is not None]
        head = (f"In the stability segment (no weight decay, a high constant learning rate, tau = {tau:g}) plain "
                f"Muon's max attention logit climbs to {min(peaks):.0f}–{max(peaks):.0f} ({min(peaks) / tau:.1f}–"
                f"{max(peaks) / tau:.1f} times tau)" if max(peaks) > tau else
                f"In the stability segment (tau = {tau:g}) plain Muon's max attention logit stays below tau "
                f"(at most {max(peaks):.1f}), so there is nothing for QK-Clip to hold")
        g = stab.get("muon_one_step_growth")
        if after and g is not None:
            within = "within" if max(after) - tau <= g else "more than"
            held = (f", while MuonClip's never exceeds {max(after):.1f} after its first clip (tau + "
                    f"{max(after) - tau:.1f}: {within} one update's growth, the most one update added to plain Muon's "
                    f"max logit above tau being {g:.1f})")
        elif after:
            held = f", while MuonClip's never exceeds {max(after):.1f} after its first clip"
        else:
            held = ", and MuonClip never clips"
        parts.append(f"{head}{held}; final validation loss {mc['mean']:.3f} ± {mc['sd']:.3f} for MuonClip against "
                     f"{mu['mean']:.3f} ± {mu['sd']:.3f} for Muon.")
    return " ".join(parts)


# ------------------------------------------------------------------------------------------------
# plots


def _axes(figsize: tuple[float, float]) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.subplots(figsize=figsize)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_curve(runs: list[list[dict[str, Any]]], key: str, x: str) -> tuple[list[float], list[float], list[float],
                                                                              list[float]]:
    pts = [{r[x]: r[key] for r in rs if r.get(key) is not None} for rs in runs]
    xs = sorted(set.intersection(*(set(p) for p in pts))) if pts else []
    vals = [[p[t] for p in pts] for t in xs]
    return xs, [statistics.fmean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def plot_efficiency(runs: dict[tuple[str, float, int], Path], eff: dict[str, Any], out_dir: Path) -> list[Path]:
    """``val_loss.png`` and ``budget.png`` of the token-efficiency runs."""
    plt, (fig, ax) = _axes((7.5, 4.6))
    keys = sorted({(k[0], k[1]) for k in runs}, key=lambda ob: (ob[0] != "adamw", ob))
    adamw = [b for o, b in keys if o == "adamw"]
    for opt, budget in keys:
        curves = [read_rows(d) for k, d in runs.items() if (k[0], k[1]) == (opt, budget)]
        xs, mean, lo, hi = _mean_curve(curves, "val_loss", "tokens")
        shade = 0.35 + 0.65 * (adamw.index(budget) + 1) / len(adamw) if opt == "adamw" else 1.0
        ax.plot(xs, mean, marker=".", ms=3, color=COLORS.get(opt), alpha=shade, ls=STYLES.get(opt, "-"),
                label=f"{opt} {budget:g}x" if opt == "adamw" else opt)
        ax.fill_between(xs, lo, hi, color=COLORS.get(opt), alpha=0.12)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"Validation loss (mean, band: min–max over {len(eff['seeds'])} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths = [_save(plt, fig, out_dir / "val_loss.png")]

    plt, (fig, ax) = _axes((6.5, 4.2))
    rows = [t for t in eff["table"] if t["optimizer"] == "adamw"]
    ax.errorbar([t["budget"] for t in rows], [t["mean"] for t in rows],
                yerr=[[t["mean"] - min(t["final_val_loss"]) for t in rows],
                      [max(t["final_val_loss"]) - t["mean"] for t in rows]],
                marker="o", color=COLORS["adamw"], capsize=3, label="AdamW, own schedule per budget")
    for opt, r in eff["ratios"].items():
        ax.axhline(r["loss"], color=COLORS.get(opt), ls="--", label=f"{opt} at 1x")
        if r["budget_matched"] is not None:
            ax.axvline(r["budget_matched"], color=COLORS.get(opt), ls=":", lw=1)
            ax.annotate(f"{r['budget_matched']:.2f}x", (r["budget_matched"], r["loss"]), textcoords="offset points",
                        xytext=(5, 8), color=COLORS.get(opt))
    ax.set_xlabel("AdamW's token budget (multiples of Muon's)")
    ax.set_ylabel("final validation loss")
    ax.set_title("Tokens AdamW needs to match Muon (budget-matched)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(plt, fig, out_dir / "budget.png"))
    return paths


def plot_stability(runs: dict[tuple[str, int], Path], tau: float, out_dir: Path) -> list[Path]:
    """``max_logit.png`` and ``clip_events.png`` of the stability runs."""
    plt, (fig, ax) = _axes((7.5, 4.6))
    for (opt, seed), d in sorted(runs.items()):
        rs = [r for r in read_rows(d) if r.get("max_logit") is not None]
        ax.plot([r["step"] for r in rs], [r["max_logit"] for r in rs], color=COLORS.get(opt), lw=1, alpha=0.8,
                ls=STYLES.get(opt, "-"), label=opt if seed == min(k[1] for k in runs) else None)
        bound = [r for r in rs if r.get("max_logit_is_bound")]
        if bound:  # the gated capture's upper bounds (<= tau), not exact maxima
            ax.scatter([r["step"] for r in bound], [r["max_logit"] for r in bound], s=10, facecolors="none",
                       edgecolors=COLORS.get(opt, "gray"), lw=0.6,
                       label=f"{opt}: LSE upper bound (exact above tau)" if seed == min(k[1] for k in runs) else None)
    ax.axhline(tau, color="red", ls="--", lw=1, label=f"tau = {tau:g}")
    ax.axhline(3 * tau, color="red", ls=":", lw=1, label=f"3 tau = {3 * tau:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("max attention logit (all layers, heads)")
    ax.set_title("Stability segment: max logit per step, before QK-Clip (every seed)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    paths = [_save(plt, fig, out_dir / "max_logit.png")]

    plt, (fig, ax) = _axes((7.5, 3.4))
    clip_runs = {k: read_rows(d) for k, d in runs.items() if k[0] == "muonclip"}
    steps: dict[int, int] = {}
    for rs in clip_runs.values():
        for r in rs:
            steps[r["step"]] = steps.get(r["step"], 0) + int(r.get("clipped_heads") or 0)
    any_clip = any(steps.values())
    ax.bar(list(steps), list(steps.values()), width=1.0, color=COLORS["muonclip"])
    ax.set_xlabel("step")
    ax.set_ylabel("heads clipped (all seeds)")
    ax.set_title("QK-Clip events of MuonClip" + ("" if any_clip else " (none: no head passed tau)"))
    ax.grid(alpha=0.3)
    paths.append(_save(plt, fig, out_dir / "clip_events.png"))
    return paths


def write_summary(path: Path, title: str, context: list[str], text: str, sections: list[tuple[str, str]],
                  data: dict[str, Any]) -> None:
    """Write ``summary.md`` (title, setup, the reading, the sections) and ``summary.json`` (``data``)."""
    parts = [f"# {title}", "", *[f"- {c}" for c in context], "", text, ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body, ""]
    path.write_text("\n".join(parts), encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=_jsonable), encoding="utf-8")


def _jsonable(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    raise TypeError(type(v).__name__)


__all__ = [
    "budget_to_reach", "clip_audit", "clip_audit_markdown", "efficiency", "efficiency_markdown", "experts",
    "experts_markdown", "interpolate", "mean_sd", "plot_efficiency", "plot_stability", "reading", "stability",
    "stability_markdown", "summarize_run", "tokens_to_reach", "write_summary",
]
