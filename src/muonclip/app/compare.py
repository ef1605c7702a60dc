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

Some presets run a protocol of their own instead (`OWN_PROTOCOL`): ``finetune``
(`muonclip.app.finetune`), ``guards`` and ``guards-mla`` (the guards of the attention logits side by
side, `muonclip.app.guards`), ``ladder`` (the budget-matched ratio at three widths,
`muonclip.app.ladder`); they share this module's checks before anything is written (`prepare`).

MuonClip with the default ``tau`` (100) never clips in the efficiency runs (the max logit stays
far below it), so its run there would be Muon's step for step; it runs only where the clip acts.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .config import OPTIMIZERS, TUNED_PRESETS, RunConfig, check_optimizer, make_config
from .cores import usable_cores
from .data import Corpus, check_fits, corpus_size, corpus_warnings, load_corpus
from .memory import check_memory
from .model import build_model, orthogonalisation
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
from .runfolder import OutputError, check_outside_runs, check_writable, inspect_folder
from .runner import RunSpec, run_all
from .sweep import budget_steps, tune
from .train_setup import check_threads

EFFICIENCY = ("adamw", "muon")
OWN_PROTOCOL = {"finetune": "muonclip.app.finetune", "guards": "muonclip.app.guards",
                "guards-mla": "muonclip.app.guards", "ladder": "muonclip.app.ladder"}
"""The presets that run a protocol of their own instead of this module's, and its module."""


def adamw_budget_lr(cfg: RunConfig, budget: float) -> float:
    """AdamW's peak rate at ``budget``: its entry of ``lr_adamw_budgets``, else ``lr_adamw``."""
    if cfg.lr_adamw_budgets:
        return cfg.lr_adamw_budgets[list(cfg.budgets).index(budget)]
    return cfg.lr_adamw


def stability_config(cfg: RunConfig, segment: str = "excessive") -> RunConfig:
    """A stability segment's config: no weight decay, a constant rate after warm-up (for Muon and
    MuonClip alike), ``stability_steps`` steps; ``"excessive"``: rate ``stability_lr``, ``tau =
    stability_tau``; ``"tuned"``: Muon's tuned rate ``lr_muon``, ``tau = stability_tuned_tau``."""
    warm = cfg.warmup("muon")
    lr, tau = (cfg.stability_lr, cfg.stability_tau) if segment == "excessive" else \
        (cfg.lr_muon, cfg.stability_tuned_tau)
    return dataclasses.replace(cfg, steps=cfg.stability_steps, weight_decay=0.0, min_lr_ratio=1.0,
                               lr_muon=lr, lr_muonclip=lr, tau=tau, warmup_muon=warm, warmup_muonclip=warm)


def plan(cfg: RunConfig, out_dir: Path, optimizers: Sequence[str]) -> tuple[
        dict[tuple[str, float, int], RunSpec], dict[tuple[str, int], RunSpec], dict[tuple[str, int], RunSpec]]:
    """The runs of a comparison: efficiency runs keyed (optimizer, budget, seed), and the stability
    runs of the excessive-rate and the tuned-rate segments, each keyed (optimizer, seed)."""
    seeds = [cfg.seed + i for i in range(cfg.seeds)]
    eff: dict[tuple[str, float, int], RunSpec] = {}
    for s in seeds:
        for opt in optimizers:
            for b in (cfg.budgets if opt == "adamw" else (1.0,)):
                c = dataclasses.replace(cfg, seed=s, steps=budget_steps(cfg, b))
                if opt == "adamw":
                    c = dataclasses.replace(c, lr_adamw=adamw_budget_lr(cfg, b))
                name = f"{opt}-x{b:g}-s{s}"
                eff[(opt, b, s)] = RunSpec(c, opt, out_dir / "runs" / name, name)
    segments: dict[str, dict[tuple[str, int], RunSpec]] = {"excessive": {}, "tuned": {}}
    folders = {"excessive": ("stability", "stability"), "tuned": ("stability-tuned", "stability at the tuned rate")}
    for segment in (cfg.stability_segments if cfg.stability_steps else ()):
        sc = stability_config(cfg, segment)
        folder, label = folders[segment]
        for s in seeds:
            for opt in ("muon", "muonclip"):
                name = f"{opt}-s{s}"
                segments[segment][(opt, s)] = RunSpec(dataclasses.replace(sc, seed=s), opt, out_dir / folder / name,
                                                      f"{label} {name}")
    return eff, segments["excessive"], segments["tuned"]


def prepare(cfg: RunConfig, out_dir: Path, runs: Sequence[tuple[RunConfig, str]], jobs: int | None,
            longest: int, *, resume: bool = False, runs_per_seed: int = 0) -> tuple[RunConfig, Corpus, int]:
    """Every check of a comparison before anything is written, then its folder created: ``jobs``
    (default None: one per core) and ``threads`` (the cores shared between the jobs when 0), the
    memory of each of ``runs`` (config, optimizer) with ``jobs`` of them at a time, and of the
    plan of ``seeds`` times ``runs_per_seed`` runs (`muonclip.app.memory.plan_memory`), the output
    folder (absent or empty, writable; ``resume``: the caller checked that it holds the same
    comparison stopped part way, default False), the corpus (loaded; its warnings for a run of
    ``longest`` steps printed). Returns the config with its threads set, the corpus and the jobs.

    Raises:
        DataError, OutputError, ValueError: bad input; nothing written.
    """
    cores = usable_cores()
    jobs = cores if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    check_threads(cfg.threads)
    if not cfg.threads:
        cfg = dataclasses.replace(cfg, threads=max(1, cores // jobs))
    for run_cfg, o in runs:
        check_memory(run_cfg, o, torch.device("cpu"), ranks_here=jobs, sharing="runs at a time",
                     corpus=corpus_size(cfg.data), runs_per_seed=runs_per_seed)  # every worker reads its own copy
    check_outside_runs(out_dir)
    if inspect_folder(out_dir).kind == "run":
        raise OutputError(f"--out {out_dir} already holds a run of muonclip train; choose a new folder for the "
                          "comparison")
    if not resume and out_dir.exists() and any(out_dir.iterdir()):
        raise OutputError(f"--out {out_dir} is not empty; choose a new folder so nothing is overwritten")
    check_writable(out_dir)
    corpus = load_corpus(cfg.data, cfg.val_fraction)
    check_fits(corpus, cfg.batch_size, cfg.block_size)
    for warning in corpus_warnings(corpus, steps=longest, batch_size=cfg.batch_size, block_size=cfg.block_size):
        print(f"muonclip: warning: {warning}", file=sys.stderr)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"--out {out_dir}: cannot create it ({e}); choose another --out") from None
    return cfg, corpus, jobs


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
    if cfg.preset in OWN_PROTOCOL:  # another protocol: its own module
        if sweep is not None or list(optimizers) != list(EFFICIENCY):
            raise ValueError(f"--preset {cfg.preset} runs its own protocol ({OWN_PROTOCOL[cfg.preset]}): "
                             "--optimizers and --sweep do not apply to it")
        if cfg.preset == "finetune":
            from .finetune import compare_finetune

            return compare_finetune(cfg, out_dir, progress=progress)
        if cfg.preset == "ladder":
            from .ladder import compare_ladder

            return compare_ladder(cfg, out_dir, jobs=jobs, progress=progress)
        from .guards import compare_guards

        return compare_guards(cfg, out_dir, jobs=jobs, progress=progress)
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


def rates_tuned(cfg: RunConfig, swept: bool) -> bool:
    """Whether ``cfg``'s rates and warm-ups are tuned ones: this run's sweep, or a tuned preset's
    values unchanged (`muonclip.app.config.TUNED_PRESETS`)."""
    if swept:
        return True
    if cfg.preset not in TUNED_PRESETS:
        return False
    preset = make_config(cfg.preset)
    return all(cfg.lr(o) == preset.lr(o) and cfg.warmup(o) == preset.warmup(o) for o in OPTIMIZERS)


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


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; elsewhere `platform.processor`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parameter_count(cfg: RunConfig) -> int:
    """The parameters of the reference GPT of ``cfg`` (tied weights once), counted on the meta device."""
    state = torch.random.get_rng_state()  # build_model seeds the global generator
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in build_model(cfg).parameters())
    finally:
        torch.random.set_rng_state(state)


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
