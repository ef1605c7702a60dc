"""A comparison's runs and the checks before any is written: the toolbox that `muonclip compare`'s
protocols share (`muonclip.app.compare` for the standard one, `muonclip.app.guards`,
`muonclip.app.ladder`; the ``--preset`` dispatch is `muonclip.app.main`'s).

* `plan`: the standard protocol's runs (efficiency at every budget, the stability segments), with
  `stability_config` (a stability segment's config) and `adamw_budget_lr` (AdamW's rate at a budget);
* `prepare`: every check before anything is written (jobs and threads, memory, the output folder,
  the corpus), then the folder created;
* `rates_tuned`: whether a config's rates are tuned ones.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .config import OPTIMIZERS, TUNED_PRESETS, RunConfig, make_config
from .cores import usable_cores
from .data import Corpus, check_fits, corpus_size, corpus_warnings, load_corpus
from .memory import check_memory
from .runfolder import check_outside_runs, check_writable, inspect_folder
from .runner import RunSpec
from .safe_files import OutputError
from .sweep import budget_steps
from .train_setup import check_threads

EFFICIENCY = ("adamw", "muon")
OWN_PROTOCOL = {"finetune": "muonclip.app.finetune", "guards": "muonclip.app.guards",
                "guards-mla": "muonclip.app.guards", "ladder": "muonclip.app.ladder"}
"""The presets that run a protocol of their own instead of the standard one (`muonclip.app.compare`), and its
module."""


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


def rates_tuned(cfg: RunConfig, swept: bool) -> bool:
    """Whether ``cfg``'s rates and warm-ups are tuned ones: this run's sweep, or a tuned preset's
    values unchanged (`muonclip.app.config.TUNED_PRESETS`)."""
    if swept:
        return True
    if cfg.preset not in TUNED_PRESETS:
        return False
    preset = make_config(cfg.preset)
    return all(cfg.lr(o) == preset.lr(o) and cfg.warmup(o) == preset.warmup(o) for o in OPTIMIZERS)
