"""`muonclip train`: one run of the reference GPT with AdamW, Muon or MuonClip.

A run lives in one folder (``run_dir``)::

    config.json      the RunConfig and the optimizer
    metrics.jsonl    one row per step (see muonclip.app.metrics)
    metrics.csv      the same rows as CSV
    checkpoint.pt    the latest checkpoint (see muonclip.distributed.checkpoint)

Step s (0-based) of every run: the batch ``train_batch(corpus, s, seed)``, learning rate
``peak * lr_factor(s)`` (linear warm-up, cosine decay to ``peak * min_lr_ratio``), forward,
backward, optimizer step (MuonClip's includes QK-Clip), then bookkeeping: per-layer max
logits (MuonClip's ``last_max_logits``; for AdamW/Muon the model's recorders, read and reset),
update RMS of the hidden matrices (`muonclip.integrations.UpdateRMS`: per unit lr, weight
decay removed, before QK-Clip), validation every ``eval_every`` steps and at the end,
a checkpoint every ``checkpoint_every`` steps and at the end.

Resume is bit-identical: batches depend only on (seed, step), the learning rate only on
the step, and the checkpoint holds model, optimizer and RNG state.

Under ``torchrun`` (see `muonclip.app.launch`): DDP, or FSDP2 with ``fsdp=True``;
``batch_size`` is the global batch and each rank trains on its block of rows, so the run
equals the one-process run up to float reduction order; rank 0 alone prints and writes
metrics; checkpoints are sharded (``checkpoint.dcp.json`` + ``checkpoint-step<N>.dcp/``) and
resume on any number of ranks. A one-process run resumes a sharded checkpoint and vice versa.

Stops:
* Ctrl-C (SIGINT): the current step finishes, a checkpoint is written, `Interrupted` is raised
  (the CLI exits with 130). A second Ctrl-C aborts at once; the last checkpoint stays valid.
  Under torchrun the stop flag is all-reduced each step (every rank stops after the same
  step and joins the save), and SIGTERM, which the launcher sends on Ctrl-C, stops the same way.
* A non-finite loss, gradient or validation loss: nothing is written for that step, the last
  good checkpoint is kept, `NonFiniteLossError` names the step (the CLI exits with 3).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed.checkpoint import (
    FILE_CHECKPOINT,
    check_compatible,
    find_checkpoint,
    has_checkpoint,
    load_full_into_sharded,
    load_sharded,
    remove_sharded,
    rng_state,
    save_file,
    save_sharded,
    set_rng_state,
)
from ..distributed.context import SINGLE, GroupContext
from ..integrations.stats import UpdateRMS
from ..optim import NonFiniteGradError, param_groups
from .config import MODEL_FIELDS, RunConfig, check_optimizer
from .data import Corpus, check_fits, corpus_warnings, load_corpus, train_batch, val_batches
from .launch import (
    all_max,
    all_mean,
    all_sum,
    check_batch,
    current_group,
    device,
    is_active,
    mode,
    rank_rows,
    wrap_model,
)
from .memory import check_memory
from .metrics import MetricsWriter
from .probes import ExpertRMS, MLAClipAudit

CHECKPOINT = FILE_CHECKPOINT
CONFIG = "config.json"


class OutputError(RuntimeError):
    """The output folder cannot be used (unwritable, or holds another run)."""


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/inf loss, gradient or validation loss at ``step`` (1-based); the last
    good checkpoint is kept."""

    def __init__(self, step: int, detail: str, checkpoint: Path | None) -> None:
        self.step, self.detail, self.checkpoint = step, detail, checkpoint
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
        super().__init__(f"non-finite {detail} at step {step}; training stopped, {kept}. "
                         "Lower the learning rate or resume from the checkpoint with other settings.")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable: raised in compare's worker processes
        return type(self), (self.step, self.detail, self.checkpoint)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C: a checkpoint of the last finished step was written (``step``, ``checkpoint``)."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"interrupted after step {step}; checkpoint saved to {checkpoint}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.step, self.checkpoint)


@dataclass
class RunResult:
    """What a finished run reports (the full history is in ``run_dir/metrics.jsonl``)."""

    optimizer: str
    run_dir: Path
    steps: int
    final_val_loss: float
    wall_time: float


def build_model(cfg: RunConfig) -> nn.Module:
    """The reference GPT of ``cfg``, initialised from ``torch.manual_seed(cfg.seed)``."""
    from ..models import GPT

    torch.manual_seed(cfg.seed)
    return GPT(model_config(cfg))


def model_config(cfg: RunConfig) -> Any:
    """The `muonclip.models.GPTConfig` of ``cfg`` (byte vocabulary)."""
    from ..models import GPTConfig

    return GPTConfig(vocab_size=256, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_kv_head=cfg.n_kv_head, n_embd=cfg.n_embd, attention=cfg.attention, qk_norm=cfg.qk_norm,
                     n_expert=cfg.n_expert, n_expert_active=cfg.n_expert_active, n_shared_expert=cfg.n_shared_expert,
                     expert_hidden=cfg.expert_hidden, aux_loss_weight=cfg.aux_loss_weight)


def build_optimizer(name: str, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The optimizer of a run.

    * ``adamw``: ``torch.optim.AdamW(lr=lr_adamw, betas=(0.9, 0.95))``, weight decay on
      tensors with ndim >= 2 only.
    * ``muon``: ``muonclip.Muon`` over `muonclip.param_groups` — hidden matrices at
      ``lr_muon``, embeddings/head/norms by its AdamW branch at ``lr_adamw``.
    * ``muonclip``: ``muonclip.MuonClip``, the same plus QK-Clip at ``tau``, at ``lr_muonclip``.
    """
    check_optimizer(name)
    if name == "adamw":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr_adamw, betas=(0.9, 0.95),
        )
    groups = param_groups(model, adamw_lr=cfg.lr_adamw)
    orth_dtype = getattr(torch, cfg.orth_dtype)
    if name == "muon":
        from ..optim import Muon

        return Muon(groups, lr=cfg.lr_muon, weight_decay=cfg.weight_decay, orth_dtype=orth_dtype)
    from .. import MuonClip

    return MuonClip(model, lr=cfg.lr_muonclip, tau=cfg.tau, groups=groups, weight_decay=cfg.weight_decay,
                    orth_dtype=orth_dtype)


def lr_factor(step: int, cfg: RunConfig, optimizer: str) -> float:
    """Multiplier of the peak lr at 0-based ``step`` of a run of ``optimizer``: linear warm-up over
    ``cfg.warmup(optimizer)`` steps, then cosine from 1 down to ``min_lr_ratio`` at the last step."""
    warmup = cfg.warmup(optimizer)
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, cfg.steps - warmup - 1)
    t = min(1.0, (step - warmup) / span)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def forward_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of ``model`` on ``x (B, T)`` against ``y (B, T)``."""
    return model(x, y)[1]


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean validation loss over the fixed ``batches`` (eval mode; the recorders are not fed)."""
    was_training = model.training
    model.eval()
    total = sum(float(forward_loss(model, x, y)) for x, y in batches) / len(batches)
    model.train(was_training)
    return total


def read_max_logits(model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctx: GroupContext = SINGLE) -> tuple[list[float], list[int]]:
    """Per-layer max logit of the step and per-layer count of clipped heads (0 without QK-Clip).

    Under torchrun, call on every rank: MuonClip's maxima are already reduced over the ranks;
    the model's own recorders (AdamW/Muon runs) saw only this rank's rows and are all-reduced
    with MAX here.
    """
    names = [f"blocks.{i}.attn" for i in range(len(model.attention_modules()))]
    clipped_map = {}
    if hasattr(optimizer, "last_max_logits"):
        logits_map = dict(optimizer.last_max_logits or {})
        clipped_map = dict(getattr(optimizer, "last_clipped", None) or {})
        model.pop_max_logits()  # nothing should be left; keep the recorders clean regardless
        reduce = False
    else:
        logits_map = model.pop_max_logits()
        reduce = True
    keys = names if all(k in logits_map for k in names) else list(logits_map)
    maxes = [float(logits_map[k].max()) for k in keys]
    if reduce:
        maxes = all_max(maxes, ctx)
    clipped = [int(clipped_map[k].sum()) if k in clipped_map else 0 for k in keys]
    return maxes, clipped


def check_out_dir(run_dir: Path, *, resume: bool) -> None:
    """Raise `OutputError` unless ``run_dir`` can be written (fresh run: must not hold a run already)."""
    probe = run_dir
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OutputError(f"--out {run_dir}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"--out {run_dir}: cannot write to {probe} (permission denied); choose another --out")
    if not resume and has_checkpoint(run_dir):
        raise OutputError(f"--out {run_dir} already holds a run; continue it with --resume or choose another --out")


def _install_sigint() -> tuple[dict[str, bool], Any]:
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        return flag, None

    def handler(signum: int, frame: Any) -> None:
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    return flag, signal.signal(signal.SIGINT, handler)


def _install_sigterm(flag: dict[str, bool]) -> Any:
    """Under torchrun: SIGTERM (what the launcher sends its workers on Ctrl-C) stops like a first
    Ctrl-C — finish the step, checkpoint on every rank, exit — and never aborts a save."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        flag["stop"] = True

    return signal.signal(signal.SIGTERM, handler)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; return the norm
    before scaling (non-finite: the caller stops the run before the optimizer step).

    Plain tensors: ``torch.nn.utils.clip_grad_norm_``. DTensor gradients (FSDP2, tensor
    parallel) may live on different meshes (FSDP2's data-parallel mesh and a 2-D one), which
    torch's version cannot stack; each gradient's norm is then reduced on its own mesh (one
    scalar all-reduce each: call on every rank) and the gradients are scaled in place.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not any(hasattr(g, "full_tensor") for g in grads):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = float(torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n
                                                        for n in norms])))
    if math.isfinite(total) and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(coef)
    return total


def _check_memory(cfg: RunConfig, optimizer: str, ctx: GroupContext, fsdp: bool) -> None:
    """`muonclip.app.memory.check_memory` on every rank; under torchrun all ranks stop together
    (one all-reduce) when one of them has too little memory, rank 0 with the message."""
    dev = device(ctx)
    try:
        check_memory(cfg, optimizer, dev, world_size=ctx.world_size, fsdp=fsdp,
                     ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if dev.type == "cpu" else 1)
        short: ValueError | None = None
    except ValueError as e:
        short = e
    if is_active(ctx, fsdp) and all_max([float(short is not None)], ctx)[0] > 0:
        raise short or ValueError("another rank has too little memory for one training step; see rank 0's message")
    if short is not None:
        raise short


def _hidden_matrices(model: nn.Module) -> list[Tensor]:
    return [p for g in param_groups(model) if g["algorithm"] == "muon" for p in g["params"]]


def train_run(cfg: RunConfig, optimizer: str, run_dir: str | Path, *, resume: bool = False,
              corpus: Corpus | None = None, progress: bool = True, label: str | None = None,
              tensorboard: str | Path | None = None, fsdp: bool = False, warn: bool = True,
              tp: int = 1) -> RunResult:
    """Train one run; see the module docstring. Every input is checked before anything is written.

    Args:
        cfg: the validated config (on resume: the checkpoint's, with any overrides applied).
        optimizer: "adamw", "muon" or "muonclip".
        run_dir: the run's folder (created).
        resume: continue from ``run_dir/checkpoint.pt`` (default False).
        corpus: a loaded corpus (default None: ``load_corpus(cfg.data, cfg.val_fraction)``).
        progress: show a progress bar (tqdm) on stderr (default True).
        label: progress-bar label (default: the optimizer name).
        tensorboard: also write every metrics row as TensorBoard scalars to this folder (default
            None; needs the ``tensorboard`` extra; see `muonclip.integrations.tensorboard`).
        fsdp: shard the model with FSDP2 (default False: DDP when a process group of several
            ranks is initialised, see `muonclip.app.launch.session`; else one process).
        warn: print `muonclip.app.data.corpus_warnings` (a run that reads its training text more
            than 10 times, a validation split smaller than one batch) to stderr before training
            (default True; `muonclip.app.compare.compare` prints them once for all its runs).
        tp: tensor-parallel size (default 1: none); > 1 needs ``fsdp``: the ranks form a
            ``(world / tp, tp)`` mesh, each block tensor-parallel over ``tp`` ranks
            (`muonclip.models.parallel`), FSDP2 over the other dimension.

    Raises:
        DataError, OutputError, CheckpointError, ValueError: bad input (also: one step would not fit
            in memory, `muonclip.app.memory`); nothing written.
        NonFiniteLossError: NaN/inf loss, gradient or validation loss; last good checkpoint kept.
        Interrupted: Ctrl-C; checkpoint of the last finished step written.
    """
    check_optimizer(optimizer)
    run_dir = Path(run_dir)
    cfg.validate()
    ctx = current_group(fsdp, tp)
    active, main, dev = is_active(ctx, fsdp), ctx.rank == 0, device(ctx)
    check_batch(cfg.batch_size, ctx, tp)
    _check_memory(cfg, optimizer, ctx, fsdp)
    check_out_dir(run_dir, resume=resume)
    if corpus is None:
        corpus = load_corpus(cfg.data, cfg.val_fraction)
    check_fits(corpus, cfg.batch_size, cfg.block_size)
    if warn and main:
        for warning in corpus_warnings(corpus, steps=cfg.steps, batch_size=cfg.batch_size, block_size=cfg.block_size):
            print(f"muonclip: warning: {warning}", file=sys.stderr)
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // ctx.world_size))

    model = build_model(cfg)
    start, extra = 0, {"elapsed": 0.0, "last_val_loss": float("nan")}
    found = find_checkpoint(run_dir) if resume else None
    if found is not None:
        check_compatible(found, optimizer=optimizer, config=cfg.to_dict(), model=model, fields=MODEL_FIELDS)
        if found.step > cfg.steps:
            raise ValueError(f"the checkpoint is at step {found.step}, past steps={cfg.steps}; raise --steps")
        if found.kind == "file":
            model.load_state_dict(found.data["model"])  # before wrapping: DDP/FSDP2 take the loaded weights
        start = found.step
        extra.update(found.data.get("extra") or {})
    train_model, model = wrap_model(model, ctx, fsdp, tp)
    opt = build_optimizer(optimizer, model, cfg)
    base_lrs = [g["lr"] for g in opt.param_groups]  # the peaks: a loaded state holds the last scheduled lr
    if found is not None:
        if found.kind == "sharded":
            set_rng_state(load_sharded(run_dir, found.data, model, opt))
        else:
            if fsdp:
                def build_plain() -> tuple[nn.Module, torch.optim.Optimizer]:
                    plain = build_model(cfg)
                    return plain, build_optimizer(optimizer, plain, cfg)

                load_full_into_sharded(model, opt, found.data, build_plain)
            else:
                opt.load_state_dict(found.data["optim"])
            set_rng_state(found.data["rng"])
    ckpt_path = run_dir / CHECKPOINT

    tb = None
    if tensorboard is not None and main:
        from ..integrations.tensorboard import TensorBoardWriter

        try:
            tb = TensorBoardWriter(tensorboard, purge_step=start + 1 if resume else None)
        except ImportError as e:
            raise ValueError(f"--tensorboard: {e}") from None
    writer = None
    if main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / CONFIG, "w", encoding="utf-8") as f:
                json.dump({"optimizer": optimizer, **cfg.to_dict()}, f, indent=2)
        except OSError as e:
            raise OutputError(f"--out {run_dir}: cannot write ({e}); choose another --out") from None
        writer = MetricsWriter(run_dir, cfg.n_layer, keep_until=start if resume else None)
    val = [(rank_rows(x, ctx, dev, tp), rank_rows(y, ctx, dev, tp)) for x, y in
           val_batches(corpus, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, block_size=cfg.block_size)]
    rms_meter = UpdateRMS(opt, params=_hidden_matrices(model))
    # one process: per-expert update RMS (3-D expert stacks) and the factors of each clipped MLA head
    expert_meter = ExpertRMS(opt, model) if not active and any(p.ndim == 3 for p in model.parameters()) else None
    audit = MLAClipAudit(opt, model) if not active else None
    tokens_per_step = cfg.batch_size * cfg.block_size
    bar = progress_bar(label or optimizer, cfg.steps, start, tokens_per_step, enabled=progress and main)
    last_saved: Path | None = found.path if found is not None else None
    elapsed0 = float(extra["elapsed"])
    t_start = time.perf_counter()

    def save(step: int) -> Path:
        extra["elapsed"] = elapsed0 + time.perf_counter() - t_start
        meta = {"optimizer": optimizer, "config": cfg.to_dict(), "step": step, "extra": dict(extra)}
        if active:
            return save_sharded(run_dir, model, opt, ctx, meta={**meta, "mode": mode(ctx, fsdp, tp)},
                                rng=rng_state())
        path = save_file(ckpt_path, {**meta, "model": model.state_dict(), "optim": opt.state_dict(),
                                     "rng": rng_state()})
        remove_sharded(run_dir)  # a resumed sharded run now continues in checkpoint.pt
        return path

    flag, old_handler = _install_sigint()
    old_term = _install_sigterm(flag) if active else None
    train_model.train()
    try:
        for step in range(start, cfg.steps):
            factor = lr_factor(step, cfg, optimizer)
            for g, lr in zip(opt.param_groups, base_lrs):
                g["lr"] = lr * factor
            x, y = train_batch(corpus, step, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=cfg.seed)
            x, y = rank_rows(x, ctx, dev, tp), rank_rows(y, ctx, dev, tp)
            t0 = time.perf_counter()
            loss = forward_loss(train_model, x, y)
            stop_now = False
            if active:  # one all-reduce: the mean loss (non-finite if any rank's is) and Ctrl-C on any rank
                loss_value, stops = all_mean([float(loss.detach()), float(flag["stop"])], ctx)
                stop_now = stops > 0
            else:
                loss_value = float(loss.detach())
            if not math.isfinite(loss_value):
                raise NonFiniteLossError(step + 1, f"loss ({loss_value})", last_saved)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:  # on every rank: the norm of DTensor gradients is reduced over the group
                norm = clip_grad_norm(model.parameters(), cfg.grad_clip)
                if not math.isfinite(norm):
                    raise NonFiniteLossError(step + 1, f"gradient (global norm {norm})", last_saved)
            rms_meter.before()
            if expert_meter is not None:
                expert_meter.before()
            try:
                opt.step()
            except NonFiniteGradError as e:
                rms_meter.discard()
                raise NonFiniteLossError(step + 1, f"gradient ({e})", last_saved) from None
            clip_stats = opt.clip_stats() if callable(getattr(opt, "clip_stats", None)) else {}
            maxes, clipped = read_max_logits(model, opt, ctx)
            rms = rms_meter.after(reduce=(lambda v: all_sum(v, ctx)) if fsdp else None)
            probes: dict[str, Any] = {}
            if expert_meter is not None:
                probes["expert_rms"] = expert_meter.after()
            if audit is not None and (events := audit.events()):
                probes["clip_audit"] = events
            step_time = time.perf_counter() - t0
            done = step + 1
            val_loss = None
            if done % cfg.eval_every == 0 or done == cfg.steps:
                val_loss = all_mean([evaluate(model, val)], ctx)[0]  # the same value on every rank
                if not math.isfinite(val_loss):
                    raise NonFiniteLossError(done, f"validation loss ({val_loss})", last_saved)
                extra["last_val_loss"] = val_loss
            row = {
                "step": done, "tokens": done * tokens_per_step, "loss": loss_value, "val_loss": val_loss,
                "lr": cfg.lr(optimizer) * factor, "max_logit": max(maxes) if maxes else None,
                "max_logits": maxes, "clipped_heads": sum(clipped), "clipped": clipped,
                "max_logit_is_bound": int(clip_stats.get("max_logit_is_bound", 0.0)) if maxes else None,
                "update_rms": rms, "step_time": step_time,
                "elapsed": elapsed0 + time.perf_counter() - t_start, **probes,
            }
            if writer is not None:
                writer.write(row)
            if tb is not None:
                tb.write(row)
            shown = f"loss {loss_value:.4f}"
            if math.isfinite(extra["last_val_loss"]):
                shown += f", val {extra['last_val_loss']:.4f}"
            bar.set_postfix_str(shown, refresh=False)
            bar.update(1)
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                last_saved = save(done)
            if stop_now or (flag["stop"] and not active):
                if last_saved is None or done % cfg.checkpoint_every:
                    last_saved = save(done)
                raise Interrupted(done, last_saved)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        if tb is not None:
            tb.close()
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return RunResult(optimizer, run_dir, cfg.steps, float(extra["last_val_loss"]),
                     elapsed0 + time.perf_counter() - t_start)


def progress_bar(label: str, total: int, start: int, tokens_per_step: int, *, enabled: bool) -> Any:
    """A tqdm bar of a run on stderr: tokens done of the run's total, the last losses, tokens/s and
    the ETA (``disable`` when not ``enabled``; ``update(1)`` per step). On a terminal it redraws in
    place; in a log file or CI it writes at most every 30 s."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=start, desc=label, unit="tok", unit_scale=tokens_per_step, disable=not enabled,
                file=sys.stderr, dynamic_ncols=tty, mininterval=0.1 if tty else 30.0, leave=True,
                bar_format="{desc}: {n_fmt}/{total_fmt} [{bar:20}] {percentage:3.0f}% | {postfix} | {rate_fmt} "
                           "| ETA {remaining}")


__all__ = [
    "CHECKPOINT", "CONFIG", "Interrupted", "NonFiniteLossError", "OutputError", "RunResult", "build_model",
    "build_optimizer", "evaluate", "forward_loss", "lr_factor", "model_config", "progress_bar", "read_max_logits",
    "train_run",
]
