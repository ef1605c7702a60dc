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

**Reading** (`read_checkpoint`, `verify`, `load_file`, `check_contents`, `load_checkpoint`): the
pointer is validated field by field (`read_checkpoint`: every field's type and range, the
config as `muonclip.app.config.RunConfig.validate` checks a config, the run's identity, the
manifest), every file of the manifest is hashed and compared (a flipped byte, a truncated or
missing file is refused naming the file), a checkpoint file's contents are checked against the
pointer (`check_contents`: the step, every model tensor's name, shape, dtype and finite values,
the optimizer state's structure, the RNG states, which torch must accept) and the optimizer's
own state by the optimizer (`muonclip.Muon.load_state_dict`; torch.optim.AdamW's moments and
steps here, `check_optimizer_state`), all before anything is loaded into the model or the
optimizer: a `CheckpointError` names the file and the field, and the folder is not modified.
Every file is opened without following a link (`muonclip.app.runfolder.open_file`), and
nothing read executes code (``weights_only=True``; DCP through
`muonclip.distributed.checkpoint`'s restricted readers). ``config.json`` is read the same
way (`read_run_config`).

**Trust model.** The manifest catches accidental corruption (a bad disk, a torn copy, a
truncated transfer), not tampering: whoever can write the folder can rewrite the manifest too.
Loading never runs code, so a run folder from an untrusted source can be resumed without risk
to the machine; what it trains is the writer's.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed import checkpoint as dcp_checkpoint
from ..distributed._context import SINGLE, GroupContext
from ..distributed.checkpoint import CheckpointError, model_shapes
from ..optim import Muon
from ..optim._state_validation import check_adamw_entry
from .config import INT_LIMIT, OPTIMIZERS, RunConfig
from .launch import agree, barrier
from .runfolder import (
    CHECKPOINT_NAME,
    CONFIG,
    POINTER,
    OutputError,
    file_digest,
    open_file,
    read_config,
    read_json,
    remove_leftovers,
    temporary_name,
    write_atomically,
    write_json,
)

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
        tensorboard: the entries of the run folder its TensorBoard logging wrote (a folder's
            name, or ``"."`` for event files in the run folder itself), which a resume keeps
            as the run's own (`muonclip.app.runfolder.inspect_folder`).
    """

    id: str
    data_sha256: str
    history: list[dict[str, Any]] = field(default_factory=list)
    tensorboard: list[str] = field(default_factory=list)

    @classmethod
    def new(cls, data_sha256: str) -> RunIdentity:
        return cls(uuid.uuid4().hex, data_sha256)

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "data_sha256": self.data_sha256, "history": list(self.history)}
        return {**out, "tensorboard": list(self.tensorboard)} if self.tensorboard else out

    @classmethod
    def from_dict(cls, d: Any) -> RunIdentity:
        """The identity of ``d`` (`to_dict`'s form).

        Raises:
            ValueError: a field is missing or malformed, naming it (``run.<field>``).
        """
        if not isinstance(d, dict):
            raise ValueError(f"run must be a JSON object (the run's identity), got {d!r:.100}")
        for key in ("id", "data_sha256"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise ValueError(f"run.{key} must be a non-empty string, got {d.get(key)!r:.100}")
        history = d.get("history", [])
        if not isinstance(history, list):
            raise ValueError(f"run.history must be a list of the resumes' changes, got {history!r:.100}")
        for i, h in enumerate(history):
            step = h.get("step") if isinstance(h, dict) else None
            changed = h.get("changed") if isinstance(h, dict) else None
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT_LIMIT \
                    or not isinstance(changed, dict) \
                    or not all(isinstance(v, list) and len(v) == 2 for v in changed.values()):
                raise ValueError(f"run.history[{i}] must be {{\"step\": a whole number >= 0, \"changed\": "
                                 f"{{field: [old, new]}}}}, got {h!r:.100}")
        tensorboard = d.get("tensorboard", [])
        if not isinstance(tensorboard, list) or not all(
                isinstance(e, str) and (e == "." or (e and e != ".." and "/" not in e)) for e in tensorboard):
            raise ValueError(f"run.tensorboard must be a list of entries of the run folder, got {tensorboard!r:.100}")
        return cls(d["id"], d["data_sha256"], list(history), list(tensorboard))


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
    """The inverse of `rng_to_json`, checked (`check_rng`).

    Raises:
        CheckpointError: not such a dict.
    """
    def dec(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)

    try:
        cuda = data.get("cuda")
        state = {"torch": dec(data["torch"]), "cuda": None if cuda is None else [dec(s) for s in cuda]}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's RNG states are unreadable ({type(e).__name__}: {e})") from None
    check_rng(state, "the checkpoint's RNG states")
    return state


def check_rng(state: Any, where: str) -> None:
    """Raise `CheckpointError` unless ``state`` is what `rng_state` returns and torch accepts it:
    ``{"torch": the CPU generator's uint8 state, "cuda": None or a list of uint8 states}`` (the
    CPU state is tried on the generator, which is then put back as it was)."""
    if not isinstance(state, dict) or not isinstance(state.get("torch"), torch.Tensor):
        raise CheckpointError(f"{where}: rng must be {{'torch': a uint8 tensor, 'cuda': ...}}, got {state!r:.100}")
    cuda = state.get("cuda")
    if cuda is not None and not isinstance(cuda, (list, tuple)):
        raise CheckpointError(f"{where}: rng.cuda must be None or a list of CUDA generator states, got {cuda!r:.100}")
    for name, t in [("rng.torch", state["torch"]), *((f"rng.cuda[{i}]", t) for i, t in enumerate(cuda or []))]:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.ndim != 1:
            raise CheckpointError(f"{where}: {name} must be a 1-D uint8 tensor (a generator's state), got {t!r:.100}")
    own = torch.get_rng_state()
    try:
        torch.set_rng_state(state["torch"])
    except (RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: rng.torch is not a state of torch's CPU generator ({e})") from None
    finally:
        torch.set_rng_state(own)


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


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _whole(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= INT_LIMIT


def read_checkpoint(folder: str | Path) -> Checkpoint:
    """Read and validate ``folder/checkpoint.json``, every field (module docstring, "Reading").

    Raises:
        CheckpointError: it is absent, unreadable, of another format or version, or a field is
            missing or malformed: the message names the file and the field.
        OutputError: it is a link or a special file.
    """
    folder = Path(folder)
    path = folder / POINTER
    try:
        data = read_json(folder, POINTER)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint in {folder} ({POINTER} not found)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt or unreadable ({type(e).__name__}: {e})") from None

    def bad(name: str, what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {name} {what}; the checkpoint was not loaded (the run folder is damaged)")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else data
        raise CheckpointError(f"{path} is not a muonclip checkpoint pointer (format {got!r:.100}, expected "
                              f"{FORMAT!r})")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {data.get('version')!r:.100}, this muonclip reads "
                              f"{VERSION}")
    missing = [k for k in _POINTER_KEYS if k not in data]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; it is incomplete")
    kind, name, step = data["kind"], data["path"], data["step"]
    if kind not in ("file", "sharded"):
        raise bad("kind", f"must be 'file' or 'sharded', got {kind!r:.100}")
    suffix = ".pt" if kind == "file" else ".dcp"
    if not isinstance(name, str) or not CHECKPOINT_NAME.fullmatch(name) or not name.endswith(suffix):
        raise bad("path", f"must name a checkpoint-step<N>{suffix} of this folder, got {name!r:.100}")
    if not _whole(step):
        raise bad("step", f"must be a whole number >= 0, got {step!r:.100}")
    if data["optimizer"] not in OPTIMIZERS:
        raise bad("optimizer", f"must be one of {list(OPTIMIZERS)}, got {data['optimizer']!r:.100}")
    try:
        RunConfig.from_dict(data["config"]).validate()
    except (TypeError, ValueError) as e:
        raise bad("config", f"is not a valid config ({e})") from None
    try:
        run = RunIdentity.from_dict(data["run"])
    except ValueError as e:
        raise bad("run", f"is malformed ({e})") from None
    extra = data["extra"]
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise bad("extra", f"must be a JSON object, got {extra!r:.100}")
    for key, allow_none in (("elapsed", False), ("last_val_loss", True)):
        v = extra.get(key)
        if key in extra and not (v is None and allow_none) and not (
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (key != "elapsed" or v >= 0)):
            raise bad(f"extra.{key}", f"must be a finite number{' or null' if allow_none else ' >= 0'}, got "
                                      f"{v!r:.100}")
    shapes = data["shapes"]
    if not isinstance(shapes, dict) or not shapes or not all(
            isinstance(k, str) and isinstance(v, list) and all(_whole(n) for n in v) for k, v in shapes.items()):
        raise bad("shapes", f"must map every model tensor's name to its shape (a list of sizes), got {shapes!r:.100}")
    files = data["files"]
    if not isinstance(files, dict) or not files:
        raise bad("files", f"must be the manifest of the checkpoint's files, got {files!r:.100}")
    for rel, entry in files.items():
        if not _inside(rel, name) or (kind == "file" and rel != name):
            raise bad("files", f"lists {rel!r:.100}, which is not a file of the checkpoint {name}")
        if not isinstance(entry, dict) or not _whole(entry.get("bytes")) or not isinstance(entry.get("sha256"), str) \
                or not _SHA256.fullmatch(entry["sha256"]):
            raise bad(f"files[{rel!r}]", f"must be {{\"bytes\": its size, \"sha256\": 64 hex digits}}, got "
                                         f"{entry!r:.100}")
    if "world_size" in data and not _whole(data["world_size"], 1):
        raise bad("world_size", f"must be a whole number >= 1, got {data['world_size']!r:.100}")
    if "mode" in data and not isinstance(data["mode"], str):
        raise bad("mode", f"must be a string, got {data['mode']!r:.100}")
    return Checkpoint(folder, kind, name, step, data["optimizer"], dict(data["config"]), run, dict(extra),
                      {k: list(v) for k, v in shapes.items()}, dict(files))


@dataclass
class RunRecord:
    """A run folder's ``config.json`` (`read_run_config`): the optimizer, the config, the run's
    identity, and the dict as read."""

    optimizer: str
    config: RunConfig
    run: RunIdentity
    data: dict[str, Any]


def read_run_config(folder: str | Path) -> RunRecord | None:
    """Read and validate ``folder/config.json`` (None when it is absent): its ``optimizer``, every
    config field (`muonclip.app.config.RunConfig.validate`) and its ``run``.

    Raises:
        OutputError: it is not a run's config, or a field is malformed: the message names the
            file and the field; or it is a link or a special file.
    """
    data = read_config(folder)
    if data is None:
        return None
    path = Path(folder) / CONFIG
    if data.get("optimizer") not in OPTIMIZERS:
        raise OutputError(f"{path}: optimizer must be one of {list(OPTIMIZERS)}, got {data.get('optimizer')!r:.100}; "
                          "the run folder is damaged")
    try:
        run = RunIdentity.from_dict(data.get("run"))
        cfg = RunConfig.from_dict({k: v for k, v in data.items() if k not in ("optimizer", "run")}).validate()
    except (TypeError, ValueError) as e:
        raise OutputError(f"{path}: {e}; the run folder is damaged") from None
    return RunRecord(data["optimizer"], cfg, run, data)


def _inside(rel: Any, name: str) -> bool:
    """True when ``rel`` is ``name`` or a plain file of the folder ``name``."""
    if not isinstance(rel, str):
        return False
    parts = rel.split("/")
    return parts[0] == name and (len(parts) == 1 or (len(parts) == 2 and parts[1] not in ("", ".", "..")))


def verify(ckpt: Checkpoint) -> None:
    """Hash every file of ``ckpt``'s manifest and compare size and SHA-256 (each opened by
    `muonclip.app.runfolder.open_file`: no link followed, nothing but regular files read).

    Raises:
        CheckpointError: a file is missing, of another size (truncated) or content, naming it.
        OutputError: a file or the checkpoint's folder is a link or a special file.
    """
    for rel, want in sorted(ckpt.files.items()):
        path = ckpt.folder / rel
        try:
            got = file_digest(ckpt.folder, rel)
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


def save_file(path: str | Path, payload: dict[str, Any], token: str | None = None) -> Path:
    """Write ``payload`` (``step``, ``model``, ``optim``, ``rng``) atomically to ``path`` as one
    ``torch.save`` dict (format and version are added; ``token``: the writer's,
    `muonclip.app.runfolder.write_atomically`)."""
    data = {"format": FILE_FORMAT, "version": VERSION, **payload}
    return write_atomically(path, lambda f: torch.save(data, f), token=token)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file written by `save_file` (tensors on the CPU; ``weights_only=True``).

    Raises:
        CheckpointError: the file is missing, unreadable/corrupt, of another format or version,
            or incomplete.
        OutputError: it is a link or a special file.
    """
    path = Path(path)
    try:
        fd = open_file(path.parent, path.name)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            data = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a torn or foreign file
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{path} is not a muonclip checkpoint (format {got!r:.100}, expected {FILE_FORMAT!r})")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {data.get('version')!r:.100}, this muonclip reads "
                              f"{VERSION}")
    missing = [k for k in ("step", "model", "optim", "rng") if k not in data]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; it is incomplete")
    return data


def check_contents(data: dict[str, Any], ckpt: Checkpoint) -> None:
    """Raise `CheckpointError` naming the file and the field unless the checkpoint file's dict
    ``data`` (`load_file`) fits its pointer ``ckpt``: its step, its model state (every tensor of
    ``ckpt.shapes``, nothing else, each of that shape, floating-point and finite), its optimizer
    state's structure (``state``: a dict of dicts; ``param_groups``: a list of dicts with
    ``params``, each parameter once) and its RNG states (`check_rng`). The optimizer checks its
    own state's values when it loads it (`load_checkpoint`)."""
    where = str(ckpt.path)
    if data["step"] != ckpt.step or not _whole(data["step"]):
        raise CheckpointError(f"{where}: step is {data['step']!r:.100}, its pointer ({POINTER}) says {ckpt.step}")
    model = data["model"]
    if not isinstance(model, dict):
        raise CheckpointError(f"{where}: model must be the model's state dict, got {type(model).__name__}")
    extra, lacking = sorted(set(model) - set(ckpt.shapes), key=str), sorted(set(ckpt.shapes) - set(model))
    if extra or lacking:
        raise CheckpointError(f"{where}: model holds other tensors than its pointer lists (unexpected "
                              f"{[str(k) for k in extra[:5]]}, missing {lacking[:5]})")
    for k, t in model.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise CheckpointError(f"{where}: model[{k!r}] must be a floating-point tensor, got {t!r:.100}")
        if list(t.shape) != list(ckpt.shapes[k]):
            raise CheckpointError(f"{where}: model[{k!r}] has shape {list(t.shape)}, its pointer says "
                                  f"{ckpt.shapes[k]}")
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: model[{k!r}] holds NaN or inf")
    optim = data["optim"]
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    state = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{where}: optim must be an optimizer state dict ({{'state': {{...}}, 'param_groups': "
                              "[{'params': [...], ...}]}})")
    ids = [pid for g in groups for pid in g["params"]]
    if len(set(map(repr, ids))) != len(ids) or not all(isinstance(v, dict) for v in state.values()):
        raise CheckpointError(f"{where}: optim lists a parameter twice, or holds a state that is not a dict")
    check_rng(data["rng"], where)


def check_optimizer_state(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, where: str) -> None:
    """For a torch optimizer (``torch.optim.AdamW``, whose ``load_state_dict`` checks little): raise
    `CheckpointError` unless ``state_dict`` has its groups and parameters, in order, and every state
    entry is an AdamW state of its parameter (`muonclip.optim._state_validation.check_adamw_entry`).
    `muonclip.Muon` checks its own (`muonclip.Muon.load_state_dict`)."""
    saved, own = state_dict["param_groups"], optimizer.param_groups
    if len(saved) != len(own) or any(len(s["params"]) != len(o["params"]) for s, o in zip(saved, own)):
        raise CheckpointError(f"{where}: optim has {[len(g['params']) for g in saved]} parameters per group, this "
                              f"optimizer {[len(g['params']) for g in own]}")
    for gi, (s, o) in enumerate(zip(saved, own)):
        for i, (pid, p) in enumerate(zip(s["params"], o["params"])):
            try:
                check_adamw_entry(state_dict["state"].get(pid, {}), p, f"optim: parameter {i} of param group {gi}: ")
            except ValueError as e:
                raise CheckpointError(f"{where}: {e}") from None


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
        token: the writer's token (`muonclip.app.runfolder.new_token`, recorded in the folder's
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
    if file_data is None:
        check_contents(data, ckpt)
    if not isinstance(optimizer, Muon):  # torch.optim.AdamW: its loader checks little (shapes are global)
        check_optimizer_state(data["optim"], optimizer, str(ckpt.path))
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
