"""`muonclip train`: one run of the reference GPT with AdamW, Muon or MuonClip.

A run lives in one folder (``run_dir``; its layout, who may write it and how: see
`muonclip.app.runfolder`)::

    config.json              the RunConfig, the optimizer and the run's identity and history
    metrics.jsonl / .csv     one row per step (see muonclip.app.metrics)
    checkpoint.json          the current checkpoint and the SHA-256 of its files
    checkpoint-step<N>.pt    the checkpoint (one process; muonclip.app.checkpoints), or
    checkpoint-step<N>.dcp/  the sharded one (under torchrun)

`train_run` goes through four stages:

1. to 3. in `muonclip.app.train_setup`: every input checked before anything is written
   (`check_inputs`), the run folder opened and on resume its checkpoint verified
   (`open_run_folder`), the model and optimizer built with the checkpoint loaded
   (`build_state`); only then is the folder's lock stamped with this writer's token.
4. here: the steps (`train_step`), their records (`muonclip.app.train_records.Records`: metrics,
   TensorBoard, progress bar) and the checkpoints.

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
metrics; checkpoints are sharded and resume on any number of ranks. A one-process run resumes
a sharded checkpoint and vice versa.

Stops:
* Ctrl-C (SIGINT): the current step finishes, a checkpoint is written, `Interrupted` is raised
  (the CLI exits with 130). A second Ctrl-C aborts at once; the last checkpoint stays valid
  (every file of a run is written by a rename, `muonclip.app.runfolder`): under the command
  (`CtrlC` installed) the process ends there with 130 (`abort`), elsewhere KeyboardInterrupt
  is raised. Under torchrun the stop flag is all-reduced each step (every rank stops after the
  same step and joins the save), and SIGTERM, which the launcher sends on Ctrl-C, stops the same
  way.
* A non-finite loss, gradient or validation loss: nothing is written for that step, the last
  good checkpoint is kept, `NonFiniteLossError` names the step (the CLI exits with 3).
* A full disk or another failed write of a checkpoint: `muonclip.app.safe_files.OutputError`
  (exit code 2), the previous checkpoint kept.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from ..optim import NonFiniteGradError
from .checkpoint_write import save_checkpoint
from .checkpoints import Checkpoint
from .config import RunConfig
from .cores import usable_cores
from .data import Corpus, train_batch, val_batches
from .launch import all_mean, all_sum, current_group, mode, rank_rows
from .train_records import Records, read_max_logits
from .train_setup import Opened, Place, State, build_state, check_inputs, open_run_folder, stamp_lock


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


ABORTED = "muonclip: aborted; the last checkpoint (if any) is intact"


def abort() -> NoReturn:
    """End the process at once with exit code 130, saying so on stderr, and with it the worker
    processes it started (multiprocessing's children: `muonclip compare`'s runs), killed: no
    exception, no unwinding (so no traceback, whatever the process was doing). Safe for a run
    folder at any moment: its files are replaced by renames, and a temporary left behind is
    removed by the next writer."""
    import multiprocessing

    with contextlib.suppress(Exception):
        for child in multiprocessing.active_children():
            child.kill()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"\n{ABORTED}\n".encode())
    os._exit(130)


class CtrlC:
    """The SIGINT handler of the ``muonclip`` command (`muonclip.app.main.main` installs it): the
    first Ctrl-C raises KeyboardInterrupt (the command exits with 130) and marks ``seen``; any
    Ctrl-C after one was seen calls `abort`. A run's loop (`train_run`) takes over Ctrl-C while it
    trains (the first one stops it after the step, with a checkpoint) and marks ``seen`` when it
    had one, so that a Ctrl-C while the command reports the stop, or while the process exits,
    ends it with 130 too, never with a traceback."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.seen:
            abort()
        self.seen = True
        raise KeyboardInterrupt


def _install_sigint() -> tuple[dict[str, bool], Any]:
    """While a run trains: the first Ctrl-C sets the stop flag; a second one calls `abort` under
    the command (`CtrlC` installed), else raises KeyboardInterrupt."""
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        return flag, None
    command = signal.getsignal(signal.SIGINT)
    command = command if isinstance(command, CtrlC) else None

    def handler(signum: int, frame: Any) -> None:
        if flag["stop"] or (command is not None and command.seen):
            if command is not None:
                abort()
            raise KeyboardInterrupt
        flag["stop"] = True
        if command is not None:
            command.seen = True

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


def train_step(step: int, cfg: RunConfig, optimizer: str, place: Place, state: State, corpus: Corpus,
               records: Records, stop: dict[str, bool], last_saved: Path | None) -> tuple[dict[str, Any], bool]:
    """One optimizer step (0-based ``step``) with its bookkeeping; returns its metrics row (without
    the validation loss) and whether a Ctrl-C on any rank asks to stop after it.

    Raises:
        NonFiniteLossError: a non-finite loss or gradient (nothing was applied).
    """
    ctx, dev, opt, model = place.ctx, place.dev, state.opt, state.model
    factor = lr_factor(step, cfg, optimizer)
    for g, lr in zip(opt.param_groups, state.base_lrs):
        g["lr"] = lr * factor
    x, y = train_batch(corpus, step, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=cfg.seed)
    x, y = rank_rows(x, ctx, dev, place.tp), rank_rows(y, ctx, dev, place.tp)
    t0 = time.perf_counter()
    loss = forward_loss(state.train_model, x, y)
    stop_now = False
    if place.active:  # one all-reduce: the mean loss (non-finite if any rank's is) and Ctrl-C on any rank
        loss_value, stops = all_mean([float(loss.detach()), float(stop["stop"])], ctx)
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
    records.rms.before()
    if records.experts is not None:
        records.experts.before()
    try:
        opt.step()
    except NonFiniteGradError as e:
        records.rms.discard()
        raise NonFiniteLossError(step + 1, f"gradient ({e})", last_saved) from None
    clip_stats = opt.clip_stats() if callable(getattr(opt, "clip_stats", None)) else {}
    maxes, clipped = read_max_logits(model, opt, ctx)
    rms = records.rms.after(reduce=(lambda v: all_sum(v, ctx)) if place.fsdp else None)
    probes: dict[str, Any] = {}
    if records.experts is not None:
        probes["expert_rms"] = records.experts.after()
    if records.audit is not None and (events := records.audit.events()):
        probes["clip_audit"] = events
    done = step + 1
    row = {
        "step": done, "tokens": done * cfg.batch_size * cfg.block_size, "loss": loss_value, "val_loss": None,
        "lr": cfg.lr(optimizer) * factor, "max_logit": max(maxes) if maxes else None,
        "max_logits": maxes, "clipped_heads": sum(clipped), "clipped": clipped,
        "max_logit_is_bound": int(clip_stats.get("max_logit_is_bound", 0.0)) if maxes else None,
        "update_rms": rms, "step_time": time.perf_counter() - t0, **probes,
    }
    return row, stop_now


def train_run(cfg: RunConfig, optimizer: str, run_dir: str | Path, *, resume: bool = False,
              corpus: Corpus | None = None, progress: bool = True, label: str | None = None,
              tensorboard: str | Path | None = None, fsdp: bool = False, warn: bool = True,
              tp: int = 1) -> RunResult:
    """Train one run; see the module docstring. Every input is checked before anything is written.

    Args:
        cfg: the validated config (on resume: the checkpoint's, with any overrides applied;
            `muonclip.app.resume` says which may change).
        optimizer: "adamw", "muon" or "muonclip".
        run_dir: the run's folder (created; a new run needs it absent or empty).
        resume: continue the run of ``run_dir`` from its checkpoint (default False).
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
            in memory, `muonclip.app.memory`); nothing written. OutputError also: a checkpoint
            could not be written (the previous one kept).
        NonFiniteLossError: NaN/inf loss, gradient or validation loss; last good checkpoint kept.
        Interrupted: Ctrl-C; checkpoint of the last finished step written.
    """
    run_dir = Path(run_dir)
    place = Place(current_group(fsdp, tp), fsdp, tp)
    corpus, digest = check_inputs(cfg, optimizer, run_dir, place, resume=resume, corpus=corpus, warn=warn)
    torch.set_num_threads(cfg.threads or max(1, usable_cores() // place.ctx.world_size))
    opened = open_run_folder(run_dir, cfg, optimizer, place, resume=resume, data_sha256=digest,
                             tensorboard=tensorboard)
    if opened.restart and place.main:
        print(f"muonclip: --out {run_dir} holds no checkpoint: the run stopped before its first one, so nothing "
              "of it was saved; restarting it from step 0 with its own config (config.json)", file=sys.stderr)
    try:
        return _train(cfg, optimizer, run_dir, place, opened, corpus, progress=progress, label=label,
                      tensorboard=tensorboard)
    finally:
        if opened.lock is not None:
            opened.lock.release()


def _train(cfg: RunConfig, optimizer: str, run_dir: Path, place: Place, opened: Opened, corpus: Corpus, *,
           progress: bool, label: str | None, tensorboard: str | Path | None) -> RunResult:
    """Stages 3 and 4 of `train_run`, under the folder's lock."""
    state = build_state(cfg, optimizer, place, opened.found, opened.data)
    opened.data = None  # loaded: not kept for the run's length
    stamp_lock(run_dir, opened, place.ctx)
    found = opened.found
    extra: dict[str, Any] = {"elapsed": 0.0, "last_val_loss": None, **(found.extra if found else {})}
    val = [(rank_rows(x, place.ctx, place.dev, place.tp), rank_rows(y, place.ctx, place.dev, place.tp)) for x, y in
           val_batches(corpus, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, block_size=cfg.block_size)]
    records = Records(run_dir, cfg, optimizer, place, opened, state, tensorboard=tensorboard, progress=progress,
                      label=label)
    last: Checkpoint | None = found
    elapsed0 = float(extra["elapsed"])
    t_start = time.perf_counter()

    def save(step: int) -> Checkpoint:
        extra["elapsed"] = elapsed0 + time.perf_counter() - t_start
        records.sync()
        meta = {"optimizer": optimizer, "config": cfg.to_dict(), "run": opened.identity.to_dict(),
                "extra": dict(extra), "mode": mode(place.ctx, place.fsdp, place.tp)}
        return save_checkpoint(run_dir, state.model, state.opt, place.ctx, sharded=place.active, step=step,
                               meta=meta, previous=last, token=opened.token)

    flag, old_handler = _install_sigint()
    old_term = _install_sigterm(flag) if place.active else None
    state.train_model.train()
    try:
        for step in range(state.start, cfg.steps):
            row, stop_now = train_step(step, cfg, optimizer, place, state, corpus, records, flag,
                                       last.path if last else None)
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                val_loss = all_mean([evaluate(state.model, val)], place.ctx)[0]  # the same value on every rank
                if not math.isfinite(val_loss):
                    raise NonFiniteLossError(done, f"validation loss ({val_loss})", last.path if last else None)
                extra["last_val_loss"] = row["val_loss"] = val_loss
            row["elapsed"] = elapsed0 + time.perf_counter() - t_start
            records.write(row, extra["last_val_loss"])
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                last = save(done)
            if stop_now or (flag["stop"] and not place.active):
                if last is None or last.step != done:
                    last = save(done)
                raise Interrupted(done, last.path)
    finally:
        records.close()
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    final = extra["last_val_loss"]
    return RunResult(optimizer, run_dir, cfg.steps, float("nan") if final is None else float(final),
                     elapsed0 + time.perf_counter() - t_start)
