"""The text of `muonclip compare`'s report: the Markdown tables, the plain-words reading, and
``summary.md`` / ``summary.json`` (the protocol: `muonclip.app.report`)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .figures import mean_sd


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
    "NAMES", "clip_audit_markdown", "efficiency_markdown", "experts_markdown", "reading", "stability_markdown",
    "write_summary",
]
