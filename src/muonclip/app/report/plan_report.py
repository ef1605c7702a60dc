"""The table and the plot of ``muonclip plan`` (`muonclip.app.plan.make_plan`'s dict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def si(x: float, unit: str = "") -> str:
    """``x`` with an SI prefix, 3 significant digits: ``1.89e14`` -> ``"189T"``."""
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}"


def size(b: float) -> str:
    """Bytes in binary units: ``"17.1 GiB"``."""
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if b >= scale * 1000 / 1024:  # never four digits of the smaller unit
            return f"{b / scale:.3g} {name}"
    return f"{b:.0f} B"


def seconds(s: float) -> str:
    """``"12.3 ms"``, ``"1.23 s"``."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


ROWS = (
    # (label, key, formatter, which optimizers)
    ("Newton-Schulz flops, owner plan", "ns_flops", si, "Muon, MuonClip"),
    ("V gathered to owners: sent", "gather_sent", size, "Muon, MuonClip"),
    ("V gathered to owners: received", "gather_recv", size, "Muon, MuonClip"),
    ("results scattered: sent", "scatter_sent", size, "Muon, MuonClip"),
    ("results scattered: received", "scatter_recv", size, "Muon, MuonClip"),
    ("agreement all-reduces (every step)", "checks", size, "Muon, MuonClip"),
    ("replica check (first step only)", "first_checks", size, "Muon, MuonClip"),
    ("copies check (first step only)", "first_copies", size, "Muon, MuonClip"),
    ("clip's max-logit all-reduce", "clip", size, "MuonClip"),
    ("optimizer state", "muon_state", size, "Muon, MuonClip"),
    ("optimizer state", "adamw_state", size, "AdamW"),
    ("peak working set (modelled)", "muon_work", size, "Muon, MuonClip"),
    ("peak working set (modelled)", "adamw_work", size, "AdamW"),
    ("step time (modelled)", "muon_seconds", seconds, "Muon"),
    ("step time (modelled)", "muonclip_seconds", seconds, "MuonClip"),
    ("step time (modelled)", "adamw_seconds", seconds, "AdamW"),
)


def _row(label: str, stats: dict[str, float], fmt: Any, who: str, width: int) -> str:
    cells = "".join(f"{fmt(stats[k]):>11}" for k in ("min", "median", "max"))
    return f"  {label:<{width}}{who:<16}{cells}"


def render_plan(plan: dict[str, Any]) -> str:
    """The readable table of ``plan``."""
    m, mesh, dev, step, s = plan["model"], plan["mesh"], plan["device"], plan["step"], plan["summary"]
    lines = [f"muonclip plan: {m['name']}: {m['source']}",
             f"  {si(m['parameters'])} parameters, {si(m['active_parameters'])} per token; {m['layers']} layers, "
             f"{m['muon_matrices']} Muon weights, {m['attention_layers']} attention layers for the clip",
             f"mesh: {mesh['description']}" + (f"; layers per stage {mesh['stage_layers']}" if len(
                 mesh["stage_layers"]) > 1 else "") + f"; wire {plan['wire']}"]
    if dev["measured"]:
        rates = ", ".join(f"{n}: {si(r, 'FLOP/s')}" for n, r in dev["measured"])
        lines.append(f"device: {dev['name']}, measured: matmul {rates}; copy {si(dev['mem_bw'], 'B/s')}")
    else:
        lines.append(f"device: {dev['name']}, published peak {si(dev['peak_flops'], 'FLOP/s')} bfloat16, memory "
                     f"{si(dev['mem_bw'], 'B/s')}, NVLink {si(dev['link_bw'], 'B/s')} per direction, between "
                     f"domains of {dev['domain']} {si(dev['net_bw'], 'B/s')} ({dev['source']})")
    width = max(len(r[0]) for r in ROWS) + 2
    lines += ["", f"per rank, one step ({mesh['world']} ranks){'':<{width - 17}}{'optimizer':<16}"
              f"{'min':>11}{'median':>11}{'max':>11}"]
    clip = not m["clip_note"]
    for label, key, fmt, who in ROWS:
        if not clip:  # the model has no attention layer the clip serves: MuonClip is not planned
            if who == "MuonClip":
                continue
            who = who.replace(", MuonClip", "")
        lines.append(_row(label, s[key], fmt, who, width))
    lines += ["", "who orthogonalises: Newton-Schulz flops per rank and imbalance (max / mean)"]
    for label, key, sent in (("owner plan (muonclip: each matrix once, longest first)", "ns_flops", "ours"),
                             ("owners round robin (Keller Jordan's Muon)", "rr_flops", None),
                             ("no owners: every rank each matrix it holds, whole (Moonlight)", "rep_flops",
                              "rep_recv")):
        st = s[key]
        extra = "" if sent is None else f"; received {size(s[sent]['max'])} max" if sent != "ours" else \
            f"; moved {size(max(s['gather_recv']['max'], s['gather_sent']['max']))} max to owners"
        lines.append(f"  {label}: {si(st['min'])} / {si(st['median'])} / {si(st['max'])}, "
                     f"imbalance {st['imbalance']:.2f}{extra}")
    share = step["share"]
    comm = "" if step["comm_modelled"] else " (no link rate: communication left out; give --link-bw)"
    lines += ["", f"time, a roofline model (compute + memory + communication, no overlap; the slowest rank){comm}:",
              f"  optimizer step: Muon {seconds(step['muon_seconds'])}, "
              + (f"MuonClip {seconds(step['muonclip_seconds'])}, " if clip else "")
              + f"AdamW {seconds(step['adamw_seconds'])}; without owners {seconds(step['replicated_seconds'])}",
              f"  training step at MFU {step['mfu']:.0%}, {step['tokens']:,} tokens of {step['seq_len']}: "
              f"{seconds(step['train_seconds'])} ({si(step['flops_per_token'])} flops per token)",
              f"  optimizer's share of it: Muon {share['muon']:.2%}, "
              + (f"MuonClip {share['muonclip']:.2%}, " if clip else "")
              + f"AdamW {share['adamw']:.2%}; Muon's extra over AdamW {step['muon_vs_adamw']:.2%} of the step",
              f"  Newton-Schulz flops per rank: {step['ns_flops_vs_model']:.2%} of the model's flops per rank",
              "exact (what a real step counts): flops, bytes, state; modelled: working set and time"]
    for note in plan["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_plan(plan: dict[str, Any], path: Path) -> Path:
    """Newton-Schulz flops and bytes moved per rank: the owner plan, owners round robin and no owners
    (every rank orthogonalising what it holds) (PNG)."""
    from .plots import pyplot, save_figure

    plt = pyplot()
    r = plan["ranks"]
    ranks = list(range(len(r["ns_flops"])))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(ranks, r["rep_flops"], color="tab:gray", label="no owners: every rank what it holds")
    top.plot(ranks, r["rr_flops"], color="tab:blue", label="owners round robin")
    top.plot(ranks, r["ns_flops"], color="tab:orange", label="owner plan (muonclip)")
    top.set_ylabel("Newton-Schulz flops")
    top.legend()
    moved = [a + b for a, b in zip(r["gather_recv"], r["scatter_recv"])]
    bottom.plot(ranks, r["rep_recv"], color="tab:gray", label="no owners: received")
    bottom.plot(ranks, moved, color="tab:orange", label="owner plan: gathered + scattered, received")
    bottom.set_ylabel("bytes per step")
    bottom.set_xlabel("rank")
    bottom.legend()
    top.set_title(f"{plan['model']['name']} on {plan['mesh']['description']}")
    return save_figure(plt, fig, path)
