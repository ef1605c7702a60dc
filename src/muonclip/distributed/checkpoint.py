"""Checkpoints of a model and its optimizer: reshardable, atomic, validated on load.

Two formats, one module:

* **Sharded** (`save` / `load`, and the run-folder form `save_sharded` / `load_sharded`):
  ``torch.distributed.checkpoint`` (DCP) from the state dicts of
  ``torch.distributed.checkpoint.state_dict.get_state_dict``. Parameters and optimizer state
  (momentum, Adam moments, step counts) are keyed by parameter name (FQN), and FSDP2 shards are
  stored as pieces of the global tensors, so a checkpoint written by N ranks loads on M ranks, on
  one process, with DDP or FSDP2 or neither (docs: "Distributed Muon"), with nothing lost:
  the loaded tensors are bit-identical to the saved ones. Layout of the directory:
  ``{"model": ..., "optim": ..., "muonclip": {...}, "extra": {...}}`` where ``"muonclip"``
  holds Muon's step and skipped-step counters (DCP's optimizer state dict keeps only ``state`` and
  ``param_groups``) and ``"extra"`` anything the caller adds (pickled: load only checkpoints
  you trust). Every rank must call these (they are collectives when a process group is
  initialised); without one they work in one process.
* **Single file** (`save_file` / `load_file`): one ``torch.save`` dict, loaded with
  ``weights_only=True``, for a one-process run.

A *run folder* holds at most one current checkpoint of either kind (`find_checkpoint`):
``checkpoint.pt`` (single file) or the pointer ``checkpoint.dcp.json`` naming a DCP folder
``checkpoint-step<N>.dcp``. Both carry the run's bookkeeping beside the tensors: ``optimizer``
(its name), ``config`` (a JSON dict), ``step``, ``extra`` (JSON), and the RNG states
(`rng_state`). `check_compatible` refuses a checkpoint that does not fit the model being
resumed, with a message that says what differs.

Never half-written: a single file is written to a temporary file beside it, flushed to disk and
``os.replace``-d onto its name (`write_atomically`); a sharded save goes to a temporary folder,
is renamed once every rank has finished, and only then does the pointer (itself written
atomically) name it. A crash or Ctrl-C at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .context import SINGLE, GroupContext

FILE_CHECKPOINT = "checkpoint.pt"
FILE_FORMAT = "muonclip-checkpoint"
FILE_VERSION = 1
SHARDED_POINTER = "checkpoint.dcp.json"
SHARDED_FORMAT = "muonclip-sharded-checkpoint"
SHARDED_VERSION = 1
_COUNTERS = ("steps_taken", "steps_skipped")
_FILE_KEYS = ("optimizer", "config", "step", "model", "optim", "rng")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run; the message says why."""


# --------------------------------------------------------------------------------------------
# DCP: model + optimizer, reshardable


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP (``.module``); FSDP2 modules are used as they are."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any] | None = None) -> None:
    """Write ``model`` and ``optimizer`` (and ``extra``) to the directory ``path``; call on every rank.

    Args:
        path: checkpoint directory (created).
        model: the model (plain, DDP-wrapped or FSDP2 ``fully_shard``-ed).
        optimizer: its optimizer (any ``torch.optim.Optimizer``; Muon's counters are kept).
        extra: small picklable values to store alongside (default None).
    """
    model = _unwrap(model)
    msd, osd = get_state_dict(model, optimizer)
    counters = {k: int(getattr(optimizer, k)) for k in _COUNTERS if hasattr(optimizer, k)}
    blob = pickle.dumps(dict(extra or {}))  # one opaque leaf: DCP loads only keys the template has
    dcp.save({"model": msd, "optim": osd, "muonclip": counters, "extra": blob}, checkpoint_id=os.fspath(path))


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a checkpoint written by `save` (by any number of ranks) into ``model`` and ``optimizer``.

    The model and optimizer must be built first, the same way (same parameter names and
    param groups), on any number of ranks. An optimizer with no state yet gets it created by
    DCP's zero-gradient, zero-lr step, then overwritten. Returns the ``extra`` dict.
    """
    model = _unwrap(model)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "muonclip": {k: 0 for k in _COUNTERS if hasattr(optimizer, k)}, "extra": b""}
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for k, v in state["muonclip"].items():
        if hasattr(optimizer, k):
            setattr(optimizer, k, int(v))
    return pickle.loads(state["extra"]) if state["extra"] else {}


def load_full_into_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, data: dict[str, Any],
                           build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """Load a single-file checkpoint (``data``, from `load_file`) into an FSDP2 ``model`` and its ``optimizer``.

    ``build()`` must return a fresh plain ``(model, optimizer)`` pair built the same way: the
    file is loaded into it and its state dicts, keyed by parameter name, are distributed into
    the shards with ``set_state_dict(full_state_dict=True)``. Call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    plain, plain_opt = build()
    plain.load_state_dict(data["model"])
    plain_opt.load_state_dict(data["optim"])
    msd, osd = get_state_dict(plain, plain_opt)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
    for k in _COUNTERS:
        if hasattr(plain_opt, k):
            setattr(optimizer, k, getattr(plain_opt, k))


# --------------------------------------------------------------------------------------------
# atomic writes, RNG


def write_atomically(path: str | Path, write: Callable[[IO[Any]], object], text: bool = False) -> Path:
    """``write(f)`` into ``.<name>.tmp-<pid>`` beside ``path``, fsync, then ``os.replace`` onto ``path``.

    On any failure (Ctrl-C included) the temporary file is removed and ``path`` is untouched.

    Args:
        path: the file to (re)place.
        write: called once with the open temporary file.
        text: open it in text mode, UTF-8 (default False: binary).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w" if text else "wb", **({"encoding": "utf-8"} if text else {})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def rng_state() -> dict[str, Any]:
    """The torch RNG states to restore on resume (CPU, and every CUDA device if present)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states returned by `rng_state`."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------
# single file


def save_file(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` atomically to ``path`` as one ``torch.save`` dict (format and version are added).

    ``payload`` holds ``optimizer`` (name), ``config`` (dict), ``step``, ``model``
    (``model.state_dict()``), ``optim`` (``optimizer.state_dict()``), ``rng`` (`rng_state`) and
    optionally ``extra``. If writing fails the previous file at ``path`` is untouched and no
    temporary file is left.
    """
    data = {"format": FILE_FORMAT, "version": FILE_VERSION, **payload}
    return write_atomically(path, lambda f: torch.save(data, f))


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_file` (tensors on the CPU).

    Raises:
        CheckpointError: the file is missing, unreadable/corrupt, of another format or version,
            or incomplete.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a torn or foreign file
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path} is not a muonclip checkpoint")
    if data.get("version") != FILE_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {data.get('version')}, this muonclip reads {FILE_VERSION}")
    missing = [k for k in _FILE_KEYS if k not in data]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; it is incomplete")
    return data


# --------------------------------------------------------------------------------------------
# run folders: the sharded pointer, finding the latest checkpoint


def _barrier(ctx: GroupContext) -> None:
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Global shape of every tensor of ``model.state_dict()`` (DTensors: the whole tensor's)."""
    return {k: list(v.shape) for k, v in _unwrap(model).state_dict().items()}


def save_sharded(run_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 ctx: GroupContext = SINGLE, *, meta: dict[str, Any], rng: dict[str, Any]) -> Path:
    """Write a reshardable checkpoint of ``model``/``optimizer`` into the run folder ``run_dir``; call on every rank.

    All ranks write ``.checkpoint-step<N>.dcp.tmp`` (`save`); after a barrier rank 0 renames it
    to ``checkpoint-step<N>.dcp``, atomically replaces the pointer ``checkpoint.dcp.json``, then
    removes the previous folder and any ``checkpoint.pt``. Returns the pointer's path.

    Args:
        run_dir: the run folder.
        model, optimizer: what to save (plain, DDP or FSDP2).
        ctx: the process group (`muonclip.distributed.context.GroupContext`; default one process).
        meta: JSON bookkeeping for the pointer: ``optimizer``, ``config``, ``step``, ``extra``
            (anything else is kept too).
        rng: rank 0's RNG states (`rng_state`), stored in the checkpoint.
    """
    run_dir = Path(run_dir)
    step = int(meta["step"])
    tmp = run_dir / f".checkpoint-step{step}.dcp.tmp"
    main = ctx.rank == 0
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    _barrier(ctx)
    save(tmp, model, optimizer, extra={"rng": rng})
    _barrier(ctx)
    pointer = run_dir / SHARDED_POINTER
    if main:
        old = None
        if pointer.exists():
            with contextlib.suppress(OSError, ValueError):
                old = json.loads(pointer.read_text(encoding="utf-8")).get("dir")
        name, n = f"checkpoint-step{step}.dcp", 1
        while (run_dir / name).exists():  # never overwrite the folder the pointer may name
            name, n = f"checkpoint-step{step}-{n}.dcp", n + 1
        os.replace(tmp, run_dir / name)
        body = {"format": SHARDED_FORMAT, "version": SHARDED_VERSION, "dir": name, "world_size": ctx.world_size,
                "shapes": model_shapes(model), **meta}
        write_atomically(pointer, lambda f: json.dump(body, f, indent=1), text=True)
        if old and old != name:
            shutil.rmtree(run_dir / old, ignore_errors=True)
        for stale in run_dir.glob(".checkpoint-step*.dcp.tmp"):  # left by interrupted saves
            shutil.rmtree(stale, ignore_errors=True)
        (run_dir / FILE_CHECKPOINT).unlink(missing_ok=True)
    _barrier(ctx)
    return pointer


def read_pointer(run_dir: str | Path) -> dict[str, Any]:
    """Read and validate ``run_dir/checkpoint.dcp.json``; raise `CheckpointError` if unusable."""
    path = Path(run_dir) / SHARDED_POINTER
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint pointer {path} is corrupt or unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{path} is not a muonclip sharded checkpoint pointer")
    if data.get("version") != SHARDED_VERSION:
        raise CheckpointError(f"{path} has version {data.get('version')}, this muonclip reads {SHARDED_VERSION}")
    missing = [k for k in ("optimizer", "config", "step", "dir", "shapes") if k not in data]
    if missing:
        raise CheckpointError(f"checkpoint pointer {path} lacks {missing}; it is incomplete")
    folder = Path(run_dir) / data["dir"]
    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{path} points to {folder}, which holds no torch.distributed.checkpoint")
    return data


def load_sharded(run_dir: str | Path, pointer: dict[str, Any], model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the sharded checkpoint named by ``pointer`` (`read_pointer`) into ``model``/``optimizer``
    (any number of ranks, or one process); return the RNG states stored with it. Call on every rank.

    Raises:
        CheckpointError: the folder cannot be loaded into this model and optimizer.
    """
    folder = Path(run_dir) / pointer["dir"]
    try:
        with warnings.catch_warnings():  # DCP warns that it loads "in a single process": intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            extra = load(folder, model, optimizer)
    except Exception as e:  # DCP raises many kinds (CheckpointException wraps per-rank errors)
        raise CheckpointError(f"sharded checkpoint {folder} cannot be loaded ({type(e).__name__}: {e})") from None
    return extra.get("rng", {})


def remove_sharded(run_dir: str | Path) -> None:
    """Remove the sharded checkpoint of ``run_dir`` (after a newer ``checkpoint.pt`` was written)."""
    run_dir = Path(run_dir)
    pointer = run_dir / SHARDED_POINTER
    if not pointer.exists():
        return
    try:
        target = json.loads(pointer.read_text(encoding="utf-8")).get("dir")
    except (OSError, ValueError):
        target = None
    pointer.unlink(missing_ok=True)
    if target:
        shutil.rmtree(run_dir / target, ignore_errors=True)


@dataclass
class FoundCheckpoint:
    """The latest checkpoint of a run folder: ``kind`` ``"file"`` (``checkpoint.pt``, ``data`` is its
    whole dict) or ``"sharded"`` (``data`` is the pointer: optimizer, config, step, dir, shapes, extra)."""

    kind: str
    path: Path
    data: dict[str, Any]

    @property
    def optimizer(self) -> str:
        return str(self.data["optimizer"])

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.data["config"])

    @property
    def step(self) -> int:
        return int(self.data["step"])


def find_checkpoint(run_dir: str | Path) -> FoundCheckpoint:
    """The latest checkpoint of ``run_dir``: ``checkpoint.pt`` or the sharded one (the higher step wins).

    Raises:
        CheckpointError: none there, or the one there is corrupt.
    """
    run_dir = Path(run_dir)
    found = []
    if (run_dir / SHARDED_POINTER).exists():
        found.append(FoundCheckpoint("sharded", run_dir / SHARDED_POINTER, read_pointer(run_dir)))
    if (run_dir / FILE_CHECKPOINT).exists() or not found:
        found.append(FoundCheckpoint("file", run_dir / FILE_CHECKPOINT, load_file(run_dir / FILE_CHECKPOINT)))
    return max(found, key=lambda f: (f.step, f.path.stat().st_mtime))


def has_checkpoint(run_dir: str | Path) -> bool:
    """True if ``run_dir`` holds a checkpoint of either kind."""
    return (Path(run_dir) / FILE_CHECKPOINT).exists() or (Path(run_dir) / SHARDED_POINTER).exists()


def check_compatible(found: FoundCheckpoint, *, optimizer: str, config: dict[str, Any], model: nn.Module,
                     fields: Sequence[str] = ()) -> None:
    """Raise `CheckpointError` unless the checkpoint ``found`` fits this run.

    Checks, in order: the optimizer name, the config entries named in ``fields`` (those that fix
    the model's shape), and every tensor name and shape of ``model.state_dict()`` (a sharded
    checkpoint: against the global shapes in its pointer).

    Args:
        found: the checkpoint (`find_checkpoint`).
        optimizer: the name of this run's optimizer.
        config: this run's config.
        model: this run's model, not yet loaded.
        fields: config keys that must be equal (default none).
    """
    data, path = found.data, found.path
    if data["optimizer"] != optimizer:
        raise CheckpointError(
            f"{path} was written by a '{data['optimizer']}' run, this run uses '{optimizer}'; "
            f"use --optimizer {data['optimizer']} or another --out"
        )
    diffs = [f"{k}: checkpoint {data['config'].get(k)!r}, now {config.get(k)!r}"
             for k in fields if data["config"].get(k) != config.get(k)]
    if diffs:
        raise CheckpointError(f"{path} holds a model of another shape ({'; '.join(diffs)})")
    own = {k: tuple(v) for k, v in model_shapes(model).items()}
    saved = ({k: tuple(v.shape) for k, v in data["model"].items()} if found.kind == "file"
             else {k: tuple(v) for k, v in data["shapes"].items()})
    if set(own) != set(saved):
        extra, lacking = sorted(set(saved) - set(own)), sorted(set(own) - set(saved))
        raise CheckpointError(f"{path} holds another model: unexpected {extra[:5]}, missing {lacking[:5]}")
    bad = [f"{k} {saved[k]} vs {v}" for k, v in own.items() if saved[k] != v]
    if bad:
        raise CheckpointError(f"{path} holds a model of another shape: {', '.join(bad[:5])}")


__all__ = [
    "FILE_CHECKPOINT", "SHARDED_POINTER", "CheckpointError", "FoundCheckpoint", "check_compatible",
    "find_checkpoint", "has_checkpoint", "load", "load_file", "load_full_into_sharded", "load_sharded",
    "model_shapes", "read_pointer", "remove_sharded", "rng_state", "save", "save_file", "save_sharded",
    "set_rng_state", "write_atomically",
]
