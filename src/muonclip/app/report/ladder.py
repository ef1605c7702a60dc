"""The report of `muonclip compare --preset ladder` (`muonclip.app.ladder`): the budget-matched ratio at
each width, its table, the plain-words reading, and ``ratio_vs_params.png`` with Wen et al. 2025's
published points beside ours.

`WEN_2025`: Wen, Hall, Ma and Liang 2025, "Fantastic Pretraining Optimizers and Where to Find
Them" (arXiv 2509.02046): against an AdamW tuned as carefully, the speed-up of the matrix-based
optimizers (Muon, Soap, Kron) falls from 1.4x at 0.1B parameters (their smallest model has 130M)
to 1.1x at 1.2B, at 1–8 times the Chinchilla-optimal data (20–160 tokens per parameter). Those
are the two figures of their abstract; the points in between are read off their plots only, so
they are not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .markdown import _pm, about, decimals, span
from .plots import pyplot, save_figure

WEN_2025 = ((130e6, 1.4), (1.2e9, 1.1))
"""(parameters, speed-up over AdamW): Wen et al. 2025's abstract (module docstring)."""


def _ratio(eff: dict[str, Any]) -> dict[str, Any] | None:
    return eff["ratios"].get("muon")


def ratio_text(eff: dict[str, Any]) -> str:
    """The rung's ratio in words at the precision its seeds allow ("about 2.6x (2.4–2.8 per seed)"),
    "> 3x" past the largest budget, "<= 1x" when AdamW matches Muon with the same tokens."""
    r = _ratio(eff)
    if r is None:
        return "-"
    per = r["budget_matched_per_seed"]
    if r["budget_matched"] is None:
        return f"> {r['max_budget']:g}x"
    if None in per:
        return (f"about {r['budget_matched']:.1f}x on the means (> {r['max_budget']:g}x for {per.count(None)} of "
                f"{len(per)} seeds)")
    return about(r["budget_matched"], per)


def ladder_markdown(results: Sequence[dict[str, Any]]) -> str:
    """The ladder's table (Markdown): a rung a row."""
    if not results:
        return "No rung finished yet."
    budgets = results[0]["efficiency"]["budgets"]
    ns = {len(r["efficiency"]["seeds"]) for r in results}
    loss = "one seed" if ns == {1} else "mean ± sd" if 1 not in ns else "mean ± sd; one seed: the value"
    head = ("| width x heads | parameters | steps | seeds | tokens (per parameter) | AdamW lr | Muon lr | "
            + " | ".join(f"AdamW {b:g}x ({loss})" for b in budgets)
            + f" | Muon 1x ({loss}) | **tokens AdamW needs to match Muon** |")
    lines = [head, "|" + "---|" * (9 + len(budgets))]
    for r in results:
        by = {(t["optimizer"], t["budget"]): t for t in r["efficiency"]["table"]}
        rates = [f"{r['lr'][o]:.4g}" + ("" if r["bracketed"][o] else " (at an edge)") for o in ("adamw", "muon")]
        cells = [_pm(by[("adamw", b)]["final_val_loss"]) if ("adamw", b) in by else "-" for b in budgets]
        lines.append(f"| {r['n_embd']} x {r['n_head']} | {r['params'] / 1e6:.3f}M | {r['steps']} | "
                     f"{len(r['efficiency']['seeds'])} | "
                     f"{r['tokens'] / 1e6:.2f}M ({r['tokens_per_param']:.1f}) | {rates[0]} | {rates[1]} | "
                     + " | ".join(cells) + f" | {_pm(by[('muon', 1.0)]['final_val_loss'])} | "
                     f"**{ratio_text(r['efficiency'])}** |")
    return "\n".join(lines)


def slope(results: Sequence[dict[str, Any]]) -> float | None:
    """Least-squares change of the ratio (on the seed means) per doubling of the parameters; None
    with fewer than two rungs that have a ratio."""
    pts = [(math.log2(r["params"]), _ratio(r["efficiency"])["budget_matched"]) for r in results
           if _ratio(r["efficiency"]) and _ratio(r["efficiency"])["budget_matched"] is not None]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def ladder_reading(results: Sequence[dict[str, Any]], planned: int) -> str:
    """The reading in plain words: the ratio at each rung with its per-seed spread, whether the
    change across the ladder exceeds that spread, and the published trend beside it."""
    if not results:
        return f"No rung of the {planned} finished."
    parts = []
    counts = [len(r["efficiency"]["seeds"]) for r in results]
    word = {1: "one seed"}
    if len(set(counts)) == 1:
        seeds = f"{word.get(counts[0], f'{counts[0]} seeds')} at each width"
    else:
        seeds = ", ".join(f"{word.get(n, f'{n} seeds')} at {r['params'] / 1e6:.3f}M" for n, r in zip(counts, results))
    rows = [f"{r['params'] / 1e6:.3f}M parameters: {ratio_text(r['efficiency'])}" for r in results]
    tpp = results[0]["tokens_per_param"]
    parts.append(f"The tokens AdamW needs to reach Muon's final loss ({seeds}, {tpp:.1f} tokens per "
                 f"parameter at 1x, every rate re-bracketed at each width): " + "; ".join(rows) + ".")
    if len(results) < planned:
        parts.append(f"Only {len(results)} of the {planned} widths finished"
                     + (": the trend below is over those." if len(results) > 1 else "."))
    ratios = [_ratio(r["efficiency"]) for r in results]
    known = [(r, q) for r, q in zip(results, ratios) if q and q["budget_matched"] is not None
             and None not in q["budget_matched_per_seed"]]
    if len(known) >= 2:
        (r0, q0), (r1, q1) = known[0], known[-1]
        first, last = q0["budget_matched_per_seed"], q1["budget_matched_per_seed"]
        change = q1["budget_matched"] - q0["budget_matched"]
        d = decimals([*first, *last]) if len(first) > 1 or len(last) > 1 else 1
        growth = r1["params"] / r0["params"]
        if len(first) == 1 and len(last) == 1:
            verdict = "one seed at each: no spread to judge the change by"
        elif len(first) == 1 or len(last) == 1:
            one, many, side, other = ((last[0], first, "largest", "smallest") if len(last) == 1
                                      else (first[0], last, "smallest", "largest"))
            if min(many) <= one <= max(many):
                verdict = (f"the {side} width's one seed is within the {other}'s per-seed range, so no change beyond "
                           "the seed spread")
            else:
                below = one < min(many)
                trend = "fall" if below == (side == "largest") else "rise"
                verdict = (f"the {side} width's one seed is {'below' if below else 'above'} every seed of the "
                           f"{other}, a {trend} suggested but not established (one seed: the {side} width's own "
                           "spread is not measured)")
        elif max(last) < min(first):
            verdict = ("every seed of the largest width is below every seed of the smallest, a fall beyond the seed "
                       "spread")
        elif min(last) > max(first):
            verdict = ("every seed of the largest width is above every seed of the smallest, a rise beyond the seed "
                       "spread")
        else:
            verdict = "the per-seed ranges overlap, so no change beyond the seed spread"
        s = slope(results)
        parts.append(f"From {r0['params'] / 1e6:.3f}M to {r1['params'] / 1e6:.3f}M parameters ({growth:.1f} times) "
                     f"the ratio moves by {change:+.{d}f} ({span(first, f'.{d}f')} per seed at the smallest, "
                     f"{span(last, f'.{d}f')} at the largest); {verdict}"
                     + (f"; least squares over the widths: {s:+.2f} per doubling of the parameters" if s is not None
                        else "") + ". Not extrapolated beyond the widths run.")
    parts += [beyond_text(r, results[0]) for r, q in zip(results, ratios) if q and q["budget_matched"] is None]
    (p0, w0), (p1, w1) = WEN_2025
    parts.append(f"Published, against an equally tuned AdamW: {w0:.1f}x at 0.1B parameters (their smallest model "
                 f"has {p0 / 1e6:.0f}M) falling to {w1:.1f}x at {p1 / 1e9:.1f}B for the matrix-based optimizers, Muon "
                 "among them, at 20–160 tokens per parameter (Wen et al. 2025). The largest width here is "
                 f"{math.log10(p0 / results[-1]['params']):.1f} orders of magnitude below their smallest model and "
                 f"trains at {'fewer' if tpp < 20 else 'as many or more'} tokens per parameter ({tpp:.1f}); the plot "
                 "sets both on one axis of parameters, side by side, not as one curve.")
    return " ".join(parts)


def beyond_text(rung: dict[str, Any], smallest: dict[str, Any]) -> str:
    """What a rung whose AdamW does not reach Muon's loss at its largest budget shows: the margin
    by which it misses (per seed, same seed), so a lower bound met by a hair reads as one, and the
    bound against the smallest rung's per-seed ratios."""
    eff = rung["efficiency"]
    top = max(eff["budgets"])
    by = {(t["optimizer"], t["budget"]): t["final_val_loss"] for t in eff["table"]}
    gaps = [a - m for a, m in zip(by[("adamw", top)], by[("muon", 1.0)])]
    n = len(gaps)
    base = [v for v in (_ratio(smallest["efficiency"]) or {}).get("budget_matched_per_seed", []) if v is not None]
    text = (f"At {rung['params'] / 1e6:.3f}M parameters AdamW at its largest budget, {top:g}x, ends "
            + (f"{gaps[0]:+.4f} nats from Muon's 1x loss (one seed)" if n == 1 else
               f"{span(gaps, '+.4f')} nats from Muon's 1x loss (per seed)")
            + f": the ratio is above {top:g}x, by an amount the budgets run cannot measure")
    if base and rung is not smallest and top > max(base):
        text += (f"; that bound is above every seed of the smallest width ({span(base, '.1f')}x), so the ratio does "
                 "not fall across the ladder" + (" (one seed at this width: suggested, not established)" if n == 1
                                                 else ""))
    return text + "."


def plot_ladder(results: Sequence[dict[str, Any]], out_dir: Path) -> Path:
    """``ratio_vs_params.png``: our ratio at each width (the seed means; bars: per-seed min–max;
    a triangle at AdamW's largest budget where it does not reach Muon's loss) against parameters
    (log scale), Wen et al. 2025's two published points beside it, 1x drawn."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    pts = [(r["params"], _ratio(r["efficiency"])) for r in results]
    pts = [(p, q) for p, q in pts if q and q["budget_matched"] is not None]
    if pts:
        xs = [p for p, _ in pts]
        ys = [q["budget_matched"] for _, q in pts]
        lo = [y - min(v for v in q["budget_matched_per_seed"] if v is not None) for y, (_, q) in zip(ys, pts)]
        hi = [max(v for v in q["budget_matched_per_seed"] if v is not None) - y for y, (_, q) in zip(ys, pts)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", color="tab:orange", capsize=3,
                    label=f"this ladder, {results[0]['tokens_per_param']:.1f} tokens per parameter: Muon vs AdamW, "
                          "budget-matched (mean; bars: per-seed range)")
    beyond = [(r["params"], _ratio(r["efficiency"])["max_budget"]) for r in results
              if _ratio(r["efficiency"]) and _ratio(r["efficiency"])["budget_matched"] is None]
    if beyond:
        ax.scatter([p for p, _ in beyond], [b for _, b in beyond], marker="^", s=60, color="tab:orange",
                   label="this ladder: beyond AdamW's largest budget (a lower bound)")
    ax.plot([p for p, _ in WEN_2025], [w for _, w in WEN_2025], marker="s", ls="--", color="tab:gray",
            label="Wen et al. 2025, 20–160 tokens per parameter: matrix-based optimizers vs AdamW (abstract)")
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("tokens AdamW needs to match Muon (x)")
    ax.set_title("Muon's token advantage against model size")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return save_figure(plt, fig, out_dir / "ratio_vs_params.png")
