"""The checkpoint of a `muonclip train` run folder: written whole or not at all, verified before use.

A run folder (`muonclip.app.runfolder`) holds at most one current checkpoint, named by the JSON
pointer ``checkpoint.json``:

* ``"kind": "file"`` — ``checkpoint-step<N>.pt``, one ``torch.save`` dict (model and optimizer
  state dicts, RNG states, step), read with ``weights_only=True``; written by one process.
* ``"kind": "sharded"`` — ``checkpoint-step<N>.dcp/``, a ``torch.distributed.checkpoint``
  folder written by every rank (`muonclip.distributed.checkpoint.save`), reshardable: it loads
  on any number of ranks, or in one process. Rank 0's RNG states ride along as JSON.

The pointer holds the run's bookkeeping: ``step``, ``optimizer``, ``config`` (the config the
state was trained with), ``run`` (the run's identity, `muonclip.app.run_state.RunIdentity`),
``extra`` (elapsed time, last validation loss), the model's tensor ``shapes`` and the ``files`` manifest: the size and
SHA-256 of every file of the checkpoint.

**Writing** (`muonclip.app.checkpoint_write.save_checkpoint`): the checkpoint goes to a temporary
name, is flushed and renamed to its own step's name; its files are hashed from the disk; the
pointer is written atomically after them; only then is the previous checkpoint removed. A kill at
any moment leaves the previous pointer and its checkpoint intact (and leftovers that the next
start removes). A failed write (a full disk) raises `OutputError` saying that the previous
checkpoint is kept.

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
Every file is opened without following a link (`muonclip.app.safe_files.open_file`), and
nothing read executes code (``weights_only=True``; DCP through
`muonclip.distributed.checkpoint`'s restricted readers). ``config.json`` is read the same
way (`read_run_config`).

**Trust model.** The manifest catches accidental corruption (a bad disk, a torn copy, a
truncated transfer), not tampering: whoever can write the folder can rewrite the manifest too.
Loading never runs code, so a run folder from an untrusted source can be resumed without risk
to the machine; what it trains is the writer's.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
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
from .run_state import RunIdentity, check_rng, rng_from_json
from .runfolder import CHECKPOINT_NAME, CONFIG, POINTER, read_config
from .safe_files import OutputError, file_digest, open_file, read_json

FORMAT = "muonclip-checkpoint"
VERSION = 2
FILE_FORMAT = "muonclip-checkpoint-file"
_POINTER_KEYS = ("kind", "path", "step", "optimizer", "config", "run", "extra", "shapes", "files")


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
    `muonclip.app.safe_files.open_file`: no link followed, nothing but regular files read).

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


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file written by `muonclip.app.checkpoint_write.save_file` (tensors on the CPU;
    ``weights_only=True``).

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
