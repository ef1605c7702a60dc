"""`muonclip compare`: the main job. Token efficiency (AdamW against Muon) and stability (Muon against
MuonClip) on the same GPT and data, with seeds, in one run.

The protocol (every value a `RunConfig` field; the defaults are the ``default`` preset's, tuned
by ``--sweep``, see `muonclip.app.sweep`):

* every optimizer at its own peak learning rate and warm-up (tuned on a bracketed log grid),
  linear warm-up then cosine decay to ``min_lr_ratio``, gradient clipping at ``grad_clip``
  (global norm, all optimizers), AdamW betas (0.9, 0.95), decoupled weight decay on matrices;
  the embeddings, tied LM head and norm gains of Muon's runs use AdamW at ``lr_adamw``;
* **token efficiency**: for each of ``seeds`` seeds (``seed``, ``seed + 1``, ...; a seed fixes
  the initial weights and the batch order, shared by the optimizers), Muon trains ``steps``
  steps (1x), and AdamW trains at every budget of ``budgets`` (default 1x, 1.5x, 2x, 3x the tokens),
  each with its own full schedule and its own tuned rate (``lr_adamw_budgets``);
* **stability**: for the same seeds, Muon and MuonClip train ``stability_steps`` steps with no
  weight decay and a constant rate after warm-up, in two segments (``stability_segments``):
  *excessive*, a rescue at ``stability_lr`` (2.5 times Muon's tuned rate) with ``tau =
  stability_tau``, the setting in which plain Muon's attention logits grow without bound and
  QK-Clip holds them; and *tuned*, the same at Muon's tuned rate ``lr_muon`` with ``tau =
  stability_tuned_tau`` set where the clip fires, which answers whether the clip costs anything
  there (clip count and the loss difference MuonClip - Muon, per seed).

The runs go in ``jobs`` worker processes at a time (default: one per core, one thread each;
`muonclip.app.runner`). Output folder::

    <out>/runs/<optimizer>-x<budget>-s<seed>/    one `muonclip train` run folder each
    <out>/stability/<optimizer>-s<seed>/         the excessive-rate segment
    <out>/stability-tuned/<optimizer>-s<seed>/   the tuned-rate segment
    <out>/sweep/                                 with --sweep: every tuning run, sweep.md, sweep.json
    <out>/val_loss.png, budget.png, max_logit.png, clip_events.png
    <out>/summary.md, summary.json               both tables and the reading (muonclip.app.report)

Some presets run a protocol of their own instead (`muonclip.app.compare_runs.OWN_PROTOCOL`, dispatched by
`muonclip.app.main`): ``finetune`` (`muonclip.app.finetune`), ``guards`` and ``guards-mla`` (the guards of the
attention logits side by side, `muonclip.app.guards`), ``ladder`` (the budget-matched ratio at three widths,
`muonclip.app.ladder`); they share the checks before anything is written (`muonclip.app.compare_runs.prepare`).

MuonClip with the default ``tau`` (100) never clips in the efficiency runs (the max logit stays
far below it), so its run there would be Muon's step for step; it runs only where the clip acts.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .compare_runs import EFFICIENCY, OWN_PROTOCOL, plan, prepare, rates_tuned
from .config import TUNED_PRESETS, RunConfig, check_optimizer
from .cores import cpu_name, usable_cores
from .model import orthogonalisation, parameter_count
from .report import (
    NAMES,
    clip_audit,
    clip_audit_markdown,
    efficiency,
    efficiency_markdown,
    experts,
    experts_markdown,
    plot_efficiency,
    plot_stability,
    protocol_markdown,
    reading,
    stability,
    stability_markdown,
    tuned_stability_markdown,
    write_summary,
)
from .runner import run_all
from .sweep import budget_steps, tune


def compare(cfg: RunConfig, out_dir: str | Path, *, optimizers: Sequence[str] = EFFICIENCY, jobs: int | None = None,
            sweep: dict[str, Any] | None = None, progress: bool = True) -> tuple[dict[str, Any], str]:
    """Run the comparison (module docstring) and write the report; return (summary data, printed tables).

    Args:
        cfg: the validated config.
        out_dir: the comparison's folder; must not exist or be empty.
        optimizers: those of the efficiency runs (default AdamW and Muon; AdamW is the reference
            of the ratios, MuonClip may be added).
        jobs: runs at a time (default None: one per core); each run gets ``threads`` threads, or
            the cores divided between the jobs.
        sweep: tune first (`muonclip.app.sweep.tune` with these keyword arguments: ``warmups``,
            ``seeds``, ...) and compare with the tuned values (default None: the config's).
        progress: progress bars on stderr (default True).

    Raises:
        DataError, OutputError, ValueError: bad input (also: the runs would not fit in memory,
            `muonclip.app.memory`); nothing written.
        NonFiniteLossError, Interrupted: from a run (see `muonclip.app.train`).
    """
    if cfg.preset in OWN_PROTOCOL:
        raise ValueError(f"--preset {cfg.preset} runs its own protocol ({OWN_PROTOCOL[cfg.preset]}), not this one: "
                         f"run it with muonclip compare --preset {cfg.preset}")
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    cfg.validate()
    for o in optimizers:
        check_optimizer(o)
    if not optimizers and not (cfg.stability_steps and cfg.stability_segments):
        raise ValueError("nothing to compare: give --optimizers or a stability segment (stability_steps > 0)")
    runs = [(cfg, o) for o in {*optimizers, *(("muon", "muonclip") if cfg.stability_steps else ())}]
    longest = max([budget_steps(cfg, b) for b in cfg.budgets] + [cfg.stability_steps])
    per_seed = sum(map(len, plan(dataclasses.replace(cfg, seeds=1), out_dir, optimizers)))
    cfg, corpus, jobs = prepare(cfg, out_dir, runs, jobs, longest, runs_per_seed=per_seed)

    sections: list[tuple[str, str]] = []
    data: dict[str, Any] = {}
    if sweep is not None:
        tuned = tune(cfg, out_dir / "sweep", corpus, jobs=jobs, progress=progress, **sweep)
        cfg = dataclasses.replace(cfg, **{f"lr_{o}": v for o, v in tuned.lr.items()},
                                  **{f"warmup_{o}": v for o, v in tuned.warmup.items()})
        if "muon" in tuned.lr:
            cfg = dataclasses.replace(cfg, lr_muonclip=tuned.lr["muon"], warmup_muonclip=tuned.warmup["muon"])
        if tuned.budget_lr:
            cfg = dataclasses.replace(cfg, lr_adamw_budgets=tuple(tuned.budget_lr[float(b)] for b in cfg.budgets))
        sections.append(("Learning-rate sweep", (out_dir / "sweep" / "sweep.md").read_text(encoding="utf-8")
                         .split("\n", 2)[2]))
        data["tuned"] = {"sets": tuned.sets(), "notes": tuned.notes}

    eff_specs, stab_specs, tuned_specs = plan(cfg, out_dir, optimizers)
    specs = sorted([*eff_specs.values(), *stab_specs.values(), *tuned_specs.values()],
                   key=lambda s: -s.cfg.steps)  # longest first
    outcomes = {o.spec.run_dir: o for o in run_all(specs, corpus, jobs=jobs, progress=progress)}
    assert all(o.result is not None for o in outcomes.values())

    n_params = parameter_count(cfg)
    tokens = cfg.steps * cfg.batch_size * cfg.block_size
    ctx = {"model": f"a {cfg.n_layer}-layer, {cfg.n_embd}-wide byte-level GPT ({n_params / 1e6:.2f}M parameters)",
           "tokens_per_param": tokens / n_params, "params": n_params,
           "rates": rates_phrase(cfg, sweep is not None, optimizers),
           "seeds": [cfg.seed + i for i in range(cfg.seeds)], "cpu": cpu_name(),
           "stability_lr": cfg.stability_lr, "lr_muon": cfg.lr_muon, "rates_tuned": rates_tuned(cfg, sweep is not None)}
    eff = stab = None
    tables = []
    if eff_specs:
        runs = {k: s.run_dir for k, s in eff_specs.items()}
        eff = efficiency(runs, cfg.budgets)
        plot_efficiency(runs, eff, out_dir)
        title = "Token efficiency: " + ", ".join(NAMES.get(o, o) for o in optimizers)
        sections.insert(0, (title, efficiency_markdown(eff)))
        tables.append(efficiency_markdown(eff))
        data["efficiency"] = eff
    if stab_specs:
        runs2 = {k: s.run_dir for k, s in stab_specs.items()}
        stab = stability(runs2, cfg.stability_tau)
        plot_stability(runs2, cfg.stability_tau, out_dir)
        sections.insert(1 if eff_specs else 0, (
            f"Stability, a rescue at an excessive rate: Muon against MuonClip at lr {cfg.stability_lr:g}",
            stability_markdown(stab)))
        tables.append(stability_markdown(stab))
        data["stability"] = stab
    tuned_stab = None
    if tuned_specs:
        runs3 = {k: s.run_dir for k, s in tuned_specs.items()}
        tuned_stab = stability(runs3, cfg.stability_tuned_tau)
        where = len(sections) - (1 if sweep is not None else 0)
        rate = "Muon's tuned rate" if rates_tuned(cfg, sweep is not None) else "Muon's rate (not tuned)"
        sections.insert(where, (f"Stability at {rate}: Muon against MuonClip at lr {cfg.lr_muon:g}, "
                                f"tau {cfg.stability_tuned_tau:g}", tuned_stability_markdown(tuned_stab)))
        tables.append(tuned_stability_markdown(tuned_stab))
        data["stability_tuned"] = tuned_stab
    every = {s.label: s.run_dir for s in specs}
    expert_rows = experts(every)
    if expert_rows:
        sections.append(("Experts: each expert's update RMS", experts_markdown(expert_rows)
                         + "\n\nPer unit learning rate, weight decay removed (`muonclip.app.probes.ExpertRMS`). Muon "
                         "orthogonalises each expert of a 3-D stack on its own, in one batched call: every expert "
                         "moves by the same RMS however many tokens it was routed."))
        data["experts"] = expert_rows
    audit = clip_audit({s.label: s.run_dir for s in specs if s.optimizer == "muonclip"})
    if audit["events"]:
        sections.append(("QK-Clip on MLA heads: Kimi K2's rule, measured", clip_audit_markdown(audit)
                         + "\n\nEach factor is the ratio of the row norms just after and just before the clip "
                         "(`muonclip.app.probes.MLAClipAudit`); in parentheses, what K2's rule asks."))
        data["clip_audit"] = audit
    text = reading(ctx, eff, stab, tuned_stab)
    sections.append(("Protocol: what was tuned, what was not", protocol_markdown(cfg, optimizers, sweep is not None)))
    wall = time.perf_counter() - t0
    context = _context(cfg, corpus, optimizers, n_params, jobs, wall, rates_tuned(cfg, sweep is not None))
    data.update(config=cfg.to_dict(), reading=text, wall_time=wall)
    compared = [*optimizers, *(("muon", "muonclip") if stab_specs or tuned_specs else ())]
    title = "muonclip compare: " + " vs ".join(NAMES.get(o, o) for o in dict.fromkeys(compared))
    write_summary(out_dir / "summary.md", title, context, text, sections, data)
    orth = [f"Muon's orthogonalisation: {orthogonalisation(cfg)}"] if set(compared) - {"adamw"} else []
    return data, "\n\n".join([*tables, text, *orth])


def rates_phrase(cfg: RunConfig, swept: bool, optimizers: Sequence[str] = ()) -> str:
    """Where the learning rates come from, in words: this run's sweep, a tuned preset's values, or
    rates that were not tuned (another preset, or changed by --set)."""
    if swept:
        return "the learning rates and warm-ups tuned by this run's sweep"
    if cfg.preset in TUNED_PRESETS:
        same = rates_tuned(cfg, False)
        variants = [o for o in optimizers if o in ("normuon", "muon_cautious", "muon_8bit")]
        if same:
            return (f"the `{cfg.preset}` preset's learning rates and warm-ups, tuned by `muonclip compare --sweep` "
                    "(docs/compare.md)" + (f"; {', '.join(variants)}: rates tuned by the same protocol at Muon's "
                                           "warm-up (benchmarks/tune_muon_variants.py)" if variants else ""))
        return "learning rates or warm-ups changed from the tuned preset's: not tuned"
    return (f"the `{cfg.preset}` preset's learning rates and warm-ups, which were not tuned (set by hand; only the "
            "`default` preset's were tuned by `muonclip compare --sweep`)")


def _context(cfg: RunConfig, corpus: Any, optimizers: Sequence[str], n_params: int, jobs: int,
             wall: float, tuned: bool) -> list[str]:
    tokens = cfg.steps * cfg.batch_size * cfg.block_size
    seeds = ", ".join(str(cfg.seed + i) for i in range(cfg.seeds))
    rates = "; ".join(f"{o} lr {cfg.lr(o):.3g}, warm-up {cfg.warmup(o)}" for o in optimizers)
    if cfg.lr_adamw_budgets and "adamw" in optimizers:
        rates += "; AdamW lr per budget " + ", ".join(f"{b:g}x: {v:.3g}" for b, v in zip(cfg.budgets,
                                                                                          cfg.lr_adamw_budgets))
    lines = [
        f"preset `{cfg.preset}`; model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context "
        f"{cfg.block_size}, attention {cfg.attention}"
        + (f", {cfg.n_expert} experts (top {cfg.n_expert_active}, {cfg.n_shared_expert} shared)" if cfg.n_expert
           else "") + f"; {n_params / 1e6:.3f}M parameters",
    ]
    if optimizers:
        lines += [
            f"token efficiency: {', '.join(optimizers)}; batch {cfg.batch_size} x {cfg.block_size} tokens, "
            f"{cfg.steps} steps = {tokens / 1e6:.2f}M tokens at 1x ({tokens / n_params:.1f} tokens per parameter)"
            + ("; AdamW at " + ", ".join(f"{b:g}x" for b in cfg.budgets) if "adamw" in optimizers else "")
            + f"; seeds {seeds}",
            f"{rates}; cosine to {cfg.min_lr_ratio:g} of the peak; gradient clipping at global norm "
            f"{cfg.grad_clip:g}; AdamW betas (0.9, 0.95); weight decay {cfg.weight_decay:g} on matrices; the "
            "embeddings, tied head and norm gains of Muon's runs use AdamW at lr_adamw",
        ]
    if cfg.stability_steps and "excessive" in cfg.stability_segments:
        lines.append(f"stability, a rescue at an excessive rate: Muon and MuonClip, {cfg.stability_steps} steps, lr "
                     f"{cfg.stability_lr:g} ({cfg.stability_lr / cfg.lr_muon:.1f} times Muon's "
                     f"{'tuned ' if tuned else ''}rate{'' if tuned else ', not tuned'}) constant after "
                     f"warm-up {cfg.warmup('muon')}, no weight decay, tau {cfg.stability_tau:g}; seeds {seeds}")
    if cfg.stability_steps and "tuned" in cfg.stability_segments:
        lines.append(f"stability at Muon's {'tuned rate' if tuned else 'rate (not tuned)'}: the same segment at lr "
                     f"{cfg.lr_muon:g}, tau "
                     f"{cfg.stability_tuned_tau:g}; seeds {seeds}")
    lines += [
        f"data: {corpus.source} ({corpus.train.numel() / 1e6:.2f}M train bytes, {corpus.val.numel() / 1e6:.2f}M "
        f"validation bytes; byte tokens; validation on {cfg.eval_batches} batches every {cfg.eval_every} steps)",
        f"machine: {cpu_name()} ({platform.machine()}), {usable_cores()} cores, {jobs} runs at a time with "
        f"{cfg.threads} thread(s) each; torch {torch.__version__}; Muon's orthogonalisation in "
        f"{orthogonalisation(cfg)}; wall time of the whole comparison {wall:.0f} s. "
        "Every run is seeded, so the same figures come back on the same CPU kind and torch version; another CPU "
        "kind runs other kernels and its losses differ (by up to about 0.01 between two kinds measured)",
    ]
    return lines
