"""Stages 1 to 3 of `muonclip train` (`muonclip.app.train.train_run`): a run's inputs checked,
its folder opened, its model and optimizer built.

1. `check_inputs`: the config, the threads, the ranks' agreement, the batch split, the memory
   estimate, the corpus — every input, before anything is written.
2. `open_run_folder`: a TensorBoard folder only where its event files break no run folder
   (`check_tensorboard`); a new run only in an absent or empty folder, a resume only of a run
   folder with its checkpoint (or, for a run that stopped before its first checkpoint, a
   restart from step 0 with its own config, said on screen); the folder's lock
   (`muonclip.app.runfolder.RunLock`); on resume the checkpoint verified against its manifest,
   the checkpoint file's contents checked against its pointer, and the resume's changes
   checked (`muonclip.app.resume`).
3. `build_state`: the model and the optimizer, wrapped for the launch, the checkpoint loaded
   and the config's hyperparameters applied. Only then is the lock stamped with this writer's
   token (`stamp_lock`), so a resume refused at any of these stages leaves the folder as it was.

`Place` says where this process trains (its process group and the launch flags).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed._context import GroupContext
from ..distributed.checkpoint import CheckpointError
from .checkpoints import (
    Checkpoint,
    check_contents,
    check_shapes,
    load_checkpoint,
    load_file,
    read_checkpoint,
    read_run_config,
    verify,
)
from .config import RunConfig, check_optimizer
from .cores import usable_cores
from .data import Corpus, check_fits, corpus_size, corpus_warnings, load_corpus
from .launch import (
    agree,
    all_gather_text,
    barrier,
    check_batch,
    check_same_everywhere,
    device,
    is_active,
    wrap_model,
)
from .memory import check_memory
from .model import build_model, build_optimizer
from .resume import (
    apply_hyperparameters,
    changes,
    check_changes,
    check_restart,
    check_same_run,
    group_hyperparameters,
)
from .run_state import RunIdentity, corpus_digest, set_rng_state
from .runfolder import RunLock, check_new_run_folder, check_run_folder, enclosing_run, is_own_entry, read_lock_token
from .safe_files import TEMPORARY_NAME, OutputError, new_token


def check_threads(threads: int) -> int:
    """The torch CPU threads of a run: ``threads`` (0: the cores shared by the ranks of the machine
    is decided by the caller). Raises ValueError naming ``--threads`` above the cores this process
    may use (`muonclip.app.cores.usable_cores`): more threads than cores never helps, and very many
    crash the thread pool."""
    cores = usable_cores()
    if threads > cores:
        raise ValueError(f"--threads {threads}: this machine has {cores} cores for this process; use at most "
                         f"{cores} (0: all of them)")
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
    checkpointed, and this writer's token (set by `stamp_lock`, once the state is built)."""

    lock: RunLock | None
    found: Checkpoint | None
    identity: RunIdentity
    changed: dict[str, list[Any]] = field(default_factory=dict)
    data: dict[str, Any] | None = None
    restart: bool = False
    token: str = ""


def tensorboard_entries(run_dir: Path, tensorboard: str | Path | None) -> list[str]:
    """The entry of ``run_dir`` that the TensorBoard folder ``tensorboard`` is or lies in: the first
    component of its real path (links resolved) inside ``run_dir``'s, ``"."`` for ``run_dir``
    itself, or [] (elsewhere, or None)."""
    if tensorboard is None:
        return []
    try:
        rel = Path(os.path.realpath(tensorboard)).relative_to(os.path.realpath(run_dir))
    except ValueError:
        return []
    return [rel.parts[0]] if rel.parts else ["."]


def check_tensorboard(run_dir: Path, tensorboard: str | Path | None) -> None:
    """Raise `OutputError` where the event files of the TensorBoard folder ``tensorboard`` would break
    a run folder: it is or lies in another run's folder (`muonclip.app.runfolder.enclosing_run`),
    which would then hold files that are not its run's and could no longer be continued; or it lies
    in ``run_dir`` under a name the run keeps for its own files (``config.json``, a checkpoint, the
    metrics, ...). Inside ``run_dir`` otherwise, it is the run's (`tensorboard_entries`)."""
    if tensorboard is None:
        return
    outer = enclosing_run(tensorboard)
    if outer is not None and outer != Path(os.path.realpath(run_dir)):
        raise OutputError(f"--tensorboard {tensorboard} lies in {outer}, the folder of another muonclip run: its "
                          "event files there would stop that run from being continued (a run folder holds one run "
                          "and nothing else); choose a folder outside it, or one inside this run's --out")
    entry = next(iter(tensorboard_entries(run_dir, tensorboard)), ".")
    if entry != "." and (is_own_entry(entry) or TEMPORARY_NAME.fullmatch(entry)):
        raise OutputError(f"--tensorboard {tensorboard}: {entry} is a name the run folder {run_dir} keeps for its "
                          f"own files; choose another folder, e.g. {Path(run_dir) / 'tensorboard'}")


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
    allowed = tensorboard_entries(run_dir, tensorboard)
    lock: RunLock | None = None
    error: BaseException | None = None
    if place.main:
        try:
            check_tensorboard(run_dir, tensorboard)
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


def stamp_lock(run_dir: Path, opened: Opened, ctx: GroupContext) -> None:
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
