"""The plots of `muonclip compare`'s report (PNG, matplotlib's Agg backend): ``val_loss.png``,
``budget.png``, ``max_logit.png``, ``clip_events.png`` (what each shows: `muonclip.app.report`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..metrics import read_rows

COLORS = {"adamw": "tab:blue", "muon": "tab:orange", "muonclip": "tab:green", "normuon": "tab:red",
          "muon_cautious": "tab:purple", "muon_8bit": "tab:brown"}
STYLES = {"muonclip": "--"}  # MuonClip equals Muon until the clip first fires: dashed, so both lines stay visible


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (imported here: matplotlib is the cli extra's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(figsize: tuple[float, float]) -> tuple[Any, Any]:
    plt = pyplot()
    return plt, plt.subplots(figsize=figsize)


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` (tight layout, 110 dpi), close it, return ``path``."""
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
    paths = [save_figure(plt, fig, out_dir / "val_loss.png")]

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
    paths.append(save_figure(plt, fig, out_dir / "budget.png"))
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
    paths = [save_figure(plt, fig, out_dir / "max_logit.png")]

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
    paths.append(save_figure(plt, fig, out_dir / "clip_events.png"))
    return paths
