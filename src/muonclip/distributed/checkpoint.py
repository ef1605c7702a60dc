"""Reshardable checkpoints of a model and its `muonclip.Muon` / `MuonClip` optimizer.

Saved with ``torch.distributed.checkpoint`` (DCP) from the state dicts of
``torch.distributed.checkpoint.state_dict.get_state_dict``: parameters and optimizer state
(momentum, Adam moments, step counts) are keyed by parameter name (FQN), and FSDP2 shards
are stored as pieces of the global tensors. So a checkpoint written by N ranks loads on M
ranks, on one process, with DDP or FSDP2 or neither (design.md 1.4), with nothing lost:
the loaded tensors are bit-identical to the saved ones.

Layout of the checkpoint (a directory): ``{"model": ..., "optim": ..., "muonclip": {...},
"extra": {...}}`` where ``"muonclip"`` holds Muon's step and skipped-step counters (DCP's
optimizer state dict keeps only ``state`` and ``param_groups``) and ``"extra"`` anything the
caller adds (data position, RNG seeds...; pickled, so load only checkpoints you trust).
Every rank must call `save` / `load` (they are collectives when a process group is
initialised); without one they work in one process.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_COUNTERS = ("steps_taken", "steps_skipped")


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


__all__ = ["load", "save"]
