"""The report of `muonclip compare --preset guards` (`muonclip.app.guards`): per segment and arm the
figures, their table, the plain-words reading and the plot of the max logit over the steps.

Per arm, over the seeds: the peak raw max logit (before any clip or cap: what the recorders
saw), for soft-capping also what the softmax saw at that peak, ``c * tanh(peak / c)``; the final
validation loss of the seeds that finished (mean ± sd; one seed: the value alone) and its
difference from plain Muon's on the same seed; the step where a run diverged; the interleaved
step cost against plain Muon (`muonclip.app.guards.step_costs`). An arm *holds* the logits when
its peak stays at most `HELD` times tau on every seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..metrics import read_rows
from .figures import mean_sd, summarize_run
from .markdown import _le, _pm, span, spread_label
from .plots import pyplot, save_figure

HELD = 3.0
"""An arm holds the logits when its peak raw max logit is at most this many times tau on every seed."""
COST_NOTICED = 1.05
"""A step cost above this ratio to plain Muon's is called a cost in the reading."""


def guard_figures(runs: dict[tuple[str, int], tuple[Path, int | None]], arms: Sequence[Any], tau: float,
                  cap: float) -> dict[str, Any]:
    """The figures of one segment (module docstring).

    Args:
        runs: (arm name, seed) -> (run folder, the step it diverged at or None).
        arms: the arms (`muonclip.app.guards.Arm`), in report order.
        tau: QK-Clip's threshold in the segment (the peaks are also given in multiples of it).
        cap: the soft cap ``c`` of the soft-capping arm.
    """
    seeds = sorted({s for _, s in runs})
    out: dict[str, Any] = {"tau": tau, "cap": cap, "seeds": seeds, "arms": {}}
    for arm in arms:
        peaks, bound, finals, diverged, clips = [], [], [], [], []
        for s in seeds:
            run_dir, diverged_at = runs[(arm.name, s)]
            rows = read_rows(run_dir)
            summary = summarize_run(rows) if rows else {}
            peaks.append(summary.get("peak_max_logit"))
            bound.append(bool(summary.get("peak_max_logit_is_bound")))
            finals.append(None if diverged_at is not None else summary.get("final_val_loss"))
            diverged.append(diverged_at)
            clips.append(summary.get("clip_steps", 0))
        done = [v for v in finals if v is not None]
        mean, sd = mean_sd(done) if done else (None, None)
        out["arms"][arm.name] = {
            "label": arm.label, "optimizer": arm.optimizer, "peak_max_logit": peaks, "peak_is_bound": bound,
            "softmax_peak": [None if p is None else (cap * math.tanh(p / cap) if arm.softcap else p) for p in peaks],
            "final_val_loss": finals, "mean": mean, "sd": sd, "diverged_at": diverged, "clip_steps": clips,
        }
    muon = out["arms"].get("muon")
    for entry in out["arms"].values():
        entry["minus_muon"] = [None if muon is None or a is None or b is None else a - b
                               for a, b in zip(entry["final_val_loss"], muon["final_val_loss"])] \
            if muon is not None else [None] * len(seeds)
    return out


def _peaks(entry: dict[str, Any], tau: float) -> str:
    peaks = [p for p in entry["peak_max_logit"] if p is not None]
    if not peaks:
        return "-"
    top = max(peaks)
    bound = any(b for p, b in zip(entry["peak_max_logit"], entry["peak_is_bound"]) if p == top)
    return f"{_le(bound)}{_num(top)} ({span([p / tau for p in peaks], '.2f' if top < 10 * tau else '.1f', 'x')})"


def _num(v: float) -> str:
    """A logit: one decimal from 10 up, else three significant digits."""
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def _diverged(entry: dict[str, Any], seeds: Sequence[int]) -> str:
    at = [(s, d) for s, d in zip(seeds, entry["diverged_at"]) if d is not None]
    return "no" if not at else ", ".join(f"seed {s} at step {d}" for s, d in at)


def _cost(cost: dict[str, Any] | None) -> str:
    if not cost:
        return "-"
    if "error" in cost:
        return "not timed"
    if "ratio" not in cost:
        return f"{cost['median_ms']:.0f} ms"
    return f"{cost['ratio']:.2f}x ({cost['ratio_q1']:.2f}–{cost['ratio_q3']:.2f}; {cost['median_ms']:.0f} ms)"


def guards_markdown(fig: dict[str, Any], arms: Sequence[Any]) -> str:
    """One segment's table (Markdown): an arm a row."""
    tau, seeds = fig["tau"], fig["seeds"]
    n = len(seeds)
    lines = [f"| arm | peak raw max logit (x tau{', per seed' if n > 1 else ''}) | the softmax saw at that peak | "
             f"final val loss ({spread_label(n)}) | per seed | minus plain Muon's (same seed) | step cost / plain "
             f"Muon's (median; quartiles; median step) | diverged |", "|---|---|---|---|---|---|---|---|"]
    costs = fig.get("step_cost", {})
    for arm in arms:
        e = fig["arms"][arm.name]
        done = [v for v in e["final_val_loss"] if v is not None]
        loss = _pm(done) + ("" if len(done) == n or not done else f" ({len(done)} of {n})") if done else "diverged"
        per = ", ".join("div." if v is None else f"{v:.4f}" for v in e["final_val_loss"])
        diffs = [d for d in e["minus_muon"] if d is not None]
        minus = "" if arm.name == "muon" else (_pm(diffs, "+.4f") + ("" if len(diffs) == n else
                                                                     f" ({len(diffs)} of {n})") if diffs else "-")
        soft = [p for p in e["softmax_peak"] if p is not None]
        saw = _num(max(soft)) + (f" (c = {fig['cap']:g})" if arm.softcap else "") if soft else "-"
        cost = _muon_cost(costs.get("muon")) if arm.name == "muon" else _cost(costs.get(arm.name))
        lines.append(f"| {e['label']} | {_peaks(e, tau)} | {saw} | {loss} | {per} | {minus} | {cost} | "
                     f"{_diverged(e, seeds)} |")
    return "\n".join(lines)


def _muon_cost(cost: dict[str, Any] | None) -> str:
    return "-" if not cost or "error" in cost else f"1 ({cost['median_ms']:.0f} ms)"


def held(entry: dict[str, Any], tau: float) -> bool:
    """Whether an arm's peak raw max logit stayed at most `HELD` tau on every seed (a diverged seed does not)."""
    return all(p is not None and d is None and p <= HELD * tau
               for p, d in zip(entry["peak_max_logit"], entry["diverged_at"]))


def _verdict(diffs: Sequence[float]) -> str:
    """The paired differences' verdict: beyond the seed spread (|mean| > sd), or not; equal at the
    printed four decimals counts as no difference."""
    mean, sd = mean_sd(diffs)
    if round(mean, 4) == 0 and round(max(map(abs, diffs)), 4) == 0:
        return "the same to four decimals"
    if len(diffs) == 1:
        return "one seed: no spread to judge it by"
    return ("higher beyond the seed spread" if mean - sd > 0 else "lower beyond the seed spread" if mean + sd < 0
            else "within the seed spread")


def segment_reading(fig: dict[str, Any], arms: Sequence[Any], rate: tuple[str, str]) -> str:
    """The plain-words reading of one segment: what each arm did to the max logit, the loss and the
    step. ``rate``: the segment's short name and its rates in words (`muonclip.app.guards.segment_names`)."""
    tau, n = fig["tau"], len(fig["seeds"])
    by = fig["arms"]
    costs = fig.get("step_cost", {})
    seeds_text = "one seed (its differences have no spread to judge them by)" if n == 1 else f"{n} seeds"
    parts = [f"At {rate[0]}: {rate[1]}; {fig['steps']} steps, tau = {tau:g}, {seeds_text}."]
    muon = by.get("muon")
    if muon is not None:
        peaks = [p for p in muon["peak_max_logit"] if p is not None]
        div = sum(d is not None for d in muon["diverged_at"])
        parts.append(f"Plain Muon's max logit reaches "
                     f"{span([p / tau for p in peaks], '.2f' if max(peaks) < 10 * tau else '.1f')} times tau"
                     + (f" and diverges on {div} of {n} seeds" if div else "") + ";")
    clauses = []
    for arm in arms:
        if arm.name == "muon":
            continue
        e = by[arm.name]
        peaks = [p for p in e["peak_max_logit"] if p is not None]
        if not peaks:
            clauses.append(f"{e['label']} diverged before its first step was recorded")
            continue
        where = f"{span([p / tau for p in peaks], '.2f' if max(peaks) < 10 * tau else '.1f')} times tau"
        if arm.softcap:
            top = max(p for p in e["softmax_peak"] if p is not None)
            what = f"lets the raw logits reach {where} while the softmax sees at most {top:.3g} (c = {fig['cap']:g})"
        elif arm.optimizer == "adamw" and not arm.qk_norm:
            what = f"reaches {where}"
        else:
            what = f"{'holds' if held(e, tau) else 'does not hold'} the max logit ({where})"
        diffs = [d for d in e["minus_muon"] if d is not None]
        verdict = "" if len(diffs) == 1 and not _verdict(diffs).startswith("the same") else f" ({_verdict(diffs)})"
        loss = (f", ends {_pm(diffs, '+.4f')} against plain Muon on the same seed{'s' if len(diffs) > 1 else ''}"
                f"{verdict}" if diffs and arm.optimizer != "adamw" else
                f", ends at {_pm([v for v in e['final_val_loss'] if v is not None], '.3f')}"
                if any(v is not None for v in e["final_val_loss"]) else "")
        div = [d for d in e["diverged_at"] if d is not None]
        if div:
            loss += f", diverges on {len(div)} of {n} seeds"
        cost = costs.get(arm.name, {})
        step = f", step {cost['ratio']:.2f}x plain Muon's" if "ratio" in cost else ""
        clauses.append(f"{e['label']} {what}{loss}{step}")
    parts.append("; ".join(clauses) + ".")
    return " ".join(parts)


def guards_reading(segments: dict[str, dict[str, Any]], arms: Sequence[Any], rates: dict[str, tuple[str, str]]) -> str:
    """The reading over every segment: one paragraph each, then which guard held the logits, which
    cost loss and which cost time, in plain words.

    ``rates``: segment -> (its short name, e.g. "Muon's tuned rate"; its rates in words), as
    `muonclip.app.guards.segment_names` gives them.
    """
    paragraphs = [segment_reading(fig, arms, rates[seg]) for seg, fig in segments.items()]
    guards = [a for a in arms if a.name != "muon" and a.optimizer != "adamw"]
    hold = [a.label for a in guards if all(held(fig["arms"][a.name], fig["tau"]) for fig in segments.values())]
    costly, slow = [], []
    for a in guards:
        for seg, fig in segments.items():
            diffs = [d for d in fig["arms"][a.name]["minus_muon"] if d is not None]
            if seg == "tuned" and len(diffs) > 1 and _verdict(diffs).startswith("higher"):
                costly.append(f"{a.label} ({_pm(diffs, '+.4f')})")
            cost = fig.get("step_cost", {}).get(a.name, {})
            if "ratio" in cost and cost["ratio"] > COST_NOTICED:
                slow.append(f"{a.label} {cost['ratio']:.2f}x ({rates[seg][0]})")
    cap = next(iter(segments.values()))["cap"]
    summary = [f"In short: {_list(hold) or 'no guard'} held the raw max logit within {HELD:g} tau on every seed "
               "of every segment"
               + (f"; soft-capping bounds what the softmax sees below c = {cap:g} by construction, whatever the raw "
                  "logits do" if any(a.softcap for a in guards) else "") + "."]
    if "tuned" in segments:
        summary.append(f"At {rates['tuned'][0]}, higher final loss than plain Muon beyond the seed spread: "
                       f"{_list(costly) or 'none'}.")
    summary.append(f"A step dearer than plain Muon's by more than {100 * (COST_NOTICED - 1):.0f}%: "
                   f"{_list(slow) or 'none'} (timed interleaved in one process: the ratio, not the milliseconds, "
                   "carries to another load).")
    return "\n\n".join([*paragraphs, " ".join(summary)])


def _list(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1] if items else ""


def plot_guards(runs: dict[str, dict[tuple[str, int], Path]], segments: dict[str, dict[str, Any]],
                arms: Sequence[Any], cap: float, out_dir: Path, titles: dict[str, str] | None = None) -> Path:
    """``max_logit.png``: the max logit per step of every arm and seed, one panel per segment
    (``titles``: segment -> its name; log scale; tau and 3 tau drawn; soft-capping's capped logit
    dashed; a diverged run's last step marked with x). QK-Clip's values at or below tau may be the
    gated capture's upper bounds (`muonclip.app.report`), which its legend says."""
    plt = pyplot()

    colors = {"muon": "tab:orange", "muonclip": "tab:green", "muon-qknorm": "tab:purple", "muon-softcap": "tab:red",
              "adamw": "tab:blue", "adamw-qknorm": "tab:cyan"}
    fig, axes = plt.subplots(1, len(segments), figsize=(6.5 * len(segments), 4.6), squeeze=False)
    for ax, (segment, figs) in zip(axes[0], segments.items()):
        tau = figs["tau"]
        first = min(figs["seeds"])
        for arm in arms:
            for s in figs["seeds"]:
                rows = [r for r in read_rows(runs[segment][(arm.name, s)]) if r.get("max_logit") is not None]
                xs, ys = [r["step"] for r in rows], [r["max_logit"] for r in rows]
                color = colors.get(arm.name)
                bound = any(r.get("max_logit_is_bound") for r in rows)  # the gated capture's bounds at or below tau
                ax.plot(xs, ys, color=color, lw=1, alpha=0.8,
                        label=(arm.label + (" (at or below tau: an upper bound, from the LSE)" if bound else ""))
                        if s == first else None)
                if arm.softcap:
                    ax.plot(xs, [cap * math.tanh(y / cap) for y in ys], color=color, lw=1, ls="--", alpha=0.8,
                            label=f"{arm.label}: what the softmax sees" if s == first else None)
                if figs["arms"][arm.name]["diverged_at"][figs["seeds"].index(s)] is not None and xs:
                    ax.scatter([xs[-1]], [ys[-1]], marker="x", color=color, s=40)
        ax.axhline(tau, color="black", ls="--", lw=0.8, label=f"tau = {tau:g}")
        ax.axhline(3 * tau, color="black", ls=":", lw=0.8, label=f"3 tau = {3 * tau:g}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("max attention logit (before clip or cap)")
        ax.set_title(f"{(titles or {}).get(segment, segment)}: Muon's arms at lr {figs['lr_muon']:g}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return save_figure(plt, fig, out_dir / "max_logit.png")
