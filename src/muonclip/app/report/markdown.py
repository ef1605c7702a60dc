"""The text of `muonclip compare`'s report: the Markdown tables, the plain-words reading, and
``summary.md`` / ``summary.json`` (the protocol: `muonclip.app.report`)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..model import orthogonalisation
from .figures import mean_sd


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _le(is_bound: bool) -> str:
    """"≤ " before a max logit that is an LSE upper bound (module docstring), else nothing."""
    return "≤ " if is_bound else ""


def _pm(values: Sequence[float], spec: str = ".4f") -> str:
    """``"mean ± sd"`` of ``values``; one value alone (one seed has no spread to print)."""
    if len(values) == 1:
        return format(values[0], spec)
    mean, sd = mean_sd(values)
    return f"{mean:{spec}} ± {sd:{spec.replace('+', '')}}"


def spread_label(n: int) -> str:
    """What a column of `_pm` values holds: ``"mean ± sd, 3 seeds"``, or ``"one seed"``."""
    return "one seed" if n == 1 else f"mean ± sd, {n} seeds"


def span(values: Sequence[float], spec: str = ".1f", unit: str = "") -> str:
    """``"a–b"`` (the smallest and largest of ``values``), or one figure when they print the same
    (one seed, or seeds that agree to the printed digits)."""
    lo, hi = format(min(values), spec), format(max(values), spec)
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def _ratio(v: float | None, top: float) -> str:
    return f"> {top:g}x" if v is None else f"{v:.2f}x"


def decimals(values: Sequence[float]) -> int:
    """Decimals the spread of ``values`` allows: 2 when they span less than 0.1, 1 when less than
    1, else 0 (a figure is not printed finer than its seeds agree)."""
    width = max(values) - min(values) if values else 0.0
    return 2 if width < 0.1 else 1 if width < 1.0 else 0


def about(value: float, per_seed: Sequence[float]) -> str:
    """``"about 2.6x (2.4–2.8 per seed)"``: ``value`` and the per-seed range at the precision their
    spread allows (`decimals`)."""
    if len(per_seed) < 2:  # no spread measured: one decimal, what three seeds supported on the default preset
        return f"about {value:.1f}x (one seed: no spread measured)"
    d = decimals(per_seed)
    return f"about {value:.{d}f}x ({min(per_seed):.{d}f}–{max(per_seed):.{d}f} per seed)"


def _ratio_pm(values: Sequence[float | None], top: float) -> str:
    known = [v for v in values if v is not None]
    if len(known) < len(values):
        return f"> {top:g}x for {len(values) - len(known)} of {len(values)} seeds"
    if len(known) == 1:
        return f"{known[0]:.2f}x (one seed)"
    return f"{_pm(known, '.2f')}x (range {min(known):.2f}–{max(known):.2f})"


def efficiency_markdown(eff: dict[str, Any]) -> str:
    """The token-efficiency tables (Markdown)."""
    n = len(eff["seeds"])
    lines = [f"| optimizer | token budget | tokens | final val loss ({spread_label(n)}) | per seed | "
             "step time (median) |", "|---|---|---|---|---|---|"]
    for t in eff["table"]:
        lines.append(f"| {t['optimizer']} | {t['budget']:g}x | {t['tokens'] / 1e6:.2f}M | {_pm(t['final_val_loss'])} | "
                     f"{', '.join(f'{v:.4f}' for v in t['final_val_loss'])} | {1000 * t['step_time']:.0f} ms |")
    for opt, r in eff["ratios"].items():
        top = r["max_budget"]
        crossing = r["crossing_per_seed"]
        crossed = _ratio_pm(crossing, 1.0) if None not in crossing else "not reached by every seed"
        per_seed = r["budget_matched_per_seed"]
        headline = (about(r["budget_matched"], per_seed) if r["budget_matched"] is not None and None not in per_seed
                    else _ratio(r["budget_matched"], top))
        lines += ["", f"| {opt} against AdamW | value |", "|---|---|",
                  f"| **tokens AdamW needs to match {opt}'s final loss** (budget-matched: AdamW's own schedule at "
                  f"each budget, interpolated), on the seed means | **{headline}** |",
                  *([f"| the same, per seed (mean ± sd) | {_ratio_pm(r['budget_matched_per_seed'], top)} |"]
                    if n > 1 else []),
                  f"| crossing ratio (secondary: {opt}'s tokens, mid-schedule, to first reach AdamW's final loss at "
                  f"1x, over AdamW's tokens; favours the faster starter) | "
                  f"{crossed} |",
                  f"| wall-clock matched: AdamW given {opt}'s seconds ({r['wall_clock_budget']:.2f}x its tokens, "
                  f"step {1000 * r['adamw_step_time']:.0f} vs {1000 * r['step_time']:.0f} ms) reaches | "
                  f"{_fmt(r['adamw_loss_wall_clock'], '.4f', 'outside the budgets run')} vs {opt}'s "
                  f"{r['loss']:.4f} |"]
    against = against_muon(eff)
    if against:
        lines += ["", f"| against Muon at 1x (same seeds) | final val loss difference ({spread_label(n)}) | per seed |",
                  "|---|---|---|"]
        for opt, diffs in against.items():
            lines.append(f"| {opt} - muon | {_pm(diffs, '+.4f')} | {', '.join(f'{d:+.4f}' for d in diffs)} |")
    return "\n".join(lines)


def against_muon(eff: dict[str, Any]) -> dict[str, list[float]]:
    """Each other optimizer's final validation loss at 1x minus Muon's, per seed (the same seed:
    the same initial weights and batches), for the optimizers other than AdamW and Muon."""
    by = {(t["optimizer"], t["budget"]): t for t in eff["table"]}
    muon = by.get(("muon", 1.0))
    if muon is None:
        return {}
    return {o: [a - b for a, b in zip(t["final_val_loss"], muon["final_val_loss"])]
            for (o, b), t in by.items() if b == 1.0 and o not in ("adamw", "muon")
            and len(t["final_val_loss"]) == len(muon["final_val_loss"])}


def stability_markdown(stab: dict[str, Any]) -> str:
    """The stability table (Markdown)."""
    tau, n = stab["tau"], len(stab["seeds"])
    lines = [f"| optimizer | peak max logit (x tau) | peak after the first clip | clip events (steps) | "
             f"clip events per layer | final val loss ({spread_label(n)}) |", "|---|---|---|---|---|---|"]
    for t in stab["table"]:
        peaks = t["peak_max_logit"]
        after = [(a, b) for a, b in zip(t["peak_after_first_clip"], t["peak_after_first_clip_is_bound"])
                 if a is not None]
        top, bound = max(after) if after else (None, False)
        lines.append(
            f"| {t['optimizer']} | {max(peaks):.1f} ({span([p / tau for p in peaks], '.1f', 'x')}) | "
            f"{f'{_le(bound)}{top:.1f} ({top / tau:.2f}x)' if after else 'no clip'} | "
            f"{sum(t['clip_events'])} ({sum(t['clip_steps'])}) | {', '.join(map(str, t['clip_events_per_layer']))} | "
            f"{_pm(t['final_val_loss'])} |")
    g = stab.get("muon_one_step_growth")
    if g is not None:
        lines += ["", f"The most one update added to plain Muon's max logit once above tau: {g:.1f}."]
    return "\n".join(lines)


def tuned_stability_markdown(stab: dict[str, Any]) -> str:
    """The tuned-rate stability segment per seed: plain Muon's peak, MuonClip's clips, both final
    losses and their difference (Markdown)."""
    tau = stab["tau"]
    by = {t["optimizer"]: t for t in stab["table"]}
    mu, mc = by.get("muon"), by.get("muonclip")
    if mu is None or mc is None:
        return stability_markdown(stab)
    lines = ["| seed | Muon's peak max logit (x tau) | MuonClip's clip events (steps) | final val loss Muon | "
             "MuonClip | MuonClip - Muon |", "|---|---|---|---|---|---|"]
    diffs = [b - a for a, b in zip(mu["final_val_loss"], mc["final_val_loss"])]
    for i, s in enumerate(stab["seeds"]):
        peak = mu["peak_max_logit"][i]
        lines.append(f"| {s} | {peak:.1f} ({peak / tau:.2f}x) | {mc['clip_events'][i]} ({mc['clip_steps'][i]}) | "
                     f"{mu['final_val_loss'][i]:.4f} | {mc['final_val_loss'][i]:.4f} | {diffs[i]:+.4f} |")
    if len(diffs) > 1:
        lines.append(f"| mean ± sd | | | {_pm(mu['final_val_loss'])} | {_pm(mc['final_val_loss'])} | "
                     f"{_pm(diffs, '+.4f')} |")
    return "\n".join(lines)


def protocol_markdown(cfg: Any, optimizers: Sequence[str], swept: bool) -> str:
    """What the comparison tuned and what it held fixed (Markdown list), from the config."""
    from ..config import TUNED_PRESETS

    shown = [*optimizers, *(("muon", "muonclip") if cfg.stability_steps and cfg.stability_segments else ())]
    rates = ", ".join(f"{o} {cfg.lr(o):.4g} (warm-up {cfg.warmup(o)})" for o in dict.fromkeys(shown))
    if swept:
        source = "tuned by this run's sweep (`muonclip.app.sweep`: 5-point log grid sqrt 2 apart, extended while " \
                 "the best is at an edge, tuning seeds apart from the reported ones)"
    elif cfg.preset in TUNED_PRESETS:
        source = ("the preset's values, tuned by `muonclip compare --sweep` with the same protocol (docs/compare.md "
                  "lists every swept point and the settings spot-checked by hand)")
    else:
        source = "not tuned: set by hand for this preset"
    lines = [f"- peak learning rates and warm-ups: {rates}; {source}"]
    if cfg.lr_adamw_budgets and "adamw" in optimizers:
        lines.append("- AdamW's rate at each budget: " + ", ".join(
            f"{b:g}x {v:.4g}" for b, v in zip(cfg.budgets, cfg.lr_adamw_budgets)))
    lines.append(f"- held fixed (not swept by this run): AdamW betas (0.9, 0.95) and eps 1e-8; weight decay "
                 f"{cfg.weight_decay:g}; cosine to {cfg.min_lr_ratio:g} of the peak; gradient clipping at "
                 f"{cfg.grad_clip:g}; batch {cfg.batch_size} x {cfg.block_size}; Muon momentum 0.95 (Nesterov), "
                 f"orthogonalisation ns5 in {orthogonalisation(cfg)}")
    lines.append(f"- seeds reported: {', '.join(str(cfg.seed + i) for i in range(cfg.seeds))}")
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


NAMES = {"adamw": "AdamW", "muon": "Muon", "muonclip": "MuonClip", "normuon": "NorMuon",
         "muon_cautious": "Muon with cautious weight decay", "muon_8bit": "Muon with 8-bit momentum"}


def reading(context: dict[str, Any], eff: dict[str, Any] | None, stab: dict[str, Any] | None,
            tuned: dict[str, Any] | None = None) -> str:
    """One paragraph in plain words: what the numbers say, with their spread, at the precision the
    spread allows.

    ``context``: ``model`` (a phrase), ``params`` (parameters), ``tokens_per_param`` (at 1x),
    ``rates`` (a phrase: where the learning rates come from); optional ``seeds`` (the seeds),
    ``cpu`` (the CPU's name), ``stability_lr`` and ``lr_muon`` (the two segments' rates),
    ``rates_tuned`` (whether ``lr_muon`` is a tuned rate; default False: it is not called tuned).

    One seed: a value alone, "(one seed, 0)", never a spread or a range of one value.
    """
    parts = []
    seeds = context.get("seeds")
    seed_text = f" {', '.join(map(str, seeds))}" if seeds else ""
    muons_rate = "Muon's tuned rate" if context.get("rates_tuned") else "Muon's rate (not tuned)"
    if eff and eff["ratios"]:
        opt, r = next(iter(eff["ratios"].items()))
        name = NAMES.get(opt, opt)
        by = {(t["optimizer"], t["budget"]): t for t in eff["table"]}
        a1, m1 = by[("adamw", 1.0)], by[(opt, 1.0)]
        n = len(eff["seeds"])
        over = f"one seed,{seed_text}" if n == 1 else f"mean ± sd over {n} seeds{seed_text}"
        parts.append(
            f"On {context['model']} trained on {m1['tokens'] / 1e6:.2f}M tokens ({context['tokens_per_param']:.1f} "
            f"tokens per parameter), {name} ends at a validation loss of {_pm(m1['final_val_loss'], '.3f')} ({over}) "
            f"against AdamW's {_pm(a1['final_val_loss'], '.3f')} with the same tokens, each at {context['rates']}.")
        ratio = r["budget_matched"]
        if ratio is None:
            parts.append(f"AdamW given up to {r['max_budget']:g} times the tokens, each with its own schedule, does "
                         f"not reach {name}'s loss (at {r['max_budget']:g}x it ends at {r['adamw_means'][-1]:.3f}), "
                         f"so on this setup AdamW needs more than {r['max_budget']:g} times the tokens.")
        elif ratio <= 1.0:
            parts.append(f"AdamW reaches {name}'s loss with the same tokens: no token advantage for {name} here.")
        else:
            known = [v for v in r["budget_matched_per_seed"] if v is not None]
            if len(known) == n:
                parts.append(f"To match it, AdamW, retrained with its own schedule on more tokens, needs "
                             f"{about(ratio, known).replace('about ', 'about ', 1)} the tokens.")
            else:
                parts.append(f"To match it, AdamW, retrained with its own schedule on more tokens, needs about "
                             f"{ratio:.1f} times the tokens on the seed means (more than {r['max_budget']:g} for "
                             f"{n - len(known)} of {n} seeds).")
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
    if eff:
        for opt, diffs in against_muon(eff).items():
            mean, sd = mean_sd(diffs)
            verdict = ("one seed: no spread to judge it by" if len(diffs) == 1 else
                       "lower than Muon's beyond the seed spread" if mean + sd < 0 else
                       "higher than Muon's beyond the seed spread" if mean - sd > 0 else
                       "within the seed spread of Muon's")
            parts.append(f"{NAMES.get(opt, opt)} ends {_pm(diffs, '+.4f')} against Muon (same seeds): {verdict}.")
    if eff or stab:
        cpu = context.get("cpu")
        parts.append((f"Measured on {cpu}; " if cpu else "") + "every run is seeded, so these figures come back on "
                     "the same CPU kind and torch version, not on another CPU kind, whose kernels round differently "
                     "(final losses differed by up to about 0.01 between two kinds).")
    if stab and len(stab["table"]) == 2:
        tau = stab["tau"]
        mu, mc = stab["table"]
        peaks = mu["peak_max_logit"]
        lr, tuned_lr = context.get("stability_lr"), context.get("lr_muon")
        rate = (f"at an excessive constant learning rate, {lr:g}, {lr / tuned_lr:.1f} times {muons_rate} "
                f"{tuned_lr:g}" if lr and tuned_lr else "at a high constant learning rate")
        head = (f"The stability segment is a rescue {rate}, with no weight decay and tau = {tau:g}: plain Muon's max "
                f"attention logit climbs to {span(peaks, '.0f')} ({span([p / tau for p in peaks])} times tau)"
                if max(peaks) > tau else
                f"In the stability segment {rate} (tau = {tau:g}) plain Muon's max attention logit stays below tau "
                f"(at most {max(peaks):.1f}), so there is nothing for QK-Clip to hold")
        after = [a for a in mc["peak_after_first_clip"] if a is not None]
        g = stab.get("muon_one_step_growth")
        if after and g is not None:
            within = "within" if max(after) - tau <= g else "more than"
            held = (f", while MuonClip's stays at most {max(after) / tau:.2f} times tau after its first clip "
                    f"({max(after):.1f}: {within} one update's growth above tau, the most one update added to plain "
                    f"Muon's max logit there being {g:.1f})")
        elif after:
            held = f", while MuonClip's never exceeds {max(after):.1f} after its first clip"
        else:
            held = ", and MuonClip never clips"
        parts.append(f"{head}{held}; both end far from a tuned run: final validation loss "
                     f"{_pm(mc['final_val_loss'], '.3f')} for MuonClip against {_pm(mu['final_val_loss'], '.3f')} "
                     f"for Muon{' (one seed)' if len(peaks) == 1 else ''}.")
    if tuned and len(tuned["table"]) == 2:
        tau = tuned["tau"]
        mu, mc = tuned["table"]
        diffs = [b - a for a, b in zip(mu["final_val_loss"], mc["final_val_loss"])]
        mean, sd = mean_sd(diffs)
        peaks = mu["peak_max_logit"]
        lr = context.get("lr_muon")
        verdict = ("one seed: no spread to judge it by." if len(diffs) == 1 else
                   "no cost beyond the seed spread." if abs(mean) <= sd or sd == 0 and mean == 0 else
                   "a cost beyond the seed spread." if mean > 0 else "lower than Muon beyond the seed spread.")
        per = "" if len(diffs) == 1 else f" (per seed {', '.join(f'{d:+.4f}' for d in diffs)})"
        parts.append(
            f"At {muons_rate}{f' ({lr:g})' if lr else ''}, same segment, tau = {tau:g}: plain Muon's max logit "
            f"peaks at {span([p / tau for p in peaks], '.2f')} times tau; MuonClip clips "
            f"{span(mc['clip_steps'], 'd')} steps{' per seed' if len(diffs) > 1 else ''} and ends "
            f"{_pm(diffs, '+.4f')} against Muon{per}: {verdict}")
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
