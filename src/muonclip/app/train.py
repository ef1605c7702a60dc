"""`muonclip train`: one run of the reference GPT with AdamW, Muon or MuonClip.

A run lives in one folder (``run_dir``; its layout, who may write it and how: see
`muonclip.app.runfolder`)::

    config.json              the RunConfig, the optimizer and the run's identity and history
    metrics.jsonl / .csv     one row per step (see muonclip.app.metrics)
    checkpoint.json          the current checkpoint and the SHA-256 of its files
    checkpoint-step<N>.pt    the checkpoint (one process; muonclip.app.checkpoints), or
    checkpoint-step<N>.dcp/  the sharded one (under torchrun)

`train_run` goes through four stages, each a function of this module:

1. `check_inputs`: the config, the threads, the ranks' agreement, the batch split, the memory
   estimate, the corpus — every input, before anything is written.
2. `open_run_folder`: a new run only in an absent or empty folder, a resume only of a run
   folder with its checkpoint (or, for a run that stopped before its first checkpoint, a
   restart from step 0 with its own config, said on screen); the folder's lock
   (`muonclip.app.runfolder.RunLock`); on resume the checkpoint verified against its manifest,
   the checkpoint file's contents checked against its pointer, and the resume's changes
   checked (`muonclip.app.resume`).
3. `build_state`: the model and the optimizer, wrapped for the launch, the checkpoint loaded
   and the config's hyperparameters applied. Only then is the lock stamped with this writer's
   token, so a resume refused at any of these stages leaves the folder as it was.
4. the steps (`train_step`), their records (`Records`: metrics, TensorBoard, progress bar) and
   the checkpoints.

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
  (the CLI exits with 130). A second Ctrl-C aborts at once; the last checkpoint stays valid.
  Under torchrun the stop flag is all-reduced each step (every rank stops after the same
  step and joins the save), and SIGTERM, which the launcher sends on Ctrl-C, stops the same way.
* A non-finite loss, gradient or validation loss: nothing is written for that step, the last
  good checkpoint is kept, `NonFiniteLossError` names the step (the CLI exits with 3).
* A full disk or another failed write of a checkpoint: `muonclip.app.runfolder.OutputError`
  (exit code 2), the previous checkpoint kept.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed.checkpoint import CheckpointError
from ..distributed.context import SINGLE, GroupContext
from ..integrations.stats import UpdateRMS
from ..optim import NonFiniteGradError
from .checkpoints import (
    Checkpoint,
    RunIdentity,
    check_contents,
    check_shapes,
    corpus_digest,
    load_checkpoint,
    load_file,
    read_checkpoint,
    read_run_config,
    save_checkpoint,
    set_rng_state,
    verify,
)
from .config import RunConfig, check_optimizer
from .data import Corpus, check_fits, corpus_size, corpus_warnings, load_corpus, train_batch, val_batches
from .launch import (
    agree,
    all_gather_text,
    all_max,
    all_mean,
    all_sum,
    barrier,
    check_batch,
    check_same_everywhere,
    current_group,
    device,
    is_active,
    mode,
    rank_rows,
    wrap_model,
)
from .memory import check_memory
from .metrics import MetricsWriter
from .model import build_model, build_optimizer, hidden_matrices
from .probes import ExpertRMS, MLAClipAudit
from .resume import (
    apply_hyperparameters,
    changes,
    check_changes,
    check_restart,
    check_same_run,
    group_hyperparameters,
)
from .runfolder import (
    OutputError,
    RunLock,
    check_new_run_folder,
    check_run_folder,
    new_token,
    read_lock_token,
    remove_leftovers,
    write_config,
)


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


def check_threads(threads: int) -> int:
    """The torch CPU threads of a run: ``threads`` (0: the cores shared by the ranks of the machine
    is decided by the caller). Raises ValueError naming ``--threads`` above this machine's cores:
    more threads than cores never helps, and very many crash the thread pool."""
    cores = os.cpu_count() or 1
    if threads > cores:
        raise ValueError(f"--threads {threads}: this machine has {cores} cores; use at most {cores} (0: all of them)")
    return threads


@dataclass(frozen=True)
class Place:
    """Where this process trains: its process group (`GroupContext`), the launch flags, and what
    follows from them (``active``: wrapped with collectives; ``main``: rank 0; ``dev``)."""

    ctx: GroupContext
    fsdp: bool
    tp: int

    @property
    def active(self) -> bool:
        return is_active(self.ctx, self.fsdp)

    @property
    def main(self) -> bool:
        return self.ctx.rank == 0

    @property
    def dev(self) -> torch.device:
        return device(self.ctx)


def _check_memory(cfg: RunConfig, optimizer: str, place: Place, corpus: tuple[int, int]) -> None:
    """`muonclip.app.memory.check_memory` for this process (its device, the ranks that share this
    machine's memory, the corpus files' ``(total, largest)`` bytes)."""
    dev = place.dev
    check_memory(cfg, optimizer, dev, world_size=place.ctx.world_size, fsdp=place.fsdp,
                 ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if dev.type == "cpu" else 1,
                 corpus=corpus)


def check_inputs(cfg: RunConfig, optimizer: str, run_dir: Path, place: Place, *, resume: bool,
                 corpus: Corpus | None, warn: bool) -> tuple[Corpus, str]:
    """Stage 1 of `train_run` (nothing is written): the ranks' agreement on every setting, the
    config, ``--threads``, the batch split, the memory estimate (corpus included), the corpus,
    the ranks' agreement on the data. Returns the corpus and its SHA-256 (`corpus_digest`).

    Every rank has the same settings (checked first), but each machine has its own cores, memory
    and files: every check after that one ends in `muonclip.app.launch.agree`, so that all ranks
    stop together, rank 0 naming the first failing rank's problem.

    Raises:
        ValueError, DataError: bad input; under torchrun, on every rank.
    """
    ctx = place.ctx
    check_same_everywhere({**cfg.to_dict(), "optimizer": optimizer, "resume": resume, "fsdp": place.fsdp,
                           "tp": place.tp, "out": os.path.abspath(run_dir)}, ctx)
    error: ValueError | None = None
    try:
        check_optimizer(optimizer)
        cfg.validate()
        check_threads(cfg.threads)
        check_batch(cfg.batch_size, ctx, place.tp)
        # the corpus is counted before it is read; a caller's corpus is in memory already
        _check_memory(cfg, optimizer, place, corpus_size(cfg.data) if corpus is None else (0, 0))
    except ValueError as e:  # DataError too
        error = e
    agree(error, ctx)
    try:
        if corpus is None:
            corpus = load_corpus(cfg.data, cfg.val_fraction)
        check_fits(corpus, cfg.batch_size, cfg.block_size)
    except ValueError as e:
        error = e
    agree(error, ctx)
    digest = corpus_digest(corpus.train, corpus.val)
    check_same_everywhere({"data_sha256": digest}, ctx)
    if warn and place.main:
        for warning in corpus_warnings(corpus, steps=cfg.steps, batch_size=cfg.batch_size, block_size=cfg.block_size):
            print(f"muonclip: warning: {warning}", file=sys.stderr)
    return corpus, digest


@dataclass
class Opened:
    """A run folder ready to write (`open_run_folder`): its lock (rank 0), the checkpoint to
    resume from (None for a new run or a restart), the run's identity with this start's
    history, what this resume changed, the checkpoint file's contents (already read and
    checked, for a file checkpoint), whether this is the restart of a run that never
    checkpointed, and this writer's token (set by `_stamp`, once the state is built)."""

    lock: RunLock | None
    found: Checkpoint | None
    identity: RunIdentity
    changed: dict[str, list[Any]] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    restart: bool = False
    token: str = ""


def _inside(run_dir: Path, other: str | Path | None) -> list[str]:
    """The entry of ``run_dir`` that ``other`` (a TensorBoard folder) is or lies in: the first
    component of its path inside ``run_dir``, ``"."`` for ``run_dir`` itself, or [] (elsewhere)."""
    if other is None:
        return []
    try:
        rel = Path(os.path.abspath(other)).relative_to(os.path.abspath(run_dir))
    except ValueError:
        return []
    return [rel.parts[0]] if rel.parts else ["."]


def open_run_folder(run_dir: Path, cfg: RunConfig, optimizer: str, place: Place, *, resume: bool,
                    data_sha256: str, tensorboard: str | Path | None = None) -> Opened:
    """Stage 2 of `train_run`: check the folder (`muonclip.app.runfolder`), take its lock (rank 0),
    and on resume read and verify the checkpoint, check its file's contents and what the resume
    changes (`muonclip.app.resume`), or, for a run without a checkpoint, that it may restart. Nothing
    in the folder is modified here (the lock file is created if absent); every rank agrees on the
    outcome. A TensorBoard folder inside ``run_dir`` is recorded in the run's identity.

    Raises:
        OutputError, CheckpointError, ValueError: on every rank.
    """
    ctx = place.ctx
    allowed = _inside(run_dir, tensorboard)
    lock: RunLock | None = None
    error: BaseException | None = None
    if place.main:
        try:
            (check_run_folder if resume else check_new_run_folder)(run_dir, allowed)
            lock = RunLock(run_dir)
            (check_run_folder if resume else check_new_run_folder)(run_dir, allowed)  # under the lock, again
        except OutputError as e:
            error = e
            if lock is not None:
                lock.release()
                lock = None
    agree(error, ctx)
    opened = Opened(lock, None, RunIdentity.new(data_sha256))
    if resume:
        try:
            opened = _check_resume(run_dir, cfg, optimizer, data_sha256, lock)
        except (CheckpointError, OutputError, ValueError) as e:
            error = e
        if error is not None and lock is not None:
            lock.release()
        agree(error, ctx)
    opened.identity.tensorboard = sorted({*opened.identity.tensorboard, *allowed})
    return opened


def _check_resume(run_dir: Path, cfg: RunConfig, optimizer: str, data_sha256: str,
                  lock: RunLock | None) -> Opened:
    """Read and verify the checkpoint of ``run_dir`` (and its file's contents) and check that this
    resume may continue it; without a checkpoint, that the run may restart (`check_restart`)."""
    record = read_run_config(run_dir)
    if not (run_dir / "checkpoint.json").exists() and record is not None:
        where = str(run_dir / "config.json")
        check_restart(run_dir, record.config)
        changed = changes(record.config.to_dict(), cfg)
        check_changes(changed, record.optimizer, optimizer, where)
        _check_text(record.run.data_sha256, data_sha256, where)
        history = [*record.run.history, *([{"step": 0, "changed": changed}] if changed else [])]
        identity = RunIdentity(record.run.id, record.run.data_sha256, history, record.run.tensorboard)
        return Opened(lock, None, identity, changed, restart=True)
    found = read_checkpoint(run_dir)
    verify(found)
    where = str(found.folder / "checkpoint.json")
    check_same_run(record.data if record else None, found.optimizer, found.config, found.run.id, where)
    changed = changes(found.config, cfg)
    check_changes(changed, found.optimizer, optimizer, where)
    _check_text(found.run.data_sha256, data_sha256, where)
    if found.step > cfg.steps:
        raise ValueError(f"the checkpoint is at step {found.step}, past steps={cfg.steps}; raise --steps")
    data = None
    if found.kind == "file":  # every rank reads it: checked here, loaded in build_state
        data = load_file(found.path)
        check_contents(data, found)
    history = [h for h in found.run.history if h["step"] < found.step]
    if changed:
        history.append({"step": found.step, "changed": changed})
    own = record.run.tensorboard if record else []
    identity = RunIdentity(found.run.id, found.run.data_sha256, history, sorted({*found.run.tensorboard, *own}))
    return Opened(lock, found, identity, changed, data)


def _check_text(saved: str, data_sha256: str, where: str) -> None:
    if saved != data_sha256:
        raise ValueError(f"the training text differs from the one {where} was trained on (its SHA-256 is "
                         f"{saved[:12]}..., this --data gives {data_sha256[:12]}...); a resume needs the same text: "
                         "restore it, or start a new run in another --out")


def _stamp(run_dir: Path, opened: Opened, ctx: GroupContext) -> None:
    """Rank 0 writes its process id, host and a fresh token into the lock file (for a second
    writer's message, and as the record of the temporaries this writer names with it); every
    rank keeps the token in ``opened.token``. Under torchrun every other rank must read the
    token there (else the ranks do not share the run folder, e.g. no shared file system)."""
    lock = opened.lock
    token = new_token() if lock is not None else ""
    if lock is not None:
        lock.stamp(token)
    if ctx.world_size == 1:
        opened.token = token
        return
    token = opened.token = all_gather_text(token, ctx)[0]
    barrier(ctx)
    error = None
    if ctx.rank != 0 and read_lock_token(run_dir) != token:
        error = OutputError(f"rank {ctx.rank} does not see rank 0's run folder {run_dir} (its {run_dir / '.lock'} "
                            "is not the one rank 0 wrote): --out must be a folder on a file system every rank shares")
    try:
        agree(error, ctx)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


@dataclass
class State:
    """The model and optimizer of a run (`build_state`): ``train_model`` (what the forward calls:
    the DDP wrapper or the model), ``model`` (with its own parameter names), ``opt``, the peak
    learning rate of each param group (``base_lrs``) and the first step to run (``start``)."""

    train_model: nn.Module
    model: nn.Module
    opt: torch.optim.Optimizer
    base_lrs: list[float]
    start: int


def build_state(cfg: RunConfig, optimizer: str, place: Place, found: Checkpoint | None,
                data: dict[str, Any] | None = None) -> State:
    """Stage 3 of `train_run`: the model, wrapped for the launch (`muonclip.app.launch.wrap_model`),
    its optimizer, and on resume the checkpoint loaded into both, the config's hyperparameters
    set again over the loaded ones (`muonclip.app.resume.apply_hyperparameters`) and the RNG
    states restored.

    ``data``: the file checkpoint's contents when already read and checked
    (`muonclip.app.checkpoints.check_contents`; default None: read and checked here).

    Raises:
        CheckpointError: the checkpoint does not fit the model (on every rank).
    """
    model = build_model(cfg)
    error = None
    try:
        if found is not None:
            check_shapes(found, model)
            if found.kind == "file":
                if data is None:
                    data = load_file(found.path)
                    check_contents(data, found)
                model.load_state_dict(data["model"])  # before wrapping: DDP/FSDP2 take the loaded weights
    except CheckpointError as e:
        error = e
    agree(error, place.ctx)
    train_model, model = wrap_model(model, place.ctx, place.fsdp, place.tp)
    opt = build_optimizer(optimizer, model, cfg)
    built = group_hyperparameters(opt)
    base_lrs = [g["lr"] for g in opt.param_groups]  # the peaks: a loaded state holds the last scheduled lr
    if found is None:
        return State(train_model, model, opt, base_lrs, 0)

    def build_plain() -> tuple[nn.Module, torch.optim.Optimizer]:
        plain = build_model(cfg)
        return plain, build_optimizer(optimizer, plain, cfg)

    rng = load_checkpoint(found, model, opt, place.ctx, build=build_plain if place.fsdp else None, file_data=data)
    apply_hyperparameters(opt, built, cfg)
    set_rng_state(rng)
    return State(train_model, model, opt, base_lrs, found.step)


class Records:
    """What a run writes besides checkpoints, on rank 0: ``config.json``, the metrics files, the
    TensorBoard scalars, the progress bar (every rank: its meters).

    Args:
        run_dir, cfg, optimizer, place: the run.
        opened: the opened folder (`open_run_folder`).
        state: the built model and optimizer (`build_state`).
        tensorboard: a TensorBoard folder (default None).
        progress: show the progress bar (default True).
        label: its label (default: the optimizer's name).

    Raises:
        OutputError: ``config.json`` or the metrics cannot be written.
        ValueError: TensorBoard is asked for but not installed.
    """

    def __init__(self, run_dir: Path, cfg: RunConfig, optimizer: str, place: Place, opened: Opened, state: State,
                 *, tensorboard: str | Path | None, progress: bool, label: str | None) -> None:
        self.writer: MetricsWriter | None = None
        self.tb: Any = None
        start, resume = state.start, opened.found is not None
        if place.main:
            if tensorboard is not None:
                from ..integrations.tensorboard import TensorBoardWriter

                try:  # a restart drops what the run logged before, as its metrics
                    self.tb = TensorBoardWriter(tensorboard, purge_step=start + 1 if resume or opened.restart else None)
                except ImportError as e:
                    raise ValueError(f"--tensorboard: {e}") from None
            try:
                remove_leftovers(run_dir, keep=opened.found.name if opened.found else None)
                write_config(run_dir, optimizer, cfg.to_dict(), opened.identity.to_dict(), token=opened.token)
                self.writer = MetricsWriter(run_dir, cfg.n_layer, keep_until=start if resume else None,
                                            token=opened.token)
            except OSError as e:
                raise OutputError(f"--out {run_dir}: cannot write {e.filename or 'a file'} ({e.strerror or e}); "
                                  "free space or choose another --out") from None
        model, opt = state.model, state.opt
        self.rms = UpdateRMS(opt, params=hidden_matrices(model))
        # one process: per-expert update RMS (3-D expert stacks) and the factors of each clipped MLA head
        one = not place.active
        self.experts = ExpertRMS(opt, model) if one and any(p.ndim == 3 for p in model.parameters()) else None
        self.audit = MLAClipAudit(opt, model) if one else None
        self.bar = progress_bar(label or optimizer, cfg.steps, start, cfg.batch_size * cfg.block_size,
                                enabled=progress and place.main)

    def write(self, row: dict[str, Any], last_val_loss: float | None) -> None:
        """Record one step's row (metrics files, TensorBoard, the progress bar).

        Raises:
            OutputError: the metrics cannot be written (e.g. a full disk).
        """
        if self.writer is not None:
            try:
                self.writer.write(row)
            except OSError as e:
                raise OutputError(f"--out {self.writer.dir}: cannot write the metrics of step {row['step']} "
                                  f"({e.strerror or e}); the last checkpoint is intact: free space and continue "
                                  "with --resume") from None
        if self.tb is not None:
            self.tb.write(row)
        shown = f"loss {row['loss']:.4f}"
        if last_val_loss is not None:
            shown += f", val {last_val_loss:.4f}"
        self.bar.set_postfix_str(shown, refresh=False)
        self.bar.update(1)

    def sync(self) -> None:
        """The metrics on disk (before a checkpoint)."""
        if self.writer is not None:
            self.writer.sync()

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.tb is not None:
            self.tb.close()


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
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // place.ctx.world_size))
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
    _stamp(run_dir, opened, place.ctx)
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
    "Interrupted", "NonFiniteLossError", "Opened", "Place", "Records", "RunResult", "State", "build_state",
    "check_inputs", "check_threads", "clip_grad_norm", "evaluate", "forward_loss", "lr_factor", "open_run_folder",
    "progress_bar", "read_max_logits", "train_run", "train_step",
]
