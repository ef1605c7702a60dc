"""The checkpoint of a `muonclip train` run folder: written whole or not at all, verified before use.

A run folder (`muonclip.app.runfolder`) holds at most one current checkpoint, named by the JSON
pointer ``checkpoint.json``:

* ``"kind": "file"`` — ``checkpoint-step<N>.pt``, one ``torch.save`` dict (model and optimizer
  state dicts, RNG states, step), read with ``weights_only=True``; written by one process.
* ``"kind": "sharded"`` — ``checkpoint-step<N>.dcp/``, a ``torch.distributed.checkpoint``
  folder written by every rank (`muonclip.distributed.checkpoint.save`), reshardable: it loads
  on any number of ranks, or in one process. Rank 0's RNG states ride along as JSON.

The pointer holds the run's bookkeeping: ``step``, ``optimizer``, ``config`` (the config the
state was trained with), ``run`` (the run's identity, `RunIdentity`), ``extra`` (elapsed time,
last validation loss), the model's tensor ``shapes`` and the ``files`` manifest: the size and
SHA-256 of every file of the checkpoint.

**Writing** (`save_checkpoint`): the checkpoint goes to a temporary name, is flushed and renamed
to its own step's name; its files are hashed from the disk; the pointer is written atomically
after them; only then is the previous checkpoint removed. A kill at any moment leaves the
previous pointer and its checkpoint intact (and leftovers that the next start removes). A
failed write (a full disk) raises `OutputError` saying that the previous checkpoint is kept.

**Reading** (`read_checkpoint`, `verify`, `load_checkpoint`): the pointer is validated, every
file of the manifest is hashed and compared (a flipped byte, a truncated or missing file is
refused with `CheckpointError` naming the file, before anything is loaded or written), and
nothing read executes code (``weights_only=True``; DCP through
`muonclip.distributed.checkpoint`'s restricted readers).

**Trust model.** The manifest catches accidental corruption (a bad disk, a torn copy, a
truncated transfer), not tampering: whoever can write the folder can rewrite the manifest too.
Loading never runs code, so a run folder from an untrusted source can be resumed without risk
to the machine; what it trains is the writer's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed import checkpoint as dcp_checkpoint
from ..distributed.checkpoint import CheckpointError, model_shapes
from ..distributed.context import SINGLE, GroupContext
from .launch import agree, barrier
from .runfolder import POINTER, OutputError, file_digest, remove_leftovers, write_atomically, write_json

FORMAT = "muonclip-checkpoint"
VERSION = 2
FILE_FORMAT = "muonclip-checkpoint-file"
_POINTER_KEYS = ("kind", "path", "step", "optimizer", "config", "run", "extra", "shapes", "files")


@dataclass
class RunIdentity:
    """Who a run is, kept in ``config.json`` and in every checkpoint pointer.

    Attributes:
        id: a random id given when the run starts (a checkpoint copied in from another run
            carries another one).
        data_sha256: SHA-256 of the run's training and validation bytes (`corpus_digest`).
        history: the changes made on resume, in order: ``{"step": s, "changed": {field: [old, new]}}``.
    """

    id: str
    data_sha256: str
    history: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def new(cls, data_sha256: str) -> RunIdentity:
        return cls(uuid.uuid4().hex, data_sha256)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "data_sha256": self.data_sha256, "history": list(self.history)}

    @classmethod
    def from_dict(cls, d: Any) -> RunIdentity:
        if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not isinstance(d.get("data_sha256"), str):
            raise ValueError(f"not a run identity: {d!r:.200}")
        return cls(d["id"], d["data_sha256"], list(d.get("history") or []))


def corpus_digest(train: torch.Tensor, val: torch.Tensor) -> str:
    """SHA-256 of a corpus's training then validation bytes (uint8 tensors)."""
    h = hashlib.sha256()
    for t in (train, val):
        h.update(t.contiguous().numpy().tobytes())
        h.update(b"\x00")
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """The torch RNG states to restore on resume (CPU, and every CUDA device if present)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states returned by `rng_state` (CUDA states only where CUDA is present)."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """`rng_state` as JSON: each byte tensor as base64 text."""
    def enc(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode("ascii")

    cuda = state.get("cuda")
    return {"torch": enc(state["torch"]), "cuda": None if cuda is None else [enc(t) for t in cuda]}


def rng_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `rng_to_json`.

    Raises:
        CheckpointError: not such a dict.
    """
    def dec(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)

    try:
        cuda = data.get("cuda")
        return {"torch": dec(data["torch"]), "cuda": None if cuda is None else [dec(s) for s in cuda]}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's RNG states are unreadable ({type(e).__name__}: {e})") from None


@dataclass
class Checkpoint:
    """A run folder's current checkpoint, as its pointer ``checkpoint.json`` describes it.

    Attributes:
        folder: the run folder.
        kind: ``"file"`` or ``"sharded"``.
        name: the checkpoint's file (``checkpoint-step<N>.pt``) or folder (``checkpoint-step<N>.dcp``).
        step: optimizer steps done.
        optimizer: "adamw", "muon" or "muonclip".
        config: the `muonclip.app.config.RunConfig` fields the state was trained with.
        run: the run's `RunIdentity`.
        extra: JSON bookkeeping (elapsed seconds, last validation loss).
        shapes: the global shape of every tensor of the model's state dict.
        files: the manifest: path relative to the folder -> ``{"bytes", "sha256"}``.
    """

    folder: Path
    kind: str
    name: str
    step: int
    optimizer: str
    config: dict[str, Any]
    run: RunIdentity
    extra: dict[str, Any]
    shapes: dict[str, list[int]]
    files: dict[str, dict[str, Any]]

    @property
    def path(self) -> Path:
        return self.folder / self.name


def read_checkpoint(folder: str | Path) -> Checkpoint:
    """Read and validate ``folder/checkpoint.json``.

    Raises:
        CheckpointError: it is absent, unreadable, of another format or version, or incomplete.
    """
    folder = Path(folder)
    path = folder / POINTER
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {folder} ({POINTER} not found)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt or unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a muonclip checkpoint pointer")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {data.get('version')!r}, this muonclip reads {VERSION}")
    missing = [k for k in _POINTER_KEYS if k not in data]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; it is incomplete")
    name, files = data["path"], data["files"]
    if data["kind"] not in ("file", "sharded") or not isinstance(name, str) or Path(name).name != name \
            or not isinstance(files, dict) or not files or not all(_inside(f, name) for f in files):
        raise CheckpointError(f"{path} is malformed (kind {data['kind']!r}, path {name!r})")
    try:
        run = RunIdentity.from_dict(data["run"])
        step = int(data["step"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is malformed ({e})") from None
    return Checkpoint(folder, data["kind"], name, step, str(data["optimizer"]), dict(data["config"]), run,
                      dict(data["extra"] or {}), dict(data["shapes"]), dict(files))


def _inside(rel: Any, name: str) -> bool:
    """True when ``rel`` is ``name`` or a plain file of the folder ``name``."""
    if not isinstance(rel, str):
        return False
    parts = rel.split("/")
    return parts[0] == name and (len(parts) == 1 or (len(parts) == 2 and parts[1] not in ("", ".", "..")))


def verify(ckpt: Checkpoint) -> None:
    """Hash every file of ``ckpt``'s manifest and compare size and SHA-256.

    Raises:
        CheckpointError: a file is missing, of another size (truncated) or content, naming it.
    """
    for rel, want in sorted(ckpt.files.items()):
        path = ckpt.folder / rel
        try:
            got = file_digest(path)
        except OSError as e:
            raise CheckpointError(f"checkpoint file {path} cannot be read ({e.strerror or e}); the checkpoint is "
                                  "incomplete and was not loaded") from None
        if got["bytes"] != want.get("bytes"):
            raise CheckpointError(f"checkpoint file {path} has {got['bytes']} bytes, its manifest ({POINTER}) "
                                  f"says {want.get('bytes')}: it is truncated or damaged, and was not loaded")
        if got["sha256"] != want.get("sha256"):
            raise CheckpointError(f"checkpoint file {path} does not match its SHA-256 in {POINTER}: it is "
                                  "corrupt, and was not loaded")
    if ckpt.kind == "sharded":
        on_disk = {f"{ckpt.name}/{p.name}" for p in ckpt.path.iterdir()} if ckpt.path.is_dir() else set()
        extra = sorted(on_disk - set(ckpt.files))
        if extra:
            raise CheckpointError(f"checkpoint folder {ckpt.path} holds files its manifest does not list "
                                  f"({', '.join(extra[:5])}); it was not loaded")


def save_file(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (``step``, ``model``, ``optim``, ``rng``) atomically to ``path`` as one
    ``torch.save`` dict (format and version are added)."""
    data = {"format": FILE_FORMAT, "version": VERSION, **payload}
    return write_atomically(path, lambda f: torch.save(data, f))


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file written by `save_file` (tensors on the CPU; ``weights_only=True``).

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
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {data.get('version')}, this muonclip reads {VERSION}")
    missing = [k for k in ("step", "model", "optim", "rng") if k not in data]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; it is incomplete")
    return data


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
                    previous: Checkpoint | None) -> Checkpoint:
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

    Raises:
        OutputError: the checkpoint could not be written (e.g. a full disk); ``previous`` stays
            the current checkpoint. Under torchrun, on every rank.
    """
    folder = Path(folder)
    main = ctx.rank == 0
    avoid = previous.name if previous else None
    rng = rng_state()
    error: BaseException | None = None
    files: dict[str, dict[str, Any]] = {}
    if main:
        folder.mkdir(parents=True, exist_ok=True)
    if sharded:
        name = _free_name(folder, step, ".dcp", avoid)
        tmp = folder / f".{name}.tmp"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
        barrier(ctx)
        try:
            dcp_checkpoint.save(tmp, model, optimizer, extra={"rng": rng_to_json(rng), "step": step})
        except (OSError, CheckpointError) as e:
            error = e
        agree(error, ctx, lambda e: _write_failed(folder, step, previous, e))
        if main:
            try:
                os.replace(tmp, folder / name)
                files = {f"{name}/{p.name}": file_digest(p) for p in sorted((folder / name).iterdir())}
            except OSError as e:
                error = e
    else:
        name = _free_name(folder, step, ".pt", avoid)
        try:
            save_file(folder / name, {"step": step, "model": model.state_dict(), "optim": optimizer.state_dict(),
                                      "rng": rng})
            files = {name: file_digest(folder / name)}
        except (OSError, RuntimeError) as e:  # RuntimeError: torch.save's zip writer on a full disk
            error = e
    ckpt = Checkpoint(folder, "sharded" if sharded else "file", name, step, meta["optimizer"], meta["config"],
                      RunIdentity.from_dict(meta["run"]), dict(meta.get("extra") or {}), model_shapes(model), files)
    if main and error is None:
        body = {"format": FORMAT, "version": VERSION, "kind": ckpt.kind, "path": name, "step": step,
                "world_size": ctx.world_size, **meta, "shapes": ckpt.shapes, "files": files}
        try:
            write_json(folder / POINTER, body)
        except OSError as e:
            error = e
        else:
            remove_leftovers(folder, keep=name)  # the previous checkpoint, and what kills left
    agree(error if main else None, ctx, lambda e: _write_failed(folder, step, previous, e))
    return ckpt


def load_checkpoint(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctx: GroupContext = SINGLE, *,
                    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]] | None = None,
                    file_data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load ``ckpt`` (already verified) into ``model`` and ``optimizer``; return its RNG states.

    A file checkpoint goes into a plain model with ``load_state_dict``; into an FSDP2 model
    through ``build()``, which must return a fresh plain ``(model, optimizer)`` pair built the
    same way (`load_full_into_sharded`). ``file_data``: the file's dict if already read
    (`load_file`). A sharded one loads on any number of ranks (call on every rank).

    Raises:
        CheckpointError: the checkpoint cannot be read or does not fit.
    """
    if ckpt.kind == "sharded":
        extra = dcp_checkpoint.load(ckpt.path, model, optimizer, keys=("rng", "step"))
        if extra["step"] != ckpt.step:
            raise CheckpointError(f"{ckpt.path} holds step {extra['step']}, its pointer says {ckpt.step}")
        return rng_from_json(extra["rng"])
    data = file_data if file_data is not None else load_file(ckpt.path)
    if data["step"] != ckpt.step:
        raise CheckpointError(f"{ckpt.path} holds step {data['step']}, its pointer says {ckpt.step}")
    try:
        if build is not None:
            load_full_into_sharded(model, optimizer, data, build)
        else:
            optimizer.load_state_dict(data["optim"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{ckpt.path} does not fit this optimizer ({type(e).__name__}: {e})") from None
    return data["rng"]


def load_full_into_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, data: dict[str, Any],
                           build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """Load a checkpoint file's dict (``data``, from `load_file`) into an FSDP2 ``model`` and its ``optimizer``.

    ``build()`` returns a fresh plain ``(model, optimizer)`` pair built the same way: the file
    is loaded into it, and its state dicts, keyed by parameter name, are distributed into the
    shards with ``set_state_dict(full_state_dict=True)``. Call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    plain, plain_opt = build()
    plain.load_state_dict(data["model"])
    plain_opt.load_state_dict(data["optim"])
    msd, osd = get_state_dict(plain, plain_opt)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
    for k in dcp_checkpoint.COUNTERS:
        if hasattr(plain_opt, k):
            setattr(optimizer, k, getattr(plain_opt, k))


def check_shapes(ckpt: Checkpoint, model: nn.Module) -> None:
    """Raise `CheckpointError` unless every tensor name and global shape of ``model.state_dict()``
    is the checkpoint's."""
    own = {k: tuple(v) for k, v in model_shapes(model).items()}
    saved = {k: tuple(v) for k, v in ckpt.shapes.items()}
    if set(own) != set(saved):
        extra, lacking = sorted(set(saved) - set(own)), sorted(set(own) - set(saved))
        raise CheckpointError(f"{ckpt.path} holds another model: unexpected {extra[:5]}, missing {lacking[:5]}")
    bad = [f"{k} {saved[k]} vs {v}" for k, v in own.items() if saved[k] != v]
    if bad:
        raise CheckpointError(f"{ckpt.path} holds a model of another shape: {', '.join(bad[:5])}")


def differences(a: dict[str, Any], b: dict[str, Any], fields: Sequence[str]) -> list[str]:
    """``"field: a_value vs b_value"`` for each of ``fields`` whose values differ (JSON lists and
    tuples compare equal)."""
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in fields if norm(a.get(k)) != norm(b.get(k))]


__all__ = [
    "FILE_FORMAT", "FORMAT", "VERSION", "Checkpoint", "CheckpointError", "RunIdentity", "check_shapes",
    "corpus_digest", "differences", "load_checkpoint", "load_file", "load_full_into_sharded", "read_checkpoint",
    "rng_from_json", "rng_state", "rng_to_json", "save_checkpoint", "save_file", "set_rng_state", "verify",
]
