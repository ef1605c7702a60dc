"""Checkpoints of a `muonclip train` run: written atomically, validated on load.

Contents (one ``torch.save`` dict, loaded with ``weights_only=True``)::

    format     "muonclip-checkpoint", version 1
    optimizer  "adamw" | "muon" | "muonclip"
    config     RunConfig.to_dict()
    step       optimizer steps done; the data position (batch s depends only on (seed, s))
    model      model.state_dict()
    optim      optimizer.state_dict()
    rng        {"torch": CPU generator state, "cuda": list of CUDA states or None}
    extra      run bookkeeping (tokens seen, wall time so far, ...)

Atomic write: the dict goes to a temporary file in the same folder, is flushed to disk, and
then ``os.replace``-d onto the target name, so a crash or Ctrl-C at any moment leaves either
the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

FORMAT = "muonclip-checkpoint"
VERSION = 1
# Fields of RunConfig that fix the model's shape: a checkpoint only loads into the same ones.
MODEL_FIELDS = ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "attention", "qk_norm")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit this run; the message says why."""


def rng_state() -> dict[str, Any]:
    """The torch RNG states to restore on resume (CPU, and every CUDA device if present)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (see the module docstring; format/version are added) atomically to ``path``.

    The temporary file ``.<name>.tmp-<pid>`` in the same folder is removed if writing fails,
    and the previous file at ``path`` is untouched in that case.
    """
    data = {"format": FORMAT, "version": VERSION, **payload}
    return write_atomically(path, lambda f: torch.save(data, f))


def write_atomically(path: str | Path, write: Callable[[IO[Any]], object], text: bool = False) -> Path:
    """``write(f)`` into ``.<name>.tmp-<pid>`` beside ``path``, fsync, then ``os.replace`` onto ``path``.

    On any failure (Ctrl-C included) the temporary file is removed and ``path`` is untouched.
    ``text``: open the file in text mode, UTF-8 (default False: binary).
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


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`.

    Raises:
        CheckpointError: the file is missing, unreadable/corrupt, or not a muonclip checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a torn or foreign file
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a muonclip checkpoint")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {data.get('version')}, this muonclip reads {VERSION}")
    missing = [k for k in ("optimizer", "config", "step", "model", "optim", "rng") if k not in data]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}; it is incomplete")
    return data


def check_compatible(data: dict[str, Any], *, optimizer: str, config: dict[str, Any], model: nn.Module,
                     path: str | Path = "checkpoint") -> None:
    """Raise `CheckpointError` unless the checkpoint ``data`` fits this run.

    Checks, in order: the optimizer name, the model-shape fields of the config
    (`MODEL_FIELDS`), and every tensor name and shape of the model's state dict.
    """
    if data["optimizer"] != optimizer:
        raise CheckpointError(
            f"{path} was written by a '{data['optimizer']}' run, this run uses '{optimizer}'; "
            f"use --optimizer {data['optimizer']} or another --out"
        )
    diffs = [f"{k}: checkpoint {data['config'].get(k)!r}, now {config.get(k)!r}"
             for k in MODEL_FIELDS if data["config"].get(k) != config.get(k)]
    if diffs:
        raise CheckpointError(f"{path} holds a model of another shape ({'; '.join(diffs)})")
    own = model.state_dict()
    saved = data["model"]
    if set(own) != set(saved):
        extra, lacking = sorted(set(saved) - set(own)), sorted(set(own) - set(saved))
        raise CheckpointError(f"{path} holds another model: unexpected {extra[:5]}, missing {lacking[:5]}")
    bad = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if saved[k].shape != v.shape]
    if bad:
        raise CheckpointError(f"{path} holds a model of another shape: {', '.join(bad[:5])}")


__all__ = [
    "CheckpointError",
    "MODEL_FIELDS",
    "check_compatible",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
