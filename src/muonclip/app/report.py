"""The report of `muonclip compare`: a summary table and three plots, from the runs' metrics.

Summary columns (one row per optimizer):

* ``final val loss`` — validation loss after the last step.
* ``tokens to AdamW's final`` — training tokens after which the run's validation loss first
  reaches AdamW's final validation loss (linear interpolation between validation points;
  "not reached" if it never does), and that as a fraction of AdamW's tokens. Moonlight
  reports Muon needing about 52% of AdamW's compute for the same loss.
* ``peak max logit`` — the largest per-head max logit seen in any step (before QK-Clip
  scaled it); ``final max logit`` — the last step's.
* ``clip events`` — head-steps scaled by QK-Clip (a head clipped on k steps counts k) and the
  number of steps with any clip.
* ``wall time`` — seconds of the run (training + validation + checkpoints);
  ``step time`` — median seconds of forward + backward + optimizer step (first 5 steps
  skipped as warm-up) and its ratio to AdamW's, measured in the same process.

Plots (PNG): ``val_loss.png`` (validation loss against tokens), ``max_logit.png`` (max logit
against steps, tau as a dashed line), ``clip_events.png`` (heads clipped per step).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .metrics import read_rows

COLORS = {"adamw": "tab:blue", "muon": "tab:orange", "muonclip": "tab:green"}
# MuonClip equals Muon until the clip first fires: dashed, so both lines stay visible.
STYLES = {"muonclip": "--"}


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
    """Per-run figures from its metric rows (see the module docstring)."""
    if not rows:
        raise ValueError("the run wrote no metrics")
    evals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    logits = [r["max_logit"] for r in rows if r.get("max_logit") is not None]
    times = [r["step_time"] for r in rows[5:]] or [r["step_time"] for r in rows]
    return {
        "steps": rows[-1]["step"],
        "tokens": rows[-1]["tokens"],
        "final_val_loss": evals[-1] if evals else None,
        "peak_max_logit": max(logits) if logits else None,
        "final_max_logit": logits[-1] if logits else None,
        "clip_events": sum(int(r.get("clipped_heads") or 0) for r in rows),
        "clip_steps": sum(1 for r in rows if r.get("clipped_heads")),
        "wall_time": rows[-1]["elapsed"],
        "step_time": statistics.median(times),
    }


def summarize(runs: dict[str, Path], lrs: dict[str, float]) -> list[dict[str, Any]]:
    """One summary dict per optimizer in ``runs`` (name -> run folder); AdamW is the reference if present."""
    out = {name: {"optimizer": name, "lr": lrs.get(name), **summarize_run(read_rows(d))} for name, d in runs.items()}
    ref = out.get("adamw")
    for name, s in out.items():
        s["tokens_to_target"] = s["ratio_to_target"] = s["step_time_ratio"] = None
        if ref is None:
            continue
        if ref["final_val_loss"] is not None:
            tt = tokens_to_reach(read_rows(runs[name]), ref["final_val_loss"])
            s["tokens_to_target"] = tt
            s["ratio_to_target"] = None if tt is None else tt / ref["tokens"]
        s["step_time_ratio"] = s["step_time"] / ref["step_time"]
    return list(out.values())


def _fmt(v: Any, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def markdown_table(summary: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    head = ("| optimizer | lr | final val loss | tokens to AdamW's final (ratio) | peak max logit | "
            "final max logit | clip events (steps) | wall time | step time (ratio) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summary:
        if s["tokens_to_target"] is None:
            reach = "not reached" if s["step_time_ratio"] is not None else "-"
        else:
            reach = f"{s['tokens_to_target'] / 1e6:.2f}M ({s['ratio_to_target']:.2f})"
        lines.append(
            f"| {s['optimizer']} | {_fmt(s['lr'], '.3g')} | {_fmt(s['final_val_loss'], '.4f')} | {reach} | "
            f"{_fmt(s['peak_max_logit'], '.1f')} | {_fmt(s['final_max_logit'], '.1f')} | "
            f"{s['clip_events']} ({s['clip_steps']}) | {s['wall_time']:.0f}s | "
            f"{1000 * s['step_time']:.0f}ms ({_fmt(s['step_time_ratio'], '.2f')}) |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, Path], out_dir: Path, tau: float) -> list[Path]:
    """Write val_loss.png, max_logit.png and clip_events.png into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {name: read_rows(d) for name, d in runs.items()}
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in rows.items():
        ev = [r for r in rs if r.get("val_loss") is not None]
        ax.plot([r["tokens"] for r in ev], [r["val_loss"] for r in ev], marker=".", label=name, color=COLORS.get(name),
                ls=STYLES.get(name, "-"))
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("Validation loss")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out_dir / "val_loss.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in rows.items():
        pts = [r for r in rs if r.get("max_logit") is not None]
        ax.plot([r["step"] for r in pts], [r["max_logit"] for r in pts], label=name, color=COLORS.get(name), lw=1.2,
                ls=STYLES.get(name, "-"))
    ax.axhline(tau, color="red", ls="--", lw=1, label=f"tau = {tau:g}")
    ax.set_xlabel("step")
    ax.set_ylabel("max attention logit (all layers, heads)")
    ax.set_title("Max logit per step (before QK-Clip)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(out_dir / "max_logit.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    any_clip = False
    for name, rs in rows.items():
        steps = [r["step"] for r in rs if r.get("clipped_heads")]
        if steps or name == "muonclip":
            any_clip = any_clip or bool(steps)
            ax.bar(steps, [r["clipped_heads"] for r in rs if r.get("clipped_heads")], width=1.0, label=name,
                   color=COLORS.get(name))
    ax.set_xlabel("step")
    ax.set_ylabel("heads clipped")
    ax.set_title("QK-Clip events" + ("" if any_clip else " (none: no head passed tau)"))
    ax.set_xlim(0, max((rs[-1]["step"] for rs in rows.values() if rs), default=1) + 1)
    ax.grid(alpha=0.3)
    if any_clip:
        ax.legend()
    paths.append(out_dir / "clip_events.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_summary(path: Path, title: str, summary: list[dict[str, Any]], context: list[str],
                  sweep: list[dict[str, Any]] | None = None) -> str:
    """Write ``summary.md`` (title, context, the table, the sweep if any) and ``summary.json``; return the table."""
    table = markdown_table(summary)
    parts = [f"# {title}", "", *[f"- {c}" for c in context], "", table, ""]
    if sweep:
        parts += ["## Learning-rate sweep", "", "| optimizer | lr | final val loss |", "|---|---|---|"]
        parts += [f"| {s['optimizer']} | {s['lr']:.3g} | "
                  f"{_fmt(s['final_val_loss'], '.4f', 'diverged at step ' + str(s.get('diverged_at')))} |"
                  for s in sweep]
        parts.append("")
    parts += ["Columns: see `muonclip.app.report` (tokens to AdamW's final = training tokens until the validation "
              "loss first reaches AdamW's final one; ratio = that / AdamW's tokens).", ""]
    path.write_text("\n".join(parts), encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps({"summary": summary, "sweep": sweep}, indent=2), encoding="utf-8")
    return table


__all__ = ["markdown_table", "plot", "summarize", "summarize_run", "tokens_to_reach", "write_summary"]
