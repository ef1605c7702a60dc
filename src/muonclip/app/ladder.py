"""`muonclip compare --preset ladder`: how Muon's token advantage over AdamW changes with model size.

The budget-matched ratio of `muonclip compare` (the tokens AdamW, retrained with its own full
schedule at each budget, needs to reach Muon's final loss; `muonclip.app.report`) measured on a
ladder of widths, with the same protocol at every rung:

* **Rungs** (`rungs`): the config's model with ``n_embd`` and ``n_head`` times each of
  `WIDTH_FACTORS` (1, 1.5, 2: the head width and the depth held; 115k, 246k and 427k parameters
  from the ``default`` model), the same corpus, batch and context.
* **The same tokens per parameter**: a rung trains ``steps`` times its parameters over the first
  rung's (Muon at 1x; AdamW at every budget of ``budgets``, each with its own full schedule);
  warm-ups, ``eval_every`` and the checkpoint interval scale with the steps, so each is the same
  share of the run at every rung.
* **Each optimizer's rate re-bracketed at each rung** (`muonclip.app.sweep.tune`): a log grid
  sqrt 2 apart centred on the rung below's best (the first rung: the config's rates), of
  `POINTS` points (`TOP_POINTS` at the largest rung), extended while the best is at an edge,
  `TUNING_SEEDS` tuning seed(s) per point (``seed + 1000``: never a reported seed); AdamW first
  (Muon's embeddings, head and norms use AdamW's rate). The warm-ups are held at the config's
  share of the run, not swept, and AdamW runs every budget at its 1x rate (the ``default``
  sweep found the same best rate at 1x, 1.5x, 2x and 3x: docs/compare.md); both are stated in the report.
* **Seeds**: ``seeds`` at every rung but the largest (``seed``, ``seed + 1``, ...), mean ± sd and
  per seed; the largest rung runs `TOP_SEEDS` (``seed``). A rung's runs cost about the square of
  its parameters (more parameters a step, more steps), so the largest rung (2x the width, 3.7 times
  the parameters of the first) costs about 14 times the first a run: one seed and a 3-point first
  grid there keep it near the cost of the two rungs below together.

The report (`muonclip.app.report.ladder`) is rewritten after each rung, so a ladder stopped part
way leaves the rungs it finished, and says how many. Run again with the same settings and the same
``--out``, it goes on: a rung recorded in ``summary.json`` with the same config and protocol (width,
steps, warm-ups, seeds, grid points, tuning seeds) is read, not rerun; the unfinished rung reuses
its finished runs (`muonclip.app.sweep.finished_loss`) and reruns the rest from their start. A
folder holding anything else, or a ladder of other settings, is refused. Output::

    <out>/width<n_embd>/sweep/                   the rung's tuning runs, sweep.md, sweep.json
    <out>/width<n_embd>/runs/<optimizer>-x<budget>-s<seed>/
    <out>/ratio_vs_params.png                    the ratio against parameters, Wen et al. 2025 beside
    <out>/summary.md, summary.json
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .compare_runs import plan, prepare
from .config import RunConfig, model_config
from .cores import cpu_name, usable_cores
from .data import Corpus
from .model import parameter_count
from .runner import run_all
from .safe_files import OutputError
from .sweep import SWEEP_SEED_OFFSET, budget_steps, finished_loss, tune

WIDTH_FACTORS = (1.0, 1.5, 2.0)
"""Each rung's ``n_embd`` and ``n_head`` over the config's."""
TUNING_SEEDS = 1
"""Tuning seeds per grid point at every rung."""
POINTS = 5
"""Rates in each rung's first grid but the largest's."""
TOP_POINTS = 3
"""Rates in the largest rung's first grid (module docstring: its cost)."""
TOP_SEEDS = 1
"""Reported seeds at the largest rung (at most ``seeds``; module docstring: its cost)."""
MAX_EXTENSIONS = 4
"""Rates added past an edge of a rung's grid at most (`muonclip.app.sweep.bracket`; the report marks a
rate still at an edge)."""
LADDER_OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class Rung:
    """One size of the ladder: its width factor, parameters, config (steps, warm-ups and seeds
    set) and the rates in its first grid."""

    factor: float
    params: int
    cfg: RunConfig
    points: int


def _scaled(value: int, ratio: float) -> int:
    return max(1, round(value * ratio))


def rungs(cfg: RunConfig) -> list[Rung]:
    """The rungs of ``cfg`` (module docstring).

    Raises:
        ValueError: a factor does not give a whole width and head count, or a rung's model cannot
            be built (head width odd for RoPE...); the message names the rung.
    """
    base = parameter_count(cfg)
    out = []
    for i, f in enumerate(WIDTH_FACTORS):
        top = i == len(WIDTH_FACTORS) - 1
        width, heads = cfg.n_embd * f, cfg.n_head * f
        if width != int(width) or heads != int(heads):
            raise ValueError(f"--preset ladder: width factor {f:g} of n_embd {cfg.n_embd} and n_head {cfg.n_head} "
                             f"gives {width:g} and {heads:g}; choose an n_embd and an n_head that {f:g} times keeps "
                             "whole (e.g. even ones)")
        c = dataclasses.replace(cfg, n_embd=int(width), n_head=int(heads))
        try:
            model_config(c)
        except ValueError as e:
            raise ValueError(f"--preset ladder: the rung of width {int(width)} ({int(heads)} heads): {e}") from None
        params = parameter_count(c)
        steps = _scaled(cfg.steps, params / base)
        ratio = steps / cfg.steps
        c = dataclasses.replace(
            c, steps=steps, eval_every=_scaled(cfg.eval_every, ratio), checkpoint_every=steps,
            warmup_adamw=_scaled(cfg.warmup("adamw"), ratio), warmup_muon=_scaled(cfg.warmup("muon"), ratio),
            warmup_muonclip=_scaled(cfg.warmup("muon"), ratio), lr_adamw_budgets=(), stability_steps=0,
            seeds=min(cfg.seeds, TOP_SEEDS) if top else cfg.seeds).validate()
        out.append(Rung(f, params, c, TOP_POINTS if top else POINTS))
    return out


def check(cfg: RunConfig) -> None:
    """Raise ValueError naming the setting when the ladder cannot measure a ratio as asked."""
    if len(cfg.budgets) < 2:
        raise ValueError(f"--preset ladder measures the tokens AdamW needs to match Muon: budgets needs 1 and at "
                         f"least one larger budget, got {cfg.budgets}")


def compare_ladder(cfg: RunConfig, out_dir: str | Path, *, jobs: int | None = None,
                   progress: bool = True) -> tuple[dict[str, Any], str]:
    """Run the ladder (module docstring) and write its report after each rung; return (summary
    data, printed table and reading).

    Args:
        cfg: the validated config (``ladder``, with any ``--set``).
        out_dir: the folder; must not exist, be empty, or hold a ladder of the same settings
            stopped part way (it goes on: `finished_rungs`).
        jobs: runs at a time (default None: one per core).
        progress: progress bars on stderr (default True).

    Raises:
        DataError, OutputError, ValueError: bad input (also: the largest rung's runs would not fit
            in memory; ``out_dir`` holds something else than this ladder); nothing written.
        NonFiniteLossError, Interrupted: from a reported run (see `muonclip.app.train`); the rungs
            finished before it are in the report.
    """
    from .report import efficiency

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    cfg.validate()
    check(cfg)
    ladder = rungs(cfg)
    top = ladder[-1].cfg
    stored = finished_rungs(cfg, out_dir, ladder)
    per_seed = sum(map(len, plan(dataclasses.replace(top, seeds=1), out_dir, LADDER_OPTIMIZERS)))
    runs = [(r.cfg, o) for r in (ladder[0], ladder[-1]) for o in LADDER_OPTIMIZERS]  # all seeds; the largest model
    cfg, corpus, jobs = prepare(cfg, out_dir, runs, jobs, max(budget_steps(top, b) for b in top.budgets),
                                resume=stored is not None, runs_per_seed=per_seed)
    results: list[dict[str, Any]] = list(stored["rungs"]) if stored else []
    before = float(stored["wall_time"]) if stored else 0.0
    centre = dict(results[-1]["lr"]) if results else {"adamw": cfg.lr_adamw, "muon": cfg.lr_muon}
    text = ""
    for rung in ladder[len(results):]:
        folder = out_dir / f"width{rung.cfg.n_embd}"
        c = dataclasses.replace(rung.cfg, threads=cfg.threads, lr_adamw=centre["adamw"], lr_muon=centre["muon"],
                                lr_muonclip=centre["muon"])
        tuned = tune(c, folder / "sweep", corpus, optimizers=LADDER_OPTIMIZERS,
                     warmups={o: [c.warmup(o)] for o in LADDER_OPTIMIZERS}, seeds=TUNING_SEEDS, points=rung.points,
                     budgets=(1.0,), max_extensions=MAX_EXTENSIONS, jobs=jobs, progress=progress)
        centre = dict(tuned.lr)
        c = dataclasses.replace(c, lr_adamw=tuned.lr["adamw"], lr_muon=tuned.lr["muon"], lr_muonclip=tuned.lr["muon"])
        eff_specs, _, _ = plan(c, folder, LADDER_OPTIMIZERS)
        todo = [s for s in eff_specs.values() if finished_loss(s) is None]  # a stopped rung's finished runs kept
        run_all(sorted(todo, key=lambda s: -s.cfg.steps), corpus, jobs=jobs, progress=progress)
        eff = efficiency({k: s.run_dir for k, s in eff_specs.items()}, c.budgets)
        results.append(_rung_result(rung, c, tuned, eff))
        text = _write(cfg, out_dir, ladder, results, corpus, jobs, before + time.perf_counter() - t0,
                      len(stored["rungs"]) if stored else 0)
    if not text:  # every rung was already there: the report rewritten as it stands
        text = _write(cfg, out_dir, ladder, results, corpus, jobs, before, len(results))
    from .report.ladder import ladder_markdown

    wall = before + time.perf_counter() - t0
    return json_data(cfg, results, text, wall), "\n\n".join([ladder_markdown(results), text])


RUNG_PROTOCOL = ("n_embd", "n_head", "n_layer", "params", "steps", "warmup", "seeds", "points")
"""The fields of a recorded rung that must equal the planned rung's for `finished_rungs` to read it."""


def _protocol(rung: Rung) -> dict[str, Any]:
    c = rung.cfg
    return {"n_embd": c.n_embd, "n_head": c.n_head, "n_layer": c.n_layer, "params": rung.params, "steps": c.steps,
            "warmup": {o: c.warmup(o) for o in LADDER_OPTIMIZERS}, "seeds": [c.seed + i for i in range(c.seeds)],
            "points": rung.points}


def finished_rungs(cfg: RunConfig, out_dir: Path, ladder: list[Rung]) -> dict[str, Any] | None:
    """The ``summary.json`` of a ladder of the same settings stopped part way in ``out_dir``, its
    ``rungs`` the finished ones; None when ``out_dir`` is absent or empty (a new ladder).

    The same settings: the same config (its ``threads`` aside), rungs planned, tuning seeds, and
    each recorded rung the planned one (`RUNG_PROTOCOL`: width, steps, warm-ups, seeds, grid
    points); the unfinished rung's finished runs are reused later (`muonclip.app.sweep.finished_loss`).

    Raises:
        OutputError: ``out_dir`` is not empty and holds no ladder's ``summary.json``, or one of
            other settings (named); nothing is touched.
    """
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return None
    path = out_dir / "summary.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ok = isinstance(data, dict) and isinstance(data.get("rungs"), list) and "rungs_planned" in data
    except (OSError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise OutputError(f"--out {out_dir} is not empty and holds no ladder to go on with; choose a new folder so "
                          "nothing is overwritten")
    want, saved = json.loads(json.dumps(cfg.to_dict())), dict(data.get("config") or {})
    differ = sorted(k for k in want.keys() | saved.keys() if k != "threads" and saved.get(k) != want.get(k))
    differ += [k for k, v in (("rungs_planned", len(ladder)), ("tuning_seeds", TUNING_SEEDS)) if data.get(k) != v]
    for i, r in enumerate(data["rungs"]):
        if i >= len(ladder):
            differ.append(f"rung {i + 1} (not planned)")
            continue
        planned = json.loads(json.dumps(_protocol(ladder[i])))
        got = {k: r.get(k, r.get("efficiency", {}).get("seeds") if k == "seeds" else None) for k in RUNG_PROTOCOL}
        differ += [f"rung {i + 1} {k}: {got[k]!r} there, {planned[k]!r} here" for k in RUNG_PROTOCOL
                   if got[k] != planned[k]]
    if differ:
        raise OutputError(f"--out {out_dir} holds a ladder of other settings ({'; '.join(differ)}); choose a new "
                          "folder, or the same settings to go on with it")
    return data


def _rung_result(rung: Rung, cfg: RunConfig, tuned: Any, eff: dict[str, Any]) -> dict[str, Any]:
    tokens = cfg.steps * cfg.batch_size * cfg.block_size
    edges = {o: [n for n in tuned.notes if n.startswith(f"{o},") and "still at the" in n] for o in LADDER_OPTIMIZERS}
    return {"factor": rung.factor, **_protocol(rung), "tokens": tokens, "tokens_per_param": tokens / rung.params,
            "lr": dict(tuned.lr),
            "bracketed": {o: not edges[o] for o in LADDER_OPTIMIZERS}, "sweep_notes": tuned.notes,
            "sweep_points": tuned.points, "efficiency": eff}


def json_data(cfg: RunConfig, results: list[dict[str, Any]], text: str, wall: float) -> dict[str, Any]:
    """``summary.json``'s content: the config, each finished rung, the reading, the wall time (over
    every session of a ladder that went on after a stop)."""
    return {"config": cfg.to_dict(), "rungs": results, "reading": text, "wall_time": wall,
            "rungs_planned": len(WIDTH_FACTORS), "tuning_seeds": TUNING_SEEDS}


def _write(cfg: RunConfig, out_dir: Path, ladder: list[Rung], results: list[dict[str, Any]], corpus: Corpus,
           jobs: int, wall: float, resumed: int = 0) -> str:
    from .report.ladder import ladder_markdown, ladder_reading, plot_ladder
    from .report.markdown import write_summary

    text = ladder_reading(results, len(ladder))
    plot_ladder(results, out_dir)
    sweeps = "\n\n".join(f"Width {r['n_embd']} ({r['params'] / 1e6:.3f}M parameters): `width{r['n_embd']}/sweep/"
                         f"sweep.md`" + "".join(f"\n- {n}" for n in r["sweep_notes"]) for r in results)
    sections = [("Budget-matched ratio at each width", ladder_markdown(results)),
                ("The rates, bracketed at each width", sweeps)]
    write_summary(out_dir / "summary.md", "muonclip compare --preset ladder: Muon's token advantage against "
                  "model size", context(cfg, ladder, results, corpus, jobs, wall, resumed), text, sections,
                  json_data(cfg, results, text, wall))
    return text


def context(cfg: RunConfig, ladder: list[Rung], results: list[dict[str, Any]], corpus: Corpus, jobs: int,
            wall: float, resumed: int = 0) -> list[str]:
    """The setup lines of the summary (``resumed``: rungs read from a stopped ladder's folder)."""
    def each(f: Any) -> str:
        vals = [f(r) for r in ladder]
        if len(set(vals)) == 1:
            return f"{vals[0]} at every rung"
        return ", ".join(f"{v} at {r.cfg.n_embd}" for v, r in zip(vals, ladder))

    first = ladder[0]
    tokens = first.cfg.steps * cfg.batch_size * cfg.block_size
    seeds = each(lambda r: "seed " + str(r.cfg.seed) if r.cfg.seeds == 1 else
                 f"{r.cfg.seeds} seeds ({', '.join(str(r.cfg.seed + i) for i in range(r.cfg.seeds))})")
    points = each(lambda r: f"{r.points} points")
    cost = (ladder[-1].params / first.params) ** 2
    return [
        f"preset `{cfg.preset}`; rungs: {cfg.n_layer} layers, width x head count "
        + ", ".join(f"{r.cfg.n_embd} x {r.cfg.n_head} ({r.params / 1e6:.3f}M parameters, {r.cfg.steps} steps)"
                    for r in ladder)
        + f"; head width {cfg.n_embd // cfg.n_head}, context {cfg.block_size}, attention {cfg.attention}",
        f"the same tokens per parameter at every rung: {tokens / first.params:.1f} at 1x (batch {cfg.batch_size} x "
        f"{cfg.block_size}); AdamW at " + ", ".join(f"{b:g}x" for b in cfg.budgets) + f", Muon at 1x; {seeds} "
        f"(a run of the largest rung costs about {cost:.0f} times one of the first: parameters times steps)",
        f"rates: re-bracketed at each rung by `muonclip.app.sweep.tune` (a first grid sqrt 2 apart centred on the rung "
        f"below's best, {points}, extended while the best is at an edge; {TUNING_SEEDS} tuning seed(s) per point, "
        f"seed {cfg.seed + SWEEP_SEED_OFFSET} on); warm-ups held at AdamW {cfg.warmup('adamw')} and Muon "
        f"{cfg.warmup('muon')} of {cfg.steps} steps (the same share at every rung), not swept; AdamW at its 1x rate "
        "at every budget (not re-bracketed per budget)",
        f"schedules: linear warm-up, cosine to {cfg.min_lr_ratio:g} of the peak; weight decay {cfg.weight_decay:g} "
        f"on matrices; gradient clipping at {cfg.grad_clip:g}; Muon's embeddings, head and norms on AdamW at AdamW's "
        "rate",
        f"data: {corpus.source} ({corpus.train.numel() / 1e6:.2f}M train bytes; byte tokens)",
        f"finished: {len(results)} of {len(ladder)} rungs"
        + (f" ({resumed} read from this folder, where a stopped ladder of the same settings left them)" if resumed
           else ""),
        f"machine: {cpu_name()} ({platform.machine()}), {usable_cores()} cores, {jobs} runs at a time with "
        f"{cfg.threads} thread(s) each; torch {torch.__version__}; wall time so far {wall:.0f} s"
        + (" (over every session of this folder; a stopped session's time after its last finished rung not counted)"
           if resumed else ""),
    ]
