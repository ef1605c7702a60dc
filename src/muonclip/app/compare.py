"""`muonclip compare`: the same GPT, data order and seed with AdamW, Muon and MuonClip.

Each optimizer trains from the same initial weights (``torch.manual_seed(seed)``) on the same
batches in the same order (batch s depends only on (seed, s)) at its own learning rate
(``lr_adamw``, ``lr_muon``, ``lr_muonclip``; see `muonclip.app.config`). The runs go one after
the other in one process, so their step times are comparable. Output folder::

    <out>/adamw/, <out>/muon/, <out>/muonclip/   one `muonclip train` run folder each
    <out>/val_loss.png, max_logit.png, clip_events.png
    <out>/summary.md, summary.json                the table (see muonclip.app.report)

``sweep=(0.5, 1, 2)`` trains every optimizer at each multiple of its learning rate (folders
``<out>/sweep/<optimizer>-x<factor>/``) and reports, per optimizer, the run with the lowest
final validation loss; the sweep table is added to ``summary.md``. A sweep run whose loss
turns non-finite is recorded as diverged and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .config import OPTIMIZERS, RunConfig, check_optimizer
from .data import check_fits, corpus_warnings, load_corpus
from .memory import check_memory
from .report import plot, summarize, write_summary
from .train import NonFiniteLossError, OutputError, check_out_dir, train_run


def compare(cfg: RunConfig, out_dir: str | Path, *, optimizers: Sequence[str] = OPTIMIZERS,
            sweep: Sequence[float] | None = None, progress: bool = True) -> tuple[list[dict[str, Any]], str]:
    """Run the comparison and write the report; return (summary rows, Markdown table).

    Args:
        cfg: the validated config.
        out_dir: the comparison's folder; must not exist or be empty.
        optimizers: which to run (default all three; "adamw" is the reference of the table).
        sweep: learning-rate multiples to try per optimizer (default None: no sweep).
        progress: progress bars on stderr (default True).

    Raises:
        DataError, OutputError, ValueError: bad input (also: one step would not fit in memory,
            `muonclip.app.memory`); nothing written.
        NonFiniteLossError, Interrupted: from a run (see `muonclip.app.train`).
    """
    out_dir = Path(out_dir)
    cfg.validate()
    for o in optimizers:
        check_optimizer(o)
    factors = [float(f) for f in (sweep or [1.0])]
    if any(not (math.isfinite(f) and f > 0) for f in factors):
        raise ValueError(f"sweep factors must be finite numbers > 0, got {factors}")
    for o in optimizers:
        check_memory(cfg, o, torch.device("cpu"))
    check_out_dir(out_dir, resume=False)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise OutputError(f"--out {out_dir} is not empty; choose a new folder so nothing is overwritten")
    corpus = load_corpus(cfg.data, cfg.val_fraction)
    check_fits(corpus, cfg.batch_size, cfg.block_size)
    for warning in corpus_warnings(corpus, steps=cfg.steps, batch_size=cfg.batch_size, block_size=cfg.block_size):
        print(f"muonclip: warning: {warning}", file=sys.stderr)

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"--out {out_dir}: cannot create it ({e}); choose another --out") from None
    runs: dict[str, Path] = {}
    lrs: dict[str, float] = {}
    sweep_rows: list[dict[str, Any]] = []
    total = len(optimizers) * len(factors)
    k = 0
    for name in optimizers:
        best: tuple[float, Path, float] | None = None
        for f in factors:
            k += 1
            lr = cfg.lr(name) * f
            run_cfg = dataclasses.replace(cfg, **{f"lr_{name}": lr})
            run_dir = out_dir / name if sweep is None else out_dir / "sweep" / f"{name}-x{f:g}"
            label = f"{name} ({k}/{total})" if sweep is None else f"{name} lr={lr:.3g} ({k}/{total})"
            try:
                result = train_run(run_cfg, name, run_dir, corpus=corpus, progress=progress, label=label,
                                   warn=False)
            except NonFiniteLossError as e:
                if sweep is None:
                    raise
                print(f"{label}: diverged ({e})", file=sys.stderr)
                sweep_rows.append({"optimizer": name, "lr": lr, "final_val_loss": None, "diverged_at": e.step})
                continue
            sweep_rows.append({"optimizer": name, "lr": lr, "final_val_loss": result.final_val_loss})
            if best is None or result.final_val_loss < best[0]:
                best = (result.final_val_loss, run_dir, lr)
        if best is None:
            raise NonFiniteLossError(cfg.steps, f"loss in every sweep run of {name}", None)
        runs[name], lrs[name] = best[1], best[2]

    summary = summarize(runs, lrs)
    plot(runs, out_dir, cfg.tau)
    context = [
        f"preset `{cfg.preset}`; model: {cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}, "
        f"context {cfg.block_size}, attention {cfg.attention}; batch {cfg.batch_size}; {cfg.steps} steps "
        f"({cfg.steps * cfg.batch_size * cfg.block_size / 1e6:.2f}M tokens); seed {cfg.seed}; tau {cfg.tau:g}; "
        f"weight decay {cfg.weight_decay:g}",
        f"data: {corpus.source} ({corpus.train.numel() / 1e6:.2f}M train bytes, {corpus.val.numel() / 1e6:.2f}M "
        "validation bytes; byte tokens)",
        f"machine: {platform.machine()} CPU, {torch.get_num_threads()} threads ({os.cpu_count()} cores); "
        f"torch {torch.__version__}",
        "the embeddings, tied LM head and norm gains use AdamW at lr_adamw in every run",
    ]
    table = write_summary(out_dir / "summary.md", "muonclip compare: AdamW vs Muon vs MuonClip", summary, context,
                          sweep_rows if sweep is not None else None)
    return summary, table


__all__ = ["compare"]
