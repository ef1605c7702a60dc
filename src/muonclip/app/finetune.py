"""`muonclip compare --preset finetune`: fine-tuning an AdamW-pretrained model with AdamW or Muon, in full or
with LoRA, measured on the new text and on the pre-training text (forgetting).

Protocol (every size from the `RunConfig`, so ``--set`` scales it):

1. **Pre-training.** The reference GPT of the config (the ``default`` preset's model) is trained
   with AdamW at the config's tuned rate and warm-up (``lr_adamw``, ``warmup_adamw``) for
   ``steps`` steps on the built-in plays *without* one genre, `HELD_OUT` (the histories): the
   common case of an open model pretrained with Adam. Its weights are kept in
   ``<out>/pretrain/model.pt``.
2. **Fine-tuning** on the held-out genre (another style: chronicles of English kings, not
   comedies or tragedies), ``steps // 8`` steps, warm-up a tenth of that, cosine to
   ``min_lr_ratio``, gradient clipping at ``grad_clip``, weight decay ``weight_decay`` on
   matrices, with the `METHODS`: AdamW full (every parameter, ``torch.optim.AdamW``), Muon full
   (`muonclip.Muon` over `muonclip.param_groups`: matrices on Muon, embeddings / head / norms on
   its AdamW branch, one rate: ``adjust_lr_fn="match_rms_adamw"`` puts both on AdamW's scale),
   LoRA + AdamW and LoRA + Muon (peft LoRA of rank `LORA_RANK`, alpha twice the rank, on every
   projection of every block; the base frozen; `muonclip.param_groups` routes A and B to Muon by
   default).
3. **Rates, bracketed.** Each method's peak rate is tuned on seed ``seed`` by the fine-tuned
   validation loss over a 5-point grid at ratio 2 (`muonclip.app.sweep.bracket`: extended past
   whichever edge holds the best until it is inside, at most `MAX_EXTENSIONS` rates), then every
   method runs ``seeds`` seeds at its rate (a seed fixes the batch order and LoRA's initial A).
4. **Measured** after fine-tuning, on fixed validation batches: the loss on the held-out genre's
   validation text (what fine-tuning is for) and on the pre-training genres' validation text
   (forgetting: its rise over the pre-trained model's loss).

The published results the report sets beside the figures (`PUBLISHED`): Qu, Huang and Horváth
(2026, "Can Muon Fine-tune Adam-Pretrained Models?", arXiv 2605.10468): full Muon fine-tuning of
Adam-pretrained models does worse than Adam, LoRA closes the gap and LoRA-Muon matches or beats
LoRA-Adam; Liu, Wang and Zhang (2026, "Optimizer-Model Consistency", arXiv 2605.06654): full
fine-tuning with the pre-training optimizer reaches the same or better new-task loss while
forgetting less than other optimizers and than LoRA.

Output: ``<out>/pretrain/model.pt``, ``<out>/finetune.json`` (every run), ``<out>/summary.md`` and
``summary.json``. Runs go one after another in this process (``threads`` threads, default every core).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..common import defaults as D
from ..optim import Muon, param_groups
from .config import RunConfig
from .cores import usable_cores
from .data import Corpus, DataError, corpus_size, train_batch, val_batches
from .data.corpus import SEPARATOR, builtin_corpus_dir, encode, list_documents, read_document
from .memory import check_memory
from .model import build_model, muon_orth_dtype, orthogonalisation
from .runfolder import check_outside_runs, check_writable, inspect_folder
from .safe_files import OutputError
from .sweep import bracket, log_grid
from .train import clip_grad_norm, evaluate, lr_factor
from .train_setup import check_threads

HELD_OUT = "histories"
"""The genre of the built-in plays held out from pre-training and fine-tuned on."""

METHODS = ("adamw-full", "muon-full", "lora-adamw", "lora-muon")
"""The fine-tuning methods, in report order."""

CENTERS = {"adamw-full": 3e-3, "muon-full": 3e-3, "lora-adamw": 1e-2, "lora-muon": 1e-2}
"""Centre of each method's first 5-point rate grid (ratio 2)."""

GRID_RATIO = 2.0
MAX_EXTENSIONS = 2
"""Rates added past an edge of a grid at most (the report marks a rate still at an edge)."""
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")

PUBLISHED = (
    "Qu, Huang and Horváth 2026 (arXiv 2605.10468), Adam-pretrained language and vision models: full Muon "
    "fine-tuning does worse than full Adam fine-tuning (an optimizer mismatch that grows with the update's "
    "strength); with LoRA the gap closes and LoRA-Muon matches or beats LoRA-Adam.",
    "Liu, Wang and Zhang 2026 (arXiv 2605.06654), SFT of LLMs: full fine-tuning with the pre-training optimizer "
    "reaches the same or a better new-task loss while forgetting less than other optimizers and than LoRA.",
)


@dataclass
class Protocol:
    """The fine-tuning protocol of a config (module doc): steps, warm-up, seeds."""

    steps: int
    warmup: int
    seeds: list[int]

    @classmethod
    def of(cls, cfg: RunConfig) -> Protocol:
        steps = max(2, cfg.steps // 8)
        return cls(steps, max(1, steps // 10), [cfg.seed + i for i in range(cfg.seeds)])


def genre_corpora(val_fraction: float, held_out: str = HELD_OUT) -> tuple[Corpus, Corpus]:
    """``(pre-training corpus, fine-tuning corpus)``: the built-in plays without and with only the
    genre ``held_out``, each play split as `muonclip.app.data.load_corpus` splits (its last
    ``val_fraction`` of bytes to validation).

    Raises:
        DataError: no such genre among the installed plays.
    """
    root = builtin_corpus_dir()
    files = list_documents(None)
    genres = sorted({f.relative_to(root).parts[0] for f in files})
    if held_out not in genres:
        raise DataError(f"no genre {held_out!r} in the built-in plays ({', '.join(genres)})")

    def corpus(chosen: list[Path], what: str) -> Corpus:
        sep = encode(SEPARATOR)
        train, val = [], []
        for f in chosen:
            text = read_document(f)
            cut = int(round(len(text) * (1.0 - val_fraction)))
            for parts, piece in ((train, text[:cut]), (val, text[cut:])):
                if parts:
                    parts.append(sep)
                parts.append(encode(piece))
        return Corpus(torch.cat(train), torch.cat(val), what, len(chosen))

    inside = [f for f in files if f.relative_to(root).parts[0] == held_out]
    outside = [f for f in files if f.relative_to(root).parts[0] != held_out]
    others = ", ".join(g for g in genres if g != held_out)
    return (corpus(outside, f"built-in plays ({others})"), corpus(inside, f"built-in plays ({held_out})"))


def _optimizer(method: str, model: nn.Module, lr: float, cfg: RunConfig) -> torch.optim.Optimizer:
    if method in ("adamw", "adamw-full", "lora-adamw"):
        trainable = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": cfg.weight_decay},
             {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}],
            lr=lr, betas=D.BETAS, eps=D.ADAMW_EPS)
    if method in ("muon-full", "lora-muon"):
        return Muon(param_groups(model), lr=lr, weight_decay=cfg.weight_decay,
                    orth_dtype=muon_orth_dtype(cfg))
    raise ValueError(f"unknown fine-tuning method {method!r}; choose one of {METHODS}")


def with_lora(model: nn.Module, seed: int) -> nn.Module:
    """``model`` with peft LoRA adapters (rank `LORA_RANK`, alpha twice that, no dropout) on `LORA_TARGETS`;
    every other weight frozen. LoRA's A is initialised from ``torch.manual_seed(seed)``."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("the finetune preset's LoRA runs need peft: pip install 'muonclip[peft]'") from None
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                            target_modules=list(LORA_TARGETS)))


def train_loop(model: nn.Module, opt: torch.optim.Optimizer, corpus: Corpus, cfg: RunConfig, *, steps: int,
               warmup: int, seed: int) -> bool:
    """``steps`` steps on ``corpus``'s training stream (batches of ``seed``), warm-up then cosine to
    ``min_lr_ratio`` (`muonclip.app.train.lr_factor`), gradients clipped at ``grad_clip``. Returns
    False (and stops) when the loss is not finite."""
    sched = dataclasses.replace(cfg, steps=steps, warmup_steps=warmup, warmup_adamw=None)
    peaks = [g["lr"] for g in opt.param_groups]
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()
    for step in range(steps):
        f = lr_factor(step, sched, "adamw")
        for g, peak in zip(opt.param_groups, peaks):
            g["lr"] = peak * f
        x, y = train_batch(corpus, step, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=seed)
        loss = model(x, y)[1]
        if not torch.isfinite(loss):
            return False
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(trainable, cfg.grad_clip)
        opt.step()
    return True


def finetune_run(method: str, lr: float, seed: int, pretrained: dict[str, Tensor], cfg: RunConfig,
                 target: Corpus, evals: dict[str, list[tuple[Tensor, Tensor]]], protocol: Protocol
                 ) -> tuple[dict[str, float | None], nn.Module]:
    """One fine-tuning run from the pre-trained weights: ``({"finetune": loss, "pretrain": loss}, model)``;
    the losses are None when the run diverged."""
    model = build_model(cfg)
    model.load_state_dict(pretrained)
    if method.startswith("lora"):
        model = with_lora(model, seed)
    opt = _optimizer(method, model, lr, cfg)
    ok = train_loop(model, opt, target, cfg, steps=protocol.steps, warmup=protocol.warmup, seed=seed)
    losses: dict[str, float | None] = {k: (evaluate(model, b) if ok else None) for k, b in evals.items()}
    if any(v is not None and not math.isfinite(v) for v in losses.values()):
        losses = dict.fromkeys(losses)
    return losses, model


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def finding(rows: dict[str, dict[str, Any]], before: dict[str, float]) -> list[str]:
    """What the measured means say about each published claim (a difference within the seeds' combined
    spread, the sum of the two standard deviations, is reported as no difference)."""

    def cmp(a: str, b: str, key: str) -> tuple[float, bool]:
        d = rows[a][key][0] - rows[b][key][0]
        return d, abs(d) > rows[a][key][1] + rows[b][key][1]

    out = []
    for a, b, claim in (("muon-full", "adamw-full", "full Muon against full AdamW"),
                        ("lora-muon", "lora-adamw", "LoRA + Muon against LoRA + AdamW")):
        d, real = cmp(a, b, "finetune")
        verdict = ("better" if d < 0 else "worse") if real else "no different (within the seeds' spread)"
        out.append(f"{claim}: fine-tuned loss {d:+.4f} ({verdict})")
    forget = {m: rows[m]["pretrain"][0] - before["pretrain"] for m in rows}
    least = min(forget, key=forget.get)
    out.append("forgetting (rise of the pre-training text's loss): " + ", ".join(
        f"{m} {forget[m]:+.4f}" for m in rows) + f"; least: {least}")
    return out


def compare_finetune(cfg: RunConfig, out_dir: str | Path, *, progress: bool = True) -> tuple[dict[str, Any], str]:
    """Run the fine-tuning comparison (module doc); return (summary data, printed table).

    Raises:
        DataError, OutputError, ValueError: bad input; nothing written.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    cfg.validate()
    if cfg.data is not None:
        raise ValueError("the finetune preset pre-trains and fine-tunes on genres of the built-in plays; "
                         "leave --data unset")
    if cfg.n_expert or cfg.attention != "mha":
        raise ValueError("the finetune preset uses the default dense MHA model (n_expert=0, attention=mha)")
    check_threads(cfg.threads)
    threads = cfg.threads or usable_cores()
    for optimizer in ("adamw", "muon"):  # one process: pre-training, then each method; two validation sets
        check_memory(cfg, optimizer, torch.device("cpu"), corpus=corpus_size(None), val_sets=2,
                     runs_per_seed=len(METHODS))
    check_outside_runs(out_dir)
    if inspect_folder(out_dir).kind == "run" or (out_dir.exists() and any(out_dir.iterdir())):
        raise OutputError(f"--out {out_dir} is not empty; choose a new folder so nothing is overwritten")
    check_writable(out_dir)
    protocol = Protocol.of(cfg)
    pre_corpus, target = genre_corpora(cfg.val_fraction)
    evals = {name: val_batches(c, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, block_size=cfg.block_size)
             for name, c in (("finetune", target), ("pretrain", pre_corpus))}
    (out_dir / "pretrain").mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)

    say: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if progress else (lambda s: None)
    say(f"pre-training with AdamW on {pre_corpus.source}: {cfg.steps} steps")
    model = build_model(cfg)
    opt = _optimizer("adamw", model, cfg.lr_adamw, cfg)
    if not train_loop(model, opt, pre_corpus, cfg, steps=cfg.steps, warmup=cfg.warmup("adamw"), seed=cfg.seed):
        raise ValueError("pre-training diverged: lower lr_adamw")
    pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(pretrained, out_dir / "pretrain" / "model.pt")
    before = {k: evaluate(model, b) for k, b in evals.items()}

    runs: list[dict[str, Any]] = []

    def run(method: str, lr: float, seed: int) -> dict[str, float | None]:
        losses, _ = finetune_run(method, lr, seed, pretrained, cfg, target, evals, protocol)
        runs.append({"method": method, "lr": lr, "seed": seed, **losses})
        say(f"  {method} lr {lr:.3g} seed {seed}: fine-tuned loss {losses['finetune']}")
        return losses

    tuned: dict[str, Any] = {}
    seed0 = protocol.seeds[0]
    for m in METHODS:
        b = bracket(lambda rates, m=m: [run(m, r, seed0)["finetune"] for r in rates],
                    log_grid(CENTERS[m], 5, GRID_RATIO), ratio=GRID_RATIO, max_extensions=MAX_EXTENSIONS)
        tuned[m] = {"lr": b.best, "bracketed": b.inside, "notes": b.notes,
                    "grid": {f"{r:.4g}": s for r, s in sorted(b.scores.items())}}
    rows: dict[str, dict[str, Any]] = {}
    for m in METHODS:
        lr = tuned[m]["lr"]
        per_seed = [next(r for r in runs if r["method"] == m and r["lr"] == lr and r["seed"] == protocol.seeds[0])]
        per_seed += [{**run(m, lr, s), "seed": s} for s in protocol.seeds[1:]]
        if any(r["finetune"] is None for r in per_seed):
            raise ValueError(f"{m} diverged at its tuned rate {lr:.3g} on a seed: the rate is at the edge of "
                             "stability; lower the grid (CENTERS) or raise steps")
        rows[m] = {"lr": lr, "finetune": _mean_std([r["finetune"] for r in per_seed]),
                   "pretrain": _mean_std([r["pretrain"] for r in per_seed]),
                   "seeds": {r["seed"]: {"finetune": r["finetune"], "pretrain": r["pretrain"]} for r in per_seed}}
    found = finding(rows, before)
    wall = time.perf_counter() - t0
    table = finetune_markdown(rows, before, tuned)
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    context = [
        f"model: the reference GPT, {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, context "
        f"{cfg.block_size} ({n_params / 1e6:.3f}M parameters), byte tokens",
        f"pre-training: AdamW, lr {cfg.lr_adamw:.4g}, warm-up {cfg.warmup('adamw')}, {cfg.steps} steps x "
        f"{cfg.batch_size} x {cfg.block_size} tokens on {pre_corpus.source}; seed {cfg.seed}",
        f"fine-tuning: {protocol.steps} steps (warm-up {protocol.warmup}, cosine to {cfg.min_lr_ratio:g}) on "
        f"{target.source}; weight decay {cfg.weight_decay:g} on matrices; LoRA rank {LORA_RANK}, alpha "
        f"{2 * LORA_RANK} on {', '.join(LORA_TARGETS)}; rates tuned on seed {protocol.seeds[0]} (5-point grid, "
        f"ratio {GRID_RATIO:g}, bracketed); seeds {', '.join(map(str, protocol.seeds))}",
        f"machine: {platform.machine()} CPU, {usable_cores()} cores, {threads} thread(s); torch {torch.__version__}; "
        f"Muon's orthogonalisation in {orthogonalisation(cfg)}; wall time {wall:.0f} s",
    ]
    data = {"config": cfg.to_dict(), "protocol": dataclasses.asdict(protocol), "before": before, "rows": rows,
            "tuned": tuned, "finding": found, "published": list(PUBLISHED), "context": context, "wall_time": wall}
    (out_dir / "finetune.json").write_text(json.dumps({"runs": runs}, indent=1), encoding="utf-8")
    (out_dir / "summary.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    md = ["# muonclip compare --preset finetune", "", *[f"- {c}" for c in context], "", table, "",
          "## What this run found", "", *[f"- {f}" for f in found], "", "## Published", "",
          *[f"- {p}" for p in PUBLISHED], ""]
    (out_dir / "summary.md").write_text("\n".join(md), encoding="utf-8")
    return data, table + "\n\n" + "\n".join(found)


def finetune_markdown(rows: dict[str, dict[str, Any]], before: dict[str, float], tuned: dict[str, Any]) -> str:
    """The table: per method its tuned rate (bracketed or not) and the two losses, mean ± std over seeds."""
    lines = ["| method | tuned lr | fine-tuned val loss (held-out genre) | pre-training text loss | forgetting |",
             "|---|---|---|---|---|",
             f"| pre-trained (AdamW), before fine-tuning | | {before['finetune']:.4f} | {before['pretrain']:.4f} | |"]
    for m, r in rows.items():
        mark = "" if tuned[m]["bracketed"] else " (edge)"
        (f, fs), (p, ps) = r["finetune"], r["pretrain"]
        lines.append(f"| {m} | {r['lr']:.3g}{mark} | {f:.4f} ± {fs:.4f} | {p:.4f} ± {ps:.4f} | "
                     f"{p - before['pretrain']:+.4f} |")
    return "\n".join(lines)
