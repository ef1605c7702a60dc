"""The tuning protocol of `muonclip compare --sweep`: every optimizer's learning rate bracketed on a log grid.

For each optimizer (AdamW first: the AdamW branch of Muon's runs then uses AdamW's tuned rate)
and each warm-up length of ``warmups``:

1. `log_grid`: ``points`` (at least 3) learning rates ``ratio`` apart (default sqrt 2), centred
   on the config's rate;
2. every rate is trained with ``seeds`` seeds (``budget_seeds`` at AdamW's larger budgets;
   different from the seeds `compare` reports, `sweep_seeds`) and scored by the mean of their
   final validation losses; a diverged run scores +inf;
3. `bracket`: if the best rate is the lowest or the highest of the grid, one more rate
   ``ratio`` beyond it is trained, and again, until the best is strictly inside (each extension is
   reported), or ``max_extensions`` were added (then the report says the best is still at an edge).

The best (warm-up, rate) pair of each optimizer is kept. With three warm-ups or more, they are
bracketed too: while the best is the shortest or the longest, one half as long or twice as long
is tried (up to half the run), its rate grid centred on the best rate so far. AdamW is then
bracketed again, at its best warm-up, at each larger token budget of `RunConfig.budgets`: its
best rate can fall as it trains longer, and the budget-matched ratio of `muonclip.app.compare`
compares Muon against AdamW tuned at every budget. Finished runs found in the output folder are
reused, so an interrupted sweep goes on where it stopped. Every point (optimizer, budget,
warm-up, rate, each seed's loss) goes into ``sweep.json`` and the Markdown table of
``sweep.md``; the tuned values are also printed as the ``--set`` arguments that reproduce them,
and are the presets' defaults (`muonclip.app.config`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import RunConfig
from .data import Corpus
from .metrics import read_rows
from .runfolder import CONFIG
from .runner import RunSpec, run_all
from .safe_files import OutputError

SQRT2 = 2.0**0.5
SWEEP_SEED_OFFSET = 1000  # tuning seeds: seed + 1000, seed + 1001, ...: never the reported ones


def log_grid(center: float, points: int = 5, ratio: float = SQRT2) -> list[float]:
    """``points`` rates ``center * ratio**k``, k = -(points-1)/2 ... (points-1)/2 (points odd: centred
    on ``center``; even: the extra point above), in increasing order.

    Raises:
        ValueError: fewer than 3 points (a bracket needs a point inside), a center <= 0 or a ratio <= 1.
    """
    if points < 3:
        raise ValueError(f"a learning-rate grid needs at least 3 points, got {points}")
    if not (center > 0 and math.isfinite(center)) or not (ratio > 1 and math.isfinite(ratio)):
        raise ValueError(f"grid center must be > 0 and ratio > 1, got {center} and {ratio}")
    low = -((points - 1) // 2)
    return [center * ratio ** (low + i) for i in range(points)]


@dataclass
class Bracket:
    """A bracketed sweep of one learning rate: every rate tried and its score (None: diverged),
    the best rate, the notes about each extension, and whether the best ended strictly inside."""

    scores: dict[float, float | None]
    best: float
    inside: bool
    notes: list[str] = field(default_factory=list)


def _score(v: float | None) -> float:
    return math.inf if v is None or not math.isfinite(v) else v


def bracket(measure: Callable[[list[float]], list[float | None]], grid: Sequence[float], *,
            ratio: float = SQRT2, max_extensions: int = 4) -> Bracket:
    """Score ``grid``, then extend it ``ratio`` beyond whichever edge holds the best score until the
    best is strictly inside (or ``max_extensions`` were added).

    Args:
        measure: rates -> their scores (lower is better; None or non-finite: diverged). Called
            once with the whole grid, then once per extension with one rate.
        grid: the first rates (at least 3 distinct).
        ratio: factor between the edge and each added rate (default sqrt 2).
        max_extensions: most rates added (default 4).

    Raises:
        ValueError: every rate tried diverged, even after extending the grid downwards.
    """
    rates = sorted(set(float(x) for x in grid))
    if len(rates) < 3:
        raise ValueError(f"a bracket needs at least 3 distinct rates, got {rates}")
    scores: dict[float, float | None] = dict(zip(rates, measure(rates)))
    notes: list[str] = []
    for added in range(max_extensions + 1):
        order = sorted(scores)
        if all(_score(scores[x]) == math.inf for x in order):
            i, side = 0, "low"  # nothing trains: look lower
        else:
            i = min(range(len(order)), key=lambda k: _score(scores[order[k]]))
            if 0 < i < len(order) - 1:
                return Bracket(scores, order[i], True, notes)
            side = "low" if i == 0 else "high"
        if added == max_extensions:
            break
        new = order[0] / ratio if side == "low" else order[-1] * ratio
        what = "every rate diverged" if _score(scores[order[i]]) == math.inf else f"the best, {order[i]:.3g},"
        notes.append(f"{what} at the {side} edge of {order[0]:.3g}..{order[-1]:.3g}: added {new:.3g}")
        scores[new] = measure([new])[0]
    order = sorted(scores)
    if all(_score(scores[x]) == math.inf for x in order):
        raise ValueError(f"every learning rate tried diverged ({order[0]:.3g}..{order[-1]:.3g})")
    i = min(range(len(order)), key=lambda k: _score(scores[order[k]]))
    notes.append(f"the best, {order[i]:.3g}, is still at the {'low' if i == 0 else 'high'} edge after "
                 f"{max_extensions} extensions")
    return Bracket(scores, order[i], False, notes)


# Fields of the comparison's protocol, not of one training run: a sweep run is the same run whatever they are.
PROTOCOL_FIELDS = ("seeds", "budgets", "lr_adamw_budgets", "stability_steps", "stability_lr", "stability_tau",
                   "preset")


def finished_loss(spec: RunSpec) -> float | None:
    """The final validation loss of ``spec``'s run if its folder holds it finished (an interrupted
    sweep goes on from where it stopped: finished runs are reused); the folder of an unfinished
    run of the same config is removed, so it runs again from the start. None when it has to run.

    Raises:
        OutputError: the folder holds a run of another config (a field other than
            `PROTOCOL_FIELDS` differs): it is left as it is; tune into a new folder.
    """
    if not (spec.run_dir / CONFIG).exists():
        if spec.run_dir.exists():
            shutil.rmtree(spec.run_dir)  # stopped before its first write: nothing of it to keep
        return None
    try:
        saved = json.loads((spec.run_dir / CONFIG).read_text(encoding="utf-8"))
    except json.JSONDecodeError:  # stopped while writing it, before its first step
        shutil.rmtree(spec.run_dir)
        return None
    saved.pop("run", None)  # the run's identity and history (muonclip.app.run_state.RunIdentity)
    want = json.loads(json.dumps({"optimizer": spec.optimizer, **spec.cfg.to_dict()}))
    differ = sorted(k for k in saved.keys() | want.keys()
                    if k not in PROTOCOL_FIELDS and not (k in saved and k in want and _same(saved[k], want[k])))
    if differ:
        what = ", ".join(f"{k}: {saved.get(k)!r} there, {want.get(k)!r} here" for k in differ)
        raise OutputError(f"{spec.run_dir} holds a run of another config ({what}); tune into a new folder")
    rows = read_rows(spec.run_dir)
    if rows and rows[-1]["step"] == spec.cfg.steps and rows[-1].get("val_loss") is not None:
        return float(rows[-1]["val_loss"])
    shutil.rmtree(spec.run_dir)
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-9 relative (a rate computed as c * sqrt(2)**k another way)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def sweep_seeds(cfg: RunConfig, n: int) -> list[int]:
    """The tuning seeds: ``cfg.seed + 1000 + i`` (never the seeds `compare` reports)."""
    return [cfg.seed + SWEEP_SEED_OFFSET + i for i in range(n)]


def budget_steps(cfg: RunConfig, budget: float) -> int:
    """Steps of a run given ``budget`` times the config's tokens (its own full schedule)."""
    return max(1, round(cfg.steps * budget))


@dataclass
class Tuned:
    """What `tune` found: per optimizer its best ``lr`` and ``warmup`` at 1x, AdamW's best rate per
    budget, and every point (`points`, the rows of ``sweep.json``)."""

    lr: dict[str, float]
    warmup: dict[str, int]
    budget_lr: dict[float, float]
    points: list[dict[str, Any]]
    notes: list[str]

    def sets(self) -> list[str]:
        """The ``--set key=value`` arguments that make a config use the tuned values."""
        out = [f"lr_{o}={v:.4g}" for o, v in self.lr.items()]
        out += [f"warmup_{o}={v}" for o, v in self.warmup.items()]
        if self.budget_lr:
            out.append("lr_adamw_budgets=" + ",".join(f"{v:.4g}" for _, v in sorted(self.budget_lr.items())))
        return out


def tune(cfg: RunConfig, out_dir: Path, corpus: Corpus, *, optimizers: Sequence[str] = ("adamw", "muon"),
         warmups: Sequence[int] | Mapping[str, Sequence[int]] | None = None, seeds: int = 2, points: int = 5,
         ratio: float = SQRT2, max_extensions: int = 4, budgets: Sequence[float] | None = None,
         budget_seeds: int | None = None, jobs: int = 1, progress: bool = True) -> Tuned:
    """Run the tuning protocol (module docstring) and write ``out_dir/sweep.json`` and ``sweep.md``.

    Args:
        cfg: the config to tune (its rates are the grid centres; steps are the 1x budget).
        out_dir: where the runs go (``<out_dir>/<optimizer>-x<budget>-w<warmup>-lr<rate>-s<seed>``).
        corpus: the loaded corpus.
        optimizers: which to tune (default AdamW and Muon; MuonClip shares Muon's rate).
        warmups: warm-up lengths to try, for every optimizer or per optimizer (a mapping; one it
            leaves out tries its config's) (default None: the config's, per optimizer).
        seeds: tuning seeds per point (default 2).
        points: rates in the first grid (default 5).
        ratio: factor between neighbouring rates (default sqrt 2).
        max_extensions: most rates added beyond an edge (default 4).
        budgets: AdamW's token budgets to tune at (default None: ``cfg.budgets``).
        budget_seeds: tuning seeds per point at the budgets beyond 1x, whose runs are longer
            (default None: ``seeds``).
        jobs: runs at a time (default 1).
        progress: progress bars (default True).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    points_log: list[dict[str, Any]] = []
    notes: list[str] = []
    base = cfg

    def measure(opt: str, budget: float, warmup: int,
                run_cfg: RunConfig) -> Callable[[list[float]], list[float | None]]:
        tuning_seeds = sweep_seeds(cfg, seeds if budget == 1 or budget_seeds is None else budget_seeds)

        def f(rates: list[float]) -> list[float | None]:
            specs, done = [], {}
            for lr in rates:
                for s in tuning_seeds:
                    c = dataclasses.replace(run_cfg, **{f"lr_{opt}": lr, f"warmup_{opt}": warmup},
                                            steps=budget_steps(run_cfg, budget), seed=s)
                    name = f"{opt}-x{budget:g}-w{warmup}-lr{lr:.4g}-s{s}"
                    spec = RunSpec(c, opt, out_dir / name, name)
                    specs.append(spec)
                    done[name] = finished_loss(spec)
            todo = [sp for sp in specs if done[sp.label] is None]
            ran = dict(zip((sp.label for sp in todo),
                           run_all(todo, corpus, jobs=jobs, progress=progress, allow_divergence=True)))
            scores: list[float | None] = []
            for k, lr in enumerate(rates):
                mine = specs[k * len(tuning_seeds):(k + 1) * len(tuning_seeds)]
                losses = [done[sp.label] if done[sp.label] is not None else ran[sp.label].final_val_loss
                          for sp in mine]
                mean = None if any(v is None for v in losses) else sum(losses) / len(losses)
                points_log.append({"optimizer": opt, "budget": budget, "warmup": warmup, "lr": lr,
                                   "seeds": tuning_seeds, "losses": losses, "mean": mean,
                                   "diverged_at": [ran[sp.label].diverged_at if sp.label in ran else None
                                                   for sp in mine]})
                scores.append(mean)
            _write(out_dir, points_log, notes, None)
            return scores
        return f

    lr: dict[str, float] = {}
    warm: dict[str, int] = {}
    for opt in optimizers:
        results: dict[int, tuple[float, float]] = {}  # warm-up -> (score of its best rate, that rate)
        tried = warmups.get(opt) if isinstance(warmups, Mapping) else warmups
        queue = sorted(set(tried or [cfg.warmup(opt)]))
        added = 0
        while queue:
            w = queue.pop(0)
            center = cfg.lr(opt) if not results else results[min(results, key=lambda x: results[x][0])][1]
            b = bracket(measure(opt, 1.0, w, base), log_grid(center, points, ratio), ratio=ratio,
                        max_extensions=max_extensions)
            notes += [f"{opt}, warm-up {w}: {n}" for n in b.notes]
            results[w] = (_score(b.scores[b.best]), b.best)
            if queue or len(results) < 3 or added == max_extensions:  # bracket the warm-up too (3 or more given)
                continue
            order = sorted(results)
            i = order.index(min(order, key=lambda x: results[x][0]))
            if 0 < i < len(order) - 1:
                break
            new = order[-1] * 2 if i else order[0] // 2
            side = "high" if i else "low"
            edge = f"{opt}: the best warm-up, {order[i]}, is at the {side} edge of {order[0]}..{order[-1]}"
            if (i and new > cfg.steps // 2) or (not i and new == order[0]):
                why = "twice it is over half the run" if i else "it is the shortest"
                notes.append(f"{edge}; not extended ({why})")
                break
            notes.append(f"{edge}: added {new}")
            queue.append(new)
            added += 1
        w_best = min(results, key=lambda x: results[x][0])
        best = (results[w_best][0], w_best, results[w_best][1])
        lr[opt], warm[opt] = best[2], best[1]
        base = dataclasses.replace(base, **{f"lr_{opt}": best[2], f"warmup_{opt}": best[1]})
    budget_lr: dict[float, float] = {}
    if "adamw" in optimizers:
        for b_ in (budgets if budgets is not None else cfg.budgets):
            if b_ == 1:
                budget_lr[1.0] = lr["adamw"]
                continue
            b = bracket(measure("adamw", b_, warm["adamw"], base), log_grid(lr["adamw"], points, ratio), ratio=ratio,
                        max_extensions=max_extensions)
            notes += [f"adamw at {b_:g}x: {n}" for n in b.notes]
            budget_lr[float(b_)] = b.best
    tuned = Tuned(lr, warm, budget_lr, points_log, notes)
    _write(out_dir, points_log, notes, tuned)
    return tuned


def _write(out_dir: Path, points: list[dict[str, Any]], notes: list[str], tuned: Tuned | None) -> None:
    body: dict[str, Any] = {"points": points, "notes": notes}
    if tuned is not None:
        body["tuned"] = {"lr": tuned.lr, "warmup": tuned.warmup,
                         "budget_lr": {f"{k:g}": v for k, v in tuned.budget_lr.items()}, "sets": tuned.sets()}
    (out_dir / "sweep.json").write_text(json.dumps(body, indent=1), encoding="utf-8")
    (out_dir / "sweep.md").write_text(sweep_markdown(points, notes, tuned), encoding="utf-8")


def sweep_markdown(points: list[dict[str, Any]], notes: list[str], tuned: Tuned | None) -> str:
    """Every point of a sweep as a Markdown table (best of each bracket in bold), the notes, the tuned values."""
    lines = ["| optimizer | budget | warm-up | lr | mean final val loss | per seed |", "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["optimizer"], p["budget"], p["warmup"]), []).append(p)
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2])):
        rows = sorted(groups[key], key=lambda p: p["lr"])
        best = min(rows, key=lambda p: _score(p["mean"]))
        for p in rows:
            mean = "diverged" if p["mean"] is None else f"{p['mean']:.4f}"
            if p is best and p["mean"] is not None:
                mean = f"**{mean}**"
            per = ", ".join("div. at " + str(d) if v is None else f"{v:.4f}" for v, d in zip(p["losses"],
                                                                                       p["diverged_at"]))
            lines.append(f"| {p['optimizer']} | {p['budget']:g}x | {p['warmup']} | {p['lr']:.4g} | {mean} | {per} |")
    parts = ["# Learning-rate sweep", "", *lines, ""]
    if notes:
        parts += ["Grid extensions:", "", *[f"- {n}" for n in notes], ""]
    if tuned is not None:
        parts += ["Tuned: `" + " ".join(f"--set {s}" for s in tuned.sets()) + "`", ""]
    return "\n".join(parts)
