"""Writing a run's checkpoint: whole or not at all (`muonclip.app.checkpoints`, "Writing").

`save_checkpoint` writes the checkpoint of a step to a temporary name, flushes and renames it to
its own step's name, hashes its files from the disk, writes the pointer ``checkpoint.json``
atomically after them and only then removes the previous checkpoint; `save_file` writes one
checkpoint file (`muonclip.app.checkpoints.load_file` reads it back).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed import checkpoint as dcp_checkpoint
from ..distributed._context import SINGLE, GroupContext
from ..distributed.checkpoint import CheckpointError, model_shapes
from .checkpoints import FILE_FORMAT, FORMAT, VERSION, Checkpoint
from .launch import agree, barrier
from .run_state import RunIdentity, rng_state, rng_to_json
from .runfolder import POINTER, remove_leftovers
from .safe_files import OutputError, file_digest, temporary_name, write_atomically, write_json


def save_file(path: str | Path, payload: dict[str, Any], token: str | None = None) -> Path:
    """Write ``payload`` (``step``, ``model``, ``optim``, ``rng``) atomically to ``path`` as one
    ``torch.save`` dict (format and version are added; ``token``: the writer's,
    `muonclip.app.safe_files.write_atomically`)."""
    data = {"format": FILE_FORMAT, "version": VERSION, **payload}
    return write_atomically(path, lambda f: torch.save(data, f), token=token)


def _free_name(folder: Path, step: int, suffix: str, avoid: str | None) -> str:
    name, n = f"checkpoint-step{step}{suffix}", 1
    while name == avoid:
        name, n = f"checkpoint-step{step}-{n}{suffix}", n + 1
    return name


def _write_failed(folder: Path, step: int, previous: Checkpoint | None, e: BaseException) -> OutputError:
    kept = f"the checkpoint of step {previous.step} is kept" if previous else "no earlier checkpoint exists"
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):  # torch.save reports a full disk as a
        cause = cause.__context__  # RuntimeError of its zip writer, raised while handling the OSError
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e).splitlines()[0]
    return OutputError(f"--out {folder}: cannot write the checkpoint of step {step} ({reason}); {kept}. "
                       "Free space or fix the folder, then continue with --resume")


def save_checkpoint(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctx: GroupContext = SINGLE, *, sharded: bool, step: int, meta: dict[str, Any],
                    previous: Checkpoint | None, token: str | None = None) -> Checkpoint:
    """Write the checkpoint of ``step`` into the run folder ``folder`` and make it the current one
    (module docstring, "Writing"). ``sharded``: every rank calls this and a DCP folder is written;
    else one process writes one file.

    Args:
        folder: the run folder (its lock held by rank 0).
        model, optimizer: what to save (plain, DDP or FSDP2).
        ctx: the process group (default one process).
        sharded: write a DCP folder (a run on several ranks, or FSDP2) instead of one file.
        step: optimizer steps done.
        meta: the pointer's ``optimizer``, ``config``, ``run``, ``extra`` (and anything else kept,
            e.g. ``mode``).
        previous: the current checkpoint (removed once the new one is in place), or None.
        token: the writer's token (`muonclip.app.safe_files.new_token`, recorded in the folder's
            lock; the same on every rank), named in the temporaries (default None: a fresh one).

    Raises:
        OutputError: the checkpoint could not be written (e.g. a full disk); ``previous`` stays
            the current checkpoint. Under torchrun, on every rank.
    """
    folder = Path(folder)
    main = ctx.rank == 0
    token = token or uuid.uuid4().hex
    avoid = previous.name if previous else None
    rng = rng_state()
    error: BaseException | None = None
    files: dict[str, dict[str, Any]] = {}
    if main:
        folder.mkdir(parents=True, exist_ok=True)
    if sharded:
        name = _free_name(folder, step, ".dcp", avoid)
        tmp = folder / temporary_name(name, token)  # never there yet: the token is this writer's
        barrier(ctx)
        try:
            dcp_checkpoint.save(tmp, model, optimizer, extra={"rng": rng_to_json(rng), "step": step})
        except (OSError, CheckpointError) as e:
            error = e
        agree(error, ctx, lambda e: _write_failed(folder, step, previous, e))
        if main:
            try:
                os.replace(tmp, folder / name)
                files = {f"{name}/{p.name}": file_digest(folder, f"{name}/{p.name}")
                         for p in sorted((folder / name).iterdir())}
            except OSError as e:
                error = e
    else:
        name = _free_name(folder, step, ".pt", avoid)
        try:
            save_file(folder / name, {"step": step, "model": model.state_dict(), "optim": optimizer.state_dict(),
                                      "rng": rng}, token=token)
            files = {name: file_digest(folder, name)}
        except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's zip writer on a full disk
            error = e
    ckpt = Checkpoint(folder, "sharded" if sharded else "file", name, step, meta["optimizer"], meta["config"],
                      RunIdentity.from_dict(meta["run"]), dict(meta.get("extra") or {}), model_shapes(model), files)
    if main and error is None:
        body = {"format": FORMAT, "version": VERSION, "kind": ckpt.kind, "path": name, "step": step,
                "world_size": ctx.world_size, **meta, "shapes": ckpt.shapes, "files": files}
        try:
            write_json(folder / POINTER, body, token=token)
        except OSError as e:
            error = e
        else:
            remove_leftovers(folder, keep=name)  # the previous checkpoint, and what kills left
    agree(error if main else None, ctx, lambda e: _write_failed(folder, step, previous, e))
    return ckpt
