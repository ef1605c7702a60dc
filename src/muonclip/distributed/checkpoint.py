"""Reshardable checkpoints of a model and its optimizer, loaded without running code from the files.

`save` writes a directory with ``torch.distributed.checkpoint`` (DCP) from the state dicts of
``torch.distributed.checkpoint.state_dict.get_state_dict``: parameters and optimizer state
(momentum, Adam moments, step counts) keyed by parameter name (FQN), FSDP2 and tensor-parallel
shards stored as pieces of the global tensors. `load` reads it back on any number of ranks, with
DDP, FSDP2 or neither (docs/design.md, "Distributed Muon"), bit for bit. The directory holds
``{"model": ..., "optim": ..., "muonclip": {...}, "extra": "<JSON>"}``: ``"muonclip"`` keeps
Muon's step and skipped-step counters (DCP's optimizer state dict keeps only ``state`` and
``param_groups``), ``"extra"`` a JSON text of whatever the caller adds. Every rank must call
both (they are collectives when a process group is initialised); without one they work in one
process. Neither is atomic: write into a temporary directory and rename it when every rank is
done (`muonclip.app.runfolder` does).

**Trust model.** Loading a checkpoint directory never executes code from it, so a directory from
an untrusted source can be loaded: the tensors are read by DCP with ``torch.load(weights_only=True)``;
the non-tensor leaves (hyperparameters, counters, the JSON text) by `SafeLoadPlanner`, with
``weights_only=True`` too, where DCP's own planner uses a full unpickler; and DCP's ``.metadata``,
a pickle, by `MetadataUnpickler`, which admits only the classes DCP's metadata is made of
(`METADATA_GLOBALS`, torch dtypes) and refuses any other global, so a pickle that would call a
function is refused before anything is loaded (`SafeFileSystemReader`). What a checkpoint holds
is still the writer's: weights from an untrusted source are only as good as their source, and
a huge file costs memory. Accidental corruption is caught one level up, by a checksum manifest
(`muonclip.app.runfolder`), not here.

Errors: every failure to read or apply a checkpoint (a refused pickle, a torn or missing file, a
state that does not fit the model, DCP's ``CheckpointException``, which is a ``BaseException``)
is raised as `CheckpointError` naming the directory.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

COUNTERS = ("steps_taken", "steps_skipped")
"""Attributes of an optimizer (`muonclip.Muon`'s counters) saved beside its state dict when present."""

METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
})
"""The globals a DCP ``.metadata`` pickle of torch 2.13 refers to (besides torch dtypes such as
``torch.float32``): its dataclasses (``Metadata``, the storage metadata of tensors and bytes,
chunk offsets and sizes, tensor properties and their memory-format enum, the file offsets of
each item), ``torch.Size``, the layout lookup ``torch.serialization._get_layout``, and the path
classes ``StorageMeta.checkpoint_id`` may hold. None of them runs code when called or built."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or does not fit the model and optimizer; the message says why."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only DCP metadata: globals outside `METADATA_GLOBALS` and torch's
    dtypes raise ``pickle.UnpicklingError`` before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of a checkpoint's metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of a checkpoint's metadata")


def read_metadata_file(f: IO[bytes], where: str = ".metadata") -> Metadata:
    """The DCP ``Metadata`` pickled in ``f``, read by `MetadataUnpickler`, with every file it names
    checked to be a plain name inside the checkpoint directory (no ``..`` or folders).

    Raises:
        CheckpointError: a refused global, a torn pickle, or another object than ``Metadata``.
    """
    try:
        metadata = MetadataUnpickler(f).load()
    except Exception as e:  # UnpicklingError, EOFError, AttributeError... on a torn or foreign file
        raise CheckpointError(f"{where} is not a readable checkpoint metadata file ({type(e).__name__}: {e}); "
                              "it was not loaded") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where} holds a {type(metadata).__name__}, not a checkpoint's metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{where} names the data file {name!r}, which is not a file of its directory")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` whose ``read_metadata`` unpickles with
    `MetadataUnpickler` (`read_metadata_file`) instead of ``pickle.load``; everything else is
    torch's (tensors are read with ``weights_only=True`` there)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_metadata_file(f, os.fspath(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor leaves are read with ``torch.load(weights_only=True)``
    (plain Python values, dtypes and tensors only) instead of a full unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # torch's own helper for the same job

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP (``.module``); FSDP2 modules are used as they are."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any] | None = None) -> None:
    """Write ``model`` and ``optimizer`` (and ``extra``) to the directory ``path``; call on every rank.

    Args:
        path: checkpoint directory (created; files in it are overwritten).
        model: the model (plain, DDP-wrapped or FSDP2 ``fully_shard``-ed).
        optimizer: its optimizer (any ``torch.optim.Optimizer``; Muon's counters are kept).
        extra: values to store alongside, JSON-serialisable (default None: nothing).

    Raises:
        TypeError: ``extra`` is not JSON-serialisable.
        CheckpointError: a rank could not write its files (e.g. a full disk); the message has
            each rank's error.
        OSError: the directory cannot be created.
    """
    model = unwrap(model)
    msd, osd = get_state_dict(model, optimizer)
    counters = {k: int(getattr(optimizer, k)) for k in COUNTERS if hasattr(optimizer, k)}
    text = json.dumps(dict(extra or {}), allow_nan=False)
    try:
        with warnings.catch_warnings():  # DCP warns that it saves "in a single process": intended there
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": msd, "optim": osd, "muonclip": counters, "extra": text}, checkpoint_id=os.fspath(path))
    except CheckpointException as e:  # a BaseException: each rank's error inside
        if any(isinstance(exc, KeyboardInterrupt) for exc, _ in e.failures.values()):
            raise KeyboardInterrupt from None
        raise CheckpointError(f"checkpoint {path} cannot be written ({_failure(e)})") from None


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The metadata of the checkpoint directory ``path`` (`read_metadata_file` of its ``.metadata``).

    Raises:
        CheckpointError: it is missing, torn, or not DCP metadata.
    """
    meta = Path(path) / ".metadata"
    try:
        with open(meta, "rb") as f:
            return read_metadata_file(f, os.fspath(meta))
    except OSError as e:
        raise CheckpointError(f"{meta} cannot be read ({e.strerror or e})") from None


def _failure(e: BaseException) -> str:
    """One line for an exception of DCP: each rank's error, without tracebacks."""
    if isinstance(e, CheckpointException):
        parts = [f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items())]
        return "; ".join(parts)[:2000]
    return f"{type(e).__name__}: {e}"[:2000]


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
         *, keys: Sequence[str] = ()) -> dict[str, Any]:
    """Load a checkpoint written by `save` (by any number of ranks) into ``model`` and ``optimizer``.

    The model and optimizer must be built first, the same way (same parameter names and
    param groups), on any number of ranks; call on every rank. An optimizer with no state yet
    gets it created by DCP's zero-gradient, zero-lr step, then overwritten. Nothing in the
    directory is executed (module docstring, "Trust model").

    Args:
        path: the checkpoint directory.
        model, optimizer: what to load into.
        keys: names the ``extra`` dict must hold (default none).

    Returns:
        The ``extra`` dict.

    Raises:
        CheckpointError: the directory cannot be read or does not fit (the message names it).
    """
    path = Path(path)
    metadata = read_metadata(path)  # a clear error before DCP's collectives and its fallbacks
    model = unwrap(model)
    try:
        with warnings.catch_warnings():  # an optimizer without state gets it from a zero-lr step, no forward before
            warnings.filterwarnings("ignore", message="MuonClip.step: no attention max logit")
            msd, osd = get_state_dict(model, optimizer)
        _place_wide_values(osd, optimizer, metadata)
        state = {"model": msd, "optim": osd, "muonclip": {k: 0 for k in COUNTERS if hasattr(optimizer, k)},
                 "extra": ""}
        with warnings.catch_warnings():  # DCP warns that it loads "in a single process": intended there
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = json.loads(state["extra"]) if state["extra"] else {}
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this model and optimizer "
                              f"({_failure(e)})") from None
    if not isinstance(extra, dict) or any(k not in extra for k in keys):
        raise CheckpointError(f"checkpoint {path} lacks {[k for k in keys if k not in extra]} in its extra values")
    for k, v in state["muonclip"].items():
        if hasattr(optimizer, k):
            setattr(optimizer, k, int(v))
    return extra


def _place_wide_values(osd: dict[str, Any], optimizer: torch.optim.Optimizer, metadata: Metadata) -> None:
    """Ask DCP for the optimizer-wide values (Muon's counters, MuonClip's ``tau``) where the
    checkpoint holds them: in every param group (this version), or in the first parameter's state
    (earlier versions, `muonclip.optim._state_dicts`), so that both load."""
    wide = getattr(optimizer, "_wide_state", None)
    if not callable(wide):
        return
    keys, saved = tuple(wide()), metadata.state_dict_metadata
    for i, group in enumerate(osd.get("param_groups", [])):
        for key in keys:
            if f"optim.param_groups.{i}.{key}" not in saved:
                group.pop(key, None)
    for fqn, entry in osd.get("state", {}).items():
        for key in keys:
            if f"optim.state.{fqn}.{key}" in saved:
                entry[key] = 0


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Global shape of every tensor of ``model.state_dict()`` (DTensors: the whole tensor's)."""
    return {k: list(v.shape) for k, v in unwrap(model).state_dict().items()}


__all__ = [
    "COUNTERS", "METADATA_GLOBALS", "CheckpointError", "MetadataUnpickler", "SafeFileSystemReader", "SafeLoadPlanner",
    "load", "model_shapes", "read_metadata", "read_metadata_file", "save", "unwrap",
]
