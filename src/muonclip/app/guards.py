"""`muonclip compare --preset guards` (and ``guards-mla``): the guards of the attention logits side by side.

Which guard holds the max attention logit under Muon, at what cost in loss and in time? Each arm
is one guard (or none) on the same model, data, seeds and schedule (`ARMS`):

* ``muon``: Muon with no guard;
* ``muonclip``: MuonClip, Muon + QK-Clip at ``tau`` (Kimi K2; on MLA heads K2's rule: q^C and
  k^C by sqrt(gamma), q^R by gamma, the shared k^R untouched);
* ``muon-qknorm``: Muon on the model with QK-Norm, RMSNorm on q and k of each head (Qwen3, OLMo
  2, Gemma 3; the reference model's ``qk_norm``). On MLA it normalises the non-rotary q^C and k^C
  of each head only: the rotary k^R is one key shared by every head and q^R meets only it, so the
  rotary part of the logit stays unguarded; and with the keys absorbed at inference (k^C never
  materialised) a norm on k^C could not be computed there, which is why K2 did not use it. Both
  are stated in the report;
* ``muon-softcap``: Muon on the model with Gemma 2's logit soft-capping, the softmax over
  ``c * tanh(s / c)`` with ``c = attn_softcap`` (the preset's 30, equal to tau: both guards then
  hold what the softmax sees to the same level); QK-Clip and soft-capping together are refused
  by the model (`muonclip.models.GPTConfig`);
* ``adamw`` and ``adamw-qknorm``: AdamW without and with QK-Norm, the reference point (on the MHA
  model of ``guards`` only).

Every arm trains the stability segment of `muonclip.app.compare` (``stability_steps`` steps, no
weight decay, a constant rate after warm-up, ``seeds`` seeds) in each of ``stability_segments``:
*excessive*, Muon's arms at ``stability_lr``; *tuned*, Muon's arms at ``lr_muon`` (the ``default``
preset's tuned rate for ``guards``; ``guards-mla``'s is set by hand and the report says so).
QK-Clip's tau is ``stability_tau`` and ``stability_tuned_tau``. AdamW's arms run at the same
multiple of AdamW's own rate (``lr_adamw * stability_lr / lr_muon`` in the excessive segment,
``lr_adamw`` in the other) with AdamW's own warm-up. A run whose loss turns non-finite is kept
and reported as diverged (its step), never dropped.

Measured per arm (`muonclip.app.report.guards`): the peak of the raw max logit (before any clip
or cap) per seed, and for soft-capping also the capped peak, ``c * tanh(peak / c)``; the final
validation loss, mean ± sd over the seeds that finished, and its difference from plain Muon's
on the same seed; whether and where it diverged; and the **step cost against plain Muon**,
timed here, interleaved: after the runs, each arm's model and optimizer are loaded from the
first seed's last checkpoint of the segment (its trained state: logits as large as the run left
them, so the clip acts as it did there), and `timing_rounds` rounds each time one step of every
arm in a rotating order (forward, backward, gradient clipping, optimizer step), ``threads``
threads. Each arm's step is the one a user of that guard runs: QK-Clip's includes capturing the
max logits its clip needs (the gated capture) and the clip; the others record no max logit (the
runs themselves record every arm's, for the report, so their own step times include it). An
arm's cost is the median over the rounds of its step time over plain Muon's in the same round:
load on the machine moves every arm of a round alike, so the ratio holds on a shared machine
where the runs' own step times do not.

Output: ``<out>/<segment>/<arm>-s<seed>/`` (one `muonclip train` run folder each), ``max_logit.png``
(max logit per step, every arm and seed, one panel per segment), ``summary.md`` and
``summary.json``.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed._context import SINGLE
from ..optim import NonFiniteGradError
from .checkpoints import CheckpointError, read_checkpoint
from .compare_runs import prepare, rates_tuned, stability_config
from .config import RunConfig
from .cores import cpu_name, usable_cores
from .data import Corpus, train_batch
from .model import parameter_count
from .runner import RunSpec, run_all
from .train import Place, build_state, clip_grad_norm, forward_loss, read_max_logits


@dataclass(frozen=True)
class Arm:
    """One arm: its name (folder and key), its label, its optimizer, and the guard its model carries."""

    name: str
    label: str
    optimizer: str
    qk_norm: bool = False
    softcap: bool = False


MHA_ARMS = (
    Arm("muon", "Muon, no guard", "muon"),
    Arm("muonclip", "MuonClip (Muon + QK-Clip)", "muonclip"),
    Arm("muon-qknorm", "Muon + QK-Norm", "muon", qk_norm=True),
    Arm("muon-softcap", "Muon + soft-capping", "muon", softcap=True),
    Arm("adamw", "AdamW, no guard", "adamw"),
    Arm("adamw-qknorm", "AdamW + QK-Norm", "adamw", qk_norm=True),
)
MLA_ARMS = (
    Arm("muon", "Muon, no guard", "muon"),
    Arm("muonclip", "MuonClip (QK-Clip, K2's rule)", "muonclip"),
    Arm("muon-qknorm", "Muon + QK-Norm on q^C, k^C (non-rotary parts)", "muon", qk_norm=True),
    Arm("muon-softcap", "Muon + soft-capping", "muon", softcap=True),
)
TIMING_ROUNDS = 100
"""Timed rounds of the step-cost measurement at most (`timing_rounds`), after `TIMING_WARMUP`."""
TIMING_WARMUP = 3


def arms(cfg: RunConfig) -> tuple[Arm, ...]:
    """The arms for ``cfg``'s model: `MLA_ARMS` for MLA, else `MHA_ARMS`."""
    return MLA_ARMS if cfg.attention == "mla" else MHA_ARMS


def timing_rounds(cfg: RunConfig) -> int:
    """Timed rounds: as many as the segment's steps, at most `TIMING_ROUNDS`."""
    return max(1, min(TIMING_ROUNDS, cfg.stability_steps))


def arm_config(cfg: RunConfig, arm: Arm, segment: str) -> RunConfig:
    """The config of ``arm`` in ``segment`` (module docstring): the stability segment's
    (`muonclip.app.compare_runs.stability_config`), AdamW at its rate times the segment's multiple, and
    the arm's guard on the model (``qk_norm``; ``attn_softcap`` from ``cfg`` for soft-capping, 0
    for the others)."""
    c = stability_config(cfg, segment)
    if arm.optimizer == "adamw" and segment == "excessive":
        c = dataclasses.replace(c, lr_adamw=cfg.lr_adamw * cfg.stability_lr / cfg.lr_muon)
    return dataclasses.replace(c, qk_norm=arm.qk_norm, attn_softcap=cfg.attn_softcap if arm.softcap else 0.0)


def plan(cfg: RunConfig, out_dir: Path) -> dict[str, dict[tuple[str, int], RunSpec]]:
    """The runs: per segment, keyed (arm name, seed)."""
    out: dict[str, dict[tuple[str, int], RunSpec]] = {}
    for segment in cfg.stability_segments:
        out[segment] = {}
        for s in range(cfg.seed, cfg.seed + cfg.seeds):
            for arm in arms(cfg):
                name = f"{arm.name}-s{s}"
                out[segment][(arm.name, s)] = RunSpec(dataclasses.replace(arm_config(cfg, arm, segment), seed=s),
                                                      arm.optimizer, out_dir / segment / name, f"{segment} {name}")
    return out


def check(cfg: RunConfig) -> None:
    """Raise ValueError naming the setting when the guards cannot run as asked."""
    if not cfg.stability_steps or not cfg.stability_segments:
        raise ValueError(f"--preset {cfg.preset} trains the stability segments: set stability_steps > 0 and "
                         "stability_segments (excessive, tuned)")
    if not cfg.attn_softcap > 0:
        raise ValueError(f"--preset {cfg.preset}: the soft-capping arm needs its cap, attn_softcap > 0 (the "
                         f"preset's 30), got {cfg.attn_softcap}")


def _clips(state: Any) -> bool:
    return hasattr(state.opt, "last_max_logits")  # MuonClip: its step consumes the recorded max logits


def _timed_step(state: Any, cfg: RunConfig, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = forward_loss(state.train_model, x, y)
    state.opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        clip_grad_norm(state.model.parameters(), cfg.grad_clip)
    state.opt.step()
    if _clips(state):
        read_max_logits(state.model, state.opt)
    return time.perf_counter() - t0


def step_costs(specs: dict[str, RunSpec], corpus: Corpus, rounds: int, *, reference: str = "muon",
               threads: int = 1) -> dict[str, dict[str, Any]]:
    """Each run's step time, interleaved (module docstring), and its ratio to ``reference``'s.

    Args:
        specs: arm name -> its finished (or diverged) run; its model and optimizer are loaded from
            the run's last checkpoint (a fresh one when it wrote none).
        corpus: the runs' corpus (the rounds' batches: ``train_batch`` at steps 0, 1, ...).
        rounds: timed rounds (after `TIMING_WARMUP` untimed ones).
        reference: the arm every ratio is against (default "muon").
        threads: torch threads while timing (default 1).

    Returns:
        arm -> ``{"median_ms", "ratio", "ratio_q1", "ratio_q3", "rounds"}`` (ratio: the median over
        rounds of the arm's time over the reference's in the same round; q1/q3 their quartiles);
        ``{"error": ...}`` for an arm whose step could not run (non-finite gradients).
    """
    place = Place(SINGLE, False, 1)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        states = {}
        for name, spec in specs.items():
            try:
                found = read_checkpoint(spec.run_dir)
            except CheckpointError:
                found = None  # diverged before its first checkpoint: the initial weights
            states[name] = build_state(spec.cfg, spec.optimizer, place, found)
            states[name].train_model.train()
            if not _clips(states[name]):  # no max logit to compute: the step a user of this arm runs
                for attn in states[name].model.attention_modules():
                    attn.recorder = None
        times: dict[str, list[float]] = {name: [] for name in specs}
        errors: dict[str, str] = {}
        order = list(specs)
        for r in range(TIMING_WARMUP + rounds):
            any_cfg = next(iter(specs.values())).cfg
            x, y = train_batch(corpus, r, batch_size=any_cfg.batch_size, block_size=any_cfg.block_size,
                               seed=any_cfg.seed)
            k = r % len(order)
            for name in order[k:] + order[:k]:
                if name in errors:
                    continue
                try:
                    t = _timed_step(states[name], specs[name].cfg, x, y)
                except NonFiniteGradError as e:
                    errors[name] = f"non-finite gradients from its last checkpoint ({e})"
                    continue
                if r >= TIMING_WARMUP:
                    times[name].append(t)
    finally:
        torch.set_num_threads(old_threads)
    out: dict[str, dict[str, Any]] = {}
    ref = times.get(reference, [])
    for name in specs:
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        mine = times[name]
        entry: dict[str, Any] = {"median_ms": 1000 * statistics.median(mine), "rounds": len(mine)}
        if len(ref) == len(mine) and reference not in errors:
            ratios = sorted(a / b for a, b in zip(mine, ref))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            entry.update(ratio=statistics.median(ratios), ratio_q1=q[0], ratio_q3=q[2])
        out[name] = entry
    return out


def compare_guards(cfg: RunConfig, out_dir: str | Path, *, jobs: int | None = None,
                   progress: bool = True) -> tuple[dict[str, Any], str]:
    """Run the guard ablation (module docstring) and write its report; return (summary data, printed tables).

    Args:
        cfg: the validated config (``guards`` or ``guards-mla``, with any ``--set``).
        out_dir: the folder; must not exist or be empty.
        jobs: runs at a time (default None: one per core).
        progress: progress bars on stderr (default True).

    Raises:
        DataError, OutputError, ValueError: bad input (also: the runs would not fit in memory); nothing
            written.
        Interrupted: Ctrl-C (see `muonclip.app.train`).
    """
    from .report.guards import guard_figures, guards_markdown, guards_reading, plot_guards
    from .report.markdown import write_summary

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    cfg.validate()
    check(cfg)
    runs = [(arm_config(cfg, a, seg), a.optimizer) for seg in cfg.stability_segments for a in arms(cfg)]
    cfg, corpus, jobs = prepare(cfg, out_dir, runs, jobs, cfg.stability_steps, runs_per_seed=len(runs))
    specs = plan(cfg, out_dir)
    every = [s for seg in specs.values() for s in seg.values()]
    outcomes = {o.spec.run_dir: o for o in run_all(every, corpus, jobs=jobs, progress=progress,
                                                   allow_divergence=True)}
    segments: dict[str, Any] = {}
    for segment, seg_specs in specs.items():
        runs_ = {k: (s.run_dir, outcomes[s.run_dir].diverged_at) for k, s in seg_specs.items()}
        tau = cfg.stability_tau if segment == "excessive" else cfg.stability_tuned_tau
        figures = guard_figures(runs_, arms(cfg), tau, cfg.attn_softcap)
        first = {a.name: seg_specs[(a.name, cfg.seed)] for a in arms(cfg)}
        figures["step_cost"] = step_costs(first, corpus, timing_rounds(cfg), threads=cfg.threads)
        figures.update(segment=segment, timing_rounds=timing_rounds(cfg), steps=cfg.stability_steps,
                       lr_muon=arm_config(cfg, MHA_ARMS[0], segment).lr_muon,
                       lr_adamw=arm_config(cfg, MHA_ARMS[4], segment).lr_adamw)
        segments[segment] = figures
    tuned = rates_tuned(cfg, False)
    rates = segment_names(cfg, tuned)
    plot_guards({seg: {k: s.run_dir for k, s in sp.items()} for seg, sp in specs.items()}, segments, arms(cfg),
                cfg.attn_softcap, out_dir, {seg: rates[seg][0] for seg in segments})
    text = guards_reading(segments, arms(cfg), rates)
    sections = []
    for seg, fig in segments.items():
        body = guards_markdown(fig, arms(cfg))
        if cfg.attention == "mla":
            body += "\n\n" + MLA_QK_NORM
        short, detail = rates[seg]
        sections.append((f"{short[:1].upper()}{short[1:]}: {detail}; tau {fig['tau']:g}, c {cfg.attn_softcap:g}",
                         body))
    wall = time.perf_counter() - t0
    data = {"config": cfg.to_dict(), "arms": [dataclasses.asdict(a) for a in arms(cfg)], "segments": segments,
            "reading": text, "wall_time": wall}
    model = "k2-mini's MLA model" if cfg.attention == "mla" else "the default model"
    write_summary(out_dir / "summary.md", f"muonclip compare --preset {cfg.preset}: the guards of the attention "
                  f"logits on {model}", context(cfg, corpus, jobs, wall, tuned), text, sections, data)
    return data, "\n\n".join([body for _, body in sections] + [text])


MLA_QK_NORM = (
    "QK-Norm on MLA, as built here: RMSNorm (with its own gain) on the non-rotary q^C and k^C of each head, after "
    "the projections; q^R and the one rotary key k^R shared by every head are left as they are, so the rotary part "
    "of each logit is not bounded by the norm. Well defined in training, where the reference model materialises "
    "k^C per head; at inference MLA absorbs k^C's projection into the query and never forms k^C, so the norm could "
    "not be applied there, which is why Kimi K2 chose QK-Clip.")
"""What QK-Norm means on MLA in this ablation, and its limits (printed under the MLA tables)."""


def segment_names(cfg: RunConfig, tuned: bool) -> dict[str, tuple[str, str]]:
    """Each segment's short name ("the excessive rate", "Muon's tuned rate") and its rates in words
    (and whether Muon's is a tuned one)."""
    muon = "Muon's tuned rate" if tuned else "Muon's hand-set, untuned rate"
    adamw = cfg.attention != "mla"
    exc = arm_config(cfg, MHA_ARMS[4], "excessive").lr_adamw
    return {
        "excessive": ("the excessive rate",
                      f"Muon's arms at lr {cfg.stability_lr:g} ({cfg.stability_lr / cfg.lr_muon:.1f} times {muon}, "
                      f"{cfg.lr_muon:g})"
                      + (f", AdamW's at {exc:.4g} (the same multiple of its own {cfg.lr_adamw:.4g})" if adamw else "")),
        "tuned": (muon, f"Muon's arms at lr {cfg.lr_muon:g}" + (f", AdamW's at its own {cfg.lr_adamw:.4g}"
                                                              if adamw else "")),
    }


def context(cfg: RunConfig, corpus: Corpus, jobs: int, wall: float, tuned: bool) -> list[str]:
    """The setup lines of the summary: model, arms, segments, timing, data, machine."""
    seeds = ", ".join(str(cfg.seed + i) for i in range(cfg.seeds))
    names = segment_names(cfg, tuned)
    lines = [
        f"preset `{cfg.preset}`; model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, context "
        f"{cfg.block_size}, attention {cfg.attention}"
        + (f", {cfg.n_expert} experts (top {cfg.n_expert_active}, {cfg.n_shared_expert} shared)" if cfg.n_expert
           else "") + f"; {parameter_count(cfg) / 1e6:.3f}M parameters",
        "arms: " + "; ".join(a.label for a in arms(cfg)) + f" (soft cap c = {cfg.attn_softcap:g})",
        f"each segment: {cfg.stability_steps} steps, batch {cfg.batch_size} x {cfg.block_size}, no weight decay, "
        f"a constant rate after warm-up (Muon's {cfg.warmup('muon')} steps"
        + (f", AdamW's own {cfg.warmup('adamw')}" if cfg.attention != "mla" else "") + "), gradient clipping at "
        f"{cfg.grad_clip:g}; seeds {seeds}; segments: "
        + "; ".join(f"{names[s][0]}, {names[s][1]}, tau "
                    f"{cfg.stability_tau if s == 'excessive' else cfg.stability_tuned_tau:g}"
                    for s in cfg.stability_segments),
        f"step cost: each arm's seed-{cfg.seed} run reloaded from its last checkpoint, {timing_rounds(cfg)} rounds "
        f"(after {TIMING_WARMUP} untimed) of one step per arm in a rotating order, in one process, {cfg.threads} "
        "thread(s); each arm's step as its user runs it (QK-Clip's with the max-logit capture it needs, the others "
        "recording none); the ratio to plain Muon's step in the same round, median over the rounds",
        f"data: {corpus.source} ({corpus.train.numel() / 1e6:.2f}M train bytes, {corpus.val.numel() / 1e6:.2f}M "
        f"validation bytes; byte tokens; validation on {cfg.eval_batches} batches every {cfg.eval_every} steps)",
        f"machine: {cpu_name()} ({platform.machine()}), {usable_cores()} cores, {jobs} runs at a time with "
        f"{cfg.threads} thread(s) each; torch {torch.__version__}; wall time {wall:.0f} s. Every run is seeded: "
        "the same figures come back on the same CPU kind and torch version",
    ]
    return lines
